"""Placement: pure code, no I/O, no clock. ``place(request, nodes) -> Placement | Unschedulable``.

Filters (in order, cheapest first): ready → not draining → runs the isolation mode → has the template → fits
vCPU → fits memory, where
"used" already includes reservations still in flight. Then best fit: the node left with the least free
capacity that still fits, over both dimensions (the mean of the two free fractions, as Kubernetes'
MostAllocated scores), ties broken by node id so
the answer does not depend on the order nodes are given in. Every rejection is counted by reason so the
caller can say "0/4 nodes fit: 3 insufficient memory, 1 draining".

``place`` is the reference. ``PlacementIndex`` is the same decision kept incrementally for many nodes
(``reserve``/``release``/``upsert``/``remove`` between decisions); it returns exactly what ``place`` returns on
``index.views()`` (property-tested), without scanning every node per decision:

- not ready / draining / template missing are counters (O(1));
- the eligible nodes holding a template are grouped by capacity shape, then in *rows* of equal used memory
  (sorted), each row keeping its distinct used-vCPU values sorted. Within a row the score only falls as used
  vCPU rises, so a row's best node is one bisect away; rows are visited fullest-memory first and the walk
  stops once a row's memory term alone is worse than the best found. Cost per decision: distinct rows
  visited × log(row), not nodes;
- "insufficient vcpu" is counted by a bisect on each shape's sorted used vCPU; when nothing fits, every
  remaining eligible node was rejected for memory.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right, insort
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field


@dataclass(frozen=True)
class NodeView:
    id: str
    capacity_vcpu: float
    capacity_memory_mb: int
    used_vcpu: float = 0.0
    used_memory_mb: int = 0
    ready: bool = True
    draining: bool = False
    templates: frozenset[str] = frozenset()
    isolation: frozenset[str] = frozenset({"container"})    # the modes it can run (issue 11)
    isolation_missing: tuple[tuple[str, str], ...] = ()     # (mode, why not) for the others


@dataclass(frozen=True)
class Request:
    template: str
    vcpu: float
    memory_mb: int
    isolation: str = "container"


@dataclass(frozen=True)
class Placement:
    node_id: str


@dataclass(frozen=True)
class Unschedulable:
    nodes: int
    reasons: dict[str, int] = field(default_factory=dict)
    never: bool = False   # no node could ever fit it (larger than every node): a 400, not a 503

    def explain(self) -> str:
        parts = ", ".join(f"{n} {r}" for r, n in sorted(self.reasons.items(), key=lambda x: (-x[1], x[0])))
        return f"0/{self.nodes} nodes fit" + (f": {parts}" if parts else ": no nodes registered")


VCPU_SLACK = 1e-9   # float vCPU sums such as 0.1 + 0.2 may fit exactly


def _reject(req: Request, n: NodeView) -> str | None:
    if not n.ready:
        return "not ready"
    if n.draining:
        return "draining"
    if req.isolation not in n.isolation:
        why = dict(n.isolation_missing).get(req.isolation)
        return f"no {req.isolation}" + (f" ({why})" if why else "")
    if req.template not in n.templates:
        return "template missing"
    if n.used_vcpu + req.vcpu > n.capacity_vcpu + VCPU_SLACK:
        return "insufficient vcpu"
    if n.used_memory_mb + req.memory_mb > n.capacity_memory_mb:
        return "insufficient memory"
    return None


def _leftover(req: Request, n: NodeView) -> float:
    free_cpu = (n.capacity_vcpu - n.used_vcpu - req.vcpu) / n.capacity_vcpu
    free_mem = (n.capacity_memory_mb - n.used_memory_mb - req.memory_mb) / n.capacity_memory_mb
    return (free_cpu + free_mem) / 2


def place(req: Request, nodes: list[NodeView]) -> Placement | Unschedulable:
    reasons: Counter[str] = Counter()
    best: tuple[float, str] | None = None
    for n in nodes:
        why = _reject(req, n)
        if why:
            reasons[why] += 1
            continue
        key = (_leftover(req, n), n.id)
        if best is None or key < best:
            best = key
    if best is not None:
        return Placement(best[1])
    never = bool(nodes) and all(req.vcpu > n.capacity_vcpu or req.memory_mb > n.capacity_memory_mb
                                for n in nodes)
    return Unschedulable(len(nodes), dict(reasons), never=never)


# --- incremental form ------------------------------------------------------------------------------------------


class _Node:
    __slots__ = ("cap_c", "cap_m", "draining", "id", "iso", "ready", "templates", "used_c", "used_m")

    def __init__(self, v: NodeView) -> None:
        self.id, self.cap_c, self.cap_m = v.id, v.capacity_vcpu, v.capacity_memory_mb
        self.used_c, self.used_m = v.used_vcpu, v.used_memory_mb
        self.ready, self.draining, self.templates = v.ready, v.draining, v.templates
        self.iso = (v.isolation, v.isolation_missing)

    def view(self) -> NodeView:
        return NodeView(self.id, self.cap_c, self.cap_m, self.used_c, self.used_m, self.ready, self.draining,
                        self.templates, *self.iso)


class _Row:
    """Nodes of one shape with the same used memory: distinct used vCPU values (sorted) → node ids (sorted)."""
    __slots__ = ("ids", "ucs")

    def __init__(self) -> None:
        self.ucs: list[float] = []
        self.ids: dict[float, list[str]] = {}


class _Shape:
    """Eligible nodes (for one template) of one capacity shape."""
    __slots__ = ("all_uc", "cap_c", "cap_m", "rows", "ums")

    def __init__(self, cap_c: float, cap_m: int) -> None:
        self.cap_c, self.cap_m = cap_c, cap_m
        self.ums: list[int] = []                 # distinct used memory, ascending
        self.rows: dict[int, _Row] = {}
        self.all_uc: list[float] = []            # used vCPU of every node, sorted (with repeats)

    def add(self, n: _Node) -> None:
        row = self.rows.get(n.used_m)
        if row is None:
            row = self.rows[n.used_m] = _Row()
            insort(self.ums, n.used_m)
        ids = row.ids.get(n.used_c)
        if ids is None:
            ids = row.ids[n.used_c] = []
            insort(row.ucs, n.used_c)
        insort(ids, n.id)
        insort(self.all_uc, n.used_c)

    def discard(self, n: _Node) -> None:
        row = self.rows[n.used_m]
        ids = row.ids[n.used_c]
        del ids[bisect_left(ids, n.id)]
        if not ids:
            del row.ids[n.used_c]
            del row.ucs[bisect_left(row.ucs, n.used_c)]
            if not row.ucs:
                del self.rows[n.used_m]
                del self.ums[bisect_left(self.ums, n.used_m)]
        del self.all_uc[bisect_left(self.all_uc, n.used_c)]

    def __len__(self) -> int:
        return len(self.all_uc)

    def _fits_cpu_upto(self, ucs: list[float], r_c: float) -> int:
        """Number of leading values u in sorted ``ucs`` with u + r_c <= cap + slack, the exact test of _reject
        (monotone in u, so a bisect on the rearranged bound, then corrected against the exact test)."""
        lim = self.cap_c + VCPU_SLACK
        i = bisect_right(ucs, lim - r_c)
        while i < len(ucs) and ucs[i] + r_c <= lim:
            i += 1
        while i > 0 and ucs[i - 1] + r_c > lim:
            i -= 1
        return i

    def best(self, r_c: float, r_m: int, best: tuple[float, str] | None) -> tuple[float, str] | None:
        """Best (score, id) among this shape's fitting nodes, or ``best`` if none beats it."""
        cap_c, cap_m = self.cap_c, self.cap_m
        slack = 2 * VCPU_SLACK / cap_c + 1e-12 if cap_c > 0 else float("inf")
        ums, rows = self.ums, self.rows
        for k in range(bisect_right(ums, cap_m - r_m) - 1, -1, -1):   # rows that fit memory, fullest first
            um = ums[k]
            free_mem = (cap_m - um - r_m) / cap_m
            if best is not None and (free_mem - slack) / 2 > best[0]:
                break                                # memory term alone is worse, and only grows from here
            row = rows[um]
            ucs = row.ucs
            j = self._fits_cpu_upto(ucs, r_c) - 1
            if j < 0:
                continue
            top = None
            while j >= 0:                            # the fullest fitting vCPU, and any equal score below it
                uc = ucs[j]
                score = ((cap_c - uc - r_c) / cap_c + free_mem) / 2
                if top is not None and score != top:
                    break
                top = score
                key = (score, row.ids[uc][0])
                if best is None or key < best:
                    best = key
                j -= 1
        return best

    def cpu_rejected(self, r_c: float) -> int:
        return len(self.all_uc) - self._fits_cpu_upto(self.all_uc, r_c)


class PlacementIndex:
    """``place`` kept incrementally: the same answer as ``place(req, index.views())``, per decision in time
    that depends on the distinct (used memory) rows visited, not on the number of nodes."""

    def __init__(self, nodes: Iterable[NodeView] = ()) -> None:
        self._nodes: dict[str, _Node] = {}
        self._not_ready = 0
        self._draining = 0
        self._eligible = 0                                            # ready and not draining
        self._by_template: dict[str, dict[tuple[float, int], _Shape]] = {}
        self._shapes: Counter[tuple[float, int]] = Counter()        # every node, for ``never``
        for v in nodes:
            self.upsert(v)

    def __len__(self) -> int:
        return len(self._nodes)

    def views(self) -> list[NodeView]:
        return [n.view() for n in self._nodes.values()]

    def view(self, node_id: str) -> NodeView:
        return self._nodes[node_id].view()

    # -- updates
    def upsert(self, v: NodeView) -> None:
        if v.id in self._nodes:
            self.remove(v.id)
        n = self._nodes[v.id] = _Node(v)
        self._shapes[(n.cap_c, n.cap_m)] += 1
        if not n.ready:
            self._not_ready += 1
        elif n.draining:
            self._draining += 1
        else:
            self._eligible += 1
            for t in n.templates:
                shapes = self._by_template.setdefault(t, {})
                shape = shapes.get((n.cap_c, n.cap_m))
                if shape is None:
                    shape = shapes[(n.cap_c, n.cap_m)] = _Shape(n.cap_c, n.cap_m)
                shape.add(n)

    def remove(self, node_id: str) -> None:
        n = self._nodes.pop(node_id)
        key = (n.cap_c, n.cap_m)
        self._shapes[key] -= 1
        if not self._shapes[key]:
            del self._shapes[key]
        if not n.ready:
            self._not_ready -= 1
        elif n.draining:
            self._draining -= 1
        else:
            self._eligible -= 1
            for t in n.templates:
                shapes = self._by_template[t]
                shapes[key].discard(n)
                if not shapes[key]:
                    del shapes[key]
                    if not shapes:
                        del self._by_template[t]

    def _move(self, node_id: str, d_c: float, d_m: int, sign: int) -> None:
        n = self._nodes[node_id]
        eligible = n.ready and not n.draining
        shapes = [self._by_template[t][(n.cap_c, n.cap_m)] for t in n.templates] if eligible else []
        for s in shapes:
            s.discard(n)
        if sign > 0:
            n.used_c, n.used_m = n.used_c + d_c, n.used_m + d_m
        else:
            n.used_c, n.used_m = n.used_c - d_c, n.used_m - d_m
        for s in shapes:
            s.add(n)

    def reserve(self, node_id: str, vcpu: float, memory_mb: int) -> None:
        self._move(node_id, vcpu, memory_mb, +1)

    def release(self, node_id: str, vcpu: float, memory_mb: int) -> None:
        self._move(node_id, vcpu, memory_mb, -1)

    # -- decision
    def place(self, req: Request) -> Placement | Unschedulable:
        if req.isolation != "container":
            return place(req, self.views())     # the other isolation modes: the reference scan (not indexed)
        shapes = self._by_template.get(req.template, {})
        best: tuple[float, str] | None = None
        for shape in shapes.values():
            best = shape.best(req.vcpu, req.memory_mb, best)
        if best is not None:
            return Placement(best[1])
        with_template = sum(len(s) for s in shapes.values())
        cpu = sum(s.cpu_rejected(req.vcpu) for s in shapes.values())
        counts = {"not ready": self._not_ready, "draining": self._draining,
                  "template missing": self._eligible - with_template, "insufficient vcpu": cpu,
                  "insufficient memory": with_template - cpu}
        never = bool(self._nodes) and all(req.vcpu > c or req.memory_mb > m for c, m in self._shapes)
        return Unschedulable(len(self._nodes), {r: k for r, k in counts.items() if k}, never=never)
