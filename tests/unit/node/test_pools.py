"""Warm pools through the control plane and the node agent on the FakeRuntime: claims, misses, refill
with bounded concurrency, the circuit breaker, reserved capacity, billing from the claim, resizing."""

from __future__ import annotations

import itertools
import time
from datetime import UTC, datetime
from typing import Any

import anyio
import httpx
import pytest

from pilldrops.node import pools as pools_mod
from tests.stack import Stack, stack
from tests.stack import until as _until

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def _pool(s: Stack, template: str = "tiny", vcpu: float = 1, memory_mb: int = 256) -> pools_mod.Pool:
    return s.agent.pools.pools[pools_mod.key_of(template, vcpu, memory_mb)]


async def _set(c: httpx.AsyncClient, size: int, **kw: Any) -> dict[str, Any]:
    r = await c.put("/v1/pools", json={"template": "tiny", "vcpu": 1, "memory_mb": 256, "size": size, **kw})
    assert r.status_code == 200, r.text
    return r.json()


async def test_claim_refill_and_billing_from_the_claim(tmp_path) -> None:
    async with stack(tmp_path) as s, s.client() as c:
        await _set(c, 3)
        await _until(lambda: len(_pool(s).ready) == 3)
        members = {m.handle.id for m in _pool(s).ready}
        await anyio.sleep(0.5)                        # pool time is never billed
        before, before_mono = datetime.now(UTC), time.monotonic()
        sb = (await c.post("/v1/sandboxes", json={"template": "tiny", "vcpu": 1, "memory_mb": 256})).json()
        assert sb["state"] == "running"
        await _until(lambda: sb["id"] in s.agent.live)    # told right after the answer (a pre-issued member)
        live = s.agent.live[sb["id"]]
        assert live.target.handle.id in members and s.agent.stats.claimed == 1
        info = (await c.get(f"/v1/sandboxes/{sb['id']}")).json()
        # billed from the claim (made during the create request), never from before it: bounds, not timings
        assert datetime.fromisoformat(info["started_at"]) >= before
        assert 0 <= info["vcpu_s"] <= time.monotonic() - before_mono
        assert live.started_mono is not None and live.started_mono >= before_mono   # the node's count too
        r = await c.post(f"/v1/sandboxes/{sb['id']}/run", json={"cmd": "echo hi"})
        assert '"exit_code":0' in r.text.replace(" ", "")
        await _until(lambda: len(_pool(s).ready) == 3)          # refilled with a new member
        assert live.target.handle.id not in {m.handle.id for m in _pool(s).ready}
        # a claimed member is never handed out again, even after its sandbox ended
        await c.delete(f"/v1/sandboxes/{sb['id']}")
        done = time.monotonic()
        info = (await c.get(f"/v1/sandboxes/{sb['id']}")).json()
        ran = (datetime.fromisoformat(info["ended_at"]) - datetime.fromisoformat(info["started_at"])).total_seconds()
        assert 0 < ran <= done - before_mono and info["vcpu_s"] == pytest.approx(ran, abs=1e-3)  # claim to end
        assert live.target.handle.id not in {m.handle.id for m in _pool(s).ready}
        assert live.target.handle.id not in await s.runtime.list_ids()
        listed = (await c.get("/v1/pools")).json()["items"]
        await _until(lambda: True)
        assert listed[0]["template"] == "tiny" and listed[0]["size"] == 3


async def test_misses_fall_back_to_cold_creates_and_are_counted(tmp_path) -> None:
    async with stack(tmp_path) as s, s.client() as c:
        s.runtime.create_delay = 0.3
        await _set(c, 1)
        await _until(lambda: len(_pool(s).ready) == 1)
        await s.agent._heartbeat()       # the control plane holds its grant (a reported member is claimed by it)
        # the claim's refill (a member: id ``pd-...``) waits until the three creates are done: on a loaded
        # machine the third create could otherwise come after the refilled member is ready and claim it
        refill_may_finish, real_create = anyio.Event(), s.runtime.create

        async def create_gated(spec: Any) -> Any:
            if spec.id.startswith("pd-"):
                await refill_may_finish.wait()
            return await real_create(spec)

        s.runtime.create = create_gated  # type: ignore[method-assign]
        codes: list[int] = []

        async def create() -> None:
            r = await c.post("/v1/sandboxes", json={"template": "tiny", "vcpu": 1, "memory_mb": 256})
            codes.append(r.status_code)

        async with anyio.create_task_group() as tg:      # at once: one claims, two boot cold
            for _ in range(3):
                tg.start_soon(create)
        assert codes == [201] * 3
        refill_may_finish.set()
        other = await c.post("/v1/sandboxes", json={"template": "tiny", "vcpu": 2, "memory_mb": 256})
        assert other.status_code == 201                           # another shape: not pooled, not a miss
        pool = _pool(s)
        await _until(lambda: pool.hits == 1)             # the claim's node is told right after its answer
        assert (pool.hits, pool.misses) == (1, 2) and s.agent.stats.claimed == 1
        await s.agent._heartbeat()
        info = (await c.get("/v1/pools")).json()["items"][0]
        assert info["hits"] == 1 and info["misses"] == 2 and info["hit_rate"] == pytest.approx(1 / 3, abs=1e-3)


async def test_refill_concurrency_is_bounded(tmp_path) -> None:
    async with stack(tmp_path) as s, s.client() as c:
        s.runtime.create_delay = 0.05
        await _set(c, 12)
        await _until(lambda: len(_pool(s).ready) == 12)
        assert s.runtime.max_concurrent_creates <= s.agent.settings.pool_concurrency
        assert s.runtime.create_calls == 12                      # no runaway: exactly the deficit
        await _set(c, 4)                                         # shrink: the surplus is destroyed
        await _until(lambda: len(_pool(s).ready) == 4 and len(s.runtime._boxes) == 4)
        await _set(c, 0)                                         # remove
        await _until(lambda: not s.agent.pools.pools and not s.runtime._boxes)


async def test_circuit_breaker_stops_refills_after_repeated_failures(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(pools_mod, "BACKOFF_MIN_S", 0.5)
    async with stack(tmp_path) as s, s.client() as c:
        s.runtime.fail_create = True
        await _set(c, 4)
        await _until(lambda: _pool(s).breaker_open)
        calls = s.runtime.create_calls
        assert pools_mod.BREAKER_FAILURES <= calls <= pools_mod.BREAKER_FAILURES + 1
        await anyio.sleep(0.3)                                   # open: no refills at all
        assert s.runtime.create_calls == calls
        assert "fail_create" in (_pool(s).last_error or "")
        await s.agent._heartbeat()
        assert (await c.get("/v1/pools")).json()["items"][0]["breaker_open"] is True
        s.runtime.fail_create = False                            # half-open trial succeeds: closed again
        await _until(lambda: len(_pool(s).ready) == 4)
        assert not _pool(s).breaker_open and _pool(s).failures == 0


async def test_pool_members_are_reserved_capacity(tmp_path) -> None:
    async with stack(tmp_path, capacity_vcpu=4, capacity_memory_mb=4096) as s, s.client() as c:
        await _set(c, 2)                                          # 2 x 1 vCPU reserved of 4
        r = await c.post("/v1/sandboxes", json={"template": "tiny", "vcpu": 3, "memory_mb": 256})
        assert r.status_code == 503 and r.json()["error"]["code"] == "capacity_unavailable"
        assert (await c.post("/v1/sandboxes", json={"template": "tiny", "vcpu": 2, "memory_mb": 256})).status_code == 201


async def test_pools_need_admin_and_a_known_template(tmp_path) -> None:
    async with stack(tmp_path) as s, s.client() as c:
        r = await c.put("/v1/pools", json={"template": "nope", "size": 1})
        assert r.status_code == 404 and r.json()["error"]["code"] == "template_not_found"
        assert (await c.put("/v1/pools", json={"template": "tiny", "size": -1})).status_code == 400
        other = await s.new_team_key("other")
        async with s.client(key=other) as c2:
            r = await c2.put("/v1/pools", json={"template": "tiny", "size": 1})
            assert r.status_code == 403
            assert (await c2.get("/v1/pools")).status_code == 200


async def test_restarted_agent_reaps_unclaimed_members(tmp_path) -> None:
    async with stack(tmp_path) as s, s.client() as c:
        await _set(c, 2)
        await _until(lambda: len(_pool(s).ready) == 2)
        sb = (await c.post("/v1/sandboxes", json={"template": "tiny", "vcpu": 1, "memory_mb": 256})).json()
        await _until(lambda: sb["id"] in s.agent.live)   # a pre-issued member: told after the answer
        member = s.agent.live[sb["id"]].target.handle.id
        await _until(lambda: len(_pool(s).ready) == 2)
        unclaimed = {m.handle.id for m in _pool(s).ready}
        # a new agent on the same state dir and runtime: adopts the claimed one, reaps the unclaimed ones
        from pilldrops.node.agent import NodeAgent
        again = NodeAgent(s.agent.settings, s.runtime, s.agent.templates, tmp_path / "node")
        await again._recover()
        assert sb["id"] in again.live and again.live[sb["id"]].target.handle.id == member
        assert not unclaimed & set(await s.runtime.list_ids())


async def test_a_rebuilt_template_retires_older_members(tmp_path) -> None:
    async with stack(tmp_path) as s, s.client() as c:
        await _set(c, 2)
        await _until(lambda: len(_pool(s).ready) == 2)
        old = {m.handle.id for m in _pool(s).ready}
        from tests.stack import FakeTemplate
        s.agent.templates.items["tiny"] = FakeTemplate("tiny", built_at=123.0)      # a new build
        s.agent.refresh_templates()
        await _until(lambda: len(_pool(s).ready) == 2 and not old & {m.handle.id for m in _pool(s).ready})
        assert not old & set(await s.runtime.list_ids())


async def test_removing_a_pool_that_does_not_exist_is_404(tmp_path) -> None:
    async with stack(tmp_path) as s, s.client() as c:
        await _set(c, 1)
        r = await c.put("/v1/pools", json={"template": "tiny", "vcpu": 1, "memory_mb": 999, "size": 0})
        assert r.status_code == 404 and "tiny 1 vCPU / 256 MiB" in r.json()["error"]["message"]
        await _set(c, 0)
        await _until(lambda: not s.agent.pools.pools)


async def test_members_becoming_ready_together_wake_debounced_heartbeats(tmp_path, monkeypatch) -> None:
    """Each ready member wakes a heartbeat (its grant is reported at once), but at most one per
    ``HEARTBEAT_DEBOUNCE_S``: a burst of refills is not a burst of full heartbeats back to back."""
    from pilldrops.node import agent as agent_mod
    async with stack(tmp_path) as s, s.client() as c:
        sent: list[float] = []
        real = s.agent.control_plane.heartbeat

        async def timed() -> None:
            sent.append(time.monotonic())
            await real()
        monkeypatch.setattr(s.agent.control_plane, "heartbeat", timed)
        real_create, made = s.runtime.create, [0]

        async def staggered(spec: Any) -> Any:           # members become ready one every 50 ms
            made[0] += 1
            await anyio.sleep(0.05 * made[0])
            return await real_create(spec)
        monkeypatch.setattr(s.runtime, "create", staggered)
        s.agent.pools.concurrency = 8
        await _set(c, 8)
        await _until(lambda: len(_pool(s).ready) == 8)
        grants = s.cp.services.sandboxes.ctx.grants
        with anyio.fail_after(2):                       # still prompt: reported well before the 5 s interval
            while grants.size() < 8:
                await anyio.sleep(0.01)
        gaps = [b - a for a, b in itertools.pairwise(sent)]
        assert sent and all(g >= agent_mod.HEARTBEAT_DEBOUNCE_S * 0.9 for g in gaps), gaps


async def test_a_granted_member_is_retired_by_its_grant_id(tmp_path) -> None:
    async with stack(tmp_path) as s, s.client() as c:
        await _set(c, 1)
        await _until(lambda: len(_pool(s).ready) == 1)
        member = _pool(s).ready[0]
        assert member.grant is not None and s.agent.pools.retire_grant(member.grant.id)
        assert s.agent.pools.granted(member.grant.id) is None and not s.agent.pools.retire_grant(member.grant.id)
        await _until(lambda: len(_pool(s).ready) == 1 and _pool(s).ready[0] is not member)    # refilled
        await _until(lambda: member.handle.id not in s.runtime._boxes)                       # destroyed
        with pytest.raises(Exception, match="never handed over|not on this node"):
            await s.agent.kill(member.grant.id)
