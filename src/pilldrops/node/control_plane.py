"""The node's client of the control plane: register, heartbeat, end reports and the outbox.

Every end is reported once; a report that fails stays in the outbox, which rides on the next register or
heartbeat, so the control plane learns every end exactly once it is reachable again. An entry leaves the
outbox only when a request that carried it succeeded (ends recorded meanwhile stay queued); the agent is
told (``delivered``), and only then drops the journal entry that lets a restarted agent report it again.

Heartbeats are deltas (issue 15) once a control plane has acked one: a beat carries only the sandboxes whose
status changed since the last acked beat (state, times, end, error, checkpoint), whose usage is due (as much
new running time as the control plane's ``usage_every_s``), whose disk use moved by ``DISK_STEP`` bytes, and
the undelivered ends, and those the control plane asked for (``want``: a pause or resume still in
flight there, which a later report settles); plus ``gone`` (ids no longer reported), and the count and ``live_digest`` of every id
it reports. A full beat goes whenever there is no acked baseline (first beat after a register: a restarted
agent, a forgotten node; a failed beat leaves the baseline as it was, so its changes are sent again), when the
acking control plane answers with another epoch than the one named (it restarted), or when it asks (``full``:
a digest that did not match, or its periodic safety net). A control plane that does not speak deltas
(no ``epoch`` in its reply) gets full beats for ever.
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
    live_digest,
)

log = logging.getLogger("pilldrops.node")
_JSON = {"content-type": "application/json"}
DISK_STEP = 1 << 20       # a running sandbox's disk use moved this much since its last acked report: send it


def _changed(prev: NodeSandboxStatus | None, st: NodeSandboxStatus, usage_every_s: float, billed: float) -> bool:
    """Whether a delta beat carries ``st``, given what the control plane last acked of it and the running
    seconds it last billed (as far as this node can tell: ``_usage_due``)."""
    if prev is None or (prev.state, prev.pid, prev.started_at, prev.end_at, prev.ended_at, prev.end_reason,
                        prev.error, prev.checkpoint_bytes) != (st.state, st.pid, st.started_at, st.end_at,
                                                                st.ended_at, st.end_reason, st.error,
                                                                st.checkpoint_bytes):
        return True
    if _usage_due(st, usage_every_s, billed):
        return True
    return (prev.disk_used_bytes is None) != (st.disk_used_bytes is None) or (
        st.disk_used_bytes is not None and abs(st.disk_used_bytes - (prev.disk_used_bytes or 0)) >= DISK_STEP)


def _usage_due(st: NodeSandboxStatus, usage_every_s: float, billed: float) -> bool:
    """The control plane's own rule (``Billing.commit_running``): a running sandbox's usage is committed once
    ``usage_every_s`` of running time accrued since the last commit. The node mirrors the last commit as the
    run_s of the last acked report that met the rule (0 at first), so a report sent for another reason (a
    state or disk change, a full beat) does not push the next commit out to twice the cadence."""
    return st.run_s is not None and st.run_s - billed >= usage_every_s


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
        # delta heartbeats: the control-plane epoch that acked ``_acked`` (each id's last acked status)
        self._epoch: str | None = None
        self._acked: dict[str, NodeSandboxStatus] = {}
        self._billed: dict[str, float] = {}     # each id's run_s the control plane billed last (_usage_due)
        self._usage_every_s = 0.0
        self._want: set[str] = set()      # ids the control plane asked to hear of again (pauses in flight)
        self._legacy = False              # the control plane refused the delta fields (it predates them)

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
        self._epoch = None                  # the first heartbeat after a register is full
        self._legacy = False                # and tries the delta fields again (an upgraded control plane)
        self.pools.configure(reg.pools)
        for st in body.sandboxes:           # only what was sent: ends recorded meanwhile stay queued
            if st.state != SandboxState.running and self.outbox.get(st.id) == st:
                del self.outbox[st.id]
                self._delivered(st.id)
        self.registered.set()
        log.info("registered with the control plane as %s", reg.node_id)
        return reg.heartbeat_interval

    async def heartbeat(self) -> None:
        """One heartbeat: a delta when a control plane acked a baseline, else full; a delta it refuses
        (``full`` in the reply) is followed by a full beat at once."""
        if await self._beat(delta=self._epoch is not None):
            await self._beat(delta=False)

    async def _beat(self, delta: bool) -> bool:
        """Send one heartbeat; True when it was a delta and the control plane asks for a full beat now."""
        sent = dict(self.outbox)
        pool_cpu, pool_mem = self.pools.reserved()
        cpu, mem = self._usage()
        statuses = {st.id: st for st in self._statuses()}       # an end in the outbox wins over its sandbox
        if delta:
            acked, every, billed = self._acked, self._usage_every_s, self._billed
            want = self._want
            body = [st for sid, st in statuses.items()
                    if sid in sent or sid in want or _changed(acked.get(sid), st, every, billed.get(sid, 0.0))]
            gone = [sid for sid in acked if sid not in statuses]
        else:
            body, gone = list(statuses.values()), []
        digest = {} if self._legacy else {"count": len(statuses), "digest": live_digest(statuses), "gone": gone,
                                          "delta_of": self._epoch if delta else None}
        hb = NodeHeartbeat(templates=self._templates(), sandboxes=body, used_vcpu=cpu + pool_cpu,
                           used_memory_mb=mem + pool_mem, pools=self.pools.statuses(grants=True), **digest)
        resp = await self.http.post(f"{self.url}/internal/v1/nodes/{self.node_id}/heartbeat",
                                    content=hb.model_dump_json(), headers=_JSON)
        if resp.status_code == 422 and not self._legacy:
            # a control plane from before delta heartbeats (extra="forbid"): full beats without the new
            # fields from now on (upgrade control planes before nodes: docs/architecture.md)
            log.warning("the control plane does not take delta heartbeats: sending full ones")
            self._legacy, self._epoch = True, None
            if not delta:
                await self._beat(delta=False)
            return delta
        if resp.status_code == 404:
            self.node_id = None     # the control plane forgot us (new database): register again
            self._epoch = None
            return False
        resp.raise_for_status()
        for sid, st in sent.items():
            if self.outbox.get(sid) is st:
                del self.outbox[sid]
                self._delivered(sid)
        reply = NodeHeartbeatReply.model_validate(resp.json()) if resp.content else NodeHeartbeatReply()
        self.pools.configure(reply.pools)
        every = self._usage_every_s       # (0: not known yet, before the first reply)
        if every > 0 and (not delta or (reply.epoch == self._epoch and not reply.full)):    # absorbed
            for st in body:
                if _usage_due(st, every, self._billed.get(st.id, 0.0)):
                    self._billed[st.id] = st.run_s or 0.0
        self._usage_every_s = reply.usage_every_s or 0.0
        self._want = set(reply.want)
        if not delta:
            self._acked = statuses
            self._billed = {sid: b for sid, b in self._billed.items() if sid in statuses}
            self._epoch = None if reply.full else reply.epoch
            return False
        if reply.epoch == self._epoch and not reply.full:
            for st in body:
                self._acked[st.id] = st
            for sid in gone:
                self._acked.pop(sid, None)
                self._billed.pop(sid, None)
            return False
        self._epoch = None          # refused (or a restarted control plane, another epoch): full now
        return True

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
