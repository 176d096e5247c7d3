"""What the sandbox use cases (``lifecycle``, ``pause_resume``, ``reconcile``) share: the store, the node
client, the clock, billing, the cached node records, which pauses/resumes this process is carrying out,
and each running sandbox's last usage report.

Rules every use case keeps:
- no store transaction is held while a node is called;
- every state change is a compare-and-set from the states it is legal from (``domain.states``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

import httpx

from pilldrops import errors
from pilldrops._internal.clock import Clock, TTLCache
from pilldrops.schema.api import SandboxState
from pilldrops.schema.node import NodeSandboxSpec, NodeSandboxStatus, NodeTemplateRef
from pilldrops.server.domain.states import TRANSITIONS
from pilldrops.server.nodes.client import NodeClient
from pilldrops.server.service import egress
from pilldrops.server.service.beats import RECENT_S, Beats, Recent
from pilldrops.server.service.billing import BillingService
from pilldrops.server.service.claims import GrantIndex
from pilldrops.server.service.pools import PoolService
from pilldrops.server.store.interface import NodeRecord, SandboxRecord, Store

S = SandboxState
log = logging.getLogger("pilldrops.sandboxes")
NODE_CACHE_S = 5.0
IN_FLIGHT = (S.pausing.value, S.resuming.value)     # a request is moving these; reconciliation leaves them


def legal_from(target: SandboxState) -> list[str]:
    """States from which ``target`` is a legal transition."""
    return [s.value for s, allowed in TRANSITIONS.items() if target in allowed]


def outcome_unknown(exc: BaseException) -> bool:
    """The node call may have been carried out (sent, but no answer came back)."""
    if not isinstance(exc, errors.NodeUnavailable):
        return False
    return not isinstance(exc.__cause__, (httpx.ConnectError, httpx.ConnectTimeout))


def timeout_left(row: SandboxRecord, st: NodeSandboxStatus, now: datetime) -> float:
    """Seconds of timeout a pausing sandbox has left: the node's own count (taken at the same instant as its
    running seconds, on its clock), else what the record's deadline leaves."""
    if st.timeout_left is not None:
        return st.timeout_left
    return max(0.0, ((row.end_at or now) - now).total_seconds())


@dataclass
class SandboxContext:
    store: Store
    nodes: NodeClient
    clock: Clock
    billing: BillingService
    pools: PoolService | None = None
    egress: egress.EgressSettings = field(default_factory=egress.EgressSettings)   # `up/serve --no-egress` ...
    templates: Any = None      # the template store's TemplateService (issue 19); None: node-built only
    node_cache: TTLCache[str, NodeRecord] = field(init=False)
    in_flight: set[str] = field(default_factory=set)      # pauses/resumes this process is carrying out
    creating: set[str] = field(default_factory=set)       # creates this process is carrying out (placed rows)
    grants: GrantIndex = field(default_factory=GrantIndex)   # pre-issued warm members, per shape (claims)
    # the last usage report of each running sandbox (billed every commit_every_s): what is billed when its
    # node is lost before the next commit
    last_usage: dict[str, tuple[NodeSandboxStatus, datetime]] = field(default_factory=dict)   # (report, received)
    beats: Beats = field(default_factory=Beats)      # delta heartbeats: each node's view, this process's epoch
    told: Recent = field(init=False)                 # claims handed over to their node just now
    killed: Recent = field(init=False)               # sandboxes stopped on their node just now

    def __post_init__(self) -> None:
        self.node_cache = self.clock.ttl_cache(NODE_CACHE_S)
        self.told = Recent(RECENT_S, self.clock.monotonic)
        self.killed = Recent(RECENT_S, self.clock.monotonic)

    async def node(self, node_id: str) -> NodeRecord | None:
        """A node's record, cached for a few seconds (used for its URL and name, which change only when it
        re-registers)."""
        node = self.node_cache.get(node_id)
        if node is None:
            node = await self.store.get_node(node_id)
            if node is not None:
                self.node_cache.put(node_id, node)
        return node

    async def node_for(self, row: SandboxRecord) -> NodeRecord:
        node = await self.node(row.node_id or "")
        if node is None:
            raise errors.NodeUnavailable(f"sandbox {row.id} has no reachable node")
        return node

    async def get_row(self, team_id: str, sandbox_id: str) -> SandboxRecord:
        row = await self.store.get_sandbox(sandbox_id, team_id)
        if row is None:
            raise errors.SandboxNotFound(f"sandbox {sandbox_id!r} not found")
        return row

    async def template_ref(self, row: SandboxRecord) -> NodeTemplateRef | None:
        """The template-store version the sandbox runs (None: a template its node built itself)."""
        version = getattr(row, "template_version", None)
        if self.templates is None or version is None:
            return None
        return await self.templates.version(row.template, version)

    def node_spec(self, row: SandboxRecord, timeout_s: float,
                  ref: NodeTemplateRef | None = None) -> NodeSandboxSpec:
        return NodeSandboxSpec(id=row.id, template=row.template, vcpu=row.vcpu, memory_mb=row.memory_mb,
                               end_at=self.clock.now() + timedelta(seconds=timeout_s), envs=row.envs,
                               access_token=row.access_token, team_id=row.team_id, timeout_s=timeout_s,
                               isolation=row.isolation, template_ref=ref, disk_mb=row.disk_mb,
                               network=egress.node_network(getattr(row, "network", None), self.egress))

    async def quiet_kill(self, node: NodeRecord, sandbox_id: str, what: str = "") -> None:
        """Stop it on that node; a failure is logged (the node's next report is reconciled anyway)."""
        try:
            await self.nodes.kill(node.url, sandbox_id)
        except errors.PillDropsError as exc:
            log.warning("could not stop %s%s on %s: %s", what, sandbox_id, node.name, exc)
        else:
            self.killed.add(sandbox_id)

    async def quiet_forget(self, node: NodeRecord, sandbox_id: str, why: str) -> None:
        """Drop its checkpoint on that node; a failure is logged (dropped at the node's next report)."""
        try:
            await self.nodes.forget(node.url, sandbox_id)
        except errors.PillDropsError as exc:
            log.warning("node %s keeps %s of %s: %s", node.name, why, sandbox_id, exc)
