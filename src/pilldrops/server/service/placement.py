"""Where a create or a resume goes: the fleet's node rows turned into scheduler views (capacity held by
sandboxes and warm pools' reservations counted as used), the scorers each caller gets, and the answer
(a node, or the typed error that explains why none fits).

Every caller gets the pool reservations: members count as used capacity at their target size, ready or
not, so neither a cold create nor a resume takes the room a refill needs. A create of a pooled shape
also prefers a node with a ready member (the claim converts that member's reservation, so the node has
that much more room): for a create with egress, one of a pool with that policy first, else one of the
loopback-only pool (the node attaches the network at the claim); a resume prefers the node that already
holds its checkpoint (nothing to move).

Runs inside the store's placement transaction (``Store.place_and_insert`` / ``place_existing``): pure,
no I/O, the pool config read beforehand.
"""

from __future__ import annotations

import difflib
from collections.abc import Sequence
from datetime import datetime, timedelta

from pilldrops import errors
from pilldrops.schema.node import NodePoolSpec, NodeTemplateRef, network_key
from pilldrops.server import scheduler
from pilldrops.server.service import isolation
from pilldrops.server.service.pools import PoolService, shape
from pilldrops.server.store.interface import Allocations, NodeRecord

NODE_READY_WINDOW = timedelta(seconds=30)    # a node silent for longer is not offered new sandboxes


def _templates(n: NodeRecord) -> frozenset[str]:
    return frozenset(t.get("name") for t in n.templates)


def holders(ref: NodeTemplateRef, nodes: Sequence[NodeRecord]) -> set[str]:
    """Nodes that hold exactly this template-store version (they report it in their heartbeats)."""
    return {n.id for n in nodes if any(t.get("name") == ref.name and t.get("version") == ref.version
                                       for t in n.templates)}


def views(req: scheduler.Request, nodes: Sequence[NodeRecord], allocs: Allocations,
          pool_specs: Sequence[NodePoolSpec], now: datetime, *, claims: bool,
          ref: NodeTemplateRef | None = None) -> tuple[list[scheduler.NodeView], set[str]]:
    """The scheduler's view of each node, and the ids of nodes with a ready pool member to claim (only
    when ``claims``: a create, whose request is of a pooled shape). With ``ref`` (a template-store
    version) every node has the template: one lacking it fetches its layers on the create."""
    want = shape(req.template, req.vcpu, req.memory_mb)
    # the pools a claim can take from: this policy's (network attached already), and for a create with
    # egress also the loopback-only one (the node attaches the network at the claim)
    keys = {req.network_key, ""}
    pooled = claims and req.isolation == "container" and any(     # warm pools hold containers
        shape(p.template, p.vcpu, p.memory_mb) == want and network_key(p.network) in keys for p in pool_specs)
    out, warm, own = [], set(), set()
    for n in nodes:
        names = _templates(n)
        cpu = sum(p.size * p.vcpu for p in pool_specs if p.template in names)
        mem = sum(p.size * p.memory_mb for p in pool_specs if p.template in names)
        ready = {k: PoolService.ready_on(n, *want, k) for k in keys} if pooled and req.template in names else {}
        if any(ready.values()):
            warm.add(n.id)
            if req.network_key and ready[req.network_key]:
                own.add(n.id)
            cpu, mem = cpu - req.vcpu, mem - req.memory_mb      # the claim takes a reserved member
        used = allocs.get(n.id, (0.0, 0))
        out.append(scheduler.NodeView(
            id=n.id, capacity_vcpu=n.capacity_vcpu, capacity_memory_mb=n.capacity_memory_mb,
            used_vcpu=used[0] + cpu, used_memory_mb=used[1] + mem,
            ready=n.state == "ready" and now - n.last_heartbeat_at < NODE_READY_WINDOW, draining=n.draining,
            templates=names | {req.template} if ref is not None else names, ram_mb=getattr(n, "ram_mb", None) or 0,
            **isolation.view_fields(getattr(n, "isolation", None))))
    return out, own or warm           # a member with the policy attached beats one to attach it to


# what a node offers is set where it starts: these are the flags that change it
CAPACITY_FLAGS = {"vcpu": "--capacity-vcpu", "memory": "--capacity-memory-mb"}


def _check_template(template: str, nodes: Sequence[NodeRecord]) -> None:
    if not any(template in _templates(n) for n in nodes):
        known = sorted({t.get("name") for n in nodes for t in n.templates})
        close = difflib.get_close_matches(template, known, n=1, cutoff=0.5)
        # a typo of a built template: name that one, never "build" the typo
        fix = (f"did you mean {close[0]!r}? available: {', '.join(known)}" if close else
               f"available: {', '.join(known) or 'none'} (build it with `pilldrops template build {template}`)")
        raise errors.TemplateNotFound(
            f"template {template!r} is not built on any node; {fix}",
            details={"template": template, "available": known, "did_you_mean": close[0] if close else None})


def _capacity_notes(req: scheduler.Request, result: scheduler.Unschedulable,
                    nodes: Sequence[NodeRecord], node_views: list[scheduler.NodeView]) -> list[str]:
    """For each dimension that rejected nodes: the roomiest node's cap and current use, and the flag that
    changes the cap (sandbox limits are caps, not reservations: offering more is safe while memory allows)."""
    names = {n.id: n.name for n in nodes}
    usable = [v for v in node_views if v.ready and not v.draining and req.template in v.templates] or node_views
    notes = []
    if "insufficient vcpu" in result.reasons:
        v = max(usable, key=lambda n: n.capacity_vcpu - n.used_vcpu)
        notes.append(f"node {names.get(v.id, v.id)} offers {v.capacity_vcpu:g} vCPU with {v.used_vcpu:g} in use "
                     f"and this asks {req.vcpu:g}; vcpu is a cap, not a reservation: start the node with "
                     f"`{CAPACITY_FLAGS['vcpu']} N` (pilldrops up / pilldrops node) to offer more")
    if "insufficient memory" in result.reasons:
        v = max(usable, key=lambda n: n.capacity_memory_mb - n.used_memory_mb)
        notes.append(f"node {names.get(v.id, v.id)} offers {v.capacity_memory_mb} MiB with {v.used_memory_mb} "
                     f"MiB in use and this asks memory_mb={req.memory_mb} MiB; start the node with "
                     f"`{CAPACITY_FLAGS['memory']} N` to offer more")
    return notes


def _too_large(req: scheduler.Request, nodes: Sequence[NodeRecord]) -> tuple[str, dict[str, object]]:
    """Why a request can never fit: each dimension it exceeds, with its unit and the largest node's size
    (a memory limit is bounded by each node's RAM too: its capacity overcommits the RAM), and the details."""
    biggest_cpu = max(nodes, key=lambda n: n.capacity_vcpu)
    # the most memory one sandbox may have on a node: its capacity, and its RAM where it reported it
    mem_max = {n.id: min(n.capacity_memory_mb, getattr(n, "ram_mb", None) or n.capacity_memory_mb) for n in nodes}
    biggest_mem = max(nodes, key=lambda n: mem_max[n.id])
    out, details = [], {}
    if req.vcpu > biggest_cpu.capacity_vcpu:
        out.append(f"vcpu={req.vcpu:g} is more than any node offers (largest: {biggest_cpu.name}, "
                   f"{biggest_cpu.capacity_vcpu:g} vCPU)")
    if req.memory_mb > mem_max[biggest_mem.id]:
        ram = mem_max[biggest_mem.id] == getattr(biggest_mem, "ram_mb", None)
        out.append(f"memory_mb={req.memory_mb} MiB is more than any node offers (largest: {biggest_mem.name}, "
                   f"{mem_max[biggest_mem.id]} MiB{' of RAM' if ram else ''})")
        details = {"field": "memory_mb", "memory_mb": req.memory_mb, "max_memory_mb": mem_max[biggest_mem.id],
                   "node": biggest_mem.name}
    return "; ".join(out) or "larger than any node", details


def _decide(req: scheduler.Request, nodes: Sequence[NodeRecord], node_views: list[scheduler.NodeView],
            scorers: list[scheduler.Scorer]) -> NodeRecord:
    result = scheduler.place(req, node_views, [*scorers, scheduler.BEST_FIT])
    if isinstance(result, scheduler.Unschedulable):
        if result.never:
            why, details = _too_large(req, nodes)
            raise errors.InvalidRequest(f"request is larger than any node: {why} ({result.explain()})",
                                        details={"reasons": result.reasons, **details})
        notes = _capacity_notes(req, result, nodes, node_views)
        raise errors.CapacityUnavailable("; ".join([result.explain(), *notes]),
                                         details={"reasons": result.reasons, "notes": notes})
    return next(n for n in nodes if n.id == result.node_id)


def _store_scorers(ref: NodeTemplateRef | None, nodes: Sequence[NodeRecord]) -> list[scheduler.Scorer]:
    """A template-store version: nodes already holding it first (no fetch); the others fetch on demand."""
    return [scheduler.prefer("holds the template", holders(ref, nodes))] if ref is not None else []


def for_create(req: scheduler.Request, nodes: Sequence[NodeRecord], allocs: Allocations,
               pool_specs: Sequence[NodePoolSpec], now: datetime,
               ref: NodeTemplateRef | None = None) -> NodeRecord:
    """Best fit, a node with a ready pool member of this shape first, then one holding the template."""
    if ref is None:
        _check_template(req.template, nodes)
    node_views, warm = views(req, nodes, allocs, pool_specs, now, claims=True, ref=ref)
    scorers = [scheduler.prefer("warm pool member", warm)] if warm else []
    return _decide(req, nodes, node_views, [*scorers, *_store_scorers(ref, nodes)])


def for_resume(req: scheduler.Request, own_node_id: str | None, nodes: Sequence[NodeRecord],
               allocs: Allocations, pool_specs: Sequence[NodePoolSpec], now: datetime,
               ref: NodeTemplateRef | None = None) -> NodeRecord:
    """Best fit, the node holding the checkpoint first (``allocs`` leave out the sandbox's own hold)."""
    if ref is None:
        _check_template(req.template, nodes)
    node_views, _ = views(req, nodes, allocs, pool_specs, now, claims=False, ref=ref)
    scorers = [scheduler.prefer("holds the checkpoint", [own_node_id])] if own_node_id else []
    return _decide(req, nodes, node_views, [*scorers, *_store_scorers(ref, nodes)])
