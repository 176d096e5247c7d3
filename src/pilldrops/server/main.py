"""Building the control plane from settings: store, services, app. Used by `pilldrops serve` and `up`."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import anyio
import httpx
from fastapi import FastAPI
from starlette.types import ASGIApp

from pilldrops._internal.clock import Clock
from pilldrops.schema.api import DEFAULT_DISK_MB, DEFAULT_ISOLATION, DEFAULT_MAX_DISK_MB, EndReason
from pilldrops.server.api.app import Services, create_app
from pilldrops.server.artifacts import BlobStore
from pilldrops.server.nodes.client import NodeClient
from pilldrops.server.ports.gateway import PortGateway
from pilldrops.server.ports.listener import PortsApp
from pilldrops.server.service.auth import AuthService
from pilldrops.server.service.billing import BillingService, BillingSettings
from pilldrops.server.service.egress import EgressSettings
from pilldrops.server.service.nodes import HEARTBEAT_INTERVAL_S, NodeService
from pilldrops.server.service.pools import PoolService
from pilldrops.server.service.sandboxes import SandboxService
from pilldrops.server.service.templates import DEFAULT_MAX_CONTEXT_BYTES, TemplateService
from pilldrops.server.service.urls import URLService
from pilldrops.server.store.sql import Store

log = logging.getLogger("pilldrops.server")
DEFAULT_PAUSED_RETENTION_S = 30 * 24 * 3600.0


@dataclass
class ControlPlane:
    app: FastAPI
    services: Services
    store: Store
    node_client: NodeClient
    ports_app: ASGIApp          # the port-URL listener's app (its own port: its own origin)

    paused_retention_s: float = DEFAULT_PAUSED_RETENTION_S

    async def run(self) -> None:
        """Background duties of a control-plane process (credit enforcement, node liveness, expiry of old
        paused sandboxes) until cancelled."""
        sbx = self.services.sandboxes
        async with anyio.create_task_group() as tg:
            tg.start_soon(self.services.billing.run_enforcer,
                          lambda team_id, sid: sbx.kill(team_id, sid, EndReason.credits_exhausted))
            tg.start_soon(self.services.nodes.run_liveness)
            tg.start_soon(self._expire_paused)
            if self.services.templates is not None:
                tg.start_soon(self._template_gc)

    async def _template_gc(self) -> None:
        while True:
            await anyio.sleep(300)
            try:
                await self.services.templates.gc()   # type: ignore[union-attr]
            except Exception:
                log.exception("template store gc failed")

    async def _expire_paused(self) -> None:
        while True:
            try:
                await self.services.sandboxes.expire_paused(self.paused_retention_s)
            except Exception:
                log.exception("paused-sandbox expiry pass failed")
            await anyio.sleep(min(60.0, max(0.5, self.paused_retention_s / 10)))

    async def aclose(self) -> None:
        await self.node_client.aclose()
        await self.store.close()


async def build_control_plane(db_url: str, node_token: str, clock: Clock | None = None, *,
                              node_transport: httpx.AsyncBaseTransport | None = None,
                              billing: BillingSettings | None = None,
                              heartbeat_interval: float = HEARTBEAT_INTERVAL_S,
                              lost_after: float = 300.0, unreachable_after: float | None = None,
                              paused_retention_s: float = DEFAULT_PAUSED_RETENTION_S,
                              default_isolation: str = DEFAULT_ISOLATION,
                              template_store: Path | None = None,
                              max_context_bytes: int = DEFAULT_MAX_CONTEXT_BYTES,
                              default_disk_mb: int = DEFAULT_DISK_MB, max_disk_mb: int = DEFAULT_MAX_DISK_MB,
                              public_host: str | None = None, ports_port: int | None = None,
                              ports_url: str | None = None,
                              egress: EgressSettings | None = None) -> ControlPlane:
    """``template_store``: the directory of the template store's layers (issue 19); None: no store (only
    templates the nodes build themselves)."""
    clock = clock or Clock()
    billing = billing or BillingSettings()
    store = await Store.open(db_url)
    node_client = NodeClient(node_token, transport=node_transport)
    billing_service = BillingService(store, clock, billing)
    egress = egress or EgressSettings()
    pools = PoolService(store, node_client, clock, egress)
    sandboxes = SandboxService(store, node_client, clock, billing_service, pools)
    sandboxes.lifecycle.default_isolation = default_isolation
    sandboxes.lifecycle.default_disk_mb, sandboxes.lifecycle.max_disk_mb = default_disk_mb, max_disk_mb
    sandboxes.ctx.egress = egress
    services = Services(auth=AuthService(store, clock, billing.initial_credits), sandboxes=sandboxes,
                        nodes=NodeService(store, sandboxes, clock, node_token, heartbeat_interval,
                                          unreachable_after=unreachable_after, lost_after=lost_after,
                                          pools=pools),
                        billing=billing_service, pools=pools,
                        urls=URLService(store, clock, public_host, ports_port=ports_port, ports_url=ports_url))
    if template_store is not None:
        services.templates = TemplateService(store, BlobStore(template_store), node_client, clock,
                                             max_context_bytes=max_context_bytes)
        sandboxes.ctx.templates = services.templates
    ports_app = PortsApp(PortGateway(sandboxes, services.urls))    # type: ignore[arg-type]
    return ControlPlane(create_app(services), services, store, node_client, ports_app, paused_retention_s)
