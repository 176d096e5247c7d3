"""Placement: pure code, no I/O, no clock. ``place(request, nodes, scorers) -> Placement | Unschedulable``.

Modelled on Nomad's scheduler: feasibility *filters*, then *scorers* that rank the nodes that passed.

- ``FILTERS`` run in order (cheapest first), each over the nodes still in the running; a node is rejected
  by the first filter it fails, and every rejection is counted under that filter's ``reason``, so the
  caller can say "0/5 nodes fit: 3 insufficient memory, 2 draining". "Used" capacity already includes
  reservations still in flight and warm pools' targets (``service.placement`` builds the views).
- ``scorers`` rank the feasible nodes lexicographically, lowest first, the first scorer deciding; the
  node id breaks the last tie so the answer does not depend on the order nodes are given in.
  ``BEST_FIT`` (the default, and the last scorer of every caller) is the node left with the least free
  capacity that still fits, over both dimensions (the mean of the two free fractions, as Kubernetes'
  MostAllocated scores); ``prefer(...)`` puts some nodes first (a warm pool member to claim, the node
  already holding a checkpoint).

A new dimension is one ``Filter`` appended to ``FILTERS`` (plus the field it reads on ``Request`` and
``NodeView``); its rejections are counted and explained like the others.

The create path chooses inside the store transaction that locks the node rows (so several control-plane
processes never over-commit a node), from rows it has just read: the decision is one pass over them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
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
    isolation: frozenset[str] = frozenset({"container"})    # the isolation modes it runs (issue 11)
    isolation_missing: tuple[tuple[str, str], ...] = ()     # (mode, why not) for the others
    ram_mb: int = 0        # the host's RAM: a memory limit past it never fits (capacity overcommits it); 0: unknown


@dataclass(frozen=True)
class Request:
    template: str
    vcpu: float
    memory_mb: int
    isolation: str = "container"
    network_key: str = ""          # the egress policy's ``network_key`` ("" loopback only): which pool it claims


@dataclass(frozen=True)
class Placement:
    node_id: str
    # what the filters rejected on the way (by reason), for logs and metrics; not part of the answer
    rejected: dict[str, int] = field(default_factory=dict, compare=False)


@dataclass(frozen=True)
class Unschedulable:
    nodes: int
    reasons: dict[str, int] = field(default_factory=dict)
    never: bool = False   # no node could ever fit it (larger than every node): a 400, not a 503

    def explain(self) -> str:
        parts = ", ".join(f"{n} {r}" for r, n in sorted(self.reasons.items(), key=lambda x: (-x[1], x[0])))
        return f"0/{self.nodes} nodes fit" + (f": {parts}" if parts else ": no nodes registered")


VCPU_SLACK = 1e-9   # float vCPU sums such as 0.1 + 0.2 may fit exactly


# ---- filters --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Filter:
    """A feasibility check: ``passes(request, node)``; ``reason`` names a rejection in the explanation.
    ``never(request, node)``, where given, is True when this node could not pass whatever runs on it (the
    request is larger than the node): when that holds for every node the request is refused as invalid."""
    reason: str
    passes: Callable[[Request, NodeView], bool]
    never: Callable[[Request, NodeView], bool] | None = None
    explain: Callable[[Request, NodeView], str] | None = None     # a per-node reason instead of ``reason``


READY = Filter("not ready", lambda r, n: n.ready)
NOT_DRAINING = Filter("draining", lambda r, n: not n.draining)
RUNS_ISOLATION = Filter("isolation mode missing", lambda r, n: r.isolation in n.isolation,
                        explain=lambda r, n: f"no {r.isolation}" + (
                            f" ({why})" if (why := dict(n.isolation_missing).get(r.isolation)) else ""))
HAS_TEMPLATE = Filter("template missing", lambda r, n: r.template in n.templates)
FITS_VCPU = Filter("insufficient vcpu", lambda r, n: n.used_vcpu + r.vcpu <= n.capacity_vcpu + VCPU_SLACK,
                   never=lambda r, n: r.vcpu > n.capacity_vcpu)
FITS_MEMORY = Filter("insufficient memory", lambda r, n: n.used_memory_mb + r.memory_mb <= n.capacity_memory_mb,
                     never=lambda r, n: r.memory_mb > n.capacity_memory_mb)
FITS_RAM = Filter("memory above the node's RAM", lambda r, n: not n.ram_mb or r.memory_mb <= n.ram_mb,
                  never=lambda r, n: bool(n.ram_mb) and r.memory_mb > n.ram_mb)

FILTERS: tuple[Filter, ...] = (READY, NOT_DRAINING, RUNS_ISOLATION, HAS_TEMPLATE, FITS_VCPU, FITS_MEMORY, FITS_RAM)


# ---- scorers --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Scorer:
    """Ranks feasible nodes: ``score(request, node)``, lower is better."""
    name: str
    score: Callable[[Request, NodeView], float]


def _leftover(req: Request, n: NodeView) -> float:
    free_cpu = (n.capacity_vcpu - n.used_vcpu - req.vcpu) / n.capacity_vcpu
    free_mem = (n.capacity_memory_mb - n.used_memory_mb - req.memory_mb) / n.capacity_memory_mb
    return (free_cpu + free_mem) / 2


BEST_FIT = Scorer("best fit", _leftover)


def prefer(name: str, node_ids: Iterable[str]) -> Scorer:
    """Nodes in ``node_ids`` before all others (``name`` says why, e.g. "warm pool member")."""
    ids = frozenset(node_ids)
    return Scorer(name, lambda r, n: 0.0 if n.id in ids else 1.0)


# ---- the decision ---------------------------------------------------------------------------------------

def place(req: Request, nodes: list[NodeView], scorers: Sequence[Scorer] = (BEST_FIT,),
          filters: Sequence[Filter] = FILTERS) -> Placement | Unschedulable:
    reasons: dict[str, int] = {}
    feasible = nodes
    for f in filters:                   # one pass per filter over the nodes still in the running
        passes = f.passes
        kept = [n for n in feasible if passes(req, n)]
        if len(kept) != len(feasible) and f.explain is None:
            reasons[f.reason] = len(feasible) - len(kept)
        elif len(kept) != len(feasible):        # each rejected node says why (e.g. the node's probe result)
            for n in feasible:
                if not passes(req, n):
                    why = f.explain(req, n)
                    reasons[why] = reasons.get(why, 0) + 1
        feasible = kept
    if feasible:
        if len(scorers) == 1:
            score = scorers[0].score
            best = min(feasible, key=lambda n: (score(req, n), n.id))
        else:
            fns = [s.score for s in scorers]
            best = min(feasible, key=lambda n: (*[fn(req, n) for fn in fns], n.id))
        return Placement(best.id, reasons)
    never_checks = [f.never for f in filters if f.never is not None]
    never = bool(nodes) and all(any(check(req, n) for check in never_checks) for n in nodes)
    return Unschedulable(len(nodes), reasons, never=never)
