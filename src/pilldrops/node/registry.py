"""The sandboxes this node holds: one record per sandbox, each in exactly one ``NodeState``.

A record carries what its state needs: a running one its ``Target`` (runtime handle, env, commands in
flight) and its usage clock; a paused one its ``Image`` on this node's disk. The record renders its own
status for the control plane and its own journal entry; state changes go through ``Sandboxes.move``, which
checks them against ``states.TRANSITIONS``.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import anyio

from pilldrops.node.dataplane import Target
from pilldrops.node.isolation import diskquota
from pilldrops.node.journal import HANDLE_FORMAT_VERSION, Entry, boot_id, handle_record
from pilldrops.node.runtime.base import Handle
from pilldrops.node.states import HAS_TARGET, INITIAL, REPORTED, NodeState, check_transition
from pilldrops.schema.api import SandboxState
from pilldrops.schema.node import NodeSandboxSpec, NodeSandboxStatus


def usage_point(started_mono: float, until: float | None = None) -> tuple[float, int]:
    """Cumulative running seconds on the monotonic clock (up to now, or to ``until``: the start of its
    teardown), and the report sequence derived from it (milliseconds), which only grows, even across agent
    restarts."""
    run_s = max(0.0, (time.monotonic() if until is None else until) - started_mono)
    return run_s, int(run_s * 1000)


@dataclass
class Image:
    """A sandbox's checkpoint on this node's disk (while it is paused, or being paused or resumed)."""

    path: Path
    run_s: float                  # running seconds at the checkpoint (usage continues from here)
    size: int = 0
    runtime_id: str = ""          # the container's name in the image (a claimed pool member keeps its own)
    timeout_left: float | None = None   # its deadline's time left at the moment it was paused (node clock)


def disk_used(handle: Handle) -> int | None:
    """Bytes in the sandbox's writable layer when it has a disk of its own (one statfs; None otherwise)."""
    if not handle.bundle:
        return None
    u = diskquota.usage(Path(handle.bundle))
    return u.used_bytes if u is not None else None


@dataclass
class Sandbox:
    spec: NodeSandboxSpec
    state: NodeState
    started_at: datetime | None = None
    target: Target | None = None          # creating: none yet; running/pausing/ending: the runtime's sandbox
    started_mono: float | None = None     # with a target: CLOCK_MONOTONIC its usage counts from
    image: Image | None = None            # pausing (being written), paused, resuming (once fetched)
    end_reason: str | None = None         # ending: why, and CLOCK_MONOTONIC when its teardown began
    ended_mono: float | None = None
    _op: anyio.Lock | None = field(default=None, repr=False, compare=False)

    @property
    def op(self) -> anyio.Lock:
        """Pause and end of one sandbox never interleave. Made on first use: most sandboxes never pause,
        and a lock each (its waiter deque) was ~0.75 KiB of the agent's memory per live sandbox."""
        if self._op is None:
            self._op = anyio.Lock()
        return self._op

    @property
    def id(self) -> str:
        return self.spec.id

    @property
    def end_at(self) -> datetime:
        return self.spec.end_at

    @property
    def runtime_id(self) -> str:
        """The runtime's name for it (a claimed warm-pool member keeps its own)."""
        if self.target is not None:
            return self.target.handle.id
        return (self.image.runtime_id if self.image else "") or self.spec.id

    def status(self) -> NodeSandboxStatus:
        state = REPORTED[self.state]
        if self.state in HAS_TARGET:
            assert self.target is not None and self.started_mono is not None
            # an ending sandbox's usage stopped when its teardown began: a heartbeat during the teardown
            # must not bill past the end its final report will carry
            until = self.ended_mono if self.state is NodeState.ending else None
            run_s, seq = usage_point(self.started_mono, until)
            return NodeSandboxStatus(id=self.id, state=state, pid=self.target.handle.pid,
                                     started_at=self.started_at, end_at=self.end_at, run_s=run_s, seq=seq,
                                     disk_used_bytes=disk_used(self.target.handle))
        if self.state is NodeState.paused and self.image is not None:
            img = self.image
            return NodeSandboxStatus(id=self.id, state=SandboxState.paused, started_at=self.started_at,
                                     run_s=img.run_s, seq=int(img.run_s * 1000), checkpoint_bytes=img.size,
                                     timeout_left=img.timeout_left)
        return NodeSandboxStatus(id=self.id, state=state)

    def journal_entry(self) -> Entry:
        """What a restarted agent needs to find this sandbox again (see ``recovery``)."""
        spec = self.spec.model_dump(mode="json")
        if self.state is NodeState.creating:
            return Entry(id=self.id, phase="creating", spec=spec)
        if self.state in (NodeState.running, NodeState.pausing, NodeState.ending):
            assert self.target is not None
            entry = Entry(id=self.id, phase="running", spec=spec, handle=handle_record(self.target.handle),
                          started_at=self.started_at.isoformat() if self.started_at else None,
                          started_mono=self.started_mono, boot_id=boot_id())
            if self.state is NodeState.ending:
                entry.end_reason, entry.ended_mono = self.end_reason, self.ended_mono
            if self.state is NodeState.pausing and self.image is not None:
                entry.phase, entry.checkpoint, entry.run_s = "pausing", str(self.image.path), self.image.run_s
            return entry
        if self.state in (NodeState.paused, NodeState.resuming) and self.image is not None:
            img = self.image
            return Entry(id=self.id, phase=self.state.value, spec=spec,  # type: ignore[arg-type]
                         handle={"id": img.runtime_id or self.id, "version": HANDLE_FORMAT_VERSION},
                         started_at=self.started_at.isoformat() if self.started_at else None, run_s=img.run_s,
                         checkpoint=str(img.path), checkpoint_bytes=img.size, boot_id=boot_id())
        raise ValueError(f"sandbox {self.id} in state {self.state.value} has no journal entry")


class Sandboxes:
    """The registry: every sandbox on this node by id, and the only place their states change."""

    def __init__(self) -> None:
        self._by_id: dict[str, Sandbox] = {}

    def add(self, sb: Sandbox) -> Sandbox:
        if sb.state not in INITIAL:
            raise ValueError(f"a sandbox cannot enter the registry {sb.state.value}")
        if sb.id in self._by_id:
            raise ValueError(f"sandbox {sb.id} is already on this node ({self._by_id[sb.id].state.value})")
        self._by_id[sb.id] = sb
        return sb

    def move(self, sb: Sandbox, to: NodeState) -> None:
        """Change a record's state (``gone`` takes it out of the registry)."""
        check_transition(sb.state, to)
        sb.state = to
        if to is NodeState.gone and self._by_id.get(sb.id) is sb:
            del self._by_id[sb.id]

    def get(self, sandbox_id: str) -> Sandbox | None:
        return self._by_id.get(sandbox_id)

    def state_of(self, sandbox_id: str) -> NodeState:
        sb = self._by_id.get(sandbox_id)
        return sb.state if sb is not None else NodeState.gone

    def is_current(self, sb: Sandbox, *states: NodeState) -> bool:
        """``sb`` is still this id's record and in one of ``states``."""
        return self._by_id.get(sb.id) is sb and sb.state in states

    def in_states(self, *states: NodeState) -> list[Sandbox]:
        return [sb for sb in self._by_id.values() if sb.state in states]

    def __iter__(self) -> Iterator[Sandbox]:
        return iter(list(self._by_id.values()))

    def __len__(self) -> int:
        return len(self._by_id)

    def statuses(self) -> list[NodeSandboxStatus]:
        return [sb.status() for sb in self._by_id.values()]
