"""The node agent: the registry of this host's sandboxes, the operations on them, and the loops that
watch them. Each duty beyond that has a module of its own:

- ``registry`` / ``states``: one record per sandbox in exactly one ``NodeState`` (one transition table);
- ``recovery``: at start, re-derive the truth from the journal and the runtime's facts (adopt or reap);
- ``checkpoints``: pause, resume, moves between nodes (export/fetch of images), dropping images;
- ``control_plane``: register, heartbeat, end reports and the outbox;
- ``template_cache``: the built templates and what a sandbox spec becomes with them;
- ``pools``: warm pools;
- ``egress``: the network of sandboxes that asked for one (veth, NAT, per-sandbox rules; attached after
  the runtime made the sandbox: a member of a warm pool with that policy has it already, a member of the
  loopback-only pool gets it at claim time).

It journals intent before creating and confirms after, enforces deadlines itself (the control plane may be
down) and notices sandboxes whose init died (``oom`` when the memory cgroup killed it, ``exited``
otherwise). Every end is recorded for the control plane (``control_plane`` delivers it).
"""

from __future__ import annotations

import functools
import logging
import os
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path

import anyio
import httpx

from pilldrops import errors
from pilldrops._internal.ids import same_secret
from pilldrops.node.checkpoints import Checkpoints
from pilldrops.node.control_plane import ControlPlaneClient, Identity
from pilldrops.node.dataplane import Target
from pilldrops.node.egress import Egress, EgressConfig
from pilldrops.node.isolation import procs
from pilldrops.node.journal import Journal
from pilldrops.node.layers import LayerCache
from pilldrops.node.pools import WarmPools
from pilldrops.node.processes import Processes
from pilldrops.node.recovery import Recovery
from pilldrops.node.registry import Sandbox, Sandboxes, usage_point
from pilldrops.node.runtime.base import Handle, Runtime, RuntimeFailure, SandboxSpec
from pilldrops.node.runtime.registry import checkpoint_unsupported, disk_refusal, support_of
from pilldrops.node.states import NodeState
from pilldrops.node.template_builds import RemoteBuilds
from pilldrops.node.template_cache import PIDS_LIMIT, TemplateCache, Templates
from pilldrops.schema.api import DEFAULT_DISK_MB, DEFAULT_MAX_DISK_MB, EndReason, SandboxState, TemplateInfo
from pilldrops.schema.node import (
    NodeBuildRequest,
    NodeKilled,
    NodeNetwork,
    NodePoolSpec,
    NodeResume,
    NodeSandboxSpec,
    NodeSandboxStatus,
    NodeTemplateRef,
)

log = logging.getLogger("pilldrops.node")
DEADLINE_TICK_S = 0.25
MONITOR_TICK_S = 2.0
HEARTBEAT_DEBOUNCE_S = 0.2  # an early heartbeat (woken by a ready member) waits this long after the last one
KILL_MANY_PARALLEL = 8      # teardowns of one batch kill at a time (each runs crun delete, umount, rm)
STOPPED_INIT_ERROR = ("its init was stopped by a signal from outside the sandbox (SIGSTOP on the node) and "
                      "could run nothing more; it was ended")
_LIVE = (NodeState.running, NodeState.pausing, NodeState.ending)
__all__ = ["PIDS_LIMIT", "NodeAgent", "Settings", "default_capacity", "instance_id", "usage_point"]


def _json(resp: httpx.Response) -> object:
    try:
        return resp.json()
    except ValueError:
        return None


def utcnow() -> datetime:
    return datetime.now(UTC)


@dataclass
class Settings:
    name: str
    public_url: str
    capacity_vcpu: float
    capacity_memory_mb: int
    control_plane_url: str | None = None
    node_token: str = ""
    create_concurrency: int = 8
    keep_on_exit: bool = False
    pool_concurrency: int = 2          # warm-pool refills in flight at once (all pools together)
    default_disk_mb: int = DEFAULT_DISK_MB     # a spec without disk_mb (from an older control plane)
    max_disk_mb: int = DEFAULT_MAX_DISK_MB     # a spec past it is refused (400 invalid_request)
    ram_mb: int | None = None          # the host's RAM as reported to the scheduler (None: /proc/meminfo)


@dataclass
class _InFlight:
    """A create in progress, for a resend of it to wait on (``NodeAgent.create``)."""

    done: anyio.Event = field(default_factory=anyio.Event)
    status: NodeSandboxStatus | None = None
    error: Exception | None = None


@dataclass
class Stats:
    created: int = 0
    claimed: int = 0                   # of ``created``: taken from a warm pool
    failed: int = 0
    ended: dict[str, int] = field(default_factory=dict)


def _usage_start(claimed_s: float | None, ready_mono: float | None) -> float | None:
    """CLOCK_MONOTONIC a pre-issued member's usage counts from (issue 15): its claim, ``claimed_s`` seconds
    before now as the control plane measured it (the hand-over comes after the create's answer: billing
    starts at the claim, as the record's ``started_at`` says), never before the member became ready (its
    pool time is never billed). None (count from the hand-over) when the control plane did not say."""
    if claimed_s is None:
        return None
    start = time.monotonic() - max(0.0, claimed_s)
    return max(start, ready_mono) if ready_mono is not None else start


class NodeAgent:
    def __init__(self, settings: Settings, runtime: Runtime, templates: Templates, state_dir: Path,
                 *, http: httpx.AsyncClient | None = None, now: Callable[[], datetime] = utcnow,
                 egress: Egress | None = None) -> None:
        if not settings.node_token:
            raise ValueError("a node agent needs a non-empty node token")
        self.settings = settings
        self.runtime = runtime
        self.templates = templates
        self.journal = Journal(state_dir / "journal")
        self.instance = instance_id(state_dir)
        self.now = now
        self.sandboxes = Sandboxes()
        self.stats = Stats()
        self._create_slots = anyio.Semaphore(settings.create_concurrency)
        self._http = http or httpx.AsyncClient(timeout=httpx.Timeout(10.0, connect=5.0),
                                               headers={"Authorization": f"Bearer {settings.node_token}"})
        self._tg: anyio.abc.TaskGroup | None = None
        self.recovered = False     # until the journal is re-derived, the registry is empty: the API refuses
        self._end_scheduled: set[str] = set()     # ends the loops started (one per sandbox)
        self._stopped_ticks: dict[str, int] = {}   # monitor ticks each sandbox's init was seen stopped
        self._creates: dict[str, _InFlight] = {}   # creates in progress by sandbox id (a resend waits on it)
        self._wake_heartbeat = anyio.Event()
        self.processes = Processes(runtime)     # the data plane's long-lived processes (processes.py)
        self.template_cache = TemplateCache(templates, settings.name, LayerCache(state_dir / "layers"),
                                            fetch=lambda digest: self._blob("layers", digest))
        self.template_cache.default_disk_mb = settings.default_disk_mb
        self.builds = (RemoteBuilds(templates, self.template_cache, self._blob, self._upload_layer,
                                    state_dir / "builds") if hasattr(templates, "_build_into") else None)
        self.pools = WarmPools(runtime, self._member_spec, self.template_cache.has,
                               concurrency=settings.pool_concurrency,
                               template_version=self.template_cache.version,
                               attach=self._attach_member, release=lambda mid: self.egress.release(mid),
                               grant_version=self.template_cache.store_version,
                               on_ready=lambda: self._wake_heartbeat.set())
        self.control_plane = ControlPlaneClient(
            settings.control_plane_url, self._http,
            Identity(settings.name, settings.public_url, settings.capacity_vcpu, settings.capacity_memory_mb,
                     self.instance, support_of(runtime), settings.ram_mb or host_ram_mb()),
            self.pools, statuses=self.statuses, usage=self._usage, templates=self.refresh_templates,
            delivered=self.journal.remove_ended)
        self.checkpoints = state_dir / "checkpoints"       # the images of paused sandboxes
        self.egress = egress or Egress(EgressConfig.from_env(self.instance), state_dir)
        self.transfer = Checkpoints(self.sandboxes, self.journal, runtime, self.template_cache,
                                    self.checkpoints, node_name=settings.name, http=self._http,
                                    create_slots=self._create_slots, record_end=self._record_end, now=now,
                                    egress=self.egress, keep_ends=bool(settings.control_plane_url))
        self.recovery = Recovery(self.sandboxes, self.journal, runtime, self.template_cache,
                                 record_end=self._record_end, now=now)

    # ---- views (read-only snapshots of the registry) --------------------------------------------------

    @property
    def live(self) -> dict[str, Sandbox]:
        """Sandboxes with a runtime sandbox behind them (running, pausing or ending)."""
        return {sb.id: sb for sb in self.sandboxes.in_states(*_LIVE)}

    @property
    def paused(self) -> dict[str, Sandbox]:
        """Sandboxes whose checkpoint image is on this node (paused, or resuming from it)."""
        return {sb.id: sb for sb in self.sandboxes.in_states(NodeState.paused, NodeState.resuming)
                if sb.image is not None}

    @property
    def outbox(self) -> dict[str, NodeSandboxStatus]:
        return self.control_plane.outbox

    @property
    def node_id(self) -> str | None:
        return self.control_plane.node_id

    # ---- lifecycle -----------------------------------------------------------------------------------

    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Recover, then enforce deadlines, watch sandboxes and talk to the control plane until cancelled."""
        await self._recover()
        async with anyio.create_task_group() as tg:
            self._tg = tg
            tg.start_soon(self._deadline_loop)
            tg.start_soon(self._monitor_loop)
            tg.start_soon(self._template_watch)
            tg.start_soon(self.pools.run)
            tg.start_soon(self.processes.run)
            if self.settings.control_plane_url:
                tg.start_soon(self._control_plane_loop)
            task_status.started()

    async def shutdown(self) -> None:
        """Tear down every sandbox this agent holds, unless asked to keep them (they then outlive us).
        Warm-pool members are always destroyed (nobody's yet; a restarted agent would reap them anyway)."""
        await self.pools.close()
        if not self.settings.keep_on_exit:
            with anyio.CancelScope(shield=True):
                async with anyio.create_task_group() as tg:
                    for sid in list(self.live):
                        tg.start_soon(functools.partial(self._end, sid, EndReason.shutdown, report=False))
                await self._flush_outbox()     # reported here, in order, not by tasks about to be cancelled
        with anyio.CancelScope(shield=True):
            await self.egress.close()          # the agent's nft table, once no sandbox holds a slot
        await self._http.aclose()

    async def _recover(self) -> None:
        await self.recovery.run()
        running = {sb.id: (sb.target.handle.pid, _rootfs(sb.target.handle))
                   for sb in self.sandboxes.in_states(*_LIVE) if sb.target is not None and sb.target.handle.pid}
        paused = {sb.id for sb in self.sandboxes.in_states(NodeState.paused, NodeState.resuming)}
        await self.egress.recover(running, paused)
        self.recovered = True

    # ---- operations the control plane asks for ------------------------------------------------------

    async def create(self, spec: NodeSandboxSpec) -> NodeSandboxStatus:
        """Idempotent per sandbox id: a retried create answers the same sandbox, and one that meets the
        first still in progress (the control plane resends on a stale connection) waits for it and answers
        its result, success or error."""
        existing = self.sandboxes.get(spec.id)
        if existing is not None and existing.state in _LIVE:
            return existing.status()           # a retried create: the same sandbox
        first = self._creates.get(spec.id)
        if first is not None:
            await first.done.wait()
            if first.error is not None:
                raise first.error
            assert first.status is not None
            return first.status
        first = self._creates[spec.id] = _InFlight()
        try:
            first.status = await self._create(spec, existing)
            return first.status
        except BaseException as exc:
            first.error = exc if isinstance(exc, Exception) else errors.ServerError(
                f"the create of {spec.id} this one repeats was cancelled")
            if isinstance(exc, errors.PillDropsError):
                # a refused hand-over of a pre-issued member: the control plane ends its record, so the
                # member is never handed over; retired (not left reported, which nobody else may claim)
                self.pools.retire_grant(spec.id)
            raise
        finally:
            del self._creates[spec.id]
            first.done.set()

    async def _create(self, spec: NodeSandboxSpec, existing: Sandbox | None) -> NodeSandboxStatus:
        await self._ensure_template(spec)
        rt_spec = self._runtime_spec(spec)
        self._check_egress(spec)
        if existing is not None:
            raise errors.InvalidState(f"sandbox {spec.id} is already {existing.state.value} on this node",
                                      current=existing.state.value, target="running")
        if spec.timeout_s is not None:     # the deadline on this node's own clock, whatever the skew
            spec = spec.model_copy(update={"end_at": self.now() + timedelta(seconds=spec.timeout_s)})
        if rt_spec.disk_mb is not None and rt_spec.disk_mb > self.settings.max_disk_mb:
            raise errors.InvalidRequest(f"disk_mb {rt_spec.disk_mb} MiB is past node {self.settings.name}'s "
                                        f"maximum of {self.settings.max_disk_mb} MiB",
                                        details={"field": "disk_mb", "max_disk_mb": self.settings.max_disk_mb})
        if (why := disk_refusal(self.runtime, rt_spec)) is not None:
            raise errors.InvalidRequest(why, details={"field": "disk_mb", "disk_mb": rt_spec.disk_mb,
                                                      "isolation": rt_spec.isolation})
        # warm pools are containers, and their members have the template's default disk
        existing = self.sandboxes.get(spec.id)    # again: a concurrent create of this id may have made it
        if existing is not None and existing.state in _LIVE:
            return existing.status()
        if existing is not None:
            raise errors.InvalidState(f"sandbox {spec.id} is already {existing.state.value} on this node",
                                      current=existing.state.value, target="running")
        poolable = (spec.isolation == "container" and self.template_cache.pooled_version(spec)
                    and rt_spec.disk_mb == self.template_cache.disk_mb(spec.model_copy(update={"disk_mb": None})))
        grant = self.pools.granted(spec.id)
        if grant is not None:     # the control plane answered this create from a pre-issued member (issue 15)
            if not same_secret(grant.access_token, spec.access_token):
                raise errors.InvalidRequest(f"sandbox {spec.id} is a pre-issued member with another access token")
            member = self.pools.claim_grant(spec.id, spec.template, spec.vcpu, spec.memory_mb) if poolable else None
            if member is None:       # refused (the member is retired: ``create``)
                raise errors.InvalidState(f"pre-issued member {spec.id} does not fit this create (template "
                                          "rebuilt, other shape, isolation or disk)", current="ready",
                                          target="running")
        else:
            member = self.pools.claim(spec.template, spec.vcpu, spec.memory_mb, spec.network) if poolable else None
        # a claim whose member is gone here (retired between a heartbeat and the hand-over) is made from
        # another member or cold, still billed from the claim, as its record's started_at says
        since = _usage_start(spec.claimed_s, member.ready_mono if member is not None else None)
        if member is not None:             # warm: a ready member becomes this sandbox (billing starts now, or
            sb = self.sandboxes.add(Sandbox(spec, NodeState.creating))     # at the claim: ``_usage_start``)
            return await self._adopt_new(sb, member.handle, claimed=True, attached=member.network_attached,
                                         since=since)
        sb = self.sandboxes.add(Sandbox(spec, NodeState.creating))
        # journaled once, when it runs (``_adopt_new``), not also before: an agent killed in between leaves
        # a half-made sandbox that the next start reaps as unrecorded (``Recovery``: every id the runtime
        # holds, bundle directories included, that no entry names), and its control plane, which got no
        # answer, records it as failed to start; a create is answered only after its entry is written
        try:
            async with self._create_slots:
                handle = await self.runtime.create(rt_spec)
        except BaseException as exc:
            self.sandboxes.move(sb, NodeState.gone)
            if not isinstance(exc, RuntimeFailure):
                raise       # e.g. cancelled: its "creating" entry stays, the next start reaps what was made
            self.journal.remove(spec.id)
            self.stats.failed += 1
            raise errors.ServerError(f"sandbox failed to start: {exc}") from exc
        return await self._adopt_new(sb, handle, claimed=False, since=since)

    def _check_egress(self, spec: NodeSandboxSpec) -> None:
        if spec.network is None:
            return
        if spec.isolation != "container":
            raise errors.NotSupported(f"egress is not supported for {spec.isolation} sandboxes (only container): "
                                      "create it without allow_internet_access/network.allow_out",
                                      details={"isolation": spec.isolation, "feature": "egress"})
        why = self.egress.unavailable()
        if why:
            raise errors.NotSupported(f"egress is not available on node {self.settings.name}: {why}",
                                      details={"feature": "egress"})

    async def _adopt_new(self, sb: Sandbox, handle: Handle, *, claimed: bool, attached: bool = False,
                         since: float | None = None) -> NodeSandboxStatus:
        """``since``: CLOCK_MONOTONIC its usage counts from (a pre-issued member: its claim), else now."""
        try:
            if attached:                   # a member of the pool of this policy: its network is there already
                self.egress.rekey(handle.id, sb.id)
            elif sb.spec.network is not None and handle.pid is not None:
                try:
                    await self.egress.attach(sb.id, handle.pid, _rootfs(handle), sb.spec.network)
                except RuntimeFailure as exc:
                    raise errors.ServerError(f"sandbox network failed to start: {exc}") from exc
            sb.target = self._target(sb.spec, handle)
            mono = time.monotonic()
            start = mono if since is None else min(since, mono)
            sb.started_at, sb.started_mono = self.now() - timedelta(seconds=mono - start), start
            self.sandboxes.move(sb, NodeState.running)
            self.journal.write(sb.journal_entry())
        except BaseException:    # what the runtime made goes with its record (never stuck in "creating")
            if self.sandboxes.is_current(sb, NodeState.running):
                self.sandboxes.move(sb, NodeState.ending)
            with anyio.CancelScope(shield=True):
                await self._destroy_quietly(handle)
                await self.egress.release(sb.id)
                if attached:
                    await self.egress.release(handle.id)    # a rekey that failed: still the member's
            self.journal.remove(sb.id)
            if self.sandboxes.is_current(sb, NodeState.creating, NodeState.ending):
                self.sandboxes.move(sb, NodeState.gone)
            self.stats.failed += 1
            raise
        self.stats.created += 1
        self.stats.claimed += claimed
        return sb.status()

    def _member_spec(self, pool: NodePoolSpec, member_id: str) -> SandboxSpec:
        base = NodeSandboxSpec(id=member_id, template=pool.template, vcpu=pool.vcpu, memory_mb=pool.memory_mb,
                               end_at=self.now(), access_token="-")
        return self._runtime_spec(base)

    async def _attach_member(self, handle: Handle, net: NodeNetwork) -> None:
        """A new member of a warm pool with a policy gets its network now, under its member id."""
        why = self.egress.unavailable()
        if why or handle.pid is None:
            raise RuntimeFailure(f"egress is not available on node {self.settings.name}: {why or 'no init pid'}")
        await self.egress.attach(handle.id, handle.pid, _rootfs(handle), net)

    def configure_pools(self, pools: list[NodePoolSpec]) -> None:
        self.pools.configure(pools)

    def _runtime_spec(self, spec: NodeSandboxSpec) -> SandboxSpec:
        return self.template_cache.runtime_spec(spec)

    def _target(self, spec: NodeSandboxSpec, handle: Handle) -> Target:
        return self.template_cache.target(spec, handle)

    def get(self, sandbox_id: str) -> Sandbox:
        """A sandbox commands can run in (running, or pausing: the data plane refuses new commands then)."""
        sb = self.sandboxes.get(sandbox_id)
        if sb is not None and sb.state in (NodeState.running, NodeState.pausing):
            return sb
        if sb is not None and sb.state in (NodeState.paused, NodeState.resuming):
            raise errors.InvalidState(f"sandbox {sandbox_id} is paused; resume it first",
                                      current="paused", target="running")
        raise errors.SandboxNotFound(f"sandbox {sandbox_id!r} is not running on this node")

    async def kill(self, sandbox_id: str) -> NodeSandboxStatus:
        with anyio.move_on_after(600):      # a restore in progress finishes first (it reads the image)
            while self.sandboxes.state_of(sandbox_id) is NodeState.resuming:
                await anyio.sleep(0.05)
        sb = self.sandboxes.get(sandbox_id)
        if sb is not None and sb.state in _LIVE:
            return await self._end(sandbox_id, EndReason.killed, report=False)
        if sb is not None and sb.state is NodeState.paused:
            return await self.transfer.end_paused(sb, EndReason.killed)
        if sandbox_id in self.outbox:
            return self.outbox[sandbox_id]
        # a claim ended before its member was handed over (and no hand-over is on its way: that one's
        # sandbox is then ended as an orphan, as before)
        if sandbox_id not in self._creates and self.pools.retire_grant(sandbox_id):
            raise errors.SandboxNotFound(f"sandbox {sandbox_id!r} was never handed over on this node "
                                         "(its pre-issued member is retired)")
        raise errors.SandboxNotFound(f"sandbox {sandbox_id!r} is not on this node")

    async def kill_many(self, ids: list[str]) -> list[NodeKilled]:
        """``kill`` for many ids at once (a batch kill from the control plane: one call, not one per id),
        their teardowns run concurrently (``KILL_MANY_PARALLEL`` at a time); one id's failure is its own."""
        ids = list(dict.fromkeys(ids))
        out: list[NodeKilled] = [NodeKilled(id=sid) for sid in ids]
        slots = anyio.Semaphore(KILL_MANY_PARALLEL)

        async def one(i: int, sid: str) -> None:
            async with slots:
                try:
                    out[i] = NodeKilled(id=sid, status=await self.kill(sid))
                except errors.SandboxNotFound:
                    pass                                   # not here: neither status nor error
                except errors.PillDropsError as exc:
                    out[i] = NodeKilled(id=sid, error_code=exc.code, error=exc.message)

        async with anyio.create_task_group() as tg:
            for i, sid in enumerate(ids):
                tg.start_soon(one, i, sid)
        return out

    def set_deadline(self, sandbox_id: str, end_at: datetime,
                     timeout_s: float | None = None) -> NodeSandboxStatus:
        sb = self.get(sandbox_id)
        if timeout_s is not None:
            end_at = self.now() + timedelta(seconds=timeout_s)
        sb.spec = sb.spec.model_copy(update={"end_at": end_at})   # journaled: a restarted agent keeps it
        self.journal.write(sb.journal_entry())
        return sb.status()

    def statuses(self) -> list[NodeSandboxStatus]:
        return self.sandboxes.statuses() + list(self.outbox.values())

    # ---- pause / resume / moves (``checkpoints``) ----------------------------------------------------

    async def pause(self, sandbox_id: str) -> NodeSandboxStatus:
        """Checkpoint a running sandbox to this node's disk (see ``Checkpoints.pause``)."""
        sb = self.sandboxes.get(sandbox_id)
        if sb is not None and sb.state is NodeState.paused:
            return sb.status()          # a retried pause
        mode = sb.spec.isolation if sb is not None else "container"
        why = checkpoint_unsupported(self.runtime, mode)
        if why:
            raise errors.NotSupported(f"this node cannot pause {mode} sandboxes: {why}")
        return await self.transfer.pause(self.get(sandbox_id))

    async def resume(self, sandbox_id: str, body: NodeResume) -> NodeSandboxStatus:
        """Restore a paused sandbox here, from this node's checkpoint or one fetched from ``source_url``."""
        sb = self.sandboxes.get(sandbox_id)
        if sb is not None and sb.state in _LIVE:
            return sb.status()           # a retried resume
        if sb is not None and sb.state is NodeState.resuming:
            raise errors.InvalidState(f"sandbox {sandbox_id} is already resuming", current="resuming",
                                      target="running")
        why = checkpoint_unsupported(self.runtime, body.spec.isolation)
        if why:
            raise errors.NotSupported(f"this node cannot resume {body.spec.isolation} sandboxes: {why}")
        await self._ensure_template(body.spec)
        return await self.transfer.resume(sandbox_id, body)

    def runtime_id_of(self, sandbox_id: str) -> str:
        return self.transfer.runtime_id_of(sandbox_id)

    async def export_checkpoint(self, sandbox_id: str) -> AsyncIterator[bytes]:
        return await self.transfer.export(sandbox_id)

    async def forget(self, sandbox_id: str) -> None:
        await self.transfer.forget(sandbox_id)

    # ---- templates -----------------------------------------------------------------------------------

    def refresh_templates(self) -> list[TemplateInfo]:
        in_use = [sb.spec.template_ref for sb in self.sandboxes if sb.spec.template_ref is not None]
        members = [str(p) for pool in self.pools.pools.values() for m in pool.ready
                   if isinstance(m.version, tuple) for p in m.version[0]]     # the layers warm members stand on
        try:
            self.template_cache.gc(in_use, members)
        except OSError:
            log.exception("template layer gc failed")
        return self.template_cache.refresh()

    async def _ensure_template(self, spec: NodeSandboxSpec) -> None:
        """A template-store version's layers on this node before anything uses them (fetched if missing)."""
        ref = spec.template_ref
        if ref is None or self.template_cache.holds(ref):
            if ref is not None:
                self.template_cache.adopt_built(ref)
            return
        t0 = time.monotonic()
        await self.template_cache.ensure(ref)
        log.info("fetched template %s v%d in %.2fs", ref.name, ref.version, time.monotonic() - t0)
        self._wake_heartbeat.set()          # the control plane learns at once that this node holds it

    async def hold_template(self, ref: NodeTemplateRef) -> None:
        await self.template_cache.ensure(ref)
        self._wake_heartbeat.set()

    async def build_template(self, req: NodeBuildRequest) -> AsyncIterator[bytes]:
        if self.builds is None:
            raise errors.NotSupported(f"node {self.settings.name} cannot build templates")
        return await self.builds.run(req)

    def _cp_url(self, path: str) -> str:
        if not self.settings.control_plane_url:
            raise errors.NotSupported("this node has no control plane (no template store)")
        return f"{self.settings.control_plane_url}/internal/v1/templates/{path}"

    async def _blob(self, kind: str, digest: str) -> AsyncIterator[bytes]:
        """A template-store blob's bytes from the control plane (the caller verifies the digest)."""
        url = self._cp_url(f"{kind}/{digest}")

        async def chunks() -> AsyncIterator[bytes]:
            try:
                async with self._http.stream("GET", url, timeout=httpx.Timeout(None, connect=5.0)) as resp:
                    if resp.status_code >= 400:
                        await resp.aread()
                        raise errors.from_wire(resp.status_code, _json(resp))
                    async for chunk in resp.aiter_bytes():
                        yield chunk
            except httpx.HTTPError as exc:
                raise errors.NodeUnavailable(f"fetching {kind[:-1]} {digest} from the control plane failed: "
                                             f"{exc!r}") from exc
        return chunks()

    async def _upload_layer(self, digest: str, path: Path) -> None:
        async def body() -> AsyncIterator[bytes]:
            async with await anyio.open_file(path, "rb") as f:
                while chunk := await f.read(1 << 20):
                    yield chunk
        try:
            resp = await self._http.put(self._cp_url(f"layers/{digest}"), content=body(),
                                        timeout=httpx.Timeout(None, connect=5.0))
        except httpx.HTTPError as exc:
            raise errors.NodeUnavailable(f"uploading layer {digest} failed: {exc!r}") from exc
        if resp.status_code >= 400:
            raise errors.from_wire(resp.status_code, _json(resp))

    # ---- ending --------------------------------------------------------------------------------------

    async def _end(self, sandbox_id: str, reason: EndReason, *, report: bool = True,
                   error: str | None = None) -> NodeSandboxStatus:
        self._stopped_ticks.pop(sandbox_id, None)
        sb = self.sandboxes.get(sandbox_id)
        if sb is not None and sb.state in (NodeState.running, NodeState.pausing):
            async with sb.op:                # a pause in progress finishes first
                pass
            if self.sandboxes.is_current(sb, NodeState.paused):
                return await self.transfer.end_paused(sb, reason)    # it was paused meanwhile
        if sb is None or not self.sandboxes.is_current(sb, NodeState.running):
            return self.outbox.get(sandbox_id) or NodeSandboxStatus(id=sandbox_id, state=SandboxState.stopped,
                                                                    end_reason=reason, ended_at=self.now())
        assert sb.target is not None
        self.sandboxes.move(sb, NodeState.ending)
        # usage ends here, when the teardown begins (how long the runtime takes to remove the sandbox is not
        # its running time), as it does for a teardown the agent's death interrupts (``Recovery``)
        sb.end_reason, sb.ended_mono, ended_at = reason.value, time.monotonic(), self.now()
        self.journal.write(sb.journal_entry())     # an agent killed during the teardown bills up to here
        await self._destroy_quietly(sb.target.handle)
        await self.egress.release(sandbox_id)
        if not self.settings.control_plane_url:
            self.journal.remove(sandbox_id)
        # else the entry stays until the control plane has the end (``ControlPlaneClient``'s ``delivered``):
        # an agent that dies first reports it again after its restart, final usage included
        self.sandboxes.move(sb, NodeState.gone)
        status = self._record_end(sandbox_id, reason, started_at=sb.started_at, started_mono=sb.started_mono,
                                  ended_mono=sb.ended_mono, ended_at=ended_at, error=error)
        if report and self._tg is not None:
            self._tg.start_soon(self._report, status)   # never hold up teardown behind the control plane
        return status

    def _record_end(self, sandbox_id: str, reason: EndReason, started_at: datetime | None = None,
                    started_mono: float | None = None, run_s: float | None = None,
                    error: str | None = None, ended_mono: float | None = None,
                    ended_at: datetime | None = None) -> NodeSandboxStatus:
        """The final status, with the final usage point (kept in the outbox until the control plane has it):
        from ``started_mono`` to ``ended_mono`` (its teardown's start; now if None), or ``run_s`` for a
        sandbox that ended while paused; ``ended_at`` (now if None) is the end on this node's clock."""
        state = SandboxState.failed if reason == EndReason.failed_start else SandboxState.stopped
        seq: int | None
        if started_mono is not None:
            run_s, seq = usage_point(started_mono, ended_mono)
        else:
            seq = int(run_s * 1000) if run_s is not None else None
        status = NodeSandboxStatus(id=sandbox_id, state=state, end_reason=reason, started_at=started_at,
                                   ended_at=ended_at or self.now(), run_s=run_s, seq=seq, error=error)
        self.outbox[sandbox_id] = status
        self.stats.ended[reason.value] = self.stats.ended.get(reason.value, 0) + 1
        return status

    async def _destroy_quietly(self, handle: Handle) -> None:
        try:
            await self.runtime.destroy(handle)
        except Exception:  # logged; its journal entry goes, so the next start reaps it
            log.exception("destroying %s failed", handle.id)

    # ---- background loops ----------------------------------------------------------------------------

    def _schedule_end(self, sb: Sandbox, reason: EndReason, error: str | None = None) -> None:
        if sb.id not in self._end_scheduled and sb.state is NodeState.running and self._tg is not None:
            self._end_scheduled.add(sb.id)
            self._tg.start_soon(self._scheduled_end, sb.id, reason, error)

    async def _scheduled_end(self, sandbox_id: str, reason: EndReason, error: str | None = None) -> None:
        try:
            await self._end(sandbox_id, reason, error=error)
        finally:
            self._end_scheduled.discard(sandbox_id)

    async def _deadline_loop(self) -> None:
        """Each expired sandbox is torn down in its own task: deadlines hold even when many expire at once."""
        while True:
            now = self.now()
            for sb in self.sandboxes.in_states(NodeState.running):
                if sb.end_at <= now:
                    log.info("sandbox %s reached its deadline", sb.id)
                    self._schedule_end(sb, EndReason.timeout)
            await anyio.sleep(DEADLINE_TICK_S)

    async def _monitor_loop(self) -> None:
        while True:
            await anyio.sleep(MONITOR_TICK_S)
            for sb in self.sandboxes.in_states(NodeState.running):
                assert sb.target is not None
                if self.runtime.running_by_pid(sb.target.handle):    # one /proc read (issue 15)
                    self._stopped_ticks.pop(sb.id, None)
                    continue
                try:
                    state = await self.runtime.state(sb.target.handle)
                except Exception:
                    log.exception("state of %s", sb.id)
                    continue
                if state.status != "running" and self.sandboxes.is_current(sb, NodeState.running):
                    self._schedule_end(sb, EndReason.oom if state.oom_killed else EndReason.exited)
                elif self._init_stopped(sb):
                    self._schedule_end(sb, EndReason.exited, STOPPED_INIT_ERROR)

    def _init_stopped(self, sb: Sandbox) -> bool:
        """Its init (pd-init, gVisor's Sentry, the microVM's QEMU) has been stopped by a signal from outside
        the sandbox (state ``T``) for two monitor ticks: nothing can run in it any more, so it ends with
        that reason instead of staying ``running`` (issue 16 item 7)."""
        handle = sb.target.handle if sb.target is not None else None
        pid, start = (handle.pid, handle.pid_start_time) if handle is not None else (None, None)
        fields = procs.stat_fields(pid) if pid and start is not None else None     # one read: state, start
        if not fields or fields[0] != "T" or int(fields[19]) != start:     # (a reused pid is not it)
            self._stopped_ticks.pop(sb.id, None)
            return False
        self._stopped_ticks[sb.id] = self._stopped_ticks.get(sb.id, 0) + 1
        return self._stopped_ticks[sb.id] >= 2

    async def _template_watch(self) -> None:
        """A template built while we run is announced at once (not at the next regular heartbeat)."""
        sig = getattr(self.templates, "signature", lambda: ())
        last = sig()
        while True:
            await anyio.sleep(1.0)
            now = sig()
            if now != last:
                last = now
                self._wake_heartbeat.set()

    async def _control_plane_loop(self) -> None:
        delay = 0.2
        interval = 5.0
        while True:
            try:
                if self.node_id is None:
                    interval = await self._register()
                    delay = 0.2
                else:
                    await self._heartbeat()
                sent = time.monotonic()
                with anyio.move_on_after(interval):
                    await self._wake_heartbeat.wait()
                # woken early (members became ready, a template arrived): at most one heartbeat per
                # HEARTBEAT_DEBOUNCE_S, so members that become ready together (steady claims refilling)
                # are reported by one heartbeat, not one each back to back
                await anyio.sleep(max(0.0, sent + HEARTBEAT_DEBOUNCE_S - time.monotonic()))
                self._wake_heartbeat = anyio.Event()
            except Exception as exc:  # noqa: BLE001 - the control plane may be down; keep trying
                log.warning("control plane unreachable: %s", exc)
                await anyio.sleep(delay)
                delay = min(delay * 2, 5.0)

    # ---- the control-plane client (``control_plane``) -------------------------------------------------

    def _usage(self) -> tuple[float, int]:
        live = [sb.spec for sb in self.sandboxes.in_states(*_LIVE)]
        return sum(s.vcpu for s in live), sum(s.memory_mb for s in live)

    async def _register(self) -> float:
        return await self.control_plane.register()

    async def _heartbeat(self) -> None:
        await self.control_plane.heartbeat()

    async def _report(self, status: NodeSandboxStatus) -> None:
        await self.control_plane.report(status)

    async def _flush_outbox(self) -> None:
        await self.control_plane.flush_outbox()

    async def wait_registered(self) -> None:
        await self.control_plane.registered.wait()


def _rootfs(handle: Handle) -> Path | None:
    """The sandbox's root on the host (crun's overlay), where its resolv.conf is written."""
    return Path(handle.bundle) / "rootfs" if handle.bundle else None


def instance_id(state_dir: Path) -> str:
    """This agent's identity: made once, kept in its state dir, so a restart (any port) is the same node."""
    import uuid
    path = state_dir / "instance"
    try:
        return path.read_text().strip()
    except OSError:
        state_dir.mkdir(parents=True, exist_ok=True)
        ident = uuid.uuid4().hex
        path.write_text(ident)
        return ident


def host_ram_mb() -> int:
    """The host's RAM in MiB (MemTotal): no sandbox's memory limit can be more than this."""
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("MemTotal:")) // 1024


def default_capacity(cpu_overcommit: float = 512.0, memory_overcommit: float = 32.0) -> tuple[float, int]:
    """Capacity offered to the scheduler: host size times overcommit ratios. Sandbox limits are caps, not
    reservations, and an RL episode rarely uses all of its allowance: 512 vCPU per core lets the 1,000-way
    fan-out of the default shape (1 vCPU, 512 MiB) run on a 2-core machine, where memory (RAM x 32 offered,
    about 0.6 MiB really used by an idle sandbox) is what binds."""
    cpus = os.cpu_count() or 1
    return cpus * cpu_overcommit, int(host_ram_mb() * memory_overcommit)
