"""The node's runtimes, one per isolation mode (issue 11): ``container`` (crun), ``gvisor`` (runsc),
``microvm`` (QEMU).

At agent start every mode's driver module is imported lazily and its ``probe()`` asked whether the mode can
run on this host; a driver is built only for the modes that can. ``RuntimeRegistry`` is itself a
``base.Runtime``, so the agent keeps calling ``create``/``exec``/``state``/... on one object:

- ``create(spec)`` / ``restore(spec, image)`` go to ``spec.isolation``; the handle they return is stamped
  ``handle.extra["isolation"] = mode``;
- every later call with a handle goes to ``handle.extra["isolation"]`` ("container" when absent: handles
  journaled before isolation modes existed). The agent journals handles, so a restarted agent re-adopts each
  sandbox through the runtime that made it.

A driver module provides ``probe() -> Probe`` (quick, never raises, leaves nothing behind) and a class built as
``Cls(state_dir, *, name=...)`` implementing ``base.Runtime`` plus ``async close()``. ``container`` keeps the
node's own state dir (the layout from before this registry); the other modes get ``<state>/runtimes/<mode>``
and the instance name ``<name>-<mode>``. The interface is written down for driver authors in
``docs/isolation.md``.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import AsyncIterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pilldrops.node.runtime.base import (
    ExecProcess,
    Handle,
    Runtime,
    RuntimeFailure,
    RuntimeState,
    SandboxSpec,
)
from pilldrops.node.runtime.base import abort_restore as base_abort_restore
from pilldrops.node.runtime.base import kept_layer as base_kept_layer
from pilldrops.schema.api import DEFAULT_ISOLATION, ISOLATION_MODES, IsolationSupport

log = logging.getLogger(__name__)

DRIVERS: dict[str, str] = {
    "container": "pilldrops.node.runtime.crun:CrunRuntime",
    "gvisor": "pilldrops.node.runtime.gvisor:GvisorRuntime",
    "microvm": "pilldrops.node.runtime.qemu:QemuRuntime",
}
ISOLATION_KEY = "isolation"


@dataclass(frozen=True)
class Probe:
    """Whether this host can run a mode. ``reason`` (when not) is short and user-facing, e.g.
    "qemu-system-x86_64 not installed"; ``detail`` (when it can) e.g. "tcg", "kvm", "ptrace"."""

    available: bool
    reason: str = ""
    detail: str = ""

    def support(self) -> IsolationSupport:
        return IsolationSupport(available=self.available, reason=self.reason, detail=self.detail)


def _module(mode: str) -> tuple[Any, str]:
    """The driver module of ``mode`` and its class name; ``(None, why)`` when the module is not there."""
    modname, _, clsname = DRIVERS[mode].partition(":")
    try:
        return importlib.import_module(modname), clsname
    except ModuleNotFoundError as e:
        if e.name == modname:
            return None, "runtime not installed"
        return None, f"runtime cannot load: {e}"
    except Exception as e:  # noqa: BLE001 - a broken driver makes only its mode unavailable
        return None, f"runtime cannot load: {e}"


def probe(mode: str) -> Probe:
    mod, why = _module(mode)
    if mod is None:
        return Probe(False, why)
    fn = getattr(mod, "probe", None)
    if fn is None:
        return Probe(False, "runtime has no probe()")
    try:
        result = fn()
    except Exception as e:  # noqa: BLE001 - a probe must not take the agent down
        return Probe(False, f"probe failed: {e}")
    return result if isinstance(result, Probe) else Probe(False, f"probe returned {result!r}")


def mode_of(handle: Handle) -> str:
    return handle.extra.get(ISOLATION_KEY) or DEFAULT_ISOLATION


class RuntimeRegistry:
    """mode → runtime instance, built from what the probes found; a ``base.Runtime`` dispatching on mode."""

    name = "registry"

    def __init__(self, runtimes: dict[str, Runtime], probes: dict[str, Probe]) -> None:
        self.runtimes = dict(runtimes)
        self.probes = {m: probes.get(m) or Probe(m in runtimes, "" if m in runtimes else "not probed")
                       for m in ISOLATION_MODES}
        self._owner: dict[str, str] = {}     # sandbox id -> mode, for ids without a stamped handle

    @classmethod
    def build(cls, state_dir: Path, *, name: str, modes: tuple[str, ...] | None = None) -> RuntimeRegistry:
        """Probe each mode (all by default) and build a runtime for each available one."""
        state_dir = Path(state_dir)
        runtimes: dict[str, Runtime] = {}
        probes: dict[str, Probe] = {}
        for mode in ISOLATION_MODES:
            if modes is not None and mode not in modes:
                probes[mode] = Probe(False, "disabled on this node")
                continue
            p = probe(mode)
            if p.available:
                mod, clsname = _module(mode)
                try:
                    if mode == DEFAULT_ISOLATION:
                        rt = getattr(mod, clsname)(state_dir, name=name)
                    else:
                        sub = state_dir / "runtimes" / mode
                        sub.mkdir(parents=True, exist_ok=True)
                        rt = getattr(mod, clsname)(sub, name=f"{name}-{mode}")
                except Exception as e:
                    if mode == DEFAULT_ISOLATION:
                        raise
                    log.warning("isolation %s unavailable: %s", mode, e)
                    p = Probe(False, f"runtime failed to start: {e}")
                else:
                    runtimes[mode] = rt
            probes[mode] = p
            log.info("isolation %s: %s", mode, f"yes ({p.detail})" if p.available else f"no ({p.reason})")
        return cls(runtimes, probes)

    # -- what this node offers ---------------------------------------------------------------------
    def modes(self) -> list[str]:
        return [m for m in ISOLATION_MODES if m in self.runtimes]

    def support(self) -> dict[str, IsolationSupport]:
        return {m: p.support() for m, p in self.probes.items()}

    def get(self, mode: str) -> Runtime:
        rt = self.runtimes.get(mode)
        if rt is None:
            p = self.probes.get(mode)
            why = p.reason if p else f"unknown mode (valid: {', '.join(ISOLATION_MODES)})"
            raise RuntimeFailure(f"isolation {mode!r} is not available on this node", detail=why)
        return rt

    def _for(self, handle: Handle) -> Runtime:
        mode = handle.extra.get(ISOLATION_KEY) or self._owner.get(handle.id) or DEFAULT_ISOLATION
        return self.get(mode)

    def _stamp(self, handle: Handle, mode: str) -> Handle:
        handle.extra[ISOLATION_KEY] = mode
        self._owner[handle.id] = mode
        return handle

    # -- Runtime --------------------------------------------------------------------------------------
    async def create(self, spec: SandboxSpec) -> Handle:
        return self._stamp(await self.get(spec.isolation).create(spec), spec.isolation)

    async def exec(self, handle: Handle, argv: list[str], *, env: dict[str, str], cwd: str | None,
                   stdin: AsyncIterable[bytes] | bytes | None = None, timeout: float | None = None,
                   output_cap: int | None = None, **extra: Any) -> ExecProcess:
        """``extra``: optional driver keywords, e.g. ``pty=(rows, cols)`` (crun), forwarded as given."""
        return await self._for(handle).exec(handle, argv, env=env, cwd=cwd, stdin=stdin, timeout=timeout,
                                            output_cap=output_cap, **extra)

    async def state(self, handle: Handle) -> RuntimeState:
        return await self._for(handle).state(handle)

    def running_by_pid(self, handle: Handle) -> bool:
        return self._for(handle).running_by_pid(handle)

    async def destroy(self, handle: Handle) -> None:
        mode = handle.extra.get(ISOLATION_KEY) or self._owner.get(handle.id)
        if mode is not None or len(self.runtimes) == 1:
            await self._for(handle).destroy(handle)
        else:       # an id nobody recorded (a reaped leftover): every runtime's destroy is idempotent
            for rt in self.runtimes.values():
                await rt.destroy(Handle(id=handle.id))
        self._owner.pop(handle.id, None)

    def _owners(self, handle: Handle) -> list[Runtime]:
        """The runtime of ``handle``; every one for an id nobody recorded (e.g. during recovery, before
        ``list_ids``): a restore's undo and a kept layer's look-up are harmless in the others."""
        mode = handle.extra.get(ISOLATION_KEY) or self._owner.get(handle.id)
        if mode is not None or len(self.runtimes) == 1:
            return [self._for(handle)]
        return list(self.runtimes.values())

    def kept_layer(self, sandbox_id: str) -> Path | None:
        try:
            runtimes = self._owners(Handle(id=sandbox_id))
        except RuntimeFailure:       # its isolation is not available here (any more): nothing of it is kept
            return None
        return next((p for rt in runtimes if (p := base_kept_layer(rt, sandbox_id)) is not None), None)

    async def abort_restore(self, handle: Handle, image_dir: Path) -> None:
        for rt in self._owners(handle):
            await base_abort_restore(rt, handle, image_dir)
        self._owner.pop(handle.id, None)

    def oom_kills(self, handle: Handle) -> int | None:
        fn = getattr(self._for(handle), "oom_kills", None)
        return fn(handle) if fn is not None else None

    async def list_ids(self) -> list[str]:
        ids: set[str] = set()
        for mode, rt in self.runtimes.items():
            for sid in await rt.list_ids():
                self._owner.setdefault(sid, mode)
                ids.add(sid)
        return sorted(ids)

    def checkpoint_unsupported(self, mode: str = DEFAULT_ISOLATION) -> str | None:
        rt = self.runtimes.get(mode)
        if rt is None:
            return f"isolation {mode!r} is not available on this node"
        return rt.checkpoint_unsupported()

    async def checkpoint(self, handle: Handle, image_dir: Path) -> int:
        return await self._for(handle).checkpoint(handle, image_dir)

    async def restore(self, spec: SandboxSpec, image_dir: Path) -> Handle:
        return self._stamp(await self.get(spec.isolation).restore(spec, image_dir), spec.isolation)

    async def close(self) -> None:
        for rt in self.runtimes.values():
            close = getattr(rt, "close", None)
            if close is not None:
                await close()


def checkpoint_unsupported(runtime: Runtime, mode: str) -> str | None:
    """Why ``mode``'s sandboxes cannot be paused on ``runtime`` (a registry or a single driver)."""
    if isinstance(runtime, RuntimeRegistry):
        return runtime.checkpoint_unsupported(mode)
    return runtime.checkpoint_unsupported()


def disk_refusal(runtime: Runtime, spec: SandboxSpec) -> str | None:
    """Why ``spec.disk_mb`` cannot be enforced by the driver that would run ``spec`` (None: it can)."""
    rt: Any = runtime.runtimes.get(spec.isolation) if isinstance(runtime, RuntimeRegistry) else runtime
    hook = getattr(rt, "disk_refusal", None)
    return hook(spec) if hook is not None else None


def support_of(runtime: Runtime) -> dict[str, IsolationSupport]:
    """What a node running ``runtime`` offers: a registry's probes; a single driver runs containers only."""
    if isinstance(runtime, RuntimeRegistry):
        return runtime.support()
    return {DEFAULT_ISOLATION: IsolationSupport(available=True, detail=runtime.name)}
