"""The E2B surface's way into a sandbox port: the shared relay (``server.ports.relay``) addressed by a
``SandboxRef``. User ports (``E2b-Sandbox-Port``, ``{port}-{id}.{domain}``) go through the port gateway
(``server.ports.gateway``, from ``routing``); the code interpreter (49999) uses ``open_tunnel`` and
``request_stream`` directly."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from pilldrops.e2b.context import SandboxRef
from pilldrops.server.ports import relay
from pilldrops.server.ports.relay import PortClosed, SandboxGone, Tunnel, request_stream
from pilldrops.server.ports.relay import target as _target

__all__ = ["PortClosed", "SandboxGone", "Tunnel", "_target", "open_tunnel", "request_stream", "upstream"]


def upstream(ref: SandboxRef) -> relay.Upstream:
    return relay.Upstream(ref.node.url, ref.id, ref.access_token, ref.node.http.headers.get("authorization"))


@asynccontextmanager
async def open_tunnel(ref: SandboxRef, port: int) -> AsyncIterator[Tunnel]:
    async with relay.open_tunnel(upstream(ref), port) as tunnel:
        yield tunnel
