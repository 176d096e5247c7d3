"""Requests for a port inside a sandbox, relayed through a byte tunnel to the sandbox's node
(``node.portforward``: a WebSocket to ``/v1/sandboxes/{id}/ports/{port}`` whose far end is
``127.0.0.1:port`` inside the sandbox). The one relay path: port URLs (``gateway``), E2B's user ports and
its code interpreter all use it.

- HTTP: one request per tunnel, written as HTTP/1.1 (``Connection: close``), the answer parsed with h11
  and streamed back. Everything from the sandbox is bounded: h11 caps the status line and headers, the
  body is streamed in chunks (one tunnel message of at most 1 MiB in flight), never buffered whole; a
  server that never starts its answer, or stalls in it, is cut after ``HEAD_TIMEOUT_S`` / ``IDLE_TIMEOUT_S``.
- WebSocket: the client's WebSocket is accepted once the sandbox's server accepted ours (same subprotocol),
  then messages are relayed both ways (websockets' sans-I/O client over the tunnel, messages capped).

Failures before an answer started raise (``PortClosed``, ``SandboxGone``, ``errors.NodeUnavailable``,
``errors.GatewayTimeout``) so that each surface answers them in its own format.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import anyio
import h11
from starlette.types import Receive, Scope, Send
from websockets.asyncio.client import connect as ws_connect
from websockets.exceptions import ConnectionClosed, InvalidStatus, WebSocketException

from pilldrops import errors
from pilldrops.schema.node import PORT_TUNNEL_READY, PORT_TUNNEL_REFUSED

log = logging.getLogger("pilldrops.ports")
CLOSE_REFUSED, READY = PORT_TUNNEL_REFUSED, PORT_TUNNEL_READY
TUNNEL_MESSAGE_MAX = 1024 * 1024
MAX_HEADER_BYTES = 64 * 1024
MAX_WS_MESSAGE = 16 * 1024 * 1024
HEAD_TIMEOUT_S = 300.0     # until the sandbox's server starts its answer (long polls fit; a mute one does not hang)
IDLE_TIMEOUT_S = 300.0     # between two chunks of an answer's body
HOP_BY_HOP = {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
              "transfer-encoding", "upgrade", "host", "content-length"}
OWN_ANSWER = {"date", "server"}     # the control plane's server sets its own


class PortClosed(Exception):
    """Nothing listens on that port inside the sandbox."""


class SandboxGone(errors.SandboxNotFound):
    """The node no longer runs the sandbox (killed or ended a moment ago)."""


@dataclass(frozen=True)
class Upstream:
    """Where a sandbox's port tunnel is: its node's data plane, the sandbox's access token and the node
    token (``authorization``)."""

    node_url: str
    sandbox_id: str
    access_token: str
    node_auth: str | None = None


class Tunnel:
    """A byte stream to ``127.0.0.1:port`` inside a sandbox."""

    def __init__(self, ws: Any) -> None:
        self.ws = ws

    async def send(self, data: bytes) -> None:
        if data:
            await self.ws.send(data)

    async def send_eof(self) -> None:
        await self.ws.send(b"")

    async def receive(self) -> bytes | None:
        """Next chunk, or None when the sandbox side closed."""
        try:
            msg = await self.ws.recv()
        except ConnectionClosed:
            return None
        return msg if isinstance(msg, bytes) else msg.encode()


@asynccontextmanager
async def open_tunnel(up: Upstream, port: int) -> AsyncIterator[Tunnel]:
    url = up.node_url.replace("http", "ws", 1) + f"/v1/sandboxes/{up.sandbox_id}/ports/{port}"
    headers = {"x-access-token": up.access_token}
    if up.node_auth:
        headers["authorization"] = up.node_auth
    try:
        ws = await ws_connect(url, additional_headers=headers, max_size=TUNNEL_MESSAGE_MAX, compression=None,
                              open_timeout=10, ping_interval=None, close_timeout=2)
    except (OSError, WebSocketException, TimeoutError) as exc:
        if isinstance(exc, InvalidStatus):
            raise errors.NodeUnavailable(f"node refused the port tunnel (HTTP {exc.response.status_code})") from exc
        raise errors.NodeUnavailable(f"node at {up.node_url} did not answer: {exc!r}") from exc
    try:
        try:
            first = await ws.recv()
        except ConnectionClosed as exc:
            code = exc.rcvd.code if exc.rcvd else 1006
            if code == CLOSE_REFUSED:
                raise PortClosed(f"nothing listens on port {port} in the sandbox") from exc
            reason = exc.rcvd.reason if exc.rcvd else ""
            raise SandboxGone(f"port {port} is unreachable: {reason or code}") from exc
        if first != READY:
            raise errors.NodeUnavailable("the node's port tunnel spoke an unknown protocol")
        yield Tunnel(ws)
    finally:
        with anyio.CancelScope(shield=True):
            await ws.close()


def target(scope: Scope) -> bytes:
    """The request's path and query as sent."""
    path = scope.get("raw_path") or scope.get("path", "/").encode()
    qs = scope.get("query_string", b"")
    return path + (b"?" + qs if qs else b"")


async def request_stream(tunnel: Tunnel, port: int, method: str, target: bytes,
                         headers: list[tuple[bytes, bytes]], body: AsyncIterator[bytes], *,
                         length: int | None = None, chunked: bool = False, head_timeout: float | None = None,
                         idle_timeout: float | None = None,
                         ) -> tuple[int, list[tuple[bytes, bytes]], AsyncIterator[bytes]]:
    """One HTTP/1.1 exchange over ``tunnel``: the answer's status, headers and a body stream. The request
    body is ``length`` bytes, or chunked, or none."""
    conn = h11.Connection(h11.CLIENT, max_incomplete_event_size=MAX_HEADER_BYTES)
    hs = [(b"host", f"127.0.0.1:{port}".encode()), *headers, (b"connection", b"close")]
    if length is not None:
        hs.append((b"content-length", str(length).encode()))
    elif chunked:
        hs.append((b"transfer-encoding", b"chunked"))
    await tunnel.send(conn.send(h11.Request(method=method, target=target, headers=hs)))
    if length is not None or chunked:
        async for chunk in body:
            if chunk:
                await tunnel.send(conn.send(h11.Data(data=chunk)))
    await tunnel.send(conn.send(h11.EndOfMessage()))

    async def next_event(timeout: float | None) -> Any:
        while True:
            try:
                ev = conn.next_event()
            except h11.RemoteProtocolError as exc:
                raise errors.NodeUnavailable(f"the sandbox's server sent a malformed answer: {exc}") from exc
            if ev is h11.NEED_DATA:
                with anyio.move_on_after(timeout) as waited:
                    data = await tunnel.receive()
                if waited.cancelled_caught:
                    raise errors.GatewayTimeout(f"the server on port {port} in the sandbox did not answer "
                                                f"within {timeout:.0f} s")
                conn.receive_data(data or b"")
                continue
            return ev

    ev = await next_event(head_timeout)
    while isinstance(ev, h11.InformationalResponse):
        ev = await next_event(head_timeout)
    if not isinstance(ev, h11.Response):
        raise errors.NodeUnavailable("the sandbox's server closed the connection without an answer")

    async def body_iter() -> AsyncIterator[bytes]:
        while True:
            try:
                e = await next_event(idle_timeout)
            except errors.PillDropsError as exc:      # the answer has started: it can only end early
                log.info("answer from port %d cut: %s", port, exc.message)
                return
            if isinstance(e, h11.Data):
                yield bytes(e.data)
            elif isinstance(e, (h11.EndOfMessage, h11.ConnectionClosed)):
                return

    drop = (HOP_BY_HOP - {"content-length"}) | OWN_ANSWER      # the body is relayed exactly: its length holds
    keep = [(k, v) for k, v in ev.headers if k.decode("latin-1").lower() not in drop]
    return ev.status_code, keep, body_iter()


async def _request_body(receive: Receive) -> AsyncIterator[bytes]:
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            return
        yield msg.get("body", b"")
        if not msg.get("more_body"):
            return


async def relay_http(up: Upstream, port: int, scope: Scope, receive: Receive, send: Send, *, path: bytes,
                     headers: list[tuple[bytes, bytes]], answer_headers: list[tuple[bytes, bytes]] = (),  # type: ignore[assignment]
                     head_timeout: float | None = HEAD_TIMEOUT_S, idle_timeout: float | None = IDLE_TIMEOUT_S
                     ) -> None:
    """Relay one HTTP request (any method, streamed both ways) to ``port`` as ``path`` with ``headers``
    (already filtered by the caller); ``answer_headers`` are added to the answer."""
    async with open_tunnel(up, port) as tunnel:
        hs = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        length = int(hs["content-length"]) if hs.get("content-length", "").isdigit() else None
        status, out, body = await request_stream(
            tunnel, port, scope["method"], path, headers, _request_body(receive), length=length,
            chunked=length is None and "transfer-encoding" in hs, head_timeout=head_timeout,
            idle_timeout=idle_timeout)
        await send({"type": "http.response.start", "status": status, "headers": [*out, *answer_headers]})
        async for chunk in body:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b""})


class WebSocketRefused(errors.NodeUnavailable):
    """The sandbox's server did not accept the WebSocket handshake."""


async def relay_websocket(up: Upstream, port: int, scope: Scope, receive: Receive, send: Send, *, path: bytes,
                          headers: list[tuple[bytes, bytes]], answer_headers: list[tuple[bytes, bytes]] = (),  # type: ignore[assignment]
                          ) -> None:
    """The sandbox's server accepts our handshake first; only then is the client's accepted (with
    ``answer_headers``). Raises before the client's WebSocket is accepted; closes it afterwards."""
    from websockets.client import ClientProtocol
    from websockets.frames import Opcode
    from websockets.http11 import Response
    from websockets.uri import parse_uri

    msg = await receive()
    if msg["type"] != "websocket.connect":
        return
    proto = ClientProtocol(parse_uri(f"ws://127.0.0.1:{port}{path.decode('latin-1')}"), max_size=MAX_WS_MESSAGE,
                           subprotocols=list(scope.get("subprotocols") or []) or None)
    async with open_tunnel(up, port) as tunnel:
        req = proto.connect()
        for k, v in headers:
            name = k.decode("latin-1")
            if not name.lower().startswith("sec-websocket-") and name.lower() not in req.headers:
                req.headers[name] = v.decode("latin-1")
        proto.send_request(req)

        async def flush() -> None:
            for data in proto.data_to_send():
                if data:
                    await tunnel.send(data)

        await flush()
        response = None
        with anyio.move_on_after(HEAD_TIMEOUT_S):
            while response is None:
                data = await tunnel.receive()
                if data is None:
                    proto.receive_eof()
                else:
                    proto.receive_data(data)
                for ev in proto.events_received():
                    if isinstance(ev, Response):
                        response = ev
                if data is None and response is None:
                    break
        if response is None or response.status_code != 101 or proto.handshake_exc is not None:
            raise WebSocketRefused(f"the server on port {port} in the sandbox refused the WebSocket")
        await send({"type": "websocket.accept", "subprotocol": response.headers.get("Sec-WebSocket-Protocol"),
                    "headers": list(answer_headers)})

        async def client_to_sandbox() -> None:
            while True:
                m = await receive()
                if m["type"] == "websocket.disconnect":
                    proto.send_close(m.get("code", 1000) if m.get("code", 1000) != 1005 else 1000)
                    await flush()
                    return
                if m.get("bytes") is not None:
                    proto.send_binary(m["bytes"])
                elif m.get("text") is not None:
                    proto.send_text(m["text"].encode())
                await flush()

        async def sandbox_to_client() -> None:
            parts: list[bytes] = []
            kind = None
            while True:
                data = await tunnel.receive()
                if data is None:
                    proto.receive_eof()
                else:
                    proto.receive_data(data)
                for frame in proto.events_received():
                    if frame.opcode in (Opcode.TEXT, Opcode.BINARY):
                        kind, parts = frame.opcode, [frame.data]
                    elif frame.opcode == Opcode.CONT:
                        parts.append(frame.data)
                    elif frame.opcode == Opcode.CLOSE:
                        await flush()
                        await send({"type": "websocket.close", "code": 1000})
                        return
                    else:
                        continue       # ping/pong: answered by the protocol object
                    if frame.fin and kind is not None:
                        payload = b"".join(parts)
                        if kind == Opcode.TEXT:
                            await send({"type": "websocket.send", "text": payload.decode("utf-8", "replace")})
                        else:
                            await send({"type": "websocket.send", "bytes": payload})
                        parts, kind = [], None
                await flush()
                if data is None:
                    await send({"type": "websocket.close", "code": 1000})
                    return

        async with anyio.create_task_group() as tg:
            async def run(fn: Any) -> None:
                try:
                    await fn()
                finally:
                    tg.cancel_scope.cancel()
            tg.start_soon(run, client_to_sandbox)
            tg.start_soon(run, sandbox_to_client)
