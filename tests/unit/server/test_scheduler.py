"""Scheduler: scenario tables that read like a spec, plus properties (never over-commits; the answer does
not depend on the order nodes are given in)."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pilldrops.server.scheduler import NodeView, Placement, Request, Unschedulable, place

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
