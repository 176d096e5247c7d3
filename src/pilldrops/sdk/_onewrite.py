"""httpx transports that send a request's head together with its body (issue 15).

httpcore writes an HTTP/1.1 request as one ``send`` for the head and one per body part: the server wakes
up for the head, finds no body yet, and wakes again. Here the head (the first write after a response was
read, i.e. the start of a request) is held and sent with the next write, or before the first read, or at
close; nothing else is ever held, so a streamed upload is sent as it is produced. Everything else is
httpcore's own network backend."""

from __future__ import annotations

from typing import Any

import httpcore
import httpx


class _Stream(httpcore.NetworkStream):
    def __init__(self, inner: httpcore.NetworkStream) -> None:
        self._inner = inner
        self._head: bytes | None = None
        self._fresh = True             # nothing written since the last read: the next write is a head

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        if self._fresh and self._head is None:
            self._head, self._fresh = buffer, False
            return
        if self._head is not None:
            buffer, self._head = self._head + buffer, None
        if buffer:
            self._inner.write(buffer, timeout)

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        if self._head is not None:
            head, self._head = self._head, None
            self._inner.write(head, timeout)
        self._fresh = True
        return self._inner.read(max_bytes, timeout)

    def close(self) -> None:
        self._head = None
        self._inner.close()

    def start_tls(self, *args: Any, **kwargs: Any) -> httpcore.NetworkStream:
        return _Stream(self._inner.start_tls(*args, **kwargs))

    def get_extra_info(self, info: str) -> Any:
        return self._inner.get_extra_info(info)


class _AsyncStream(httpcore.AsyncNetworkStream):
    def __init__(self, inner: httpcore.AsyncNetworkStream) -> None:
        self._inner = inner
        self._head: bytes | None = None
        self._fresh = True

    async def write(self, buffer: bytes, timeout: float | None = None) -> None:
        if self._fresh and self._head is None:
            self._head, self._fresh = buffer, False
            return
        if self._head is not None:
            buffer, self._head = self._head + buffer, None
        if buffer:
            await self._inner.write(buffer, timeout)

    async def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        if self._head is not None:
            head, self._head = self._head, None
            await self._inner.write(head, timeout)
        self._fresh = True
        return await self._inner.read(max_bytes, timeout)

    async def aclose(self) -> None:
        self._head = None
        await self._inner.aclose()

    async def start_tls(self, *args: Any, **kwargs: Any) -> httpcore.AsyncNetworkStream:
        return _AsyncStream(await self._inner.start_tls(*args, **kwargs))

    def get_extra_info(self, info: str) -> Any:
        return self._inner.get_extra_info(info)


class _Backend(httpcore.NetworkBackend):
    def __init__(self, inner: httpcore.NetworkBackend) -> None:
        self._inner = inner

    def connect_tcp(self, *args: Any, **kwargs: Any) -> httpcore.NetworkStream:
        return _Stream(self._inner.connect_tcp(*args, **kwargs))

    def connect_unix_socket(self, *args: Any, **kwargs: Any) -> httpcore.NetworkStream:
        return _Stream(self._inner.connect_unix_socket(*args, **kwargs))

    def sleep(self, seconds: float) -> None:
        self._inner.sleep(seconds)


class _AsyncBackend(httpcore.AsyncNetworkBackend):
    def __init__(self, inner: httpcore.AsyncNetworkBackend) -> None:
        self._inner = inner

    async def connect_tcp(self, *args: Any, **kwargs: Any) -> httpcore.AsyncNetworkStream:
        return _AsyncStream(await self._inner.connect_tcp(*args, **kwargs))

    async def connect_unix_socket(self, *args: Any, **kwargs: Any) -> httpcore.AsyncNetworkStream:
        return _AsyncStream(await self._inner.connect_unix_socket(*args, **kwargs))

    async def sleep(self, seconds: float) -> None:
        await self._inner.sleep(seconds)


def _wrap(transport: Any, cls: type) -> Any:
    pool = getattr(transport, "_pool", None)
    inner = getattr(pool, "_network_backend", None)
    if isinstance(pool, (httpcore.ConnectionPool, httpcore.AsyncConnectionPool)) and inner is not None:
        pool._network_backend = cls(inner)      # type: ignore[union-attr]
    return transport        # another httpx/httpcore layout: the plain transport, one write more per request


def transport(limits: httpx.Limits) -> httpx.HTTPTransport:
    return _wrap(httpx.HTTPTransport(limits=limits), _Backend)       # type: ignore[no-any-return]


def async_transport(limits: httpx.Limits) -> httpx.AsyncHTTPTransport:
    return _wrap(httpx.AsyncHTTPTransport(limits=limits), _AsyncBackend)   # type: ignore[no-any-return]
