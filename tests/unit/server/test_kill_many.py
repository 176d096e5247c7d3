"""Kills in one store transaction (``Store.end_sandboxes``) and batch kills (``POST /v1/sandboxes/kill``):
exact final billing, one node call per node, tenancy, typed errors. SQLite and PostgreSQL (``store_url``)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import anyio
import httpx
import pytest

from pilldrops.schema.node import NodeSandboxStatus
from pilldrops.server.domain.billing import Rates
from pilldrops.server.nodes.client import NodeClient
from pilldrops.server.store.interface import EndSandbox, NewSandbox
from pilldrops.server.store.sql import Store
from tests.stack import stack

pytestmark = pytest.mark.anyio
RATES = Rates()
LEGAL = ["pending", "starting", "running", "pausing", "paused", "resuming", "stopping", "lost"]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


class Calls:
    """Counts calls of chosen methods of an object (the real methods still run)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, obj: Any, *names: str) -> None:
        self.n: dict[str, int] = dict.fromkeys(names, 0)
        self.args: dict[str, list[Any]] = {n: [] for n in names}
        for name in names:
            real = getattr(obj, name)

            async def counted(*a: Any, _real: Any = real, _name: str = name, **kw: Any) -> Any:
                self.n[_name] += 1
                self.args[_name].append(a)
                return await _real(*a, **kw)
            monkeypatch.setattr(obj, name, counted)


async def test_end_sandboxes_bills_the_final_report_once_and_ends_from_the_locked_row(tmp_path, store_url) -> None:
    async with stack(tmp_path, db_url=store_url) as s, s.client() as c:
        sb = (await c.post("/v1/sandboxes", json={"template": "tiny", "vcpu": 2, "memory_mb": 1024})).json()
        store = s.cp.store
        row = await store.get_sandbox(sb["id"])
        now = row.started_at + timedelta(seconds=20)
        end = EndSandbox(sb["id"], "stopped", "killed", final=True, seq=7000, run_s=7.0)
        done = await store.end_sandboxes([end], from_states=LEGAL, now=now, rates=RATES, charge_credits=True)
        got = done.rows[sb["id"]]
        assert done.ended == {sb["id"]} and len(done.entries) == 1
        assert (got.state, got.end_reason) == ("stopped", "killed")
        assert got.ended_at == row.started_at + timedelta(seconds=7)     # start + final running seconds
        assert got.billed_run_s == pytest.approx(7.0) and got.vcpu_s == pytest.approx(14.0)
        assert got.gb_s == pytest.approx(7.0)
        team = await store.get_team(s.team_id)
        assert team.credits_usd == pytest.approx(5.0 - got.cost_usd)
        # again (a retried kill): the row is no longer in from_states, nothing is billed twice
        again = await store.end_sandboxes([end], from_states=LEGAL, now=now, rates=RATES, charge_credits=True)
        assert again.ended == set() and again.entries == []
        assert again.rows[sb["id"]].cost_usd == got.cost_usd
        assert (await store.get_team(s.team_id)).credits_usd == pytest.approx(team.credits_usd)
        assert (await store.usage_totals(s.team_id, None, None))[4] == pytest.approx(got.cost_usd)
        # a final report beyond the wall interval is capped at it; ended_at never after now
        sb2 = (await c.post("/v1/sandboxes", json={"template": "tiny"})).json()
        r2 = await store.get_sandbox(sb2["id"])
        at = r2.started_at + timedelta(seconds=3)
        far = EndSandbox(sb2["id"], "stopped", "killed", final=True, seq=99_000, run_s=99.0)
        got2 = (await store.end_sandboxes([far], from_states=LEGAL, now=at, rates=RATES,
                                          charge_credits=True)).rows[sb2["id"]]
        assert got2.billed_run_s == pytest.approx(3.0) and got2.ended_at == at
        # no final report (the node did not have it): ended now, nothing billed
        sb3 = (await c.post("/v1/sandboxes", json={"template": "tiny"})).json()
        got3 = (await store.end_sandboxes([EndSandbox(sb3["id"], "stopped", "killed")], from_states=LEGAL,
                                          now=at, rates=RATES, charge_credits=True)).rows[sb3["id"]]
        assert got3.ended_at == at and got3.cost_usd == 0 and got3.state == "stopped"
        for x in (sb, sb2, sb3):
            await s.agent.kill(x["id"])


async def test_end_sandboxes_closes_a_paused_interval_and_bills_its_storage(tmp_path, store_url) -> None:
    async with stack(tmp_path, db_url=store_url) as s, s.client() as c:
        sb = (await c.post("/v1/sandboxes", json={"template": "tiny"})).json()
        assert (await c.post(f"/v1/sandboxes/{sb['id']}/pause")).json()["state"] == "paused"
        store = s.cp.store
        row = await store.get_sandbox(sb["id"])
        assert row.paused_at is not None and row.checkpoint_bytes
        now = row.paused_at + timedelta(seconds=100)
        done = await store.end_sandboxes([EndSandbox(sb["id"], "stopped", "killed", final=True, seq=None,
                                                     run_s=None)],
                                         from_states=LEGAL, now=now, rates=RATES, charge_credits=True)
        got = done.rows[sb["id"]]
        assert done.storage_charged and got.paused_at is None and got.ended_at == now
        assert got.storage_gb_s == pytest.approx(row.checkpoint_bytes / 1024**3 * 100)
        assert got.paused_s == pytest.approx((row.paused_s or 0) + 100)
        pauses = (await store.pauses_of([sb["id"]]))[sb["id"]]
        assert pauses[-1].storage_gb_s == pytest.approx(got.storage_gb_s - row.storage_gb_s)
        await s.agent.forget(sb["id"])


async def test_an_end_charges_each_team_once_and_starts_the_grace_clock_once(store_url) -> None:
    """A batch end of two teams' sandboxes, a running and a paused one each: each team is charged the sum of
    its ledger rows once; the charge that takes a balance to zero or below stamps when it ran out, and a
    later charge keeps that first stamp."""
    store = await Store.open(store_url)
    try:
        t0 = datetime.now(UTC)
        rich, poor = await store.create_team("rich", t0, credits_usd=10.0), await store.create_team("poor", t0,
                                                                                                 credits_usd=1e-5)
        node = await store.upsert_node(name="n", url="http://127.0.0.1:1", capacity_vcpu=64,
                                       capacity_memory_mb=65536, templates=[], now=t0)
        ids: dict[str, list[str]] = {}
        for team in (rich, poor):
            for i, state in enumerate(("running", "pausing", "running")):
                new = NewSandbox(id=f"sb_{team.name}{i:012d}", team_id=team.id, template="tiny", vcpu=1,
                                 memory_mb=1024, timeout=600, state=state, access_token="t" * 32,
                                 created_at=t0, end_at=t0 + timedelta(seconds=600))
                assert await store.insert_claimed(new, node.id, t0) is not None
                ids.setdefault(team.id, []).append(new.id)
            assert await store.record_pause(ids[team.id][1], paused_at=t0 + timedelta(seconds=5),
                                            checkpoint_bytes=2 * 1024**3, timeout_left=60)
        now = t0 + timedelta(seconds=20)
        ends = [EndSandbox(sid, "stopped", "killed", final=True, seq=run * 1000, run_s=float(run))
                for team_ids in ids.values() for sid, run in zip(team_ids[:2], (10, 5), strict=True)]
        done = await store.end_sandboxes(ends, from_states=LEGAL, now=now, rates=RATES, charge_credits=True)
        assert done.storage_charged and len(done.entries) == 4 and len(done.ended) == 4
        for team, start in ((rich, 10.0), (poor, 1e-5)):
            billed = sum(done.rows[sid].cost_usd for sid in ids[team.id][:2])
            # 10 + 5 s running (1 vCPU, 1 GiB), 15 s paused with 2 GiB
            assert billed == pytest.approx(15 * (RATES.vcpu_s_usd + RATES.gb_s_usd)
                                           + 2 * 15 * RATES.storage_gb_s_usd)
            got = await store.get_team(team.id)
            assert got.credits_usd == pytest.approx(start - billed)
            assert got.credits_exhausted_at == (now if team is poor else None)
        later = now + timedelta(seconds=30)           # a later charge keeps when the balance ran out
        await store.end_sandboxes([EndSandbox(ids[poor.id][2], "stopped", "killed", final=True, seq=5000,
                                              run_s=5.0)], from_states=LEGAL, now=later, rates=RATES,
                                  charge_credits=True)
        assert (await store.get_team(poor.id)).credits_exhausted_at == now
    finally:
        await store.close()


async def test_a_kill_is_one_store_write_after_the_node_answers(tmp_path, store_url, monkeypatch) -> None:
    async with stack(tmp_path, db_url=store_url) as s, s.client() as c:
        sb = (await c.post("/v1/sandboxes", json={"template": "tiny", "vcpu": 2, "memory_mb": 2048})).json()
        await anyio.sleep(0.5)
        store = s.cp.store
        calls = Calls(monkeypatch, store, "get_sandbox", "end_sandboxes", "commit_usage", "update_sandbox",
                      "end_interval", "set_sandbox")
        killed = (await c.delete(f"/v1/sandboxes/{sb['id']}")).json()
        assert calls.n == {"get_sandbox": 1, "end_sandboxes": 1, "commit_usage": 0, "update_sandbox": 0,
                           "end_interval": 0, "set_sandbox": 0}
        life = (datetime.fromisoformat(killed["ended_at"]) - datetime.fromisoformat(killed["started_at"])).total_seconds()
        assert killed["state"] == "stopped" and killed["vcpu_s"] == pytest.approx(2 * life, abs=0.01)
        assert killed["cost_usd"] == pytest.approx(2 * life * (RATES.vcpu_s_usd + RATES.gb_s_usd), rel=1e-3)


async def test_batch_kill_one_node_call_per_node_one_transaction_and_tenancy(tmp_path, store_url,
                                                                          monkeypatch) -> None:
    async with stack(tmp_path, db_url=store_url, nodes=2, capacity_vcpu=3) as s, s.client() as c:
        made = (await c.post("/v1/sandboxes/batch", json={"template": "tiny", "count": 5})).json()
        ids = [it["sandbox"]["id"] for it in made["items"]]
        assert len({it["sandbox"]["node_id"] for it in made["items"]}) == 2     # spread over both nodes
        other_key = await s.new_team_key("team-b")
        async with s.client(key=other_key) as b:
            theirs = (await b.post("/v1/sandboxes", json={"template": "tiny"})).json()["id"]
        await anyio.sleep(0.3)
        nodes = Calls(monkeypatch, s.cp.services.sandboxes.nodes, "kill", "kill_many")
        store = Calls(monkeypatch, s.cp.store, "end_sandboxes")
        ended_one = ids[0]
        assert (await c.delete(f"/v1/sandboxes/{ended_one}")).status_code == 200
        nodes.n["kill"] = store.n["end_sandboxes"] = 0
        nul = "sb_\x00nul"            # no id holds a NUL: unknown on both stores (PostgreSQL's text refuses one)
        r = await c.post("/v1/sandboxes/kill", json={"ids": [*ids, ids[1], theirs, "sb_nope", nul]})
        assert r.status_code == 200, r.text
        body = r.json()
        assert nodes.n == {"kill": 0, "kill_many": 2} and store.n["end_sandboxes"] == 1
        assert sum(len(a[1]) for a in nodes.args["kill_many"]) == 4     # the ended one is not sent again
        by_id = {it["id"]: it for it in body["items"]}
        assert [it["id"] for it in body["items"]] == [*ids, theirs, "sb_nope", nul]      # deduplicated, in order
        for sid in ids:
            info = by_id[sid]["sandbox"]
            assert info["state"] == "stopped" and info["ended_at"] and by_id[sid]["error"] is None
            if sid != ended_one:
                life = (datetime.fromisoformat(info["ended_at"])
                        - datetime.fromisoformat(info["started_at"])).total_seconds()
                assert info["vcpu_s"] == pytest.approx(life, abs=0.01) and info["cost_usd"] > 0
        for sid in (theirs, "sb_nope", nul):       # another team's id answers exactly like an unknown one
            assert by_id[sid]["sandbox"] is None and by_id[sid]["error"]["code"] == "sandbox_not_found"
        assert by_id[theirs]["error"]["message"].replace(theirs, "X") == \
            by_id["sb_nope"]["error"]["message"].replace("sb_nope", "X")
        assert (body["killed"], body["failed"]) == (5, 3)
        async with s.client(key=other_key) as b:
            assert (await b.get(f"/v1/sandboxes/{theirs}")).json()["state"] == "running"
            await b.delete(f"/v1/sandboxes/{theirs}")
        assert await s.runtime.list_ids() == [] and await s.others[0][1].list_ids() == []
        total = sum(by_id[sid]["sandbox"]["cost_usd"] for sid in ids)
        assert (await s.cp.store.usage_totals(s.team_id, None, None))[4] == pytest.approx(total, rel=1e-6)


async def test_batch_kill_by_labels_kills_only_live_matches(tmp_path, store_url) -> None:
    async with stack(tmp_path, db_url=store_url) as s, s.client() as c:
        a = [(await c.post("/v1/sandboxes", json={"template": "tiny", "metadata": {"run": "a", "i": str(i)}})).json()
             for i in range(3)]
        keep = (await c.post("/v1/sandboxes", json={"template": "tiny", "metadata": {"run": "b"}})).json()
        await c.delete(f"/v1/sandboxes/{a[0]['id']}")
        body = (await c.post("/v1/sandboxes/kill", json={"labels": {"run": "a"}})).json()
        assert sorted(it["id"] for it in body["items"]) == sorted(x["id"] for x in a[1:])
        assert all(it["sandbox"]["state"] == "stopped" for it in body["items"]) and body["killed"] == 2
        assert (await c.get(f"/v1/sandboxes/{keep['id']}")).json()["state"] == "running"
        none = (await c.post("/v1/sandboxes/kill", json={"labels": {"run": "zzz"}})).json()
        assert none == {"items": [], "killed": 0, "failed": 0}
        await c.delete(f"/v1/sandboxes/{keep['id']}")


@pytest.mark.parametrize("body", [{}, {"ids": []}, {"ids": ["sb_x"], "labels": {"a": "b"}}, {"labels": {}},
                                  {"ids": ["sb_x"] * 1001}, {"ids": [""]}, {"ids": "sb_x"}, {"idz": ["sb_x"]}])
async def test_batch_kill_bad_input_is_a_typed_400(tmp_path, body) -> None:
    async with stack(tmp_path) as s, s.client() as c:
        r = await c.post("/v1/sandboxes/kill", json=body)
        assert r.status_code in (400, 422), r.text
        err = r.json()["error"]
        assert err["code"] == "invalid_request" and err["message"] and err["request_id"]
        assert "details" in err


async def test_batch_kill_node_failure_fails_only_its_sandboxes(tmp_path, monkeypatch) -> None:
    async with stack(tmp_path, nodes=2, capacity_vcpu=2) as s, s.client() as c:
        made = (await c.post("/v1/sandboxes/batch", json={"template": "tiny", "count": 4})).json()
        ids = [it["sandbox"]["id"] for it in made["items"]]
        node_of = {it["sandbox"]["id"]: it["sandbox"]["envd_url"] for it in made["items"]}
        client = s.cp.services.sandboxes.nodes
        real = client.kill_many

        async def flaky(url: str, sids: list[str]) -> Any:
            if url == "http://node-b":
                from pilldrops import errors
                raise errors.NodeUnavailable("node-b is down")
            return await real(url, sids)
        monkeypatch.setattr(client, "kill_many", flaky)
        body = (await c.post("/v1/sandboxes/kill", json={"ids": ids})).json()
        for it in body["items"]:
            if node_of[it["id"]] == "http://node-b":
                assert it["error"]["code"] == "node_unavailable" and it["sandbox"] is None
                assert (await c.get(f"/v1/sandboxes/{it['id']}")).json()["state"] == "running"
            else:
                assert it["sandbox"]["state"] == "stopped"
        monkeypatch.setattr(client, "kill_many", real)
        assert (await c.post("/v1/sandboxes/kill", json={"ids": ids})).json()["failed"] == 0


async def test_node_client_kill_many_falls_back_to_single_kills_on_an_older_node() -> None:
    seen: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(f"{request.method} {request.url.path}")
        if request.method == "POST":
            return httpx.Response(405, json={"error": {"code": "invalid_request", "message": "Method Not Allowed"}})
        sid = request.url.path.rsplit("/", 1)[1]
        if sid == "sb_gone":
            return httpx.Response(404, json={"error": {"code": "sandbox_not_found", "message": "no"}})
        return httpx.Response(200, json=NodeSandboxStatus(id=sid, state="stopped", run_s=1.0, seq=1000)
                              .model_dump(mode="json"))

    client = NodeClient("t", transport=httpx.MockTransport(handler))
    try:
        got = await client.kill_many("http://n", ["sb_a", "sb_gone"])
    finally:
        await client.aclose()
    assert got["sb_a"].status is not None and got["sb_a"].status.run_s == 1.0
    assert got["sb_gone"].status is None and got["sb_gone"].error_code is None
    assert seen == ["POST /node/v1/sandboxes/kill", "DELETE /node/v1/sandboxes/sb_a",
                    "DELETE /node/v1/sandboxes/sb_gone"]
