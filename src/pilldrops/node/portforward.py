"""Reach a TCP port inside a sandbox from the node: a connection to ``127.0.0.1:PORT`` made inside the
sandbox's own network namespace, relayed over a WebSocket of the node's data plane.

A sandbox's network is its own namespace (loopback only unless egress was asked for), so nothing on the
host can dial its ports. The node connects from a short-lived helper thread that ``setns``-es into the
namespace of the sandbox's init (``/proc/<pid>/ns/net``), creates and connects the socket there, and ends:
a socket keeps the namespace it was made in, and a namespace is a per-thread attribute, so nothing else of
the agent ever runs inside the sandbox's network. The thread never returns to a pool, so no other work can
inherit its namespace even if switching back were to fail.

The relay is byte-transparent (HTTP, WebSocket or anything else over TCP); each direction is a bounded
stream of WebSocket binary messages, so a sandbox that floods its side only ever has one chunk in flight.
"""

from __future__ import annotations

import ctypes
import errno
import os
import socket
import threading
from typing import Any

import anyio
import anyio.abc

from pilldrops import errors
from pilldrops.schema.node import PORT_TUNNEL_GONE, PORT_TUNNEL_READY, PORT_TUNNEL_REFUSED

CLONE_NEWNET = 0x40000000
CHUNK = 64 * 1024
CONNECT_TIMEOUT_S = 5.0
# what the control plane reads (schema: shared by both sides)
CLOSE_REFUSED, CLOSE_GONE, READY = PORT_TUNNEL_REFUSED, PORT_TUNNEL_GONE, PORT_TUNNEL_READY

_libc = ctypes.CDLL(None, use_errno=True)


def _setns(fd: int) -> None:
    if _libc.setns(fd, CLONE_NEWNET) != 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))


def _connect_in_netns(init_pid: int, port: int, timeout: float) -> socket.socket:
    """Runs in its own thread: enter the sandbox's netns, connect, come back."""
    own = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
    try:
        target = os.open(f"/proc/{init_pid}/ns/net", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        os.close(own)
        raise
    try:
        _setns(target)
        try:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        finally:
            _setns(own)          # the socket stays in the sandbox's namespace; this thread does not
    finally:
        os.close(target)
        os.close(own)
    try:
        sock.settimeout(timeout)
        sock.connect(("127.0.0.1", port))
        sock.settimeout(None)
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    except BaseException:
        sock.close()
        raise
    return sock


async def connect(init_pid: int, port: int, timeout: float = CONNECT_TIMEOUT_S) -> anyio.abc.SocketStream:
    """A stream connected to ``127.0.0.1:port`` in the network namespace of process ``init_pid``.

    ``ConnectionRefusedError`` when nothing listens there; ``errors.SandboxNotFound`` when the process is
    gone."""
    if not 1 <= port <= 65535:
        raise errors.InvalidRequest(f"port {port} is out of range")
    box: dict[str, Any] = {}

    def work() -> None:
        try:
            box["sock"] = _connect_in_netns(init_pid, port, timeout)
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            box["err"] = e

    def in_fresh_thread() -> None:       # a pool thread only waits; the netns switch happens in a new one
        t = threading.Thread(target=work, name=f"portforward-{init_pid}-{port}", daemon=True)
        t.start()
        t.join()

    await anyio.to_thread.run_sync(in_fresh_thread)
    if "err" in box:
        err = box["err"]
        if isinstance(err, FileNotFoundError) or (isinstance(err, OSError) and err.errno == errno.ESRCH):
            raise errors.SandboxNotFound("the sandbox's process is gone") from err
        raise err
    return await anyio.abc.SocketStream.from_socket(box["sock"])


class Tunnel:
    """One open relay; listed among the sandbox's commands in flight (``Target.active``) so that a pause
    closes it first (a checkpoint cannot carry an established connection)."""

    pid = None
    timed_out = False
    truncated = False

    def __init__(self) -> None:
        self.scope = anyio.CancelScope()

    async def kill(self) -> None:
        self.scope.cancel()


async def relay(ws: Any, stream: anyio.abc.SocketStream, tunnel: Tunnel | None = None) -> None:
    """Pump bytes both ways between a Starlette ``WebSocket`` (already accepted) and ``stream`` until either
    side closes (or ``tunnel`` is killed); then close both."""
    async def up() -> None:          # client -> sandbox
        try:
            while True:
                msg = await ws.receive()
                if msg["type"] == "websocket.disconnect":
                    break
                data = msg.get("bytes")
                if data is None and msg.get("text") is not None:
                    data = msg["text"].encode()
                if data:
                    await stream.send(data)
                elif data is not None:         # an empty message: the client finished sending
                    await stream.send_eof()
        finally:
            tg.cancel_scope.cancel()

    async def down() -> None:        # sandbox -> client
        try:
            while True:
                try:
                    data = await stream.receive(CHUNK)
                except (anyio.EndOfStream, anyio.BrokenResourceError, OSError):
                    break
                await ws.send_bytes(data)
        finally:
            tg.cancel_scope.cancel()

    try:
        with tunnel.scope if tunnel is not None else anyio.CancelScope():
            async with anyio.create_task_group() as tg:
                tg.start_soon(up)
                tg.start_soon(down)
    finally:
        with anyio.CancelScope(shield=True):
            await stream.aclose()
            try:
                await ws.close()
            except Exception:  # noqa: BLE001 - already closed by the peer
                pass
