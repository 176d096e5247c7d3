"""A streaming ``multipart/form-data`` reader for envd uploads: parts one after the other, each body as
chunks, nothing held beyond one read plus the boundary. The raw ``filename`` parameter is kept as sent
(E2B sends the full destination path there; helpers that take the basename would lose it).
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator

from pilldrops import errors

MAX_HEADERS = 16 * 1024
MAX_PARTS = 1000
_PARAM = re.compile(r';\s*([A-Za-z0-9_*-]+)\s*=\s*("(?:[^"\\]|\\.)*"|[^;]*)')


def boundary_of(content_type: str) -> bytes:
    m = re.search(r'boundary="?([^";]+)"?', content_type)
    if not m or not (1 <= len(m.group(1)) <= 200):
        raise errors.InvalidRequest("multipart upload without a valid boundary")
    return m.group(1).encode()


def disposition(headers: dict[str, str]) -> dict[str, str]:
    params = {}
    for key, value in _PARAM.findall(";" + headers.get("content-disposition", "").split(";", 1)[-1]):
        value = value.strip()
        if value.startswith('"') and value.endswith('"'):
            value = re.sub(r"\\(.)", r"\1", value[1:-1])
        params[key.lower()] = value
    return params


class Part:
    def __init__(self, reader: MultipartReader, headers: dict[str, str]) -> None:
        self._r = reader
        self.headers = headers
        self.params = disposition(headers)
        self.done = False

    @property
    def name(self) -> str | None:
        return self.params.get("name")

    @property
    def filename(self) -> str | None:
        return self.params.get("filename")

    async def chunks(self) -> AsyncIterator[bytes]:
        while not self.done:
            chunk = await self._r._body_chunk(self)
            if chunk:
                yield chunk


class MultipartReader:
    def __init__(self, body: AsyncIterator[bytes], boundary: bytes) -> None:
        self._body = body
        self._delim = b"\r\n--" + boundary
        self._buf = bytearray(b"\r\n")        # so the first boundary looks like every other one
        self._eof = False
        self._finished = False
        self._current: Part | None = None
        self._parts = 0

    async def _more(self) -> bool:
        if self._eof:
            return False
        try:
            chunk = await self._body.__anext__()
        except StopAsyncIteration:
            self._eof = True
            return False
        self._buf += chunk
        return True

    async def next_part(self) -> Part | None:
        if self._current is not None:
            async for _ in self._current.chunks():       # skip what the caller did not read
                pass
        if self._finished:
            return None
        if self._current is None:                         # the preamble up to the first boundary
            while (i := self._buf.find(self._delim)) < 0:
                del self._buf[:max(0, len(self._buf) - len(self._delim))]
                if not await self._more():
                    raise errors.InvalidRequest("multipart body without its boundary")
            del self._buf[:i + len(self._delim)]
        while len(self._buf) < 2:
            if not await self._more():
                raise errors.InvalidRequest("truncated multipart body")
        if self._buf[:2] == b"--":
            self._finished = True
            return None
        while (j := self._buf.find(b"\r\n\r\n")) < 0:
            if len(self._buf) > MAX_HEADERS:
                raise errors.InvalidRequest("multipart part headers are too large")
            if not await self._more():
                raise errors.InvalidRequest("truncated multipart part headers")
        raw = bytes(self._buf[:j]).decode("utf-8", "replace")
        del self._buf[:j + 4]
        headers = {}
        for ln in raw.split("\r\n"):
            if ":" in ln:
                k, v = ln.split(":", 1)
                headers[k.strip().lower()] = v.strip()
        self._parts += 1
        if self._parts > MAX_PARTS:
            raise errors.InvalidRequest(f"more than {MAX_PARTS} parts in one upload")
        self._current = Part(self, headers)
        return self._current

    async def _body_chunk(self, part: Part) -> bytes:
        while True:
            i = self._buf.find(self._delim)
            if i >= 0:
                out = bytes(self._buf[:i])
                del self._buf[:i + len(self._delim)]
                part.done = True
                return out
            keep = len(self._delim)
            if len(self._buf) > keep:
                out = bytes(self._buf[:-keep])
                del self._buf[:-keep]
                return out
            if not await self._more():
                raise errors.InvalidRequest("truncated multipart part")
