"""The sandbox service: one facade over the sandbox use cases, each in a module of its own:

- ``lifecycle``: create (idempotent, placed) and batch create, reads, connect, set_timeout, kill;
- ``placement``: where a create or a resume goes (filters and scorers in ``server.scheduler``);
- ``pause_resume``: pause, resume, expiry of old paused sandboxes;
- ``reconcile``: node reports absorbed, pauses/resumes settled, orphans stopped, node loss;
- ``context``: what they share (store, node client, clock, billing, cached node records).

The API (``server.api``), the node service and the E2B-compatible surface call these methods; their names
and signatures are the service's contract.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from datetime import datetime

from pilldrops._internal.clock import Clock
from pilldrops.schema.api import (
    BatchCreateRequest,
    BatchCreateResponse,
    CreateSandboxRequest,
    EndReason,
    KillSandboxesRequest,
    KillSandboxesResponse,
    SandboxInfo,
    SandboxList,
)
from pilldrops.schema.node import NodeSandboxStatus
from pilldrops.server.nodes.client import NodeClient
from pilldrops.server.service.billing import BillingService
from pilldrops.server.service.context import SandboxContext
from pilldrops.server.service.lifecycle import Lifecycle
from pilldrops.server.service.pause_resume import PauseResume
from pilldrops.server.service.pools import PoolService
from pilldrops.server.service.reconcile import Reconciler
from pilldrops.server.store.interface import NodeRecord, SandboxRecord, Store


class SandboxService:
    def __init__(self, store: Store, nodes: NodeClient, clock: Clock, billing: BillingService,
                 pools: PoolService | None = None) -> None:
        self.ctx = SandboxContext(store, nodes, clock, billing, pools)
        self.lifecycle = Lifecycle(self.ctx)
        self.reconciler = Reconciler(self.ctx)
        self.reconciler.resync = self.lifecycle.resync_claim
        self.pause_resume = PauseResume(self.ctx, self.lifecycle, self.reconciler)

    @property
    def store(self) -> Store:
        return self.ctx.store

    @property
    def nodes(self) -> NodeClient:
        return self.ctx.nodes

    @property
    def clock(self) -> Clock:
        return self.ctx.clock

    @property
    def billing(self) -> BillingService:
        return self.ctx.billing

    @property
    def pools(self) -> PoolService | None:
        return self.ctx.pools

    # ---- reads ---------------------------------------------------------------------------------------

    async def info(self, row: SandboxRecord, *, with_token: bool = False) -> SandboxInfo:
        return await self.lifecycle.info(row, with_token=with_token)

    async def get_row(self, team_id: str, sandbox_id: str) -> SandboxRecord:
        return await self.ctx.get_row(team_id, sandbox_id)

    async def list(self, team_id: str, *, states: list[str], labels: dict[str, str], limit: int,
                   cursor: str | None) -> SandboxList:
        return await self.lifecycle.list(team_id, states=states, labels=labels, limit=limit, cursor=cursor)

    async def connect(self, team_id: str, sandbox_id: str) -> SandboxRecord:
        return await self.lifecycle.connect(team_id, sandbox_id)

    async def node_for(self, row: SandboxRecord) -> NodeRecord:
        return await self.ctx.node_for(row)

    def forget_node(self, node_id: str) -> None:
        """Drop the cached record of a node (it re-registered: its URL may have changed)."""
        self.ctx.node_cache.pop(node_id)

    # ---- create, timeout, kill -----------------------------------------------------------------------

    async def create(self, team_id: str, req: CreateSandboxRequest,
                     idempotency_key: str | None = None) -> tuple[SandboxRecord, bool]:
        return await self.lifecycle.create(team_id, req, idempotency_key)

    async def create_batch(self, team_id: str, req: BatchCreateRequest, idempotency_key: str | None = None,
                           disconnected: Callable[[], Awaitable[bool]] | None = None) -> BatchCreateResponse:
        return await self.lifecycle.create_batch(team_id, req, idempotency_key, disconnected)

    async def set_timeout(self, team_id: str, sandbox_id: str, timeout: int) -> SandboxRecord:
        return await self.lifecycle.set_timeout(team_id, sandbox_id, timeout)

    async def kill(self, team_id: str, sandbox_id: str, reason: EndReason = EndReason.killed) -> SandboxRecord:
        return await self.lifecycle.kill(team_id, sandbox_id, reason)

    async def kill_many(self, team_id: str, req: KillSandboxesRequest) -> KillSandboxesResponse:
        return await self.lifecycle.kill_many(team_id, req)

    # ---- pause / resume ------------------------------------------------------------------------------

    async def pause(self, team_id: str, sandbox_id: str) -> SandboxRecord:
        return await self.pause_resume.pause(team_id, sandbox_id)

    async def resume(self, team_id: str, sandbox_id: str) -> SandboxRecord:
        return await self.pause_resume.resume(team_id, sandbox_id)

    async def expire_paused(self, retention_s: float) -> int:
        return await self.pause_resume.expire_paused(retention_s)

    # ---- node reports --------------------------------------------------------------------------------

    async def absorb(self, node: NodeRecord, statuses: list[NodeSandboxStatus], received: datetime,
                     live: set[str] | None = None, gone: Sequence[str] = ()) -> set[str]:
        return await self.reconciler.absorb(node, statuses, received, live, gone)

    async def apply_node_status(self, node_id: str, st: NodeSandboxStatus,
                                row: SandboxRecord | None = None) -> None:
        await self.reconciler.apply_node_status(node_id, st, row)

    async def mark_lost(self, node_id: str, last_seen: datetime) -> None:
        await self.reconciler.mark_lost(node_id, last_seen)

    async def stop_orphans(self, node: NodeRecord, statuses: list[NodeSandboxStatus],
                           rows: dict[str, SandboxRecord] | None = None) -> None:
        await self.reconciler.stop_orphans(node, statuses, rows)

    async def reconcile_node(self, node_id: str, live_ids: set[str], received: datetime | None = None) -> None:
        await self.reconciler.reconcile_node(node_id, live_ids, received)
