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

import functools
import logging
import os
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
from pilldrops.node.runtime.base import Handle, Runtime, RuntimeFailure, SandboxSpec
from pilldrops.schema.api import EndReason, SandboxState, TemplateInfo
from pilldrops.schema.node import (
    NodeEvent, NodeHeartbeat, NodeRegister, NodeRegistered, NodeSandboxSpec, NodeSandboxStatus,
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

    def status(self) -> NodeSandboxStatus:
        run_s, seq = usage_point(self.started_mono)
        return NodeSandboxStatus(id=self.spec.id, state=SandboxState.running, pid=self.target.handle.pid,
                                 started_at=self.started_at, end_at=self.end_at, run_s=run_s, seq=seq)

    def journal_entry(self) -> Entry:
        return Entry(id=self.spec.id, phase="running", spec=self.spec.model_dump(mode="json"),
                     handle=vars(self.target.handle), started_at=self.started_at.isoformat(),
                     started_mono=self.started_mono, boot_id=boot_id())


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


@dataclass
class Stats:
    created: int = 0
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
        self.instance = instance_id(state_dir)
        self.now = now
        self.live: dict[str, Live] = {}
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

    # ---- lifecycle -----------------------------------------------------------------------------------

    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Recover, then enforce deadlines, watch sandboxes and talk to the control plane until cancelled."""
        await self._recover()
        async with anyio.create_task_group() as tg:
            self._tg = tg
            tg.start_soon(self._deadline_loop)
            tg.start_soon(self._monitor_loop)
            tg.start_soon(self._template_watch)
            if self.settings.control_plane_url:
                tg.start_soon(self._control_plane_loop)
            task_status.started()

    async def shutdown(self) -> None:
        """Tear down every sandbox this agent holds, unless asked to keep them (they then outlive us)."""
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
            if entry.boot_id != this_boot:
                entry.started_mono = None      # another boot: its monotonic clock says nothing here
            handle = entry.runtime_handle()
            spec = NodeSandboxSpec.model_validate(entry.spec)
            state = await self.runtime.state(handle) if entry.phase == "running" else None
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
                    continue
            await self._destroy_quietly(handle)
            self.journal.remove(entry.id)
            reason = EndReason.failed_start if entry.phase == "creating" else (
                EndReason.oom if state and state.oom_killed else EndReason.exited)
            self._record_end(spec.id, reason, started_mono=entry.started_mono)
        for sid in await self.runtime.list_ids():
            if sid not in known:
                log.warning("reaping unrecorded sandbox %s", sid)
                await self._destroy_quietly(Handle(id=sid))

    def _target(self, spec: NodeSandboxSpec, handle: Any) -> Target:
        tpl = self._template(spec.template)
        return Target(id=spec.id, handle=handle, env={**dict(tpl.env), **spec.envs}, workdir=tpl.workdir or "/")

    # ---- operations the control plane asks for ------------------------------------------------------

    async def create(self, spec: NodeSandboxSpec) -> NodeSandboxStatus:
        if spec.id in self.live:
            return self.live[spec.id].status()           # a retried create: the same sandbox
        try:
            tpl = self._template(spec.template)
        except Exception as exc:  # noqa: BLE001 - template stores raise their own errors
            raise errors.TemplateNotFound(f"template {spec.template!r} is not built on node "
                                          f"{self.settings.name}: {exc}") from exc
        rt_spec = SandboxSpec(id=spec.id, layers=tuple(Path(p) for p in tpl.layers), vcpu=spec.vcpu,
                              memory_mb=spec.memory_mb, pids_limit=PIDS_LIMIT,
                              envs={**dict(tpl.env), **spec.envs}, workdir=tpl.workdir or "/",
                              hostname=spec.id.replace("_", "-"))
        if spec.timeout_s is not None:     # the deadline on this node's own clock, whatever the skew
            spec = spec.model_copy(update={"end_at": self.now() + timedelta(seconds=spec.timeout_s)})
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
        live = Live(spec, self._target(spec, handle), self.now(), spec.end_at, time.monotonic())
        self.journal.write(live.journal_entry())
        self.live[spec.id] = live
        self.stats.created += 1
        return live.status()

    def get(self, sandbox_id: str) -> Live:
        live = self.live.get(sandbox_id)
        if live is None or live.ending:
            raise errors.SandboxNotFound(f"sandbox {sandbox_id!r} is not running on this node")
        return live

    async def kill(self, sandbox_id: str) -> NodeSandboxStatus:
        if sandbox_id not in self.live:
            if sandbox_id in self.outbox:
                return self.outbox[sandbox_id]
            raise errors.SandboxNotFound(f"sandbox {sandbox_id!r} is not on this node")
        return await self._end(sandbox_id, EndReason.killed, report=False)

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
        return [lv.status() for lv in self.live.values()] + starting + list(self.outbox.values())

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
        if live is None or live.ending:
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
                    started_mono: float | None = None) -> NodeSandboxStatus:
        """The final status, with the final usage point (kept in the outbox until the control plane has it)."""
        state = SandboxState.failed if reason == EndReason.failed_start else SandboxState.stopped
        run_s, seq = usage_point(started_mono) if started_mono is not None else (None, None)
        status = NodeSandboxStatus(id=sandbox_id, state=state, end_reason=reason, started_at=started_at,
                                   ended_at=self.now(), run_s=run_s, seq=seq)
        self.outbox[sandbox_id] = status
        self.stats.ended[reason.value] = self.stats.ended.get(reason.value, 0) + 1
        return status

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
                if live.end_at <= now:
                    log.info("sandbox %s reached its deadline", sid)
                    self._schedule_end(live, EndReason.timeout)
            await anyio.sleep(DEADLINE_TICK_S)

    async def _monitor_loop(self) -> None:
        while True:
            await anyio.sleep(MONITOR_TICK_S)
            for sid, live in list(self.live.items()):
                if live.ending:
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
        used_cpu = sum(lv.spec.vcpu for lv in self.live.values())
        used_mem = sum(lv.spec.memory_mb for lv in self.live.values())
        hb = NodeHeartbeat(templates=self.refresh_templates(), sandboxes=self.statuses(), used_vcpu=used_cpu,
                           used_memory_mb=used_mem)
        resp = await self._http.post(f"{self.settings.control_plane_url}/internal/v1/nodes/{self.node_id}/heartbeat",
                                     content=hb.model_dump_json(), headers={"content-type": "application/json"})
        if resp.status_code == 404:
            self.node_id = None     # the control plane forgot us (new database): register again
            return
        resp.raise_for_status()
        for sid in sent:
            self.outbox.pop(sid, None)

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
