"""The gateway in front of every port inside a sandbox: authorize the request (``URLService.authorize``:
a signed token, a cookie left by one, or a public port), strip what is PillDrops' own (the token, its
cookie, our auth headers), then relay it (``relay``) to the sandbox's node. Two ways in, one path:

- ``/ports/{sandbox_id}/{port}/...`` on the control plane's port (``handle_path``): the sandbox's server
  sees ``/...`` and ``X-Forwarded-Prefix: /ports/{id}/{port}``;
- ``Host: {port}-{id}.{domain}`` and E2B's ``E2b-Sandbox-Id``/``E2b-Sandbox-Port`` headers (the E2B router
  calls ``serve`` with ``e2b=True``: the same checks, E2B's error bodies).

Browsers: a valid token in the query string sets an HttpOnly, SameSite=Lax cookie for that sandbox and
port only (``Path=/ports/{id}/{port}/``, or the whole host in the host form), so relative links, scripts,
images and WebSockets of the page work without the token; a top-level navigation carrying the token is
answered with a redirect to the same URL without it (the token leaves the address bar and history).
"""

from __future__ import annotations

import json
import re
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

from starlette.types import Receive, Scope, Send

from pilldrops import errors
from pilldrops._internal.ids import new_id
from pilldrops.server.ports import relay
from pilldrops.server.service.urls import PATH_PREFIX, TOKEN_PARAM, URLService, host_id

if TYPE_CHECKING:
    from pilldrops.server.service.sandboxes import SandboxService

COOKIE = "pilldrops_port"
MAX_QUERY_TOKENS = 4
# ours, never passed into a sandbox
PRIVATE = {"e2b-sandbox-id", "e2b-sandbox-port", "x-access-token", "e2b-traffic-access-token", "x-api-key",
           "x-forwarded-prefix", "x-forwarded-host", "x-forwarded-proto"}
_PATH_RE = re.compile(r"^/ports/([a-z0-9_]{1,64})/(\d{1,5})(/.*)?$", re.DOTALL)


def _query(scope: Scope) -> tuple[list[str], bytes]:
    """Tokens in the query string, and the query string without them (other parameters byte for byte)."""
    raw: bytes = scope.get("query_string", b"")
    tokens, keep = [], []
    for part in raw.split(b"&") if raw else []:
        name = part.split(b"=", 1)[0]
        if name == TOKEN_PARAM.encode():
            tokens.append(part.split(b"=", 1)[1].decode("latin-1") if b"=" in part else "")
        else:
            keep.append(part)
    return tokens[:MAX_QUERY_TOKENS], b"&".join(keep)


def _cookies(headers: list[tuple[bytes, bytes]]) -> tuple[list[str], list[tuple[bytes, bytes]]]:
    """Our cookie's values (every one: a browser sends one per matching path), and the headers with our
    cookie taken out of every Cookie header (the sandbox's own cookies pass through)."""
    ours, out = [], []
    for k, v in headers:
        if k.lower() != b"cookie":
            out.append((k, v))
            continue
        keep = []
        for item in v.decode("latin-1").split(";"):
            name, _, value = item.strip().partition("=")
            if name == COOKIE:
                ours.append(value.strip('"'))
            elif item.strip():
                keep.append(item.strip())
        if keep:
            out.append((b"cookie", "; ".join(keep).encode("latin-1")))
    return ours, out


def _ours(name: str, value: bytes) -> bool:
    """Headers that are PillDrops' own: its routing and auth headers, and an API key in Authorization."""
    n = name.lower()
    return n in PRIVATE or n in relay.HOP_BY_HOP or (n == "authorization" and value.startswith(b"Bearer pd_"))


def _forwarded(scope: Scope, headers: list[tuple[bytes, bytes]], prefix: str) -> list[tuple[bytes, bytes]]:
    hs = {k.decode("latin-1").lower(): v for k, v in scope.get("headers", [])}
    out = [(k, v) for k, v in headers if not _ours(k.decode("latin-1"), v)]
    out.append((b"x-forwarded-proto", _scheme(scope).encode()))
    if "host" in hs:
        out.append((b"x-forwarded-host", hs["host"]))
    if prefix:
        out.append((b"x-forwarded-prefix", prefix.encode()))
    return out


def _scheme(scope: Scope) -> str:
    scheme = str(scope.get("scheme", "http"))
    return {"ws": "http", "wss": "https"}.get(scheme, scheme)


def _cookie(token: str, expires_at: int, now: float, path: str, secure: bool) -> tuple[bytes, bytes]:
    attrs = [f"{COOKIE}={token}", f"Path={quote(path, safe='/_-.~')}", f"Max-Age={max(0, int(expires_at - now))}",
             "HttpOnly", "SameSite=Lax"]
    if secure:
        attrs.append("Secure")
    return b"set-cookie", "; ".join(attrs).encode("latin-1")


def error_body(exc: errors.PillDropsError) -> dict[str, Any]:
    exc.request_id = exc.request_id or new_id("req", 12)
    return exc.to_body()


async def send_error(scope: Scope, send: Send, exc: errors.PillDropsError, body: dict[str, Any] | None = None,
                     status: int | None = None) -> None:
    """A typed JSON error; for a WebSocket before its accept, the same as an HTTP denial answer where the
    server supports it (else a close with code 1008 / 1011 and the message)."""
    payload = json.dumps(body if body is not None else error_body(exc)).encode()
    status = status or exc.status or 500
    head = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
    if scope["type"] == "websocket":
        if "websocket.http.response" in (scope.get("extensions") or {}):
            await send({"type": "websocket.http.response.start", "status": status, "headers": head})
            await send({"type": "websocket.http.response.body", "body": payload})
        else:
            await send({"type": "websocket.close", "code": 1008 if status in (401, 403) else 1011,
                        "reason": exc.message[:120]})
        return
    await send({"type": "http.response.start", "status": status, "headers": head})
    await send({"type": "http.response.body", "body": payload})


class PortGateway:
    def __init__(self, sandboxes: SandboxService, urls: URLService) -> None:
        self.sandboxes = sandboxes
        self.urls = urls

    @staticmethod
    def matches(path: str) -> bool:
        return path.startswith(PATH_PREFIX)

    async def handle_path(self, scope: Scope, receive: Receive, send: Send) -> None:
        """``/ports/{sandbox_id}/{port}/...``."""
        m = _PATH_RE.match(scope.get("path", ""))
        if m is None or not 1 <= int(m.group(2)) <= 65535:
            if scope["type"] == "websocket":
                await receive()
            await send_error(scope, send, errors.NotFound(
                "a port URL is /ports/{sandbox_id}/{port}/...; get one with sb.get_url(port)"))
            return
        sandbox_id, port = m.group(1), int(m.group(2))
        prefix = f"{PATH_PREFIX}{sandbox_id}/{port}"
        if m.group(3) is None and scope["type"] == "http":   # relative links need the trailing slash
            qs = scope.get("query_string", b"")
            location = prefix + "/" + ("?" + qs.decode("latin-1") if qs else "")
            await send({"type": "http.response.start", "status": 308,
                        "headers": [(b"location", location.encode("latin-1")), (b"content-length", b"0")]})
            await send({"type": "http.response.body", "body": b""})
            return
        await self.serve(sandbox_id, port, scope, receive, send, prefix=prefix)

    async def serve(self, sandbox_id: str, port: int, scope: Scope, receive: Receive, send: Send, *,
                    prefix: str = "", e2b: bool = False) -> None:
        """Authorize and relay one request for ``port`` of ``sandbox_id``; ``prefix`` is the path the URL
        form puts before the sandbox's own ('' for the host and header forms)."""
        query_tokens, query = _query(scope)
        cookie_tokens, headers = _cookies(list(scope.get("headers", [])))
        try:
            row, expires_at = await self.urls.authorize(sandbox_id, port, [*query_tokens, *cookie_tokens],
                                                        reveal_missing=e2b)
            node = await self.sandboxes.node_for(row)
        except errors.PillDropsError as exc:
            if scope["type"] == "websocket":
                await receive()              # the websocket.connect message, before any answer
            await self._refuse(scope, send, exc, sandbox_id, e2b)
            return
        path = relay.target(scope)
        path = path.split(b"?", 1)[0][len(prefix.encode()):] or b"/"
        if query:
            path += b"?" + query
        answer: list[tuple[bytes, bytes]] = []
        if expires_at is not None and query_tokens:        # a token in the URL: the browser keeps it as a cookie
            token = next(t for t in query_tokens if t)
            https = _scheme(scope) == "https" or dict(headers).get(b"x-forwarded-proto") == b"https"
            answer.append(_cookie(token, expires_at, self.urls.clock.now().timestamp(), prefix + "/", https))
            if scope["type"] == "http" and scope["method"] in ("GET", "HEAD") and \
                    dict(headers).get(b"sec-fetch-mode") == b"navigate":
                location = (prefix.encode() + path) if prefix else path
                await send({"type": "http.response.start", "status": 303,
                            "headers": [(b"location", location), (b"content-length", b"0"),
                                        (b"cache-control", b"no-store"), (b"referrer-policy", b"no-referrer"),
                                        *answer]})
                await send({"type": "http.response.body", "body": b""})
                return
        up = relay.Upstream(node.url, row.id, row.access_token, self.sandboxes.nodes.http.headers.get("authorization"))
        fwd = _forwarded(scope, headers, prefix)
        try:
            if scope["type"] == "websocket":
                await relay.relay_websocket(up, port, scope, receive, send, path=path, headers=fwd,
                                            answer_headers=answer)
            else:
                await relay.relay_http(up, port, scope, receive, send, path=path, headers=fwd,
                                       answer_headers=answer)
        except relay.PortClosed:
            await self._refuse(scope, send, errors.PortNotOpen(
                f"the sandbox is running but nothing listens on port {port}",
                details={"sandbox_id": row.id, "port": port}), sandbox_id, e2b, closed=True)
        except errors.PillDropsError as exc:
            await self._refuse(scope, send, exc, sandbox_id, e2b)

    async def _refuse(self, scope: Scope, send: Send, exc: errors.PillDropsError, sandbox_id: str, e2b: bool,
                      closed: bool = False) -> None:
        if not e2b or isinstance(exc, errors.AuthenticationError):
            await send_error(scope, send, exc)
            return
        # E2B's proxy answers a gone or unreachable sandbox with 502 and its own body (the SDKs read it)
        eid = host_id(sandbox_id)
        if closed:
            message = "The sandbox is running but port is not open"
        elif isinstance(exc, errors.SandboxNotFound | errors.InvalidState):
            message = "The sandbox was not found"
        else:
            message = f"The sandbox is running but unreachable: {exc.message}"
        body = {"sandboxId": eid, "message": message, "code": 502, **error_body(exc)}
        if closed:
            body["port"] = int(exc.details["port"]) if isinstance(exc.details, dict) else None
        await send_error(scope, send, exc, body, status=502)
