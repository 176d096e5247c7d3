"""The sandbox state machine, in one table. An illegal transition is ``InvalidState`` naming both states."""

from __future__ import annotations

from pilldrops.errors import InvalidState
from pilldrops.schema.api import SandboxState as S

TRANSITIONS: dict[S, frozenset[S]] = {
    S.pending: frozenset({S.starting, S.failed, S.stopped}),
    S.starting: frozenset({S.running, S.failed, S.stopping, S.stopped, S.lost}),
    S.running: frozenset({S.pausing, S.stopping, S.stopped, S.lost, S.failed}),
    S.pausing: frozenset({S.paused, S.running, S.stopped, S.lost, S.failed}),   # running: the checkpoint failed
    S.paused: frozenset({S.resuming, S.stopping, S.stopped, S.lost}),
    S.resuming: frozenset({S.running, S.paused, S.stopped, S.lost, S.failed}),  # paused: the restore failed
    S.stopping: frozenset({S.stopped, S.lost, S.failed}),
    S.stopped: frozenset(),
    S.failed: frozenset(),
    S.lost: frozenset({S.running, S.stopped}),   # a lost node came back: reconciled, not doubled
}

ENDED: frozenset[S] = frozenset({S.stopped, S.failed, S.lost})
LIVE: frozenset[S] = frozenset({S.pending, S.starting, S.running, S.pausing, S.paused, S.resuming, S.stopping})
# states that hold a node's CPU and memory (a paused sandbox is only a checkpoint on disk)
HOLDING: frozenset[S] = LIVE - {S.paused}


def can_transition(current: S, target: S) -> bool:
    return target in TRANSITIONS[current]


def check_transition(current: S, target: S) -> None:
    if not can_transition(current, target):
        raise InvalidState(current=current.value, target=target.value)
