"""The SDK's default transports send a request's head with its body (``sdk/_onewrite.py``, issue 15)."""

from __future__ import annotations

import socket
import threading

import httpx
import pytest

from pilldrops.sdk import _onewrite


def _server(n: int, delay: float = 0.2) -> tuple[int, list[bytes]]:
    """Answers ``n`` requests on one kept-alive connection; records what each first ``recv`` got (after a
    pause, so that everything the client sent in separate writes could have arrived)."""
    import time

    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen()
    got: list[bytes] = []

    def serve() -> None:
        c, _ = srv.accept()
        with c, srv:
            for _ in range(n):
                time.sleep(delay)
                got.append(c.recv(65536))
                c.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")

    threading.Thread(target=serve, daemon=True).start()
    return srv.getsockname()[1], got


def _one_segment_each(got: list[bytes]) -> None:
    post, get = got
    assert post.startswith(b"POST /run ") and post.endswith(b'{"cmd":"true"}'), post
    assert get.startswith(b"GET /x ") and get.endswith(b"\r\n\r\n"), get


def test_sync_post_is_one_write() -> None:
    port, got = _server(2)
    with httpx.Client(transport=_onewrite.transport(httpx.Limits())) as c:
        assert c.post(f"http://127.0.0.1:{port}/run", content=b'{"cmd":"true"}').text == "ok"
        assert c.get(f"http://127.0.0.1:{port}/x").text == "ok"
    _one_segment_each(got)


@pytest.mark.anyio
async def test_async_post_is_one_write() -> None:
    port, got = _server(2)
    async with httpx.AsyncClient(transport=_onewrite.async_transport(httpx.Limits())) as c:
        assert (await c.post(f"http://127.0.0.1:{port}/run", content=b'{"cmd":"true"}')).text == "ok"
        assert (await c.get(f"http://127.0.0.1:{port}/x")).text == "ok"
    _one_segment_each(got)


def test_the_default_client_uses_it() -> None:
    from pilldrops.sdk._base import http_client_kwargs
    from pilldrops.sdk._config import resolve

    kw = http_client_kwargs(resolve("http://x", "k"))
    assert isinstance(kw["transport"]._pool._network_backend, _onewrite._Backend)
    own = httpx.MockTransport(lambda r: httpx.Response(200))
    assert http_client_kwargs(resolve("http://x", "k", transport=own))["transport"] is own
