"""The node agent: owns the sandboxes of one host.

- Journals intent before creating and confirms after; on start it re-derives the truth from the runtime
  (``_recover``): live sandboxes in the journal are adopted, half-made ones and runtime containers it
  has no record of are destroyed.
- Enforces deadlines itself (the control plane may be down) and notices sandboxes whose init died
  (``oom`` when the memory cgroup killed it, ``exited`` otherwise).
- Reports every end to the control plane; reports that fail stay in an outbox that rides on the next
  heartbeat, so the control plane learns every end exactly once it is reachable again.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import shutil
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any, Protocol

import anyio
import httpx

from pilldrops import errors
from pilldrops._version import __version__
from pilldrops.node.dataplane import Target
from pilldrops.node.journal import Entry, Journal, boot_id
from pilldrops.node.pools import WarmPools
from pilldrops.node.processes import Processes
from pilldrops.node.runtime.base import Handle, Runtime, RuntimeFailure, SandboxSpec
from pilldrops.schema.api import EndReason, SandboxState, TemplateInfo
from pilldrops.schema.node import (
    NodeEvent, NodeHeartbeat, NodeHeartbeatReply, NodePoolSpec, NodeRegister, NodeRegistered, NodeResume,
    NodeSandboxSpec, NodeSandboxStatus,
)

log = logging.getLogger("pilldrops.node")
DEADLINE_TICK_S = 0.25
MONITOR_TICK_S = 2.0
PIDS_LIMIT = 1024


def utcnow() -> datetime:
    return datetime.now(timezone.utc)


class Templates(Protocol):
    def get(self, name: str) -> Any: ...

    def list(self) -> list[Any]: ...


def usage_point(started_mono: float) -> tuple[float, int]:
    """Cumulative running seconds on the monotonic clock, and the report sequence derived from it
    (milliseconds), which only grows, even across agent restarts."""
    run_s = max(0.0, time.monotonic() - started_mono)
    return run_s, int(run_s * 1000)


@dataclass
class Live:
    spec: NodeSandboxSpec
    target: Target
    started_at: datetime
    end_at: datetime
    started_mono: float
    ending: bool = False
    end_scheduled: bool = False
    op: anyio.Lock = field(default_factory=anyio.Lock)    # pause and end of one sandbox never interleave

    def status(self) -> NodeSandboxStatus:
        run_s, seq = usage_point(self.started_mono)
        state = SandboxState.pausing if self.target.pausing else SandboxState.running
        return NodeSandboxStatus(id=self.spec.id, state=state, pid=self.target.handle.pid,
                                 started_at=self.started_at, end_at=self.end_at, run_s=run_s, seq=seq)

    def journal_entry(self) -> Entry:
        return Entry(id=self.spec.id, phase="running", spec=self.spec.model_dump(mode="json"),
                     handle=vars(self.target.handle), started_at=self.started_at.isoformat(),
                     started_mono=self.started_mono, boot_id=boot_id())


@dataclass
class Paused:
    """A checkpointed sandbox: no process, no cgroup; its image is on this node's disk."""

    spec: NodeSandboxSpec
    run_s: float
    image: Path
    size: int
    started_at: datetime | None = None
    runtime_id: str = ""        # the container's name in the image (a claimed warm-pool member keeps its own)
    timeout_left: float | None = None   # its deadline's time left at the moment it was paused (node clock)

    def status(self) -> NodeSandboxStatus:
        return NodeSandboxStatus(id=self.spec.id, state=SandboxState.paused, started_at=self.started_at,
                                 run_s=self.run_s, seq=int(self.run_s * 1000), checkpoint_bytes=self.size,
                                 timeout_left=self.timeout_left)

    def journal_entry(self, phase: str = "paused") -> Entry:
        return Entry(id=self.spec.id, phase=phase, spec=self.spec.model_dump(mode="json"),  # type: ignore[arg-type]
                     handle={"id": self.runtime_id or self.spec.id},
                     started_at=self.started_at.isoformat() if self.started_at else None, run_s=self.run_s,
                     checkpoint=str(self.image), checkpoint_bytes=self.size, boot_id=boot_id())


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


@dataclass
class Stats:
    created: int = 0
    claimed: int = 0                   # of ``created``: taken from a warm pool
    failed: int = 0
    ended: dict[str, int] = field(default_factory=dict)


class NodeAgent:
    def __init__(self, settings: Settings, runtime: Runtime, templates: Templates, state_dir: Path,
                 *, http: httpx.AsyncClient | None = None, now: Callable[[], datetime] = utcnow) -> None:
        if not settings.node_token:
            raise ValueError("a node agent needs a non-empty node token")
        self.settings = settings
        self.runtime = runtime
        self.templates = templates
        self.journal = Journal(state_dir / "journal")
        self.checkpoints = state_dir / "checkpoints"
        self.instance = instance_id(state_dir)
        self.now = now
        self.live: dict[str, Live] = {}
        self.paused: dict[str, Paused] = {}
        self.resuming: set[str] = set()
        self.outbox: dict[str, NodeSandboxStatus] = {}
        self.node_id: str | None = None
        self.stats = Stats()
        self._create_slots = anyio.Semaphore(settings.create_concurrency)
        self._http = http or httpx.AsyncClient(timeout=httpx.Timeout(10.0, connect=5.0),
                                               headers={"Authorization": f"Bearer {settings.node_token}"})
        self._registered = anyio.Event()
        self._tpl_cache: dict[str, Any] = {}
        self._tg: anyio.abc.TaskGroup | None = None
        self.creating: set[str] = set()      # in flight: reported as starting, so never taken for lost
        self._wake_heartbeat = anyio.Event()
        self.processes = Processes(runtime)     # the data plane's long-lived processes (processes.py)
        self.pools = WarmPools(runtime, self._member_spec, self._has_template,
                               concurrency=settings.pool_concurrency, template_version=self._template_version)

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
        await self._http.aclose()

    async def _recover(self) -> None:
        """Derive the truth from the runtime; adopt what is running and recorded, reap everything else."""
        known = set()
        this_boot = boot_id()
        for entry in self.journal.entries():
            known.add(entry.id)
            known.add(str(entry.handle.get("id") or entry.id))   # a claimed warm-pool member keeps its name
            if entry.boot_id != this_boot:
                entry.started_mono = None      # another boot: its monotonic clock says nothing here
            handle = entry.runtime_handle()
            spec = NodeSandboxSpec.model_validate(entry.spec)
            if entry.phase in ("paused", "resuming") or (entry.phase == "pausing" and not entry.handle):
                await self._recover_paused(entry, spec, handle)
                continue
            state = await self.runtime.state(handle) if entry.phase in ("running", "pausing") else None
            if state is not None and state.status == "running":
                try:
                    target = self._target(spec, handle)
                except Exception:  # noqa: BLE001 - its template is gone: cannot serve it, so reap below
                    log.exception("cannot adopt %s", spec.id)
                else:
                    started = datetime.fromisoformat(entry.started_at) if entry.started_at else self.now()
                    self.live[spec.id] = Live(spec, target, started, spec.end_at,
                                              entry.started_mono if entry.started_mono is not None
                                              else time.monotonic())
                    log.info("adopted sandbox %s (pid %s)", spec.id, state.pid)
                    if entry.phase == "pausing":        # the checkpoint did not finish: it still runs
                        self._drop_image(entry.checkpoint)
                        self.journal.write(self.live[spec.id].journal_entry())
                    continue
            await self._destroy_quietly(handle)
            if entry.phase == "pausing":
                self._drop_image(entry.checkpoint)
            self.journal.remove(entry.id)
            reason = EndReason.failed_start if entry.phase == "creating" else (
                EndReason.oom if state and state.oom_killed else EndReason.exited)
            self._record_end(spec.id, reason, started_mono=entry.started_mono)
        for sid in await self.runtime.list_ids():
            if sid not in known:
                log.warning("reaping unrecorded sandbox %s", sid)
                await self._destroy_quietly(Handle(id=sid))

    async def _recover_paused(self, entry: Entry, spec: NodeSandboxSpec, handle: Handle) -> None:
        """A paused sandbox survives a restart as its image. A restore the crash interrupted is undone (its
        half-started container destroyed), so the sandbox is simply paused again: the image was kept."""
        if entry.phase == "resuming":
            await self._destroy_quietly(Handle(id=str(entry.handle.get("id") or spec.id)))
        image = Path(entry.checkpoint or "")
        if entry.checkpoint and image.is_dir() and entry.phase != "pausing":
            started = datetime.fromisoformat(entry.started_at) if entry.started_at else None
            p = Paused(spec, entry.run_s or 0.0, image, entry.checkpoint_bytes or 0, started,
                       str(entry.handle.get("id") or spec.id))
            self.paused[spec.id] = p
            self.journal.write(p.journal_entry())
            log.info("recovered paused sandbox %s", spec.id)
            return
        self._drop_image(entry.checkpoint)
        self.journal.remove(spec.id)
        status = self._record_end(spec.id, EndReason.exited, run_s=entry.run_s)
        status.error = "its checkpoint was lost"

    def _drop_image(self, path: str | Path | None) -> None:
        if path:
            shutil.rmtree(path, ignore_errors=True)

    def _target(self, spec: NodeSandboxSpec, handle: Any) -> Target:
        tpl = self._template(spec.template)
        return Target(id=spec.id, handle=handle, env={**dict(tpl.env), **spec.envs}, workdir=tpl.workdir or "/")

    # ---- operations the control plane asks for ------------------------------------------------------

    async def create(self, spec: NodeSandboxSpec) -> NodeSandboxStatus:
        if spec.id in self.live:
            return self.live[spec.id].status()           # a retried create: the same sandbox
        rt_spec = self._runtime_spec(spec)
        if spec.timeout_s is not None:     # the deadline on this node's own clock, whatever the skew
            spec = spec.model_copy(update={"end_at": self.now() + timedelta(seconds=spec.timeout_s)})
        member = self.pools.claim(spec.template, spec.vcpu, spec.memory_mb)
        if member is not None:             # warm: a ready member becomes this sandbox (billing starts now)
            return self._adopt_new(spec, member, claimed=True)
        self.journal.write(Entry(id=spec.id, phase="creating", spec=spec.model_dump(mode="json")))
        self.creating.add(spec.id)
        try:
            async with self._create_slots:
                handle = await self.runtime.create(rt_spec)
        except RuntimeFailure as exc:
            self.journal.remove(spec.id)
            self.stats.failed += 1
            raise errors.ServerError(f"sandbox failed to start: {exc}") from exc
        finally:
            self.creating.discard(spec.id)
        return self._adopt_new(spec, handle, claimed=False)

    def _adopt_new(self, spec: NodeSandboxSpec, handle: Handle, *, claimed: bool) -> NodeSandboxStatus:
        live = Live(spec, self._target(spec, handle), self.now(), spec.end_at, time.monotonic())
        self.journal.write(live.journal_entry())
        self.live[spec.id] = live
        self.stats.created += 1
        self.stats.claimed += claimed
        return live.status()

    def _member_spec(self, pool: NodePoolSpec, member_id: str) -> SandboxSpec:
        base = NodeSandboxSpec(id=member_id, template=pool.template, vcpu=pool.vcpu, memory_mb=pool.memory_mb,
                               end_at=self.now(), access_token="-")
        return self._runtime_spec(base)

    def _has_template(self, name: str) -> bool:
        return name in self._tpl_cache

    def _template_version(self, name: str) -> object:
        tpl = self._tpl_cache.get(name)
        return (tuple(str(p) for p in tpl.layers), getattr(tpl, "built_at", None)) if tpl is not None else None

    def configure_pools(self, pools: list[NodePoolSpec]) -> None:
        self.pools.configure(pools)

    def _runtime_spec(self, spec: NodeSandboxSpec) -> SandboxSpec:
        try:
            tpl = self._template(spec.template)
        except Exception as exc:  # noqa: BLE001 - template stores raise their own errors
            raise errors.TemplateNotFound(f"template {spec.template!r} is not built on node "
                                          f"{self.settings.name}: {exc}") from exc
        return SandboxSpec(id=spec.id, layers=tuple(Path(p) for p in tpl.layers), vcpu=spec.vcpu,
                           memory_mb=spec.memory_mb, pids_limit=PIDS_LIMIT,
                           envs={**dict(tpl.env), **spec.envs}, workdir=tpl.workdir or "/",
                           hostname=spec.id.replace("_", "-"))

    def get(self, sandbox_id: str) -> Live:
        live = self.live.get(sandbox_id)
        if live is None or live.ending:
            if sandbox_id in self.paused or sandbox_id in self.resuming:
                raise errors.InvalidState(f"sandbox {sandbox_id} is paused; resume it first",
                                          current="paused", target="running")
            raise errors.SandboxNotFound(f"sandbox {sandbox_id!r} is not running on this node")
        return live

    async def kill(self, sandbox_id: str) -> NodeSandboxStatus:
        with anyio.move_on_after(600):
            while sandbox_id in self.resuming:       # a restore in progress finishes first (it reads the image)
                await anyio.sleep(0.05)
        if sandbox_id not in self.live:
            if sandbox_id in self.paused:
                return self._end_paused(sandbox_id, EndReason.killed)
            if sandbox_id in self.outbox:
                return self.outbox[sandbox_id]
            raise errors.SandboxNotFound(f"sandbox {sandbox_id!r} is not on this node")
        return await self._end(sandbox_id, EndReason.killed, report=False)

    # ---- pause / resume ----------------------------------------------------------------------------

    async def pause(self, sandbox_id: str) -> NodeSandboxStatus:
        """Checkpoint a running sandbox to this node's disk: its processes and cgroup are gone afterwards.
        Commands in flight end first (their runs report ``paused``). On failure it keeps running."""
        if sandbox_id in self.paused:
            return self.paused[sandbox_id].status()          # a retried pause
        why = self.runtime.checkpoint_unsupported()
        if why:
            raise errors.NotSupported(f"this node cannot pause sandboxes: {why}")
        live = self.get(sandbox_id)
        async with live.op:
            if self.live.get(sandbox_id) is not live or live.ending:
                raise errors.InvalidState(f"sandbox {sandbox_id} ended before it could be paused",
                                          current="stopped", target="paused")
            await live.target.end_commands()
            run_s, _ = usage_point(live.started_mono)
            left = max(0.0, (live.end_at - self.now()).total_seconds())   # the same instant as run_s
            image = self.checkpoints / sandbox_id
            shutil.rmtree(image, ignore_errors=True)
            image.mkdir(parents=True)
            entry = live.journal_entry()
            entry.phase, entry.checkpoint, entry.run_s = "pausing", str(image), run_s
            self.journal.write(entry)
            try:
                size = await self.runtime.checkpoint(live.target.handle, image)
            except Exception as exc:  # noqa: BLE001 - whatever failed, find out what is left
                live.target.pausing = False
                state = await self._state_quietly(live.target.handle)
                if state not in ("stopped", "gone"):     # the runtime's contract: it keeps running
                    self.journal.write(live.journal_entry())
                    self._drop_image(image)
                    raise errors.ServerError(f"pausing {sandbox_id} failed (it keeps running): {exc}") from exc
                # its processes are gone (the dump happened, then something after it failed): what the image
                # holds is all there is, so keep it as a paused sandbox (restore validates it) if it has any
                log.exception("pausing %s failed after its processes were gone", sandbox_id)
                if not any(image.iterdir()):
                    live.ending = True
                    self.live.pop(sandbox_id, None)
                    self.journal.remove(sandbox_id)
                    self._drop_image(image)
                    self._record_end(sandbox_id, EndReason.exited, started_at=live.started_at, run_s=run_s)
                    raise errors.ServerError(f"pausing {sandbox_id} failed and it is gone: {exc}") from exc
                size = sum(f.stat().st_size for f in image.rglob("*") if f.is_file() and not f.is_symlink())
            p = Paused(live.spec, run_s, image, size, live.started_at, live.target.handle.id, left)
            self.journal.write(p.journal_entry())
            self.paused[sandbox_id] = p
            self.live.pop(sandbox_id, None)
        log.info("paused sandbox %s (%d bytes)", sandbox_id, size)
        return p.status()

    async def resume(self, sandbox_id: str, body: NodeResume) -> NodeSandboxStatus:
        """Restore a paused sandbox here, from this node's checkpoint or one fetched from ``source_url``."""
        if sandbox_id in self.live:
            return self.live[sandbox_id].status()           # a retried resume
        if sandbox_id in self.resuming:
            raise errors.InvalidState(f"sandbox {sandbox_id} is already resuming", current="resuming",
                                      target="running")
        why = self.runtime.checkpoint_unsupported()
        if why:
            raise errors.NotSupported(f"this node cannot resume sandboxes: {why}")
        self.resuming.add(sandbox_id)
        try:
            # a move (source_url) always takes the source's copy: one left here from an earlier pause is stale
            p = None if body.source_url else self.paused.get(sandbox_id)
            fetched = p is None
            if p is None:
                if not body.source_url:
                    raise errors.SandboxNotFound(f"no checkpoint of {sandbox_id} on node {self.settings.name}")
                stale = self.paused.pop(sandbox_id, None)
                if stale is not None:
                    self.journal.remove(sandbox_id)
                    self._drop_image(stale.image)
                p = await self._fetch_checkpoint(sandbox_id, body)
            try:
                spec = body.spec.model_copy(update={"end_at": self.now() + timedelta(seconds=body.timeout_s)})
                rt_spec = self._runtime_spec(spec)
                if p.runtime_id and p.runtime_id != rt_spec.id:   # a claimed pool member keeps its own name
                    rt_spec = dataclasses.replace(rt_spec, id=p.runtime_id,
                                                  hostname=p.runtime_id.replace("_", "-"))
                self.journal.write(p.journal_entry("resuming"))
                try:
                    async with self._create_slots:
                        handle = await self.runtime.restore(rt_spec, p.image)
                except RuntimeFailure as exc:
                    raise errors.ServerError(f"resuming {sandbox_id} failed (it stays paused): {exc}") from exc
            except BaseException:
                if fetched:     # a copy: the source node's checkpoint stays the sandbox's, this one goes
                    self.journal.remove(sandbox_id)
                    self._drop_image(p.image)
                else:
                    self.journal.write(p.journal_entry())
                raise
            live = Live(spec, self._target(spec, handle), p.started_at or self.now(), spec.end_at,
                        time.monotonic() - max(p.run_s, body.run_s))
            self.journal.write(live.journal_entry())
            self.live[sandbox_id] = live
            self.paused.pop(sandbox_id, None)
            self._drop_image(p.image)
        finally:
            self.resuming.discard(sandbox_id)
        log.info("resumed sandbox %s", sandbox_id)
        return live.status()

    async def _fetch_checkpoint(self, sandbox_id: str, body: NodeResume) -> Paused:
        """Copy a checkpoint from the node that paused it (same node token), as a tar stream with xattrs
        (the writable layer's overlay whiteouts and opaque dirs)."""
        image = self.checkpoints / sandbox_id
        shutil.rmtree(image, ignore_errors=True)
        image.mkdir(parents=True)
        ok = False
        try:
            tar = await anyio.open_process(["tar", "--numeric-owner", "--xattrs", "--xattrs-include=*", "-x",
                                            "-f", "-", "-C", str(image)], stdin=subprocess.PIPE,
                                           stderr=subprocess.PIPE)
            async with tar:
                assert tar.stdin is not None
                url = f"{body.source_url}/node/v1/sandboxes/{sandbox_id}/checkpoint"
                async with self._http.stream("GET", url, timeout=httpx.Timeout(None, connect=5.0)) as resp:
                    if resp.status_code >= 400:
                        await resp.aread()
                        raise errors.from_wire(resp.status_code, _json_or_none(resp))
                    runtime_id = resp.headers.get("x-pilldrops-runtime-id") or sandbox_id
                    async for chunk in resp.aiter_bytes():
                        await tar.stdin.send(chunk)
                await tar.stdin.aclose()
                code = await tar.wait()
            if code != 0:
                raise errors.ServerError(f"unpacking the checkpoint of {sandbox_id} failed (tar exit {code})")
            size = sum(f.stat().st_size for f in image.rglob("*") if f.is_file() and not f.is_symlink())
            p = Paused(body.spec, body.run_s, image, size, None, runtime_id)
            ok = True
            return p
        except httpx.HTTPError as exc:
            raise errors.NodeUnavailable(f"fetching the checkpoint of {sandbox_id} failed: {exc!r}") from exc
        finally:
            if not ok:
                self._drop_image(image)

    def runtime_id_of(self, sandbox_id: str) -> str:
        p = self.paused.get(sandbox_id)
        return (p.runtime_id or sandbox_id) if p else sandbox_id

    async def export_checkpoint(self, sandbox_id: str) -> Any:
        """The checkpoint as a tar stream (for another node resuming it). The copy here stays until the
        control plane says the move is done (``forget``)."""
        p = self.paused.get(sandbox_id)
        if p is None:
            raise errors.SandboxNotFound(f"no checkpoint of {sandbox_id} on node {self.settings.name}")
        proc = await anyio.open_process(["tar", "--numeric-owner", "--xattrs", "--xattrs-include=*", "-c",
                                         "-f", "-", "-C", str(p.image), "."], stdin=subprocess.DEVNULL,
                                        stderr=subprocess.DEVNULL)

        async def stream() -> Any:
            async with proc:
                assert proc.stdout is not None
                try:
                    async for chunk in proc.stdout:
                        yield chunk
                    if await proc.wait() != 0:   # abort the response: the receiver sees a broken transfer
                        raise RuntimeError(f"packing the checkpoint of {sandbox_id} failed (tar exit "
                                           f"{proc.returncode})")
                finally:
                    if proc.returncode is None:
                        proc.kill()
        return stream()

    def forget(self, sandbox_id: str) -> None:
        """Drop a checkpoint that now lives on another node. No end is recorded: the sandbox lives on."""
        p = self.paused.pop(sandbox_id, None)
        if p is None:
            raise errors.SandboxNotFound(f"no checkpoint of {sandbox_id} on node {self.settings.name}")
        self.journal.remove(sandbox_id)
        self._drop_image(p.image)
        log.info("dropped checkpoint of %s (moved to another node)", sandbox_id)

    def _end_paused(self, sandbox_id: str, reason: EndReason) -> NodeSandboxStatus:
        p = self.paused.pop(sandbox_id)
        self.journal.remove(sandbox_id)
        self._drop_image(p.image)
        return self._record_end(sandbox_id, reason, started_at=p.started_at, run_s=p.run_s)

    def set_deadline(self, sandbox_id: str, end_at: datetime, timeout_s: float | None = None) -> NodeSandboxStatus:
        live = self.get(sandbox_id)
        if timeout_s is not None:
            end_at = self.now() + timedelta(seconds=timeout_s)
        live.end_at = end_at
        live.spec = live.spec.model_copy(update={"end_at": end_at})   # a restarted agent keeps the deadline
        self.journal.write(live.journal_entry())
        return live.status()

    def statuses(self) -> list[NodeSandboxStatus]:
        starting = [NodeSandboxStatus(id=sid, state=SandboxState.starting) for sid in self.creating]
        resuming = [NodeSandboxStatus(id=sid, state=SandboxState.resuming) for sid in self.resuming
                    if sid not in self.live]
        paused = [p.status() for sid, p in self.paused.items() if sid not in self.resuming]
        return ([lv.status() for lv in self.live.values()] + starting + resuming + paused
                + list(self.outbox.values()))

    def refresh_templates(self) -> list[TemplateInfo]:
        """Re-read the built templates (off the hot path: at start and with each heartbeat)."""
        cache, infos = {}, []
        for st in self.templates.list():
            if not getattr(st, "built", True):
                continue
            t = self.templates.get(st.name)
            cache[st.name] = t
            built = datetime.fromtimestamp(t.built_at, timezone.utc) if t.built_at else None
            infos.append(TemplateInfo(name=st.name, description=getattr(st, "description", ""),
                                      layers=[str(p) for p in t.layers], size_bytes=t.size, built_at=built))
        self._tpl_cache = cache
        return infos

    def _template(self, name: str) -> Any:
        tpl = self._tpl_cache.get(name)
        if tpl is None:
            tpl = self._tpl_cache[name] = self.templates.get(name)
        return tpl

    # ---- ending --------------------------------------------------------------------------------------

    async def _end(self, sandbox_id: str, reason: EndReason, *, report: bool = True) -> NodeSandboxStatus:
        live = self.live.get(sandbox_id)
        if live is not None and not live.ending:
            await live.op.acquire()          # a pause in progress finishes first
            live.op.release()
            if self.live.get(sandbox_id) is not live and sandbox_id in self.paused:
                return self._end_paused(sandbox_id, reason)    # it was paused meanwhile
        if live is None or live.ending or self.live.get(sandbox_id) is not live:
            return self.outbox.get(sandbox_id) or NodeSandboxStatus(id=sandbox_id, state=SandboxState.stopped,
                                                                    end_reason=reason, ended_at=self.now())
        live.ending = True
        await self._destroy_quietly(live.target.handle)
        self.journal.remove(sandbox_id)
        self.live.pop(sandbox_id, None)
        status = self._record_end(sandbox_id, reason, started_at=live.started_at, started_mono=live.started_mono)
        if report and self._tg is not None:
            self._tg.start_soon(self._report, status)   # never hold up teardown behind the control plane
        return status

    def _record_end(self, sandbox_id: str, reason: EndReason, started_at: datetime | None = None,
                    started_mono: float | None = None, run_s: float | None = None) -> NodeSandboxStatus:
        """The final status, with the final usage point (kept in the outbox until the control plane has it);
        ``run_s`` instead of ``started_mono`` for a sandbox that ended while paused."""
        state = SandboxState.failed if reason == EndReason.failed_start else SandboxState.stopped
        seq: int | None
        if started_mono is not None:
            run_s, seq = usage_point(started_mono)
        else:
            seq = int(run_s * 1000) if run_s is not None else None
        status = NodeSandboxStatus(id=sandbox_id, state=state, end_reason=reason, started_at=started_at,
                                   ended_at=self.now(), run_s=run_s, seq=seq)
        self.outbox[sandbox_id] = status
        self.stats.ended[reason.value] = self.stats.ended.get(reason.value, 0) + 1
        return status

    async def _state_quietly(self, handle: Handle) -> str:
        try:
            return (await self.runtime.state(handle)).status
        except Exception:  # noqa: BLE001
            log.exception("state of %s", handle.id)
            return "unknown"

    async def _destroy_quietly(self, handle: Any) -> None:
        try:
            await self.runtime.destroy(handle)
        except Exception:  # noqa: BLE001 - logged; the monitor loop retries via list_ids on restart
            log.exception("destroying %s failed", handle.id)

    # ---- background loops ----------------------------------------------------------------------------

    def _schedule_end(self, live: Live, reason: EndReason) -> None:
        if not live.end_scheduled and not live.ending and self._tg is not None:
            live.end_scheduled = True
            self._tg.start_soon(self._end, live.spec.id, reason)

    async def _deadline_loop(self) -> None:
        """Each expired sandbox is torn down in its own task: deadlines hold even when many expire at once."""
        while True:
            now = self.now()
            for sid, live in list(self.live.items()):
                if live.end_at <= now and not live.target.pausing:
                    log.info("sandbox %s reached its deadline", sid)
                    self._schedule_end(live, EndReason.timeout)
            await anyio.sleep(DEADLINE_TICK_S)

    async def _monitor_loop(self) -> None:
        while True:
            await anyio.sleep(MONITOR_TICK_S)
            for sid, live in list(self.live.items()):
                if live.ending or live.target.pausing:
                    continue
                try:
                    state = await self.runtime.state(live.target.handle)
                except Exception:  # noqa: BLE001
                    log.exception("state of %s", sid)
                    continue
                if state.status != "running":
                    self._schedule_end(live, EndReason.oom if state.oom_killed else EndReason.exited)

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
                with anyio.move_on_after(interval):
                    await self._wake_heartbeat.wait()
                self._wake_heartbeat = anyio.Event()
            except Exception as exc:  # noqa: BLE001 - the control plane may be down; keep trying
                log.warning("control plane unreachable: %s", exc)
                await anyio.sleep(delay)
                delay = min(delay * 2, 5.0)

    def _register_body(self) -> NodeRegister:
        s = self.settings
        return NodeRegister(name=s.name, url=s.public_url, capacity_vcpu=s.capacity_vcpu,
                            capacity_memory_mb=s.capacity_memory_mb, templates=self.refresh_templates(),
                            sandboxes=self.statuses(), version=__version__, instance=self.instance)

    async def _register(self) -> float:
        url = f"{self.settings.control_plane_url}/internal/v1/nodes/register"
        body = self._register_body()
        resp = await self._http.post(url, content=body.model_dump_json(),
                                     headers={"content-type": "application/json"})
        resp.raise_for_status()
        reg = NodeRegistered.model_validate(resp.json())
        self.node_id = reg.node_id
        self.pools.configure(reg.pools)
        for st in body.sandboxes:           # only what was sent: ends recorded meanwhile stay queued
            if st.state != SandboxState.running and self.outbox.get(st.id) == st:
                del self.outbox[st.id]
        self._registered.set()
        log.info("registered with the control plane as %s", reg.node_id)
        return reg.heartbeat_interval

    async def wait_registered(self) -> None:
        await self._registered.wait()

    async def _heartbeat(self) -> None:
        sent = dict(self.outbox)
        pool_cpu, pool_mem = self.pools.reserved()
        used_cpu = sum(lv.spec.vcpu for lv in self.live.values()) + pool_cpu
        used_mem = sum(lv.spec.memory_mb for lv in self.live.values()) + pool_mem
        hb = NodeHeartbeat(templates=self.refresh_templates(), sandboxes=self.statuses(), used_vcpu=used_cpu,
                           used_memory_mb=used_mem, pools=self.pools.statuses())
        resp = await self._http.post(f"{self.settings.control_plane_url}/internal/v1/nodes/{self.node_id}/heartbeat",
                                     content=hb.model_dump_json(), headers={"content-type": "application/json"})
        if resp.status_code == 404:
            self.node_id = None     # the control plane forgot us (new database): register again
            return
        resp.raise_for_status()
        for sid in sent:
            self.outbox.pop(sid, None)
        if resp.content:
            self.pools.configure(NodeHeartbeatReply.model_validate(resp.json()).pools)

    async def _report(self, status: NodeSandboxStatus) -> None:
        if not self.settings.control_plane_url or self.node_id is None:
            return
        try:
            resp = await self._http.post(
                f"{self.settings.control_plane_url}/internal/v1/nodes/{self.node_id}/events",
                content=NodeEvent(sandbox=status).model_dump_json(), headers={"content-type": "application/json"})
            if resp.status_code < 300:
                self.outbox.pop(status.id, None)
        except httpx.HTTPError as exc:
            log.warning("event for %s not delivered (kept for the next heartbeat): %s", status.id, exc)

    async def _flush_outbox(self) -> None:
        for status in list(self.outbox.values()):
            await self._report(status)


def _json_or_none(resp: httpx.Response) -> Any:
    try:
        return resp.json()
    except ValueError:
        return None


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


def default_capacity(cpu_overcommit: float = 64.0, memory_overcommit: float = 32.0) -> tuple[float, int]:
    """Capacity offered to the scheduler: host size times overcommit ratios (sandbox limits are caps,
    and an RL episode rarely uses all of its allowance)."""
    cpus = os.cpu_count() or 1
    with open("/proc/meminfo") as f:
        total_kb = next(int(line.split()[1]) for line in f if line.startswith("MemTotal:"))
    return cpus * cpu_overcommit, int(total_kb / 1024 * memory_overcommit)


__all__ = ["NodeAgent", "Settings", "default_capacity"]
