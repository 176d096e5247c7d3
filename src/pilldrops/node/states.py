"""A sandbox's state on this node, in one table (the node's side of ``server/domain/states.py``).

Every sandbox the agent holds is one record in ``registry.Sandboxes`` with exactly one of these states;
a change of state goes through ``check_transition``. ``gone`` is where a record ends: it left this node
(ended, failed to start, or its checkpoint moved to another node) and is no longer in the registry.
"""

from __future__ import annotations

import enum

from pilldrops.errors import InvalidState
from pilldrops.schema.api import SandboxState


class NodeState(enum.Enum):
    creating = "creating"      # the runtime is creating it (journaled as intent)
    running = "running"        # its init runs; commands may run in it
    pausing = "pausing"        # commands ended, the runtime is checkpointing it
    paused = "paused"          # no process, no cgroup: its checkpoint image is on this node's disk
    resuming = "resuming"      # its image is being fetched or restored
    ending = "ending"          # the runtime is destroying it
    gone = "gone"              # no longer on this node (not kept in the registry)


S = NodeState
TRANSITIONS: dict[NodeState, frozenset[NodeState]] = {
    S.creating: frozenset({S.running, S.gone}),                  # gone: the create failed
    S.running: frozenset({S.pausing, S.ending}),
    S.pausing: frozenset({S.paused, S.running, S.gone}),      # running: the checkpoint failed, it runs on
    S.paused: frozenset({S.resuming, S.gone}),                   # gone: ended while paused, or moved away
    S.resuming: frozenset({S.running, S.paused, S.gone}),     # paused: the restore failed (image kept)
    S.ending: frozenset({S.gone}),
    S.gone: frozenset(),
}
# the states a record may enter the registry in: a create or a resume starting here, or what recovery adopts
INITIAL: frozenset[NodeState] = frozenset({S.creating, S.resuming, S.running, S.paused})
# states with a runtime sandbox (a ``Target``) behind them
HAS_TARGET: frozenset[NodeState] = frozenset({S.running, S.pausing, S.ending})
# what the control plane is told for each state (an ending sandbox still counts as running until its end
# is reported with its final usage point)
REPORTED: dict[NodeState, SandboxState] = {
    S.creating: SandboxState.starting, S.running: SandboxState.running, S.pausing: SandboxState.pausing,
    S.paused: SandboxState.paused, S.resuming: SandboxState.resuming, S.ending: SandboxState.running,
}


def can_transition(current: NodeState, target: NodeState) -> bool:
    return target in TRANSITIONS[current]


def check_transition(current: NodeState, target: NodeState) -> None:
    if not can_transition(current, target):
        raise InvalidState(f"a sandbox on this node cannot go from {current.value} to {target.value}",
                           current=current.value, target=target.value)
