"""Pause and resume through the control plane and the node agent (FakeRuntime: the logic, not CRIU; the
real checkpoint is tested in tests/integration/test_checkpoint.py and tests/e2e/test_pause_e2e.py)."""

from __future__ import annotations

import json
from typing import Any

import anyio
import httpx
import pytest

from tests.stack import stack

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def _create(c: httpx.AsyncClient, **kw: Any) -> dict[str, Any]:
    r = await c.post("/v1/sandboxes", json={"template": "tiny", **kw})
    assert r.status_code == 201, r.text
    return r.json()


async def _run(c: httpx.AsyncClient, sid: str, cmd: str) -> dict[str, Any]:
    r = await c.post(f"/v1/sandboxes/{sid}/run", json={"cmd": cmd})
    assert r.status_code == 200, r.text
    events = [json.loads(line) for line in r.text.splitlines() if line.strip()]
    out = "".join(__import__("base64").b64decode(e["data"]).decode() for e in events if e["type"] == "stdout")
    return {"out": out, "exit": events[-1]}


async def test_pause_resume_keeps_files_and_states_flow(tmp_path, store_url) -> None:
    async with stack(tmp_path, db_url=store_url) as s, s.client() as c:
        sb = await _create(c, timeout=600)
        sid = sb["id"]
        assert (await _run(c, sid, "echo hello > f.txt"))["exit"]["exit_code"] == 0
        r = await c.post(f"/v1/sandboxes/{sid}/pause")
        assert r.status_code == 200, r.text
        info = r.json()
        assert info["state"] == "paused" and info["checkpoint_bytes"] > 0 and info["paused_at"]
        assert 590 < info["timeout_left"] <= 600
        assert sid in s.agent.paused and sid not in s.agent.live and await s.runtime.list_ids() == []
        # a paused sandbox runs nothing, and says why
        r = await c.post(f"/v1/sandboxes/{sid}/run", json={"cmd": "true"})
        assert r.status_code == 409 and r.json()["error"]["code"] == "invalid_state"
        assert "paused" in r.json()["error"]["message"]
        # it holds no capacity on its node
        assert (await s.cp.store.allocations()).get(info["node_id"], (0, 0)) == (0, 0)
        r = await c.post(f"/v1/sandboxes/{sid}/resume")
        assert r.status_code == 200, r.text
        back = r.json()
        assert back["state"] == "running" and back["paused_at"] is None and back["access_token"]
        assert (await _run(c, sid, "cat f.txt"))["out"] == "hello\n"
        assert not (tmp_path / "node" / "checkpoints" / sid).exists()       # image dropped after restore
        hist = (await c.get("/v1/history")).json()["items"][0]
        assert len(hist["pauses"]) == 1 and hist["pauses"][0]["resumed_at"] is not None
        assert hist["pauses"][0]["checkpoint_bytes"] == info["checkpoint_bytes"]


async def test_illegal_transitions_are_409_naming_both_states(tmp_path, store_url) -> None:
    async with stack(tmp_path, db_url=store_url) as s, s.client() as c:
        sid = (await _create(c))["id"]
        r = await c.post(f"/v1/sandboxes/{sid}/resume")
        assert r.status_code == 409
        assert r.json()["error"]["details"] == {"from": "running", "to": "running"}
        assert (await c.post(f"/v1/sandboxes/{sid}/pause")).status_code == 200
        r = await c.post(f"/v1/sandboxes/{sid}/pause")
        assert r.status_code == 409 and r.json()["error"]["details"] == {"from": "paused", "to": "paused"}
        assert "paused" in r.json()["error"]["message"]
        await c.delete(f"/v1/sandboxes/{sid}")
        r = await c.post(f"/v1/sandboxes/{sid}/resume")
        assert r.status_code == 409 and r.json()["error"]["details"] == {"from": "stopped", "to": "running"}
        assert (await c.post("/v1/sandboxes/sb_nope/pause")).status_code == 404


async def test_two_concurrent_resumes_exactly_one_wins(tmp_path, store_url) -> None:
    async with stack(tmp_path, db_url=store_url) as s, s.client() as c:
        for _ in range(3):
            sid = (await _create(c))["id"]
            assert (await c.post(f"/v1/sandboxes/{sid}/pause")).status_code == 200
            codes: list[int] = []

            async def resume(sid: str = sid, codes: list[int] = codes) -> None:
                codes.append((await c.post(f"/v1/sandboxes/{sid}/resume")).status_code)

            async with anyio.create_task_group() as tg:
                for _ in range(4):
                    tg.start_soon(resume)
            assert sorted(codes) == [200, 409, 409, 409]
            assert (await c.get(f"/v1/sandboxes/{sid}")).json()["state"] == "running"
            assert list(s.runtime._boxes).count(sid) == 1


async def test_a_run_in_flight_ends_promptly_as_paused(tmp_path) -> None:
    async with stack(tmp_path) as s, s.client() as c:
        sid = (await _create(c))["id"]
        result: dict[str, Any] = {}

        async def long_run() -> None:
            result.update(await _run(c, sid, "echo started; sleep 60; echo never"))

        with anyio.fail_after(15):
            async with anyio.create_task_group() as tg:
                tg.start_soon(long_run)
                while not s.agent.live[sid].target.active:
                    await anyio.sleep(0.02)
                r = await c.post(f"/v1/sandboxes/{sid}/pause")
                assert r.status_code == 200, r.text
        assert result["exit"]["paused"] is True and "never" not in result["out"]
        assert result["exit"]["exit_code"] != 0


async def test_failures_leave_a_consistent_state(tmp_path, store_url) -> None:
    async with stack(tmp_path, db_url=store_url) as s, s.client() as c:
        sid = (await _create(c))["id"]
        s.runtime.fail_checkpoint = True
        r = await c.post(f"/v1/sandboxes/{sid}/pause")
        assert r.status_code == 500 and "keeps running" in r.json()["error"]["message"]
        assert (await c.get(f"/v1/sandboxes/{sid}")).json()["state"] == "running"
        assert (await _run(c, sid, "echo ok"))["out"] == "ok\n"
        s.runtime.fail_checkpoint = False
        assert (await c.post(f"/v1/sandboxes/{sid}/pause")).status_code == 200
        s.runtime.fail_restore = True
        r = await c.post(f"/v1/sandboxes/{sid}/resume")
        assert r.status_code == 500 and "stays paused" in r.json()["error"]["message"]
        assert (await c.get(f"/v1/sandboxes/{sid}")).json()["state"] == "paused"
        s.runtime.fail_restore = False
        assert (await c.post(f"/v1/sandboxes/{sid}/resume")).json()["state"] == "running"
        # a node that cannot checkpoint says so
        s.runtime.checkpoint_supported = False
        r = await c.post(f"/v1/sandboxes/{sid}/pause")
        assert r.status_code == 501 and r.json()["error"]["code"] == "not_supported"
        assert (await c.get(f"/v1/sandboxes/{sid}")).json()["state"] == "running"


async def test_paused_time_bills_storage_only_and_does_not_count_against_the_timeout(
        tmp_path, store_url) -> None:
    async with stack(tmp_path, db_url=store_url) as s, s.client() as c:
        sid = (await _create(c, timeout=2))["id"]
        await _run(c, sid, "head -c 2000000 /dev/zero > big")
        paused = (await c.post(f"/v1/sandboxes/{sid}/pause")).json()
        vcpu_at_pause = paused["vcpu_s"]
        await anyio.sleep(2.5)                     # longer than its whole timeout
        mid = (await c.get(f"/v1/sandboxes/{sid}")).json()
        assert mid["state"] == "paused" and mid["vcpu_s"] == pytest.approx(vcpu_at_pause, abs=0.05)
        assert mid["storage_gb_s"] > 0
        back = (await c.post(f"/v1/sandboxes/{sid}/resume")).json()
        assert back["state"] == "running" and back["storage_gb_s"] > 0
        with anyio.fail_after(10):                 # the rest of its timeout runs out after the resume
            while (await c.get(f"/v1/sandboxes/{sid}")).json()["state"] == "running":
                await anyio.sleep(0.1)
        end = (await c.get(f"/v1/sandboxes/{sid}")).json()
        assert end["end_reason"] == "timeout"
        assert 1.5 < end["vcpu_s"] < 3.0            # ~2 s of running time, the 2.5 s paused not included
        hist = (await c.get("/v1/history")).json()["items"][0]
        (p,) = hist["pauses"]
        assert p["storage_gb_s"] == pytest.approx(end["storage_gb_s"], rel=1e-6)
        from datetime import datetime
        paused_s = (datetime.fromisoformat(p["resumed_at"]) - datetime.fromisoformat(p["paused_at"])).total_seconds()
        assert paused_s >= 2.5
        assert p["storage_gb_s"] == pytest.approx(p["checkpoint_bytes"] / 1024**3 * paused_s, rel=1e-3)


async def test_kill_while_paused_and_retention(tmp_path, store_url) -> None:
    async with stack(tmp_path, db_url=store_url, paused_retention_s=1.0) as s, s.client() as c:
        a, b = (await _create(c))["id"], (await _create(c))["id"]
        for sid in (a, b):
            await _run(c, sid, "head -c 20000000 /dev/zero > big")
            assert (await c.post(f"/v1/sandboxes/{sid}/pause")).status_code == 200
        killed = (await c.delete(f"/v1/sandboxes/{a}")).json()
        assert killed["state"] == "stopped" and killed["end_reason"] == "killed" and killed["storage_gb_s"] > 0
        assert not (tmp_path / "node" / "checkpoints" / a).exists() and a not in s.agent.paused
        with anyio.fail_after(10):
            while (await c.get(f"/v1/sandboxes/{b}")).json()["state"] == "paused":
                await anyio.sleep(0.1)
        expired = (await c.get(f"/v1/sandboxes/{b}")).json()
        assert expired["state"] == "stopped" and expired["end_reason"] == "paused_expired"
        assert b not in s.agent.paused


async def test_resume_moves_to_another_node_when_its_own_is_full(tmp_path, store_url) -> None:
    async with stack(tmp_path, db_url=store_url, nodes=2, capacity_vcpu=2, capacity_memory_mb=4096) as s, \
            s.client() as c:
        (other, _other_rt), = s.others
        sid = (await _create(c, vcpu=2, memory_mb=1024))["id"]
        home = (await c.get(f"/v1/sandboxes/{sid}")).json()["node_id"]
        await _run(c, sid, "mkdir -p d && echo kept > d/x")
        assert (await c.post(f"/v1/sandboxes/{sid}/pause")).status_code == 200
        # its node fills up while it is paused (paused sandboxes hold no capacity)
        fill = (await _create(c, vcpu=2, memory_mb=1024))
        assert fill["node_id"] == home
        back = (await c.post(f"/v1/sandboxes/{sid}/resume")).json()
        assert back["state"] == "running" and back["node_id"] != home
        assert (await _run(c, sid, "cat d/x"))["out"] == "kept\n"
        holder = s.agent if s.agent.node_id == home else other
        assert sid not in holder.paused and sid not in holder.live       # the old node dropped its copy
        assert not list((holder.checkpoints).glob(f"{sid}*"))
        assert sid in (other if holder is s.agent else s.agent).live


async def test_an_unanswered_pause_or_resume_is_settled_by_the_node_reports(tmp_path, monkeypatch) -> None:
    from datetime import timedelta

    from pilldrops import errors
    from pilldrops.server.service import reconcile as svc

    async with stack(tmp_path) as s, s.client() as c:
        sid = (await _create(c))["id"]
        nodes = s.cp.node_client
        real_pause, real_resume = nodes.pause, nodes.resume

        def lost_answer(real: Any) -> Any:
            async def call(*a: Any, **k: Any) -> Any:
                await real(*a, **k)                     # the node does it ...
                try:
                    raise httpx.ReadTimeout("no answer")
                except httpx.ReadTimeout as exc:       # ... but the answer never arrives
                    raise errors.NodeUnavailable("node did not answer") from exc
            return call

        monkeypatch.setattr(nodes, "pause", lost_answer(real_pause))
        assert (await c.post(f"/v1/sandboxes/{sid}/pause")).status_code == 502
        assert (await c.get(f"/v1/sandboxes/{sid}")).json()["state"] == "pausing"    # unknown: not guessed
        await s.agent._heartbeat()
        assert (await c.get(f"/v1/sandboxes/{sid}")).json()["state"] == "pausing"    # too early to settle
        monkeypatch.setattr(svc, "SETTLE_AFTER", timedelta(0))
        await s.agent._heartbeat()
        info = (await c.get(f"/v1/sandboxes/{sid}")).json()
        assert info["state"] == "paused" and info["checkpoint_bytes"] is not None

        monkeypatch.setattr(nodes, "resume", lost_answer(real_resume))
        assert (await c.post(f"/v1/sandboxes/{sid}/resume")).status_code == 502
        await s.agent._heartbeat()
        back = (await c.get(f"/v1/sandboxes/{sid}")).json()
        assert back["state"] == "running" and back["paused_at"] is None
        assert len((await c.get("/v1/history")).json()["items"][0]["pauses"]) == 1


async def test_a_resume_does_not_take_the_room_a_warm_pool_keeps(tmp_path) -> None:
    """The pool's members count as used at their target size for a resume as for a create (the one
    deliberate change of the control-plane split): a resume that only fits in that room is a 503."""
    async with stack(tmp_path, capacity_vcpu=4, capacity_memory_mb=8192) as s, s.client() as c:
        a = (await _create(c, vcpu=2, memory_mb=512))["id"]
        assert (await c.post(f"/v1/sandboxes/{a}/pause")).status_code == 200
        pool = {"template": "tiny", "vcpu": 1, "memory_mb": 256}
        assert (await c.put("/v1/pools", json={**pool, "size": 2})).status_code == 200     # keeps 2 vCPU
        b = (await _create(c, vcpu=2, memory_mb=512))["id"]                                 # the other 2
        r = await c.post(f"/v1/sandboxes/{a}/resume")
        assert r.status_code == 503 and r.json()["error"]["code"] == "capacity_unavailable", r.text
        assert (await c.get(f"/v1/sandboxes/{a}")).json()["state"] == "paused"
        await c.delete(f"/v1/sandboxes/{b}")
        assert (await c.post(f"/v1/sandboxes/{a}/resume")).status_code == 200
        await c.delete(f"/v1/sandboxes/{a}")
        await c.put("/v1/pools", json={**pool, "size": 0})
