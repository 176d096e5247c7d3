"""Building the control plane from settings: store, services, app. Used by `pilldrops serve` and `up`."""

from __future__ import annotations

from dataclasses import dataclass

import anyio
import httpx
from fastapi import FastAPI

from pilldrops._internal.clock import Clock
from pilldrops.schema.api import EndReason
from pilldrops.server.api.app import Services, create_app
from pilldrops.server.nodes.client import NodeClient
from pilldrops.server.service.auth import AuthService
from pilldrops.server.service.billing import BillingService, BillingSettings
from pilldrops.server.service.nodes import HEARTBEAT_INTERVAL_S, NodeService
from pilldrops.server.service.sandboxes import SandboxService
from pilldrops.server.store.sql import Store


@dataclass
class ControlPlane:
    app: FastAPI
    services: Services
    store: Store
    node_client: NodeClient

    async def run(self) -> None:
        """Background duties of a control-plane process (credit enforcement, node liveness) until cancelled."""
        sbx = self.services.sandboxes
        async with anyio.create_task_group() as tg:
            tg.start_soon(self.services.billing.run_enforcer,
                          lambda team_id, sid: sbx.kill(team_id, sid, EndReason.credits_exhausted))
            tg.start_soon(self.services.nodes.run_liveness)

    async def aclose(self) -> None:
        await self.node_client.aclose()
        await self.store.close()


async def build_control_plane(db_url: str, node_token: str, clock: Clock | None = None, *,
                              node_transport: httpx.AsyncBaseTransport | None = None,
                              billing: BillingSettings | None = None,
                              heartbeat_interval: float = HEARTBEAT_INTERVAL_S,
                              lost_after: float = 300.0, unreachable_after: float | None = None) -> ControlPlane:
    clock = clock or Clock()
    billing = billing or BillingSettings()
    store = await Store.open(db_url)
    node_client = NodeClient(node_token, transport=node_transport)
    billing_service = BillingService(store, clock, billing)
    sandboxes = SandboxService(store, node_client, clock, billing_service)
    services = Services(auth=AuthService(store, clock, billing.initial_credits), sandboxes=sandboxes,
                        nodes=NodeService(store, sandboxes, clock, node_token, heartbeat_interval,
                                          unreachable_after=unreachable_after, lost_after=lost_after),
                        billing=billing_service)
    return ControlPlane(create_app(services), services, store, node_client)
