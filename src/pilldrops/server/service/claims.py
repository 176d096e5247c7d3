"""Warm claims answered from memory (issue 15): the ready pool members the nodes pre-issued (``NodeGrant``:
sandbox id, access token, template version; sent with each heartbeat, at once when a member becomes ready),
kept per shape by the process that receives the heartbeats.

A create of a pooled shape pops one and records it with ONE store write (``Store.insert_claimed``: the row,
already ``running`` since now, with its team, labels and deadline); the answer goes out, then the node is
told (a create with the grant's id: it hands the member over and enforces the timeout from then). A create
with egress waits for the node (its network is attached at the claim) before it answers.

Failure analysis (what keeps "an answered create is in the store" and exact billing):

- control plane SIGKILLed before the insert: nothing happened; the grant is still the node's.
- after the insert, before the answer: the row is recorded; the client's retry with its idempotency key
  replays it (it is running); the node is told by the next heartbeat (below).
- after the answer, before the node was told: the row is recorded; requests for the sandbox wait on the
  node (``GRANT_WAIT_S``); the node's next heartbeat still lists the grant, and ``Reconciler.reconcile_node``
  tells the node then (``resync``), with the deadline left from the record's ``end_at``.
- billing: ``started_at`` is the claim, and the node's running seconds count from the claim too, however
  late it is told (the tell carries ``claimed_s``, the claim's age when it is sent: this process's
  monotonic clock, or for a resync the wall clock since ``started_at``; the node never counts from before
  the member became ready, so its pool time is never billed). Before, the node counted from the hand-over,
  which comes after the answer: the live view (wall time since the claim) billed the gap and the final bill
  dropped it (``test_a_claim_is_billed_from_the_claim_however_late_its_node_is_told``). The create request's
  own transit to the node (milliseconds) is the only time not counted.
- node agent restarted before it was told: its unclaimed members are reaped, the grant is gone; the
  record is then a running sandbox its node no longer has: ``lost`` after the usual grace period, billed
  nothing (no running seconds were reported).
- the member was retired (template rebuilt, pool shrunk) between a heartbeat and the claim: the node refuses
  the hand-over; the record is ended ``failed`` at once, billed nothing (the client sees it ended).
- two control planes (PostgreSQL) pop the same grant: the grant id is the row's primary key, so exactly one
  insert wins; the other gets None and takes the next grant (or the regular create path).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable

from pilldrops.schema.node import NodeGrant, NodePoolStatus

log = logging.getLogger("pilldrops.claims")
Shape = tuple[str, float, int]
USED_TTL_S = 120.0       # a grant popped here is never offered again by a heartbeat composed before its claim


def shape(template: str, vcpu: float, memory_mb: int) -> Shape:
    return (template, round(float(vcpu), 3), int(memory_mb))


class GrantIndex:
    """Grants per shape, each with its node: replaced wholesale by each heartbeat of that node."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._by_node: dict[str, dict[Shape, deque[NodeGrant]]] = {}
        self._used: dict[str, float] = {}         # grant id -> when it was popped here
        self._listed: dict[str, set[str]] = {}    # node id -> every grant its last heartbeat listed

    def update(self, node_id: str, pools: list[NodePoolStatus]) -> None:
        now = self._clock()
        self._used = {g: t for g, t in self._used.items() if now - t < USED_TTL_S}
        self._listed[node_id] = {g.id for p in pools for g in p.grants}
        self._by_node[node_id] = {
            shape(p.template, p.vcpu, p.memory_mb): deque(g for g in p.grants if g.id not in self._used)
            for p in pools if p.grants}

    def drop_node(self, node_id: str) -> None:
        self._by_node.pop(node_id, None)
        self._listed.pop(node_id, None)

    def listed(self, node_id: str, grant_id: str) -> bool:
        """Whether ``node_id``'s last heartbeat listed ``grant_id`` (its member was still unclaimed then)."""
        return grant_id in self._listed.get(node_id, ())

    def pop(self, template: str, vcpu: float, memory_mb: int, version: str | None,
            usable: Callable[[str], bool]) -> tuple[str, NodeGrant] | None:
        """A grant of this shape (of template-store ``version``, when not None) on a node ``usable`` accepts;
        never the same one twice from this process."""
        key = shape(template, vcpu, memory_mb)
        for node_id, shapes in self._by_node.items():
            grants = shapes.get(key)
            if not grants or not usable(node_id):
                continue
            for _ in range(len(grants)):
                g = grants.popleft()
                if version is not None and g.template_version != version:
                    grants.append(g)            # another build: it may be right for another create
                    continue
                self._used[g.id] = self._clock()
                return node_id, g
        return None

    def give_back(self, node_id: str, grant: NodeGrant, template: str, vcpu: float, memory_mb: int) -> None:
        """A grant popped but not used (the create replayed an earlier one instead): offered again."""
        self._used.pop(grant.id, None)
        self._by_node.setdefault(node_id, {}).setdefault(shape(template, vcpu, memory_mb), deque()).appendleft(grant)

    def size(self) -> int:
        return sum(len(g) for shapes in self._by_node.values() for g in shapes.values())
