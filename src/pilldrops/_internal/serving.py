"""Running ASGI apps under uvicorn inside our own task group, with our own signal handling, so several
servers (control plane + node agent in ``pilldrops up``) stop together and cleanly on Ctrl-C."""

from __future__ import annotations

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


class Served:
    def __init__(self, app: Any, host: str, port: int) -> None:
        # an idle kept-alive connection is closed by the client first (httpx after 5 s, Node's fetch after
        # 4 s, our node client after 2 s): a server that closes at 5 s races a request the client sends on
        # it at that moment (ECONNRESET on a non-idempotent upload under load)
        config = uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False,
                                lifespan="off", timeout_graceful_shutdown=5, backlog=4096,
                                timeout_keep_alive=KEEP_ALIVE_S)
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
