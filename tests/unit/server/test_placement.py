"""The create and resume paths' placement (``service.placement``): node rows to views, pool reservations for
every caller, the warm-member and own-node preferences, and the typed errors."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from types import SimpleNamespace
from typing import Any

import pytest

from pilldrops import errors
from pilldrops.schema.node import NodePoolSpec
from pilldrops.server import scheduler
from pilldrops.server.scheduler import Request
from pilldrops.server.service import placement

NOW = datetime(2026, 1, 1, tzinfo=UTC)


def row(nid: str, cpu: float = 4, mem: int = 4096, *, templates: tuple[str, ...] = ("tiny",), ready: int = 0,
        state: str = "ready", draining: bool = False, silent_s: float = 0) -> Any:
    pool_status = [{"template": "tiny", "vcpu": 1, "memory_mb": 512, "ready": ready}] if ready else []
    return SimpleNamespace(id=nid, name=nid, url=f"http://{nid}", capacity_vcpu=cpu, capacity_memory_mb=mem,
                           state=state, draining=draining, templates=[{"name": t} for t in templates],
                           last_heartbeat_at=NOW - timedelta(seconds=silent_s), pool_status=pool_status)


POOL = [NodePoolSpec(template="tiny", vcpu=1, memory_mb=512, size=2)]


def test_create_prefers_a_node_with_a_ready_member_over_a_better_fit() -> None:
    nodes = [row("a", ready=1), row("b")]
    # b is the fuller node (1 vCPU held + 2 reserved for the pool) yet still fits: best fit alone picks it
    allocs = {"b": (1.0, 1024)}
    req = Request("tiny", 1, 512)
    node_views, warm = placement.views(req, nodes, allocs, POOL, NOW, claims=True)
    assert warm == {"a"} and scheduler.place(req, node_views) == scheduler.Placement("b")
    assert placement.for_create(req, nodes, allocs, POOL, NOW).id == "a"
    assert placement.for_create(Request("tiny", 1, 512), nodes, allocs, [], NOW).id == "b"


def test_pool_reservations_count_for_every_caller() -> None:
    # each node reserves 2 x (1 vCPU, 512 MiB) for the pool: 2 vCPU left on a 4 vCPU node
    nodes = [row("a"), row("b", cpu=8, mem=8192)]
    allocs = {"a": (1.0, 512)}
    assert placement.for_create(Request("tiny", 2, 1024), nodes, allocs, POOL, NOW).id == "b"
    # a resume prefers the node holding its checkpoint, but not into the room the pool keeps
    assert placement.for_resume(Request("tiny", 2, 1024), "a", nodes, allocs, [], NOW).id == "a"
    assert placement.for_resume(Request("tiny", 2, 1024), "a", nodes, allocs, POOL, NOW).id == "b"
    assert placement.for_resume(Request("tiny", 1, 512), "a", nodes, allocs, POOL, NOW).id == "a"


def test_not_ready_silent_and_draining_nodes_are_explained() -> None:
    nodes = [row("a", silent_s=60), row("b", state="unreachable"), row("c", draining=True), row("d", mem=256)]
    with pytest.raises(errors.CapacityUnavailable) as info:
        placement.for_create(Request("tiny", 1, 512), nodes, {}, [], NOW)
    assert info.value.message == ("0/4 nodes fit: 2 not ready, 1 draining, 1 insufficient memory; node d offers "
                                  "256 MiB with 0 MiB in use and this asks memory_mb=512 MiB; start the node with "
                                  "`--capacity-memory-mb N` to offer more")
    assert info.value.details["reasons"] == {"not ready": 2, "draining": 1, "insufficient memory": 1}


def test_larger_than_any_node_and_unknown_template() -> None:
    with pytest.raises(errors.InvalidRequest, match=r"larger than any node: memory_mb=9000 MiB is more than any "
                                                    r"node offers \(largest: a, \d+ MiB\) \(0/1 nodes fit"):
        placement.for_create(Request("tiny", 1, 9000), [row("a")], {}, [], NOW)
    with pytest.raises(errors.TemplateNotFound, match=r"'big' is not built on any node; available: tiny"):
        placement.for_create(Request("big", 1, 512), [row("a")], {}, [], NOW)


def test_a_create_with_egress_prefers_a_member_of_its_policy_then_a_loopback_one() -> None:
    from pilldrops.schema.node import NodeNetwork, network_key
    net = NodeNetwork(allow_out=["198.18.0.0/24"])
    pools = [*POOL, NodePoolSpec(template="tiny", vcpu=1, memory_mb=512, size=2, network=net)]
    own = row("own")
    own.pool_status = [{"template": "tiny", "vcpu": 1, "memory_mb": 512, "ready": 1, "network": net.model_dump()}]
    nodes = [row("loop", ready=1), own, row("none")]
    egress = Request("tiny", 1, 512, network_key=network_key(net))
    assert placement.views(egress, nodes, {}, pools, NOW, claims=True)[1] == {"own"}
    other = Request("tiny", 1, 512, network_key=network_key(NodeNetwork(allow_internet_access=True)))
    assert placement.views(other, nodes, {}, pools, NOW, claims=True)[1] == {"loop"}   # attach at claim
    assert placement.views(Request("tiny", 1, 512), nodes, {}, pools, NOW, claims=True)[1] == {"loop"}
    own_only = [own, row("none")]                       # no egress: never a member with a network
    assert placement.views(Request("tiny", 1, 512), own_only, {}, pools, NOW, claims=True)[1] == set()
