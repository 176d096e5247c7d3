"""The node's client of the control plane: register, heartbeat, end reports and the outbox.

Every end is reported once; a report that fails stays in the outbox, which rides on the next register or
heartbeat, so the control plane learns every end exactly once it is reachable again. An entry leaves the
outbox only when a request that carried it succeeded (ends recorded meanwhile stay queued); the agent is
told (``delivered``), and only then drops the journal entry that lets a restarted agent report it again.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import anyio
import httpx

from pilldrops._version import __version__
from pilldrops.node.pools import WarmPools
from pilldrops.schema.api import IsolationSupport, SandboxState, TemplateInfo
from pilldrops.schema.node import (
    NodeEvent,
    NodeHeartbeat,
    NodeHeartbeatReply,
    NodeRegister,
    NodeRegistered,
    NodeSandboxStatus,
)

log = logging.getLogger("pilldrops.node")
_JSON = {"content-type": "application/json"}


@dataclass
class Identity:
    """What the node tells the control plane about itself when registering."""

    name: str
    public_url: str
    capacity_vcpu: float
    capacity_memory_mb: int
    instance: str
    isolation: dict[str, IsolationSupport] = field(default_factory=dict)   # each mode, as probed at start
    ram_mb: int = 0                    # the host's RAM (0: unknown)


class ControlPlaneClient:
    def __init__(self, url: str | None, http: httpx.AsyncClient, identity: Identity, pools: WarmPools, *,
                 statuses: Callable[[], list[NodeSandboxStatus]], usage: Callable[[], tuple[float, int]],
                 templates: Callable[[], list[TemplateInfo]],
                 delivered: Callable[[str], None] = lambda sandbox_id: None) -> None:
        self.url = url
        self.http = http
        self.identity = identity
        self.pools = pools
        self._statuses = statuses        # every sandbox's status, the outbox's included
        self._usage = usage              # (vCPU, MiB) the node's sandboxes hold, warm pools excluded
        self._templates = templates      # the built templates, re-read
        self._delivered = delivered      # an end left the outbox: the control plane has it
        self.outbox: dict[str, NodeSandboxStatus] = {}
        self.node_id: str | None = None
        self.registered = anyio.Event()

    async def register(self) -> float:
        """Register (again); returns the heartbeat interval the control plane asks for."""
        i = self.identity
        body = NodeRegister(name=i.name, url=i.public_url, capacity_vcpu=i.capacity_vcpu,
                            capacity_memory_mb=i.capacity_memory_mb, templates=self._templates(),
                            sandboxes=self._statuses(), version=__version__, instance=i.instance,
                            isolation=i.isolation, ram_mb=i.ram_mb)
        resp = await self.http.post(f"{self.url}/internal/v1/nodes/register", content=body.model_dump_json(),
                                    headers=_JSON)
        resp.raise_for_status()
        reg = NodeRegistered.model_validate(resp.json())
        self.node_id = reg.node_id
        self.pools.configure(reg.pools)
        for st in body.sandboxes:           # only what was sent: ends recorded meanwhile stay queued
            if st.state != SandboxState.running and self.outbox.get(st.id) == st:
                del self.outbox[st.id]
                self._delivered(st.id)
        self.registered.set()
        log.info("registered with the control plane as %s", reg.node_id)
        return reg.heartbeat_interval

    async def heartbeat(self) -> None:
        sent = dict(self.outbox)
        pool_cpu, pool_mem = self.pools.reserved()
        cpu, mem = self._usage()
        hb = NodeHeartbeat(templates=self._templates(), sandboxes=self._statuses(), used_vcpu=cpu + pool_cpu,
                           used_memory_mb=mem + pool_mem, pools=self.pools.statuses(grants=True))
        resp = await self.http.post(f"{self.url}/internal/v1/nodes/{self.node_id}/heartbeat",
                                    content=hb.model_dump_json(), headers=_JSON)
        if resp.status_code == 404:
            self.node_id = None     # the control plane forgot us (new database): register again
            return
        resp.raise_for_status()
        for sid, st in sent.items():
            if self.outbox.get(sid) is st:
                del self.outbox[sid]
                self._delivered(sid)
        if resp.content:
            self.pools.configure(NodeHeartbeatReply.model_validate(resp.json()).pools)

    async def report(self, status: NodeSandboxStatus) -> None:
        """Send one end now; on failure it stays in the outbox for the next heartbeat."""
        if not self.url or self.node_id is None:
            return
        try:
            resp = await self.http.post(f"{self.url}/internal/v1/nodes/{self.node_id}/events",
                                        content=NodeEvent(sandbox=status).model_dump_json(), headers=_JSON)
            if resp.status_code < 300 and self.outbox.get(status.id) is status:
                del self.outbox[status.id]
                self._delivered(status.id)
        except httpx.HTTPError as exc:
            log.warning("event for %s not delivered (kept for the next heartbeat): %s", status.id, exc)

    async def flush_outbox(self) -> None:
        for status in list(self.outbox.values()):
            await self.report(status)
