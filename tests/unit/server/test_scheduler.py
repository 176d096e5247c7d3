"""Scheduler: scenario tables that read like a spec, plus properties (never over-commits; the answer does
not depend on the order nodes are given in; the chosen node is optimal); filters are counted and explained,
a new filter joins by being appended, scorers rank lexicographically."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pilldrops.server.scheduler import (
    BEST_FIT,
    FILTERS,
    Filter,
    NodeView,
    Placement,
    Request,
    Unschedulable,
    place,
    prefer,
)

T = frozenset({"tiny"})


def node(nid: str, cpu: float = 8, mem: int = 8192, used_cpu: float = 0, used_mem: int = 0, **kw) -> NodeView:
    return NodeView(nid, cpu, mem, used_cpu, used_mem, templates=kw.pop("templates", T), **kw)


@pytest.mark.parametrize("scenario,nodes,expect", [
    ("only node fits", [node("a")], "a"),
    ("best fit: the fuller node that still fits", [node("a", used_mem=1024), node("b", used_mem=6144)], "b"),
    ("overloaded node is skipped", [node("a", used_mem=8000), node("b")], "b"),
    ("perfect fit is taken", [node("a"), node("b", used_cpu=7, used_mem=7680)], "b"),
    ("both dimensions count", [node("a", used_cpu=7.5), node("b", used_mem=4096)], "b"),
    ("draining node is skipped", [node("a", draining=True, used_mem=7000), node("b")], "b"),
    ("not ready node is skipped", [node("a", ready=False, used_mem=7000), node("b")], "b"),
    ("node without template is skipped", [node("a", templates=frozenset(), used_mem=7000), node("b")], "b"),
    ("tie broken by id", [node("b"), node("a")], "a"),
])
def test_placement_table(scenario: str, nodes: list[NodeView], expect: str) -> None:
    assert place(Request("tiny", 1, 512), nodes) == Placement(expect), scenario


def test_unschedulable_explains_every_rejection() -> None:
    nodes = [node("a", used_mem=8000), node("b", used_mem=8000), node("c", used_cpu=8), node("d", draining=True)]
    res = place(Request("tiny", 1, 512), nodes)
    assert isinstance(res, Unschedulable) and not res.never
    assert res.explain() == "0/4 nodes fit: 2 insufficient memory, 1 draining, 1 insufficient vcpu"
    assert place(Request("tiny", 1, 512), []).explain() == "0/0 nodes fit: no nodes registered"


def test_larger_than_any_node_is_never() -> None:
    res = place(Request("tiny", 1, 9000), [node("a"), node("b")])
    assert isinstance(res, Unschedulable) and res.never


nodes_st = st.lists(st.builds(
    lambda i, cpu, mem, uc, um, dr: node(f"n{i}", cpu, mem, min(uc, cpu), min(um, mem), draining=dr),
    st.integers(0, 10_000), st.sampled_from([2, 4, 8, 16]), st.sampled_from([1024, 4096, 16384]),
    st.floats(0, 16), st.integers(0, 16384), st.booleans()), max_size=12, unique_by=lambda n: n.id)
req_st = st.builds(Request, st.just("tiny"), st.sampled_from([0.5, 1, 2, 4]), st.sampled_from([256, 512, 2048]))


@settings(max_examples=300, deadline=None)
@given(nodes_st, req_st, st.randoms())
def test_never_overcommits_and_order_independent(nodes: list[NodeView], req: Request, rnd: random.Random) -> None:
    res = place(req, nodes)
    shuffled = list(nodes)
    rnd.shuffle(shuffled)
    assert place(req, shuffled) == res
    if isinstance(res, Placement):
        n = next(x for x in nodes if x.id == res.node_id)
        assert n.used_vcpu + req.vcpu <= n.capacity_vcpu + 1e-9
        assert n.used_memory_mb + req.memory_mb <= n.capacity_memory_mb
        assert not n.draining
    else:
        assert sum(res.reasons.values()) == len(nodes)


def fits(req: Request, n: NodeView) -> bool:
    return (n.ready and not n.draining and req.template in n.templates
            and n.used_vcpu + req.vcpu <= n.capacity_vcpu + 1e-9
            and n.used_memory_mb + req.memory_mb <= n.capacity_memory_mb)


def score(req: Request, n: NodeView) -> float:
    """Free capacity left after placing, mean of both fractions: lower is a better (fuller) fit."""
    return ((n.capacity_vcpu - n.used_vcpu - req.vcpu) / n.capacity_vcpu
            + (n.capacity_memory_mb - n.used_memory_mb - req.memory_mb) / n.capacity_memory_mb) / 2


@settings(max_examples=300, deadline=None)
@given(nodes_st, req_st)
def test_chosen_node_is_optimal(nodes: list[NodeView], req: Request) -> None:
    res = place(req, nodes)
    feasible = [n for n in nodes if fits(req, n)]
    if not feasible:
        assert isinstance(res, Unschedulable)
        return
    assert isinstance(res, Placement)
    chosen = next(n for n in nodes if n.id == res.node_id)
    assert fits(req, chosen)
    assert not any(score(req, n) < score(req, chosen) for n in feasible)
    assert not any(score(req, n) == score(req, chosen) and n.id < chosen.id for n in feasible)


@pytest.mark.parametrize("scenario,nodes,req,explain", [
    ("every filter reason", [node("a", ready=False), node("b", draining=True), node("c", templates=frozenset()),
                             node("d", used_cpu=8), node("e", used_mem=8000)],
     Request("tiny", 1, 512),
     "0/5 nodes fit: 1 draining, 1 insufficient memory, 1 insufficient vcpu, 1 not ready, 1 template missing"),
    ("unknown template", [node("a"), node("b")], Request("big", 1, 512), "0/2 nodes fit: 2 template missing"),
    ("no nodes", [], Request("tiny", 1, 512), "0/0 nodes fit: no nodes registered"),
    ("first failing filter counts", [node("a", ready=False, draining=True, used_mem=8192)], Request("tiny", 1, 512),
     "0/1 nodes fit: 1 not ready"),
])
def test_explains_every_filter(scenario: str, nodes: list[NodeView], req: Request, explain: str) -> None:
    res = place(req, nodes)
    assert isinstance(res, Unschedulable) and res.explain() == explain, scenario


def test_rejections_are_counted_on_success_too() -> None:
    res = place(Request("tiny", 1, 512), [node("a", draining=True), node("b", used_mem=8000), node("c")])
    assert res == Placement("c") and res.rejected == {"draining": 1, "insufficient memory": 1}


def test_a_new_dimension_is_one_filter() -> None:
    """A filter appended to FILTERS is applied, counted and explained like the built-in ones."""
    gpu = Filter("no gpu", lambda r, n: not n.id.startswith("cpu"))
    nodes = [node("cpu-a", used_mem=7000), node("gpu-b")]
    assert place(Request("tiny", 1, 512), nodes, filters=(*FILTERS, gpu)) == Placement("gpu-b")
    res = place(Request("tiny", 1, 512), nodes[:1], filters=(*FILTERS, gpu))
    assert isinstance(res, Unschedulable) and res.explain() == "0/1 nodes fit: 1 no gpu" and not res.never


@pytest.mark.parametrize("scenario,nodes,preferred,expect", [
    ("a preferred node wins over a better fit", [node("a"), node("b", used_mem=6144)], {"a"}, "a"),
    ("best fit among the preferred", [node("a"), node("b", used_mem=4096), node("c", used_mem=6144)], {"a", "b"}, "b"),
    ("a preferred node that does not fit is skipped", [node("a", used_mem=8000), node("b")], {"a"}, "b"),
])
def test_prefer_scorer_ranks_first(scenario: str, nodes: list[NodeView], preferred: set[str], expect: str) -> None:
    req = Request("tiny", 1, 512)
    assert place(req, nodes, [prefer("test", preferred), BEST_FIT]) == Placement(expect), scenario


@pytest.mark.parametrize("scenario,nodes,req,expect", [
    ("equal scores across rows tie by id: b is fuller in memory, a in vCPU",
     [node("b", 4, 4096, used_cpu=2, used_mem=2048), node("a", 4, 4096, used_cpu=3, used_mem=1024)],
     Request("tiny", 1, 0), "a"),
    ("used vCPU differing in the last bit scores the same: tie by id",
     [node("b", 16, 4096, used_cpu=0.1 + 0.2), node("a", 16, 4096, used_cpu=0.3)], Request("tiny", 1, 512), "a"),
    ("a sum that overshoots capacity by a rounding error still fits",
     [node("a", 0.3, 4096, used_cpu=0.1), node("b", 4, 4096)], Request("tiny", 0.2, 512), "a"),
])
def test_ties_and_rounding(scenario: str, nodes: list[NodeView], req: Request, expect: str) -> None:
    assert place(req, nodes) == Placement(expect), scenario


