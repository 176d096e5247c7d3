"""The control plane's node client on real sockets (``AiohttpExchange``: what `serve` and `up` use; the
in-process stacks use httpx over ASGI). A small HTTP/1.1 server on loopback answers each request as a test
scripts it: answers, typed errors, a kept-alive connection closed under the next request, silence,
oversized answers, no server at all."""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime

import pytest

from pilldrops import errors
from pilldrops.schema.node import NodeDeadline, NodeSandboxSpec
from pilldrops.server.nodes import client as node_client
from pilldrops.server.nodes.client import NodeClient

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


STATUS = {"id": "sb_x", "state": "running"}
SPEC = NodeSandboxSpec(id="sb_x", template="tiny", vcpu=1, memory_mb=64, access_token="t",
                       end_at=datetime.now(UTC))


@dataclass
class Seen:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes


@dataclass
class Node:
    """``answer(seen, n)`` says what to do with the n-th request: ``(status, body)`` to answer (kept alive),
    ``(status, body, how)`` to answer in pieces (``"split"``: the head, then the body in two writes 5 ms
    apart; ``"chunked"``: chunked transfer encoding, three chunks 5 ms apart) or as a redirect
    (``"redirect"``: ``Location`` set to ``body``), ``"drop"`` to close the connection unanswered,
    ``"hang"`` to never answer."""
    answer: Callable[[Seen, int], object]
    seen: list[Seen] = field(default_factory=list)
    connections: int = 0
    url: str = ""


async def _read_request(reader: asyncio.StreamReader) -> Seen | None:
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except (asyncio.IncompleteReadError, ConnectionError):
        return None
    lines = head.decode().split("\r\n")
    method, path, _ = lines[0].split(" ", 2)
    headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:] if ln)}
    body = await reader.readexactly(int(headers.get("content-length", "0")))
    return Seen(method, path, headers, body)


@asynccontextmanager
async def node(answer: Callable[[Seen, int], object]) -> AsyncIterator[Node]:
    state = Node(answer)

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        state.connections += 1
        try:
            while (req := await _read_request(reader)) is not None:
                state.seen.append(req)
                what = answer(req, len(state.seen))
                if what == "drop":
                    return
                if what == "hang":
                    await asyncio.sleep(3600)
                status, body, how = (*what, "")[:3]  # type: ignore[misc]
                data = body if isinstance(body, bytes) else json.dumps(body).encode()
                head = f"HTTP/1.1 {status} X\r\ncontent-type: application/json\r\n"
                if how == "redirect":
                    writer.write(f"{head}location: {body}\r\ncontent-length: 0\r\n\r\n".encode())
                elif how == "chunked":
                    writer.write(f"{head}transfer-encoding: chunked\r\n\r\n".encode())
                    third = len(data) // 3 + 1
                    for part in (data[i:i + third] for i in range(0, len(data), third)):
                        writer.write(f"{len(part):x}\r\n".encode() + part + b"\r\n")
                        await writer.drain()
                        await asyncio.sleep(0.005)
                    writer.write(b"0\r\n\r\n")
                elif how == "split":
                    writer.write(f"{head}content-length: {len(data)}\r\n\r\n".encode() + data[:len(data) // 2])
                    await writer.drain()
                    await asyncio.sleep(0.005)
                    writer.write(data[len(data) // 2:])
                else:
                    writer.write(f"{head}content-length: {len(data)}\r\n\r\n".encode() + data)
                await writer.drain()
        finally:
            writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    state.url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    try:
        yield state
    finally:
        server.close()


@asynccontextmanager
async def client(**kw: object) -> AsyncIterator[NodeClient]:
    nc = NodeClient("secret-token", **kw)  # type: ignore[arg-type]
    try:
        yield nc
    finally:
        await nc.aclose()


async def test_answers_errors_and_what_is_sent() -> None:
    def answer(req: Seen, n: int) -> object:
        if req.method == "POST":
            return 200, STATUS
        if req.path.endswith("/sb_gone"):
            return 404, {"error": {"code": "sandbox_not_found", "message": "no such sandbox"}}
        if "/sb_bad/" in req.path:
            return 409, {"error": {"code": "invalid_state", "message": "it is paused"}}
        return 500, b"<html>not json</html>"

    async with node(answer) as n, client() as nc:
        assert isinstance(nc._json, node_client.AiohttpExchange)
        status = await nc.create(n.url, SPEC)
        assert (status.id, status.state.value) == ("sb_x", "running")
        sent = n.seen[0]
        assert sent.path == "/node/v1/sandboxes" and sent.headers["authorization"] == "Bearer secret-token"
        assert sent.headers["content-type"] == "application/json"
        assert json.loads(sent.body)["id"] == "sb_x"
        assert await nc.kill(n.url, "sb_gone") is None           # not on that node
        with pytest.raises(errors.InvalidState, match="it is paused"):
            await nc.set_deadline(n.url, "sb_bad", NodeDeadline(end_at=datetime.now(UTC)))
        with pytest.raises(errors.PillDropsError) as exc:        # a non-JSON error body: still typed
            await nc.set_deadline(n.url, "sb_other", NodeDeadline(end_at=datetime.now(UTC)))
        assert exc.value.code == errors.ServerError.code and not isinstance(exc.value, errors.NodeUnavailable)
        assert n.connections == 1                                # one kept-alive connection for all


async def test_refused_token_and_no_server() -> None:
    async with node(lambda req, n: (401, {"error": {"code": "unauthenticated", "message": "no"}})) as n, \
            client() as nc:
        with pytest.raises(errors.NodeUnavailable, match="node token"):
            await nc.create(n.url, SPEC)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{s.getsockname()[1]}"        # bound, not listening: refused
        async with client() as nc:
            with pytest.raises(errors.NodeUnavailable, match="did not answer"):
                await nc.kill(closed, "sb_x")


async def test_a_kept_alive_connection_closed_under_a_call() -> None:
    """The node closed the pooled connection as the next request went out: a call that is safe to repeat
    (create and kill are idempotent per id; aiohttp itself repeats PUT and DELETE) is sent once more on a
    fresh connection; another (a pause) is a NodeUnavailable, never sent twice."""
    def answer(req: Seen, n: int) -> object:
        return "drop" if n in (2, 4) else (200, STATUS)

    async with node(answer) as n, client() as nc:
        await nc.create(n.url, SPEC)                              # 1: answered, connection kept
        assert (await nc.create(n.url, SPEC)).id == "sb_x"        # 2: dropped, 3: sent again, answered
        assert [s.method for s in n.seen] == ["POST"] * 3
        with pytest.raises(errors.NodeUnavailable):               # 4: dropped, not repeated
            await nc.pause(n.url, "sb_x")
        assert [s.method for s in n.seen] == ["POST"] * 4 and n.seen[3].path.endswith("/pause")


async def test_silence_and_oversized_answers(monkeypatch: pytest.MonkeyPatch) -> None:
    async with node(lambda req, n: "hang") as n, client(timeout=0.3) as nc:
        with pytest.raises(errors.NodeUnavailable):
            await nc.create(n.url, SPEC)
    monkeypatch.setattr(node_client, "MAX_ANSWER_BYTES", 1000)
    async with node(lambda req, n: (200, {**STATUS, "error": "x" * 2000})) as n, client() as nc:
        with pytest.raises(errors.NodeUnavailable, match="at most 1000"):
            await nc.create(n.url, SPEC)


async def test_proxies_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """HTTP_PROXY / NO_PROXY are honoured as the httpx client did (read once, when the client is made)."""
    for name in ("http_proxy", "HTTP_PROXY", "all_proxy", "ALL_PROXY", "no_proxy", "NO_PROXY"):
        monkeypatch.delenv(name, raising=False)
    async with node(lambda req, n: (200, STATUS)) as proxy:
        monkeypatch.setenv("HTTP_PROXY", proxy.url)
        async with client() as nc:
            await nc.create("http://node-a.internal:7071", SPEC)
        assert proxy.seen[0].path == "http://node-a.internal:7071/node/v1/sandboxes"    # via the proxy
        monkeypatch.setenv("NO_PROXY", "127.0.0.1")
        async with node(lambda req, n: (200, STATUS)) as direct, client() as nc:
            await nc.create(direct.url, SPEC)                     # NO_PROXY: straight to the node
        assert len(proxy.seen) == 1 and direct.seen[0].path == "/node/v1/sandboxes"


async def test_answers_that_arrive_in_pieces_are_read_whole() -> None:
    """An answer split across writes (segments) or chunked is read to its end, never cut at what arrived
    first (a batch kill's answer of 1,000 ids is ~200 KiB); a node's redirect is not followed."""
    items = [{"id": f"sb_{i:05d}", "status": {**STATUS, "id": f"sb_{i:05d}", "error": "x" * 150}}
             for i in range(1000)]

    def answer(req: Seen, n: int) -> object:
        if req.path.endswith("/kill"):
            return 200, {"items": items}, "split"
        if req.method == "POST":
            return 200, STATUS, "chunked" if n % 2 else "split"
        return 307, "/elsewhere", "redirect"

    async with node(answer) as n, client() as nc:
        for _ in range(4):
            assert (await nc.create(n.url, SPEC)).id == "sb_x"
        killed = await nc.kill_many(n.url, [it["id"] for it in items])
        assert len(killed) == 1000 and killed["sb_00999"].status is not None
        with pytest.raises(errors.PillDropsError):
            await nc.kill(n.url, "sb_x")
        assert not any(s.path == "/elsewhere" for s in n.seen)
