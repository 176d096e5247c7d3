"""Running ASGI apps under uvicorn inside our own task group, with our own signal handling, so several
servers (control plane + node agent in ``pilldrops up``) stop together and cleanly on Ctrl-C."""

from __future__ import annotations

import asyncio
import errno
import fcntl
import logging
import os
import signal
import socket
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import anyio
import uvicorn


class PortInUse(RuntimeError):
    """The port a server was asked to listen on is taken; the message says which and what to do."""


def check_port(host: str, port: int, option: str = "--port") -> None:
    """Fail at once, before minutes of set-up, when ``host:port`` cannot be listened on."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise PortInUse(f"port {port} on {host} is already in use (another `pilldrops up`?): stop it or "
                                f"choose another port with {option} N") from None
            raise


_LOCKS: dict[Path, int] = {}


class DataDirInUse(RuntimeError):
    """Another PillDrops process of the same role holds the data dir."""


def lock_data_dir(data_dir: Path, role: str) -> int:
    """Hold ``<data_dir>/<role>.lock`` for the life of this process (released when it exits, even killed): two
    control planes, or two node agents, on one data dir would share a database and sandbox state and tear
    down each other's sandboxes. Returns the lock's fd (keep it open)."""
    data_dir.mkdir(parents=True, exist_ok=True)
    path = (data_dir / f"{role}.lock").resolve()
    if path in _LOCKS:                       # this process holds it already (a second command in-process)
        return _LOCKS[path]
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.read(fd, 32).decode(errors="replace").strip() or "?"
        os.close(fd)
        raise DataDirInUse(f"another PillDrops {role} (pid {holder}) is using the data dir {data_dir}: stop it, "
                           f"or give this one its own --data-dir") from None
    os.ftruncate(fd, 0)
    os.write(fd, str(os.getpid()).encode())
    _LOCKS[path] = fd
    return fd


def release_data_dir(fd: int) -> None:
    """Give a data-dir lock back before the process exits (tests)."""
    for path, held in list(_LOCKS.items()):
        if held == fd:
            del _LOCKS[path]
    os.close(fd)


def run_served(fn: Callable[..., Awaitable[Any]], *args: Any, uvloop: bool = True) -> Any:
    """``anyio.run`` for the long-running servers (``up``, ``serve``, ``node``), with ``uvloop`` on uvloop
    when it is installed (the server extra has it), whose event loop costs less CPU per request; uvicorn
    picks httptools' parser by itself when that is installed. The node agent stays on asyncio's loop: it
    starts a subprocess (crun) per operation, and uvloop spawns with a full fork() of the agent where
    CPython's subprocess uses vfork (measured: twice the agent's CPU per create and kill)."""
    opts = {}
    if uvloop:
        try:
            import uvloop as _  # noqa: F401
            opts = {"use_uvloop": True}
        except ImportError:
            pass
    return anyio.run(fn, *args, backend="asyncio", backend_options=opts)


KEEP_ALIVE_S = 20      # idle keep-alive connections the server holds (uvicorn's default: 5 s)


class OneWrite:
    """An asyncio transport whose writes of one event-loop tick go out as ONE ``send`` (issue 15).

    uvicorn writes a response's head and its body separately (two ``send`` calls, two TCP segments: with
    TCP_NODELAY the client wakes up for the head and again for the body). Here a write is appended to a
    buffer and the buffer is sent by a callback at the end of the tick, so a head and the body written
    right after it leave together. Nothing waits longer than the current tick, and no more than
    ``HOLD_MAX`` bytes are ever held (a producer that writes much without yielding meets the transport's
    own flow control as before); ``close``/``write_eof`` send what is held first; everything else is the
    wrapped transport's."""

    __slots__ = ("_held", "_loop", "_size", "_t")

    def __init__(self, transport: Any) -> None:
        self._t = transport
        self._held: list[bytes] = []
        self._size = 0
        self._loop = asyncio.get_running_loop()

    HOLD_MAX = 64 * 1024      # more than this in one tick goes out at once (the transport's flow control)

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if not data:
            return
        if not self._held:
            self._loop.call_soon(self._send)
        self._held.append(bytes(data))
        self._size += len(data)
        if self._size > self.HOLD_MAX:
            self._send()

    def writelines(self, lines: Any) -> None:
        for data in lines:
            self.write(data)

    def _send(self) -> None:
        if self._held:
            data = self._held[0] if len(self._held) == 1 else b"".join(self._held)
            self._held.clear()
            self._size = 0
            if not self._t.is_closing():
                self._t.write(data)

    def get_write_buffer_size(self) -> int:
        return self._t.get_write_buffer_size() + sum(map(len, self._held))

    def close(self) -> None:
        self._send()
        self._t.close()

    def write_eof(self) -> None:
        self._send()
        self._t.write_eof()

    def abort(self) -> None:
        self._held.clear()
        self._size = 0
        self._t.abort()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._t, name)


def one_write_protocol() -> type:
    """uvicorn's HTTP protocol (httptools' when installed, as ``http="auto"`` picks) on a ``OneWrite``."""
    try:
        import httptools  # noqa: F401
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as base
    except ImportError:
        from uvicorn.protocols.http.h11_impl import H11Protocol as base

    class OneWriteProtocol(base):  # type: ignore[misc, valid-type]
        def connection_made(self, transport: Any) -> None:
            super().connection_made(OneWrite(transport))

    return OneWriteProtocol


class Served:
    def __init__(self, app: Any, host: str, port: int) -> None:
        # an idle kept-alive connection is closed by the client first (httpx after 5 s, Node's fetch after
        # 4 s, our node client after 2 s): a server that closes at 5 s races a request the client sends on
        # it at that moment (ECONNRESET on a non-idempotent upload under load)
        config = uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False,
                                lifespan="off", timeout_graceful_shutdown=5, backlog=4096,
                                timeout_keep_alive=KEEP_ALIVE_S, http=one_write_protocol())
        self.server = uvicorn.Server(config)
        # IPPROTO_TCP explicitly: asyncio sets TCP_NODELAY only on accepted sockets whose proto says TCP; with
        # proto 0 every keep-alive response stalled ~40 ms on Nagle + the client's delayed ACK
        self.sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM,
                                  socket.IPPROTO_TCP)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))   # bind now: a busy port fails before anything else starts
        self.port = self.sock.getsockname()[1]

    async def serve(self) -> None:
        await self.server._serve(sockets=[self.sock])

    def stop(self) -> None:
        self.server.should_exit = True


async def wait_for_signal() -> int:
    """Return when SIGINT or SIGTERM arrives (the caller then shuts down in its own order)."""
    with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for sig in signals:
            logging.getLogger("pilldrops").warning("received %s, shutting down", signal.Signals(sig).name)
            return int(sig)
    return 0
