"""Warm claims answered from pre-issued grants (issue 15), on the in-process stack (FakeRuntime) and on both
stores: one store write and no node call before the answer, the node told right after, a control plane that
died in between resynced by the next heartbeat, a member the node no longer holds ended unbilled, racing
control planes, idempotent retries, and ``GrantIndex`` itself."""

from __future__ import annotations

import secrets
import time
from datetime import datetime, timedelta
from typing import Any

import anyio
import pytest

from pilldrops.node import pools as pools_mod
from pilldrops.schema.node import NodeGrant, NodePoolStatus
from pilldrops.server.service.claims import GrantIndex
from pilldrops.server.service.lifecycle import Lifecycle
from pilldrops.server.store.interface import NewSandbox
from tests.stack import Stack, stack, until

pytestmark = pytest.mark.anyio
TELL = Lifecycle._tell
SHAPE = {"template": "tiny", "vcpu": 1, "memory_mb": 256}


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def _until(pred: Any, timeout: float = 10.0) -> None:
    with anyio.fail_after(timeout):
        while not pred():
            await anyio.sleep(0.02)


def _pool(s: Stack) -> pools_mod.Pool:
    return s.agent.pools.pools[pools_mod.key_of("tiny", 1, 256)]


async def _granted_pool(s: Stack, c: Any, size: int = 2) -> None:
    """A pool of ``size`` ready members whose grants the control plane holds."""
    r = await c.put("/v1/pools", json={**SHAPE, "size": size})
    assert r.status_code == 200, r.text
    await _until(lambda: len(_pool(s).ready) == size)
    await anyio.sleep(0.3)             # the agent's own (debounced) heartbeat for members just made ready
    await s.agent._heartbeat()
    assert s.cp.services.sandboxes.ctx.grants.size() == size


async def test_a_claim_is_one_store_write_and_the_node_is_told_after_the_answer(tmp_path, store_url,
                                                                               monkeypatch) -> None:
    async with stack(tmp_path, db_url=store_url) as s, s.client() as c:
        await _granted_pool(s, c)
        store = s.cp.store
        grants = {m.grant.id for m in _pool(s).ready if m.grant}
        calls: list[str] = []

        async def no_placement(*a: Any, **k: Any) -> Any:
            raise AssertionError("a claimable create was placed")

        real_insert = store.insert_claimed

        async def counted(*a: Any, **k: Any) -> Any:
            calls.append("insert_claimed")
            return await real_insert(*a, **k)

        monkeypatch.setattr(store, "place_and_insert", no_placement)
        monkeypatch.setattr(store, "insert_claimed", counted)
        r = await c.post("/v1/sandboxes", json={**SHAPE, "timeout": 60, "envs": {"A": "1"},
                                                "metadata": {"run": "x"}})
        assert r.status_code == 201, r.text
        sb = r.json()
        assert sb["id"] in grants and sb["state"] == "running" and calls == ["insert_claimed"]
        assert sb["started_at"] == sb["created_at"]            # billing starts at the claim
        await _until(lambda: sb["id"] in s.agent.live)         # told right after the answer
        live = s.agent.live[sb["id"]]
        assert live.spec.envs == {"A": "1"} and live.spec.access_token == sb["access_token"]
        assert abs((live.spec.end_at - s.agent.now()).total_seconds() - 60) < 5   # the timeout, on the node
        assert not any(m.grant and m.grant.id == sb["id"] for m in _pool(s).ready)
        listed = (await c.get("/v1/sandboxes", params={"metadata": "run=x"})).json()["items"]
        assert [x["id"] for x in listed] == [sb["id"]]
        run = await c.post(f"/v1/sandboxes/{sb['id']}/run", json={"cmd": "echo hi"})
        assert '"exit_code":0' in run.text.replace(" ", "")
        assert (await c.delete(f"/v1/sandboxes/{sb['id']}")).json()["state"] == "stopped"


async def test_a_claim_is_billed_from_the_claim_however_late_its_node_is_told(tmp_path, monkeypatch) -> None:
    """The billing race of session 5 (``test_claim_refill_and_billing_from_the_claim`` flaked under load):
    the record is running and billed from the claim, but the node is told after the answer, and it counted
    the sandbox's running seconds from that hand-over; so the gap (however long the told-after-the-answer
    task waited for the loop) was billed in the live view and dropped from the final bill, which was then
    short of ``ended_at - started_at`` of a sandbox that ran since its claim. Here the hand-over is held
    past the answer: the node must count from the claim, and the final bill equals the claim-to-end time."""
    async with stack(tmp_path) as s, s.client() as c:
        await _granted_pool(s, c, size=1)
        release = anyio.Event()
        real_tell = Lifecycle._tell
        handed: list[Any] = []

        async def held(self: Lifecycle, *a: Any, **k: Any) -> None:
            await release.wait()                       # the told-after-the-answer task, late
            await real_tell(self, *a, **k)

        real_create = s.agent.create

        async def node_create(spec: Any) -> Any:
            st = await real_create(spec)               # its status right at the hand-over
            handed.append((spec, st))
            return st

        monkeypatch.setattr(Lifecycle, "_tell", held)
        monkeypatch.setattr(s.agent, "create", node_create)
        before = time.monotonic()
        sb = (await c.post("/v1/sandboxes", json={**SHAPE, "timeout": 60})).json()
        answered = time.monotonic()
        assert sb["state"] == "running" and sb["id"] not in s.agent.live
        await anyio.sleep(0.5)
        released = time.monotonic()
        release.set()
        await until(lambda: sb["id"] in s.agent.live)
        (spec, st), = handed
        held_s = released - answered
        assert spec.claimed_s is not None and spec.claimed_s >= held_s
        # the node's running seconds at the hand-over already cover the time since the claim
        assert held_s <= st.run_s <= time.monotonic() - before, (st.run_s, held_s)
        assert 55 <= (st.end_at - s.agent.now()).total_seconds() <= 60 - held_s + 0.01  # the deadline left
        ended = (await c.delete(f"/v1/sandboxes/{sb['id']}")).json()
        done = time.monotonic()
        info = (await c.get(f"/v1/sandboxes/{sb['id']}")).json()
        assert ended["state"] == "stopped" and info["state"] == "stopped"
        ran = (datetime.fromisoformat(info["ended_at"]) - datetime.fromisoformat(info["started_at"])).total_seconds()
        assert held_s <= ran <= done - before                    # claim to end: never the pool time before
        assert info["vcpu_s"] == pytest.approx(ran * SHAPE["vcpu"], abs=1e-3)   # billed = claim to end


async def test_an_idempotent_retry_replays_the_claim_and_wastes_no_member(tmp_path) -> None:
    async with stack(tmp_path) as s, s.client() as c:
        await _granted_pool(s, c)
        first = await c.post("/v1/sandboxes", json=SHAPE, headers={"Idempotency-Key": "ep-1"})
        again = await c.post("/v1/sandboxes", json=SHAPE, headers={"Idempotency-Key": "ep-1"})
        assert first.status_code == 201 and again.json()["id"] == first.json()["id"]
        idx = s.cp.services.sandboxes.ctx.grants                 # the retry's grant was given back: every

        def offered() -> set[str]:
            return {g.id for shapes in idx._by_node.values() for gs in shapes.values() for g in gs}

        # member still offered (once the heartbeat that reported the refill, maybe in flight now, arrived; a
        # grant kept as used would stay out of every later heartbeat's index)
        await _until(lambda: {m.grant.id for m in _pool(s).ready if m.grant and m.reported} <= offered())
        other = await c.post("/v1/sandboxes", json={**SHAPE, "vcpu": 1}, headers={"Idempotency-Key": "ep-2"})
        assert other.json()["id"] != first.json()["id"]


async def test_a_claim_whose_node_was_never_told_is_resynced_by_the_next_heartbeat(tmp_path, monkeypatch) -> None:
    """The control plane "died" between the store write (and its answer) and telling the node."""
    async with stack(tmp_path) as s, s.client() as c:
        await _granted_pool(s, c)
        real_tell = Lifecycle._tell
        dropped: list[str] = []

        async def dies_once(self: Lifecycle, node: Any, row: Any, spec: Any, raise_: bool = False) -> None:
            if not dropped:
                dropped.append(row.id)
                self.ctx.creating.discard(row.id)        # as after a restart: nobody carries it out
                return
            await real_tell(self, node, row, spec, raise_)

        monkeypatch.setattr(Lifecycle, "_tell", dies_once)
        sb = (await c.post("/v1/sandboxes", json={**SHAPE, "timeout": 120})).json()
        await anyio.sleep(0.2)
        assert dropped == [sb["id"]] and sb["id"] not in s.agent.live
        assert s.agent.pools.granted(sb["id"]) is not None           # the member still waits for it
        await s.agent._heartbeat()                                    # lists the grant: the node is told
        await _until(lambda: sb["id"] in s.agent.live)
        live = s.agent.live[sb["id"]]
        assert 100 < (live.spec.end_at - s.agent.now()).total_seconds() <= 121   # what the record has left
        info = (await c.get(f"/v1/sandboxes/{sb['id']}")).json()
        assert info["state"] == "running"


async def test_a_member_the_node_no_longer_holds_ends_the_claim_failed_and_unbilled(tmp_path,
                                                                                    monkeypatch) -> None:
    async with stack(tmp_path) as s, s.client() as c:
        await _granted_pool(s, c, size=1)
        monkeypatch.setattr(s.agent.pools, "claim_grant", lambda *a, **k: None)    # retired meanwhile
        sb = (await c.post("/v1/sandboxes", json=SHAPE)).json()

        async def ended() -> bool:
            return (await c.get(f"/v1/sandboxes/{sb['id']}")).json()["state"] == "failed"
        with anyio.fail_after(10):
            while not await ended():
                await anyio.sleep(0.05)
        info = (await c.get(f"/v1/sandboxes/{sb['id']}")).json()
        assert info["end_reason"] == "failed_start" and info["cost_usd"] == 0, info
        assert sb["id"] not in s.agent.live


async def test_two_control_planes_racing_for_one_member_record_it_once(tmp_path, store_url) -> None:
    async with stack(tmp_path, db_url=store_url) as s:
        now = s.cp.services.sandboxes.ctx.clock.now()
        node_id = s.agent.node_id

        def new(team: str) -> NewSandbox:
            return NewSandbox(id="sb_grant0000000000001", team_id=team, template="tiny", vcpu=1, memory_mb=256,
                              timeout=60, state="running", access_token=secrets.token_urlsafe(8),
                              created_at=now, end_at=now + timedelta(seconds=60), metadata={"k": "v"})
        results: list[Any] = []

        async def one() -> None:
            results.append(await s.cp.store.insert_claimed(new(s.team_id), node_id, now))
        async with anyio.create_task_group() as tg:
            tg.start_soon(one)
            tg.start_soon(one)
        won = [r for r in results if r is not None]
        assert len(won) == 1 and won[0].state == "running" and won[0].started_at is not None


def test_grant_index_pops_each_grant_once_by_shape_and_version() -> None:
    t = [0.0]
    idx = GrantIndex(clock=lambda: t[0])
    st = NodePoolStatus(template="tiny", vcpu=1, memory_mb=256, size=2, grants=[
        NodeGrant(id="sb_a", access_token="x", template_version="3"),
        NodeGrant(id="sb_b", access_token="y", template_version="4")])
    idx.update("n1", [st])
    assert idx.listed("n1", "sb_a") and idx.size() == 2
    assert idx.pop("tiny", 2, 256, None, lambda n: True) is None                 # another shape
    assert idx.pop("tiny", 1, 256, "4", lambda n: False) is None                 # node not usable
    assert idx.pop("tiny", 1, 256, "4", lambda n: True)[1].id == "sb_b"          # type: ignore[index]
    idx.update("n1", [st])                           # a heartbeat composed before that claim
    assert idx.size() == 1 and idx.listed("n1", "sb_b")                          # never offered again
    got = idx.pop("tiny", 1, 256, None, lambda n: True)
    assert got is not None and got[1].id == "sb_a"
    idx.give_back("n1", got[1], "tiny", 1, 256)
    assert idx.size() == 1
    t[0] = 1000.0                                    # long after: a grant still listed is offered again
    idx.update("n1", [st])
    assert idx.size() == 2
    idx.drop_node("n1")
    assert idx.size() == 0 and not idx.listed("n1", "sb_a")


async def test_reported_members_are_never_claimed_anonymously(tmp_path) -> None:
    async with stack(tmp_path) as s, s.client() as c:
        await _granted_pool(s, c, size=1)
        pools = s.agent.pools
        assert pools.claim("tiny", 1, 256) is None                   # reported: only its grant takes it
        gid = next(m.grant.id for m in _pool(s).ready if m.grant)
        assert pools.claim_grant(gid, "tiny", 2, 256) is None        # not of that shape
        waiter_done: list[bool] = []

        async def waiter() -> None:
            await pools.wait_granted(gid, 5)
            waiter_done.append(True)
        async with anyio.create_task_group() as tg:
            tg.start_soon(waiter)
            await anyio.sleep(0.05)
            assert not waiter_done
            assert pools.claim_grant(gid, "tiny", 1, 256) is not None
        assert waiter_done and pools.granted(gid) is None and pools.claim_grant(gid, "tiny", 1, 256) is None


# ---- stranded members (review of issue 15): a grant that can never be claimed is dropped for good, and its
# member retired on the node, never left reported (which only its grant may claim) ---------------------------

async def _state(c: Any, sid: str) -> str:
    return (await c.get(f"/v1/sandboxes/{sid}")).json()["state"]


async def test_a_member_of_another_disk_than_the_create_is_not_claimed(tmp_path) -> None:
    """``serve --default-disk-mb`` other than ``node --default-disk-mb``: the member's disk is not the
    create's, so its grant is not popped for it (before: answered running, then ended failed_start, and the
    member stranded); the regular path creates it, with the disk the control plane gives it."""
    async with stack(tmp_path) as s, s.client() as c:
        await _granted_pool(s, c, size=1)
        member = _pool(s).ready[0]
        assert member.grant is not None and member.grant.disk_mb == s.agent.template_cache.default_disk_mb
        s.cp.services.sandboxes.lifecycle.default_disk_mb = member.grant.disk_mb // 2
        r = await c.post("/v1/sandboxes", json={**SHAPE, "timeout": 60})
        assert r.status_code == 201, r.text
        sb = r.json()
        assert sb["id"] != member.grant.id and sb["state"] == "running"
        await anyio.sleep(0.2)
        assert await _state(c, sb["id"]) == "running" and sb["id"] in s.agent.live
        assert s.agent.live[sb["id"]].spec.disk_mb == member.grant.disk_mb // 2
        assert s.agent.pools.granted(member.grant.id) is not None      # still offered to a create it fits
        s.cp.services.sandboxes.lifecycle.default_disk_mb = member.grant.disk_mb
        again = (await c.post("/v1/sandboxes", json={**SHAPE, "timeout": 60})).json()
        assert again["id"] == member.grant.id
        await _until(lambda: again["id"] in s.agent.live)


async def test_a_refused_hand_over_retires_the_member_and_drops_its_grant_for_good(tmp_path, monkeypatch) -> None:
    async with stack(tmp_path) as s, s.client() as c:
        await _granted_pool(s, c, size=1)
        gid = _pool(s).ready[0].grant.id                             # type: ignore[union-attr]
        real = s.agent.pools.claim_grant
        monkeypatch.setattr(s.agent.pools, "claim_grant", lambda *a, **k: None)    # refused (other build, say)
        sb = (await c.post("/v1/sandboxes", json=SHAPE)).json()
        assert sb["id"] == gid
        with anyio.fail_after(10):
            while await _state(c, gid) != "failed":
                await anyio.sleep(0.05)
        monkeypatch.setattr(s.agent.pools, "claim_grant", real)
        assert s.agent.pools.granted(gid) is None                    # retired, not left reported
        await _until(lambda: len(_pool(s).ready) == 1 and _pool(s).ready[0].grant.id != gid)  # type: ignore[union-attr]
        idx = s.cp.services.sandboxes.ctx.grants
        idx.update(s.agent.node_id, [NodePoolStatus(**SHAPE, size=1, grants=[
            NodeGrant(id=gid, access_token="x")])])                   # a heartbeat composed before it
        assert idx.pop("tiny", 1, 256, None, lambda n: True) is None    # never offered again
        other = (await c.post("/v1/sandboxes", json=SHAPE)).json()   # never tried again: the regular path
        assert other["id"] != gid and other["state"] == "running"


async def _claim_never_told(s: Stack, c: Any, monkeypatch: Any) -> str:
    """A claim answered, its node never told (the tell's outcome unknown): the grant stays listed."""
    dropped: list[str] = []

    async def lost(self: Lifecycle, node: Any, row: Any, *a: Any, **k: Any) -> None:
        dropped.append(row.id)
        self.ctx.creating.discard(row.id)

    monkeypatch.setattr(Lifecycle, "_tell", lost)
    sb = (await c.post("/v1/sandboxes", json={**SHAPE, "timeout": 120})).json()
    await _until(lambda: dropped == [sb["id"]])
    assert s.agent.pools.granted(sb["id"]) is not None
    return str(sb["id"])


async def test_a_claim_killed_before_its_node_was_told_retires_its_member(tmp_path, monkeypatch) -> None:
    async with stack(tmp_path) as s, s.client() as c:
        await _granted_pool(s, c, size=1)
        sid = await _claim_never_told(s, c, monkeypatch)
        r = await c.delete(f"/v1/sandboxes/{sid}")
        assert r.status_code in (200, 204), r.text
        assert await _state(c, sid) in ("killed", "stopped")
        assert s.agent.pools.granted(sid) is None                    # the kill reached it: retired
        await _until(lambda: len(_pool(s).ready) == 1 and _pool(s).ready[0].grant.id != sid)  # type: ignore[union-attr]
        monkeypatch.undo()
        await anyio.sleep(0.3)
        await s.agent._heartbeat()
        fresh = _pool(s).ready[0].grant.id                          # type: ignore[union-attr]
        again = (await c.post("/v1/sandboxes", json=SHAPE)).json()   # the refilled member, claimed at once
        assert again["id"] == fresh and again["state"] == "running"
        await _until(lambda: again["id"] in s.agent.live)


async def test_a_claim_ended_before_its_node_was_told_is_stopped_there_by_the_next_heartbeat(tmp_path,
                                                                                             monkeypatch) -> None:
    """Its record ended (timed out, killed) and the kill did not reach the node: the reconciler stops it
    there at the next heartbeat that still lists the grant (the node retires the member), and no create
    tries that grant again (before: one failing insert per create, the member stranded for ever)."""
    async with stack(tmp_path) as s, s.client() as c:
        await _granted_pool(s, c, size=1)
        sid = await _claim_never_told(s, c, monkeypatch)
        store = s.cp.store
        assert await store.update_sandbox(sid, from_states=["running"], state="stopped", end_reason="killed",
                                          ended_at=s.cp.services.sandboxes.ctx.clock.now())
        inserts: list[str] = []
        real_insert = store.insert_claimed

        async def counted(new: Any, *a: Any, **k: Any) -> Any:
            inserts.append(new.id)
            return await real_insert(new, *a, **k)
        monkeypatch.setattr(store, "insert_claimed", counted)
        await s.agent._heartbeat()                   # lists the grant: its record has ended
        await _until(lambda: s.agent.pools.granted(sid) is None)
        await _until(lambda: len(_pool(s).ready) == 1 and _pool(s).ready[0].grant.id != sid)  # type: ignore[union-attr]
        monkeypatch.setattr(Lifecycle, "_tell", TELL)
        await anyio.sleep(0.3)
        await s.agent._heartbeat()
        sb = (await c.post("/v1/sandboxes", json=SHAPE)).json()
        assert sid not in inserts and sb["id"] != sid and sb["state"] == "running"
        await _until(lambda: sb["id"] in s.agent.live)


async def test_a_claim_whose_member_was_retired_before_the_tell_is_billed_from_the_claim(tmp_path,
                                                                                       monkeypatch) -> None:
    """The member is really retired (its pool removed) between the heartbeat that offered it and the tell:
    the node makes the sandbox another way (cold here), and counts its running time from the claim, as
    the record's started_at says (before: from the late hand-over)."""
    async with stack(tmp_path) as s, s.client() as c:
        await _granted_pool(s, c, size=1)
        gid = _pool(s).ready[0].grant.id                             # type: ignore[union-attr]
        go = anyio.Event()

        async def late(self: Lifecycle, *a: Any, **k: Any) -> None:
            await go.wait()
            await TELL(self, *a, **k)
        monkeypatch.setattr(Lifecycle, "_tell", late)
        sb = (await c.post("/v1/sandboxes", json={**SHAPE, "timeout": 120})).json()
        assert sb["id"] == gid
        s.agent.configure_pools([])                                  # the pool is removed: its member retired
        await _until(lambda: s.agent.pools.granted(gid) is None)
        await anyio.sleep(1.0)
        go.set()
        await _until(lambda: gid in s.agent.live)
        live = s.agent.live[gid]
        started = datetime.fromisoformat(sb["started_at"])
        assert abs((live.started_at - started).total_seconds()) < 0.5, (live.started_at, started)
        assert time.monotonic() - live.started_mono >= 1.0           # counted from the claim, not the tell
        assert await _state(c, gid) == "running"


def test_grant_index_discards_a_dead_grant_for_good_while_a_node_lists_it() -> None:
    idx = GrantIndex(clock=lambda: 0.0)
    st = NodePoolStatus(template="tiny", vcpu=1, memory_mb=256, size=2, grants=[
        NodeGrant(id="sb_a", access_token="x", disk_mb=10240), NodeGrant(id="sb_b", access_token="y")])
    idx.update("n1", [st])
    assert idx.pop("tiny", 1, 256, None, lambda n: True, lambda n, g: g.disk_mb in (None, 4096))[1].id == "sb_b"  # type: ignore[index]
    idx.discard("sb_a")
    idx.update("n1", [st])
    assert idx.size() == 0 and set(idx.listed_popped("n1")) == {"sb_a", "sb_b"}   # popped, dead
    idx.stopped("sb_a")
    assert "sb_a" not in idx.listed_popped("n1")                   # asked to retire it once only
    idx.update("n1", [])                                           # no longer listed: forgotten
    assert not idx.popped("sb_a")
    assert NodeGrant(id="sb_c", access_token="z").model_dump(mode="json").keys() == {
        "id", "access_token", "template_version"}                  # an older control plane's wire


async def test_a_claim_whose_egress_tell_is_unanswered_is_that_error_not_a_replay_of_itself(tmp_path,
                                                                                           monkeypatch) -> None:
    """A claim with egress is answered once its node attached it; when the node's answer is lost (the outcome
    unknown: the record stays, with its key, for the heartbeat to settle) the request gets that error. The
    key is checked by the insert, and an error after this very request's insert is never answered as a
    replay of the row it made itself (that would hand out, as created, a sandbox its node may not have)."""
    import httpx

    from pilldrops import errors

    async with stack(tmp_path) as s, s.client() as c:
        await _granted_pool(s, c, size=1)
        nodes = s.cp.node_client

        async def unanswered(*a: Any, **k: Any) -> Any:
            try:
                raise httpx.ReadTimeout("no answer")
            except httpx.ReadTimeout as exc:
                raise errors.NodeUnavailable("node did not answer") from exc

        monkeypatch.setattr(nodes, "create", unanswered)
        r = await c.post("/v1/sandboxes", json={**SHAPE, "allow_internet_access": True},
                         headers={"Idempotency-Key": "episode-egress"})
        assert r.status_code == 502, r.text
        assert r.json()["error"]["code"] == "node_unavailable"
