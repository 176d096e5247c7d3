"""envd's plain-HTTP ``/files`` (E2B spec §4.5): download, and upload as multipart (one or more parts named
``file`` whose raw filename is the destination) or as a raw ``application/octet-stream`` body (optionally
``Content-Encoding: gzip``). Bodies stream through to the node's ``/files`` route, never held whole here.

Auth: ``X-Access-Token`` equal to the sandbox's token, or (no header) a valid signed URL:
``signature = "v1_" + base64_nopad(sha256("<path>:<read|write>:<username>:<token>[:<expiration>]"))`` with
``signature_expiration`` (unix seconds) not past. Errors are ``{"code": <status>, "message": ...}``.
"""

from __future__ import annotations

import base64
import hashlib
import json
import time
import zlib
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import parse_qs

from pilldrops import errors
from pilldrops._internal.ids import same_secret
from pilldrops.e2b.envd import node
from pilldrops.e2b.envd.connect import Body, ConnectError, Receive, Send, send_response
from pilldrops.e2b.envd.multipart import MultipartReader, boundary_of
from pilldrops.e2b.envd.users import check_user, resolve

MAX_UNZIPPED = 8 * 1024**3          # the node's own upload cap
_CHUNK = 256 * 1024


class HTTPError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def signature(path: str, op: str, user: str, token: str, expiration: str | None) -> str:
    raw = f"{path}:{op}:{user}:{token}" + (f":{expiration}" if expiration else "")
    return "v1_" + base64.b64encode(hashlib.sha256(raw.encode()).digest()).decode().rstrip("=")


def authorize(query: dict[str, str], headers: dict[str, str], token: str, op: str) -> None:
    given = headers.get("x-access-token")
    if given is not None:
        if not same_secret(given, token):
            raise HTTPError(401, "unauthorized access, please provide a valid access token or method signing")
        return
    sig = query.get("signature")
    if not sig:
        raise HTTPError(401, "unauthorized access, please provide a valid access token or method signing")
    exp = query.get("signature_expiration")
    if exp is not None and (not exp.isdigit() or int(exp) < time.time()):
        raise HTTPError(401, "signature is expired")
    want = signature(query.get("path", ""), op, query.get("username", ""), token, exp)
    if not same_secret(sig, want):
        raise HTTPError(401, "invalid signature")


def _status_of(exc: errors.PillDropsError) -> int:
    if isinstance(exc, errors.NotFound):
        return 404
    if isinstance(exc, errors.InvalidRequest):
        return 507 if "No space left" in exc.message else 400
    return exc.status if 400 <= exc.status < 600 else 500


async def serve_files(ref: Any, workdir: str, method: str, query_string: bytes, headers: dict[str, str],
                      receive: Receive, send: Send) -> None:
    query = {k: v[-1] for k, v in parse_qs(query_string.decode("latin-1"), keep_blank_values=True).items()}
    try:
        if method not in ("GET", "POST"):
            raise HTTPError(405, f"method {method} is not allowed on /files")
        authorize(query, headers, ref.access_token, "read" if method == "GET" else "write")
        try:
            user = check_user(query.get("username") or None)
        except ConnectError as e:
            raise HTTPError(401, e.message) from None
        if method == "GET":
            await _download(ref, resolve(query.get("path") or None, user, workdir), query, send)
        else:
            written = await _upload(ref, query, headers, user, workdir, Body(receive))
            await send_response(send, 200, json.dumps(written).encode(), "application/json")
    except HTTPError as e:
        await _error(send, e.status, e.message)
    except errors.PillDropsError as e:
        await _error(send, _status_of(e), e.message)


async def _error(send: Send, status: int, message: str) -> None:
    await send_response(send, status, json.dumps({"code": status, "message": message}).encode(), "application/json")


async def _download(ref: Any, path: str, query: dict[str, str], send: Send) -> None:
    if not path or path == "/":
        raise HTTPError(400, f"path '{path}' is a directory")
    async with ref.node.stream("GET", "/files", params={"path": path}) as resp:
        if resp.status_code >= 300:
            body = await resp.aread()
            try:
                err = errors.from_wire(resp.status_code, json.loads(body))
            except ValueError:
                err = errors.ServerError(f"node answered {resp.status_code}")
            if isinstance(err, errors.InvalidRequest) and "directory" in err.message:
                raise HTTPError(400, f"path '{path}' is a directory")
            raise err
        name = path.rsplit("/", 1)[-1].replace('"', "")
        await send({"type": "http.response.start", "status": 200, "headers": [
            (b"content-type", b"application/octet-stream"),
            (b"content-disposition", f'attachment; filename="{name}"'.encode("utf-8", "replace"))]})
        async for chunk in resp.aiter_raw():
            if chunk:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})


async def _gunzip(chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    d = zlib.decompressobj(16 + zlib.MAX_WBITS)
    total = 0
    async for chunk in chunks:
        out = d.decompress(chunk)
        total += len(out)
        if total > MAX_UNZIPPED:
            raise HTTPError(413, f"the upload unpacks to more than {MAX_UNZIPPED} bytes")
        if out:
            yield out
    tail = d.flush()
    if tail:
        yield tail


async def _raw_body(body: Body) -> AsyncIterator[bytes]:
    while await body._fill():
        if body._buf:
            chunk = bytes(body._buf)
            body._buf.clear()
            yield chunk
    if body.disconnected:
        raise HTTPError(400, "the client went away during the upload")


async def _put(ref: Any, path: str, content: AsyncIterator[bytes]) -> dict[str, str]:
    if not path.startswith("/") or path == "/":
        raise HTTPError(400, f"invalid upload path '{path}'")
    await node.call(ref, "PUT", "/files", params={"path": path}, content=content, timeout=None)
    return {"name": path.rsplit("/", 1)[-1], "type": "file", "path": path}


async def _upload(ref: Any, query: dict[str, str], headers: dict[str, str], user: str, workdir: str,
                  body: Body) -> list[dict[str, str]]:
    ctype = headers.get("content-type", "")
    encoding = headers.get("content-encoding", "identity").lower()
    query_path = query.get("path") or None
    if not ctype.lower().startswith("multipart/form-data"):
        if query_path is None:
            raise HTTPError(400, "an octet-stream upload needs ?path=")
        if encoding not in ("identity", "gzip"):
            raise HTTPError(406, f"content encoding {encoding!r} is not supported")
        chunks = _raw_body(body)
        return [await _put(ref, resolve(query_path, user, workdir), _gunzip(chunks) if encoding == "gzip" else chunks)]
    reader = MultipartReader(_raw_body(body), boundary_of(ctype))
    written: list[dict[str, str]] = []
    seen: set[str] = set()
    while (part := await reader.next_part()) is not None:
        if part.name != "file":
            continue
        dest = resolve(query_path or part.filename or None, user, workdir)
        if dest in seen and query_path is None:
            raise HTTPError(400, f"two parts upload to '{dest}'")
        seen.add(dest)
        written.append(await _put(ref, dest, part.chunks()))
    if not written:
        raise HTTPError(400, "no part named 'file' in the upload")
    return written
