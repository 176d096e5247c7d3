"""Placement: pure code, no I/O, no clock. ``place(request, nodes) -> Placement | Unschedulable``.

Filters (in order, cheapest first): ready → not draining → has the template → fits vCPU → fits memory, where
"used" already includes reservations still in flight. Then best fit: the node left with the least free
capacity that still fits, over both dimensions (the mean of the two free fractions, as Kubernetes'
MostAllocated scores), ties broken by node id so
the answer does not depend on the order nodes are given in. Every rejection is counted by reason so the
caller can say "0/4 nodes fit: 3 insufficient memory, 1 draining".
"""

from __future__ import annotations

from collections import Counter
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


@dataclass(frozen=True)
class Request:
    template: str
    vcpu: float
    memory_mb: int


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


def _reject(req: Request, n: NodeView) -> str | None:
    if not n.ready:
        return "not ready"
    if n.draining:
        return "draining"
    if req.template not in n.templates:
        return "template missing"
    if n.used_vcpu + req.vcpu > n.capacity_vcpu + 1e-9:
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
