"""Running ASGI apps under uvicorn inside our own task group, with our own signal handling, so several
servers (control plane + node agent in ``pilldrops up``) stop together and cleanly on Ctrl-C."""

from __future__ import annotations

import logging
import signal
import socket

import anyio
import uvicorn
from fastapi import FastAPI


class Served:
    def __init__(self, app: FastAPI, host: str, port: int) -> None:
        config = uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False,
                                lifespan="off", timeout_graceful_shutdown=5, backlog=4096)
        self.server = uvicorn.Server(config)
        # IPPROTO_TCP explicitly: asyncio sets TCP_NODELAY only on accepted sockets whose proto says TCP; with
        # proto 0 every keep-alive response stalled ~40 ms on Nagle + the client's delayed ACK
        self.sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM,
                                  socket.IPPROTO_TCP)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))   # bind now: a busy port fails before anything else starts
        self.port = self.sock.getsockname()[1]

    async def serve(self) -> None:
        await self.server._serve(sockets=[self.sock])  # noqa: SLF001 - serve() would steal SIGINT

    def stop(self) -> None:
        self.server.should_exit = True


async def wait_for_signal() -> int:
    """Return when SIGINT or SIGTERM arrives (the caller then shuts down in its own order)."""
    with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for sig in signals:
            logging.getLogger("pilldrops").warning("received %s, shutting down", signal.Signals(sig).name)
            return int(sig)
    return 0
