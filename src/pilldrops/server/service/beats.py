"""Delta heartbeats on the control plane's side (issue 15): what each node last told this process it reports,
and the ids this process told or killed a moment ago.

A node's full beat sets its view here (the ids it reports, their XOR digest). A delta beat names the epoch
(this process) that acked its baseline; with its ids added and its ``gone`` removed, the view must have the
node's count and digest, else the delta is refused (``full``: the node sends a full beat at once). Every
``full_every``-th delta is refused too, so a full reconcile runs at least that often per node (the safety net
for whatever changed in the store without this process telling the node: another control plane, a tell or a
kill that failed). A restarted control plane has a new epoch and no views: every node's first delta to it is
refused. An older node's beats carry no digest and are always full.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import datetime

from pilldrops.schema.node import NodeHeartbeat, id_hash, live_digest

FULL_EVERY = 12     # deltas of a node between two full beats (12 × 5 s: a full reconcile every minute)
RECENT_S = 5.0      # one heartbeat interval: how long an act of this process hides a snapshot's stale view


@dataclass
class NodeView:
    ids: set[str] = field(default_factory=set)
    acc: int = 0                     # XOR of the ids' hashes (``live_digest``)
    deltas: int = 0                  # delta beats absorbed since the last full one
    verified_at: datetime | None = None   # the last beat whose count and digest matched


class Beats:
    def __init__(self, full_every: int = FULL_EVERY) -> None:
        self.epoch = secrets.token_hex(8)
        self.full_every = full_every
        self._views: dict[str, NodeView] = {}

    def full(self, node_id: str, hb: NodeHeartbeat, at: datetime) -> None:
        """A full beat was absorbed: the node's view is its ids."""
        ids = {st.id for st in hb.sandboxes}
        view = NodeView(ids=ids, acc=int(live_digest(ids), 16))
        if hb.digest is not None and hb.digest == live_digest((), view.acc) and hb.count == len(ids):
            view.verified_at = at
        self._views[node_id] = view

    def delta(self, node_id: str, hb: NodeHeartbeat, at: datetime) -> set[str] | None:
        """A delta beat: the node's ids when it can be absorbed as a delta (epoch, count and digest agree,
        and it is not the safety net's turn), else None (the view is dropped: a full beat must follow)."""
        view = self._views.get(node_id)
        if view is None or hb.delta_of != self.epoch:
            self._views.pop(node_id, None)
            return None
        self._apply(view, (st.id for st in hb.sandboxes), hb.gone)
        view.deltas += 1
        if (len(view.ids) != hb.count or live_digest((), view.acc) != hb.digest
                or view.deltas >= self.full_every):
            del self._views[node_id]
            return None
        view.verified_at = at
        return view.ids

    @staticmethod
    def _apply(view: NodeView, added: Iterable[str], gone: Iterable[str]) -> None:
        for sid in added:
            if sid not in view.ids:
                view.ids.add(sid)
                view.acc ^= id_hash(sid)
        for sid in gone:
            if sid in view.ids:
                view.ids.discard(sid)
                view.acc ^= id_hash(sid)

    def verified_at(self, node_id: str) -> datetime | None:
        """When ``node_id`` last confirmed (count and digest) that it still reports the same ids."""
        view = self._views.get(node_id)
        return view.verified_at if view is not None else None

    def forget(self, node_id: str) -> None:
        """It (re-)registered: its next delta is refused until a full beat sets its view again."""
        self._views.pop(node_id, None)


class Recent:
    """Ids this process acted on (told a node of a claim, killed on a node) within the last ``ttl_s``
    seconds of ``clock`` time: a heartbeat composed before the act still lists them as they were, and acting
    again on that snapshot is wasted work. Two generations, so memory stays bounded without a sweep."""

    def __init__(self, ttl_s: float, clock: Callable[[], float]) -> None:
        self.ttl_s = ttl_s
        self._clock = clock
        self._cur: dict[str, float] = {}
        self._old: dict[str, float] = {}
        self._since = clock()

    def add(self, sandbox_id: str) -> None:
        now = self._clock()
        if now - self._since >= self.ttl_s:
            self._old, self._cur, self._since = self._cur, {}, now
        self._cur[sandbox_id] = now

    def __contains__(self, sandbox_id: object) -> bool:
        at = self._cur.get(sandbox_id)   # type: ignore[call-overload]
        if at is None:
            at = self._old.get(sandbox_id)   # type: ignore[call-overload]
        return at is not None and self._clock() - at < self.ttl_s
