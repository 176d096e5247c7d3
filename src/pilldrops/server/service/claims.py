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
- the member was retired (template rebuilt, pool shrunk) between a heartbeat and the claim: the node no
  longer holds the grant, so the tell is an ordinary create of that id: another ready member of the shape,
  or a cold create, billed from the claim all the same (``claimed_s``), as the record's ``started_at`` says.
- the member does not fit the create (its ``disk_mb``, which the grant carries, is not the create's:
  ``serve --default-disk-mb`` and ``node --default-disk-mb`` differ, say): it is never popped for it (the
  regular path creates it). A hand-over the node still refuses (another template build, say) ends the
  record ``failed`` at once, billed nothing (the client sees it ended); the grant is ``discard``ed here for
  good and the node retires the member (never left reported, which only its grant may claim).
- a grant whose id has a record already (``insert_claimed`` returns None: another control plane won it, or
  an earlier claim of it ended) is ``discard``ed for good, never tried again. A claim whose record ends
  before its node was told (killed, timed out while the tell's outcome was unknown) has its kill reach the
  node, which retires the member; should it not, the node's next heartbeat still lists the grant, and the
  reconciler stops it there (the node retires it) and discards the grant.
- two control planes (PostgreSQL) pop the same grant: the grant id is the row's primary key, so exactly one
  insert wins; the other gets None, discards it and takes the next grant (or the regular create path).

Several control planes: grants live only in the process that receives a node's heartbeats (this index is
in memory, not in the store). Behind a load balancer a node's heartbeats reach one control plane at a time,
so a create that reaches another one finds no grant of that node and takes the regular path (placed by the
store). There the node hands it only a member it has not reported yet, and every ready member is reported
at once, so such a create is mostly a cold create (a pool miss). With N control planes receiving creates
evenly, about 1/N of the pooled creates are answered from memory (warm); the rest are cold, and the
reported members wait for a create that reaches the control plane holding their grants. Until grants are
shared (in the store) or an anonymous claim may take a reported member, run one control plane per fleet,
or point the nodes and the pooled creates at the same one, for the full hit rate.
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
        self._dead: set[str] = set()              # grants never to offer again (kept while a node lists them)
        self._stopped: set[str] = set()           # dead grants whose node was asked to retire the member

    def update(self, node_id: str, pools: list[NodePoolStatus]) -> None:
        now = self._clock()
        self._used = {g: t for g, t in self._used.items() if now - t < USED_TTL_S}
        self._listed[node_id] = {g.id for p in pools for g in p.grants}
        self._dead = {g for g in self._dead if any(g in ids for ids in self._listed.values())}
        self._stopped &= self._dead
        self._by_node[node_id] = {
            shape(p.template, p.vcpu, p.memory_mb): deque(
                g for g in p.grants if g.id not in self._used and g.id not in self._dead)
            for p in pools if p.grants}

    def discard(self, grant_id: str) -> None:
        """A grant that can never be claimed (its id has a record already: another control plane claimed
        it, or an earlier claim of it ended; or its node refused the hand-over): never offered again."""
        self._dead.add(grant_id)
        for shapes in self._by_node.values():
            for grants in shapes.values():
                for g in [g for g in grants if g.id == grant_id]:
                    grants.remove(g)

    def listed_popped(self, node_id: str) -> list[str]:
        """The grants ``node_id``'s last heartbeat listed that this process popped or discarded: claims its
        node may not have been told of (or whose record ended first)."""
        return [g for g in self._listed.get(node_id, ())
                if (g in self._used or g in self._dead) and g not in self._stopped]

    def stopped(self, grant_id: str) -> None:
        """``grant_id`` is dead and its node was asked to retire the member (once: an older node ignores it)."""
        self.discard(grant_id)
        self._stopped.add(grant_id)

    def popped(self, grant_id: str) -> bool:
        """Whether this process popped ``grant_id`` (recently) or discarded it."""
        return grant_id in self._used or grant_id in self._dead

    def drop_node(self, node_id: str) -> None:
        self._by_node.pop(node_id, None)
        self._listed.pop(node_id, None)

    def listed(self, node_id: str, grant_id: str) -> bool:
        """Whether ``node_id``'s last heartbeat listed ``grant_id`` (its member was still unclaimed then)."""
        return grant_id in self._listed.get(node_id, ())

    def pop(self, template: str, vcpu: float, memory_mb: int, version: str | None,
            usable: Callable[[str], bool],
            fits: Callable[[str, NodeGrant], bool] = lambda node_id, g: True) -> tuple[str, NodeGrant] | None:
        """A grant of this shape (of template-store ``version``, when not None) on a node ``usable`` accepts,
        that ``fits`` the create (its member's disk); never the same one twice from this process."""
        key = shape(template, vcpu, memory_mb)
        for node_id, shapes in self._by_node.items():
            grants = shapes.get(key)
            if not grants or not usable(node_id):
                continue
            for _ in range(len(grants)):
                g = grants.popleft()
                if (version is not None and g.template_version != version) or not fits(node_id, g):
                    grants.append(g)            # another build or disk: it may be right for another create
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
