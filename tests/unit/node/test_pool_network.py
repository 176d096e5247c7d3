"""Warm pools per egress policy (issue 14 part 3) on the FakeRuntime with a recording fake egress (the real
netns/veth/nft one: tests/network/test_pool_network.py): a pool's members are made with their network
attached; a create of the same shape and policy claims one without attaching anything; another policy falls
back to attach-at-claim from the loopback-only pool (or boots cold); a create without egress never gets a
member with a network; shrinking a pool releases its members' networks; the pool API validates the
policy like a create (and the deployment's --no-egress / --egress-allow); pause/resume keeps the policy."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from pilldrops.node import pools as pools_mod
from pilldrops.schema.node import NodeNetwork, network_key
from pilldrops.server.service.egress import EgressSettings
from tests.stack import FakeEgress, Stack, fake_egress, stack
from tests.stack import until as _until

pytestmark = pytest.mark.anyio
SHAPE = {"template": "tiny", "vcpu": 1, "memory_mb": 256}
NET = {"allow_internet_access": False, "network": {"allow_out": ["198.18.0.0/24", "198.19.1.1"]}}


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def _pool(s: Stack, net: NodeNetwork | None = None) -> pools_mod.Pool:
    return s.agent.pools.pools[pools_mod.key_of("tiny", 1, 256, net)]


def _policy_pool(s: Stack) -> pools_mod.Pool:
    return next(p for k, p in s.agent.pools.pools.items() if k[3])


async def _set(c: httpx.AsyncClient, size: int, **kw: Any) -> httpx.Response:
    return await c.put("/v1/pools", json={**SHAPE, "size": size, **kw})


def test_network_key_is_the_policy_whatever_the_order() -> None:
    a = NodeNetwork(allow_out=["10.0.0.0/8", "198.18.0.1"], deny_out=["10.1.0.0/16"])
    b = NodeNetwork(allow_out=["198.18.0.1", "10.0.0.0/8"], deny_out=["10.1.0.0/16"])
    assert network_key(a) == network_key(b) != ""
    assert network_key(None) == network_key(NodeNetwork(deny_out=["10.0.0.0/8"])) == ""   # opens nothing
    assert network_key(NodeNetwork(allow_internet_access=True)) != network_key(NodeNetwork(allow_internet_access=True,
                                                                                         cap=["10.0.0.0/8"]))
    assert network_key(a.model_dump()) == network_key(a)


async def test_policy_pool_members_are_attached_and_claimed_without_an_attach(tmp_path) -> None:
    async with stack(tmp_path) as s, s.client() as c:
        fake: FakeEgress = fake_egress(s)
        r = await _set(c, 2, **NET)
        assert r.status_code == 200, r.text
        assert r.json()["network"] == {"allow_out": ["198.18.0.0/24", "198.19.1.1/32"], "deny_out": []}
        await _until(lambda: len(_policy_pool(s).ready) == 2)
        members = {m.handle.id for m in _policy_pool(s).ready}
        assert members <= set(fake.attached) and fake.attaches == 2
        # the same policy in another order is the same pool
        sb = (await c.post("/v1/sandboxes", json={**SHAPE, "network": {"allow_out": ["198.19.1.1",
                                                                                     "198.18.0.0/24"]}})).json()
        handle = s.agent.live[sb["id"]].target.handle
        assert handle.id in members and s.agent.stats.claimed == 1
        assert fake.attaches == 2 or fake.attaches == 3           # none for the claim (3: the refill's)
        assert (handle.id, sb["id"]) in fake.rekeyed and fake.attached[sb["id"]].allow_out == [
            "198.18.0.0/24", "198.19.1.1/32"]
        # a create without egress never gets a member with a network: boots cold (no loopback pool here)
        plain = (await c.post("/v1/sandboxes", json=SHAPE)).json()
        assert not s.agent.live[plain["id"]].target.handle.id.startswith("pd-") and plain["id"] not in fake.attached
        await s.agent.control_plane.heartbeat()
        listed = (await c.get("/v1/pools")).json()["items"]
        assert [(p["allow_internet_access"], p["network"]["allow_out"], p["hits"]) for p in listed] == [
            (False, ["198.18.0.0/24", "198.19.1.1/32"], 1)]
        # removing the pool releases every member's network (and a wrong policy names what is there)
        r = await _set(c, 0, allow_internet_access=True)
        assert r.status_code == 404 and "198.19.1.1/32" in r.json()["error"]["message"]
        await _until(lambda: len(_policy_pool(s).ready) == 2)
        left = {m.handle.id for m in _policy_pool(s).ready}
        assert (await _set(c, 0, **NET)).status_code == 200
        await _until(lambda: not any(k[3] for k in s.agent.pools.pools))
        assert left <= set(fake.released)
        assert not (left & set(await s.runtime.list_ids()))


async def test_other_policy_attaches_at_claim_from_the_loopback_pool(tmp_path) -> None:
    async with stack(tmp_path) as s, s.client() as c:
        fake = fake_egress(s)
        assert (await _set(c, 1)).status_code == 200                          # loopback only
        assert (await _set(c, 1, **NET)).status_code == 200                   # and one policy, same shape
        await _until(lambda: len(_pool(s).ready) == 1 and len(_policy_pool(s).ready) == 1)
        loopback = _pool(s).ready[0].handle.id
        before = fake.attaches
        sb = (await c.post("/v1/sandboxes", json={**SHAPE, "allow_internet_access": True})).json()
        assert s.agent.live[sb["id"]].target.handle.id == loopback             # the loopback member
        assert fake.attaches == before + 1 and fake.attached[sb["id"]].allow_internet_access   # at the claim
        assert not any(new == sb["id"] for _, new in fake.rekeyed)
        plain = (await c.post("/v1/sandboxes", json=SHAPE)).json()             # refilled loopback member or cold
        assert plain["id"] not in fake.attached
        await s.agent.control_plane.heartbeat()
        pools = {(p["allow_internet_access"], bool(p["network"])): p for p in (await c.get("/v1/pools")).json()["items"]}
        assert pools[(False, False)]["hits"] >= 1 and pools[(False, True)]["misses"] == 0
        for kw in ({}, NET):
            await _set(c, 0, **kw)


async def test_pool_policy_is_checked_like_a_create(tmp_path) -> None:
    async with stack(tmp_path) as s, s.client() as c:
        r = await _set(c, 1, network={"allow_out": ["nope"]})
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_request"
    for sub in ("off", "cap"):
        (tmp_path / sub).mkdir()
    async with stack(tmp_path / "off", egress=EgressSettings.of(no_egress=True)) as s, s.client() as c:
        r = await _set(c, 1, allow_internet_access=True)
        assert r.status_code == 403 and r.json()["error"]["code"] == "egress_forbidden", r.text
        assert (await _set(c, 1, network={"deny_out": ["10.0.0.0/8"]})).status_code == 200   # opens nothing
        assert [p["network"] for p in (await c.get("/v1/pools")).json()["items"]] == [None]
    async with stack(tmp_path / "cap", egress=EgressSettings.of(allow=["198.18.0.0/15"])) as s, s.client() as c:
        fake = fake_egress(s)
        r = await _set(c, 1, network={"allow_out": ["10.0.0.0/8"]})
        assert r.status_code == 403 and r.json()["error"]["details"]["reason"] == "outside_cap"
        assert (await _set(c, 1, **NET)).status_code == 200
        await _until(lambda: any(p.ready for k, p in s.agent.pools.pools.items() if k[3]))
        assert all(n.cap == ["198.18.0.0/15"] for n in fake.attached.values())   # members made under the cap
        sb = (await c.post("/v1/sandboxes", json={**SHAPE, **NET})).json()
        assert s.agent.live[sb["id"]].target.handle.id.startswith("pd-")
        await _set(c, 0, **NET)


async def test_template_default_policy_makes_the_pool_and_its_creates_match(tmp_path) -> None:
    async with stack(tmp_path) as s, s.client() as c:
        fake = fake_egress(s)
        object.__setattr__(s.agent.templates.get("tiny"), "network", {
            "allow_internet_access": True, "allow_out": [], "deny_out": ["198.18.9.0/24"]})
        s.agent.refresh_templates()
        await s.agent.control_plane.heartbeat()
        r = (await _set(c, 1)).json()                        # unset: the template's default, like a create
        assert r["allow_internet_access"] is True and r["network"]["deny_out"] == ["198.18.9.0/24"]
        await _until(lambda: any(p.ready for k, p in s.agent.pools.pools.items() if k[3]))
        before = fake.attaches
        sb = (await c.post("/v1/sandboxes", json=SHAPE)).json()
        assert s.agent.live[sb["id"]].target.handle.id.startswith("pd-") and fake.attaches <= before + 1
        assert fake.attached[sb["id"]].deny_out == ["198.18.9.0/24"]
        await _set(c, 0)


async def test_a_failed_member_attach_counts_towards_the_breaker_and_leaves_nothing(tmp_path) -> None:
    async with stack(tmp_path) as s, s.client() as c:
        fake = fake_egress(s)

        async def broken(*a: Any) -> int:
            raise RuntimeError("no veth today")
        fake.attach = broken  # type: ignore[method-assign]
        assert (await _set(c, 1, **NET)).status_code == 200
        await _until(lambda: _policy_pool(s).failures >= 2)
        assert "no veth today" in (_policy_pool(s).last_error or "")
        assert await s.runtime.list_ids() == [] or all(not i.startswith("pd-") for i in await s.runtime.list_ids())
        assert fake.released                                  # each failed member's network was released
        await _set(c, 0, **NET)


async def test_claimed_policy_member_pauses_and_resumes_with_its_policy(tmp_path) -> None:
    async with stack(tmp_path) as s, s.client() as c:
        fake = fake_egress(s)
        assert (await _set(c, 1, **NET)).status_code == 200
        await _until(lambda: len(_policy_pool(s).ready) == 1)
        sb = (await c.post("/v1/sandboxes", json={**SHAPE, **NET})).json()
        assert (await c.post(f"/v1/sandboxes/{sb['id']}/pause")).status_code == 200
        del fake.attached[sb["id"]]
        r = await c.post(f"/v1/sandboxes/{sb['id']}/resume")
        assert r.status_code == 200, r.text
        assert fake.attached[sb["id"]].allow_out == ["198.18.0.0/24", "198.19.1.1/32"]   # re-attached on resume
        assert r.json()["network"]["allow_out"] == ["198.18.0.0/24", "198.19.1.1/32"]
        await c.delete(f"/v1/sandboxes/{sb['id']}")
        assert sb["id"] in fake.released
        await _set(c, 0, **NET)


def test_rekey_moves_the_members_record_to_the_sandbox(tmp_path) -> None:
    from pilldrops.node.egress import Egress, EgressConfig
    from pilldrops.node.runtime.base import RuntimeFailure
    eg = Egress(EgressConfig(tag="ab12"), tmp_path)
    eg._record("pd-1", 3, NodeNetwork(allow_internet_access=True))
    eg.rekey("pd-1", "sb_x")
    assert eg.slot_of("sb_x") == 3 and eg.slot_of("pd-1") is None
    assert eg.policy_of("sb_x").allow_internet_access              # type: ignore[union-attr]
    again = Egress(EgressConfig(tag="ab12"), tmp_path)              # what a restarted agent reads
    assert again.slot_of("sb_x") == 3 and again.slot_of("pd-1") is None
    with pytest.raises(RuntimeFailure):
        eg.rekey("pd-2", "sb_y")                                    # a member without a network
