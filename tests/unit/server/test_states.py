"""The sandbox state machine: every edge of the table, legal and illegal."""

from __future__ import annotations

import itertools

import pytest

from pilldrops.errors import InvalidState
from pilldrops.schema.api import SandboxState as S
from pilldrops.server.domain.states import ENDED, TRANSITIONS, can_transition, check_transition

LEGAL = {
    (S.pending, S.starting), (S.pending, S.failed), (S.pending, S.stopped),
    (S.starting, S.running), (S.starting, S.failed), (S.starting, S.stopping), (S.starting, S.stopped),
    (S.starting, S.lost),
    (S.running, S.pausing), (S.running, S.stopping), (S.running, S.stopped), (S.running, S.lost),
    (S.running, S.failed),
    # pause: running -> pausing -> paused -> resuming -> running; a failed checkpoint goes back to running,
    # a failed restore back to paused (the image is intact)
    (S.pausing, S.paused), (S.pausing, S.running), (S.pausing, S.stopped), (S.pausing, S.lost),
    (S.pausing, S.failed),
    (S.paused, S.resuming), (S.paused, S.stopping), (S.paused, S.stopped), (S.paused, S.lost),
    (S.resuming, S.running), (S.resuming, S.paused), (S.resuming, S.stopped), (S.resuming, S.lost),
    (S.resuming, S.failed),
    (S.stopping, S.stopped), (S.stopping, S.lost), (S.stopping, S.failed),
    (S.lost, S.running), (S.lost, S.stopped),
}


@pytest.mark.parametrize("a,b", list(itertools.product(S, S)))
def test_every_edge(a: S, b: S) -> None:
    assert can_transition(a, b) == ((a, b) in LEGAL)
    if (a, b) in LEGAL:
        check_transition(a, b)
    else:
        with pytest.raises(InvalidState) as ei:
            check_transition(a, b)
        assert ei.value.details == {"from": a.value, "to": b.value}
        assert a.value in str(ei.value) and b.value in str(ei.value)


def test_stopped_and_failed_are_final() -> None:
    assert all(not TRANSITIONS[s] for s in (S.stopped, S.failed))
    assert ENDED == {S.stopped, S.failed, S.lost}
