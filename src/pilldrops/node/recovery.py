"""Recovery at agent start: derive the truth from the journal and the runtime's facts.

- A journaled sandbox the runtime reports running is adopted (same process, same usage clock when the
  boot is the same); a ``pausing`` one whose checkpoint did not finish still runs, so it is adopted too.
- A paused one survives as its image; a restore the crash interrupted is undone and it is paused again.
- Half-made ones (``creating``), ones whose init died meanwhile and runtime containers nobody journaled
  are destroyed; every end found is recorded for the control plane. A teardown the crash interrupted
  (journaled with its reason and the moment it began) is finished and billed up to that moment; so is one
  the agent finished but whose end the control plane never got (the entry stays until it is delivered).
- Records of a newer format than this agent reads are left alone, and so are their containers.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path

from pilldrops.node.checkpoints import RecordEnd, drop_image
from pilldrops.node.journal import Entry, Journal, boot_id
from pilldrops.node.registry import Image, Sandbox, Sandboxes
from pilldrops.node.runtime.base import Handle, Runtime, abort_restore
from pilldrops.node.states import NodeState
from pilldrops.node.template_cache import TemplateCache
from pilldrops.schema.api import EndReason
from pilldrops.schema.node import NodeSandboxSpec

log = logging.getLogger("pilldrops.node")


class Recovery:
    def __init__(self, sandboxes: Sandboxes, journal: Journal, runtime: Runtime, templates: TemplateCache, *,
                 record_end: RecordEnd, now: Callable[[], datetime]) -> None:
        self.sandboxes = sandboxes
        self.journal = journal
        self.runtime = runtime
        self.templates = templates
        self._record_end = record_end
        self.now = now

    async def run(self) -> None:
        """Adopt what is running and recorded, reap everything else (once, at start: into an empty registry)."""
        entries = self.journal.entries()
        known = set(self.journal.skipped)
        this_boot = boot_id()
        for entry in entries:
            known.add(entry.id)
            known.add(str(entry.handle.get("id") or entry.id))   # a claimed warm-pool member keeps its name
            if entry.boot_id != this_boot:
                entry.started_mono = None      # another boot: its monotonic clock says nothing here
            await self._recover(entry)
        for sid in await self.runtime.list_ids():
            if sid not in known:
                log.warning("reaping unrecorded sandbox %s", sid)
                await self._destroy_quietly(Handle(id=sid))

    async def _recover(self, entry: Entry) -> None:
        handle = entry.runtime_handle()
        spec = NodeSandboxSpec.model_validate(entry.spec)
        if entry.end_reason is not None and entry.phase in ("paused", "pausing"):
            # it ended while paused (or its pause failed with it gone): the end was not delivered yet
            drop_image(entry.checkpoint)       # (the entry stays until the control plane has the end)
            self._record_end(spec.id, EndReason(entry.end_reason), run_s=entry.run_s)
            return
        if entry.phase in ("paused", "resuming") or (entry.phase == "pausing" and not entry.handle):
            await self._recover_paused(entry, spec)
            return
        if entry.end_reason is not None:     # its teardown had begun: finish it, billed up to when it began
            await self._destroy_quietly(handle)   # (the entry stays until the control plane has the end)
            run_s = (max(0.0, entry.ended_mono - entry.started_mono)
                     if entry.started_mono is not None and entry.ended_mono is not None else None)
            self._record_end(spec.id, EndReason(entry.end_reason), run_s=run_s)
            return
        state = await self.runtime.state(handle) if entry.phase in ("running", "pausing") else None
        if state is not None and state.status == "running":
            try:
                target = self.templates.target(spec, handle)
            except Exception:  # its template is gone: cannot serve it, so reap below
                log.exception("cannot adopt %s", spec.id)
            else:
                started = datetime.fromisoformat(entry.started_at) if entry.started_at else self.now()
                mono = entry.started_mono if entry.started_mono is not None else time.monotonic()
                sb = self.sandboxes.add(Sandbox(spec, NodeState.running, started, target, mono))
                log.info("adopted sandbox %s (pid %s)", spec.id, state.pid)
                if entry.phase == "pausing":        # the checkpoint did not finish: it still runs
                    drop_image(entry.checkpoint)
                    self.journal.write(sb.journal_entry())
                return
        await self._destroy_quietly(handle)
        if entry.phase == "pausing":
            drop_image(entry.checkpoint)
        self.journal.remove(entry.id)
        reason = EndReason.failed_start if entry.phase == "creating" else (
            EndReason.oom if state and state.oom_killed else EndReason.exited)
        self._record_end(spec.id, reason, started_mono=entry.started_mono)

    async def _recover_paused(self, entry: Entry, spec: NodeSandboxSpec) -> None:
        """A paused sandbox survives a restart as its image. A restore the crash interrupted is undone (its
        half-started container destroyed), so the sandbox is simply paused again: the image was kept."""
        runtime_id = str(entry.handle.get("id") or spec.id)
        if entry.phase == "resuming" and not entry.checkpoint:
            await self._destroy_quietly(Handle(id=runtime_id))
        elif entry.phase == "resuming":    # the writable layer the restore took goes back into the image
            try:
                await abort_restore(self.runtime, Handle(id=runtime_id), Path(entry.checkpoint))
            except Exception:  # logged; an unrecorded container is reaped at the next start
                log.exception("undoing the restore of %s failed", runtime_id)
        path = Path(entry.checkpoint or "")
        if entry.checkpoint and path.is_dir() and entry.phase != "pausing":
            started = datetime.fromisoformat(entry.started_at) if entry.started_at else None
            image = Image(path, entry.run_s or 0.0, entry.checkpoint_bytes or 0, runtime_id)
            sb = self.sandboxes.add(Sandbox(spec, NodeState.paused, started, image=image))
            self.journal.write(sb.journal_entry())
            log.info("recovered paused sandbox %s", spec.id)
            return
        drop_image(entry.checkpoint)
        self.journal.remove(spec.id)
        status = self._record_end(spec.id, EndReason.exited, run_s=entry.run_s)
        status.error = "its checkpoint was lost"

    async def _destroy_quietly(self, handle: Handle) -> None:
        try:
            await self.runtime.destroy(handle)
        except Exception:  # logged; an unrecorded container is reaped at the next start
            log.exception("destroying %s failed", handle.id)
