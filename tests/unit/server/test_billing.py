"""Billing: pricing rules, exactly-once usage commits, final cost on kill, credits, history and usage."""

from __future__ import annotations

from datetime import timedelta

import anyio
import pytest
from hypothesis import given
from hypothesis import strategies as st

from pilldrops._internal.clock import Clock
from pilldrops.server.domain.billing import Rates, billable, running_usage
from pilldrops.server.service.billing import BillingSettings
from tests.stack import stack

pytestmark = pytest.mark.anyio
RATES = Rates()


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def test_prices_match_the_formula() -> None:
    use = running_usage(vcpu=2, memory_mb=1536, seconds=10)
    assert (use.vcpu_s, use.gb_s) == (20, 15)
    assert use.cost(RATES) == pytest.approx(20 * 0.0000140 + 15 * 0.0000045)
    assert running_usage(1, 512, -3).vcpu_s == 0
    assert Rates().storage_gb_s_usd == pytest.approx(0.15 / (30 * 24 * 3600))


@given(st.lists(st.tuples(st.floats(-5, 1e5), st.floats(0, 1e5)), max_size=30), st.floats(0, 1e5))
def test_billable_never_negative_never_beyond_wall_and_idempotent(reports: list, wall: float) -> None:  # type: ignore[type-arg]
    billed = 0.0
    for run_s, _ in reports:
        total, delta = billable(run_s, billed, wall)
        assert delta >= 0 and total <= max(wall, billed) + 1e-9
        again_total, again = billable(run_s, total, wall)
        assert again == 0 and again_total == total           # a resend adds nothing
        billed = total


async def test_commit_is_exactly_once_per_seq(tmp_path, store_url) -> None:
    async with stack(tmp_path, db_url=store_url) as s, s.client() as c:
        sb = (await c.post("/v1/sandboxes", json={"template": "tiny", "vcpu": 2, "memory_mb": 1024})).json()
        store, now = s.cp.store, Clock().now()
        row = await store.get_sandbox(sb["id"])
        later = now + timedelta(seconds=30)
        assert await store.commit_usage(sb["id"], 5000, 5.0, now=later, rates=RATES, charge_credits=True)
        assert await store.commit_usage(sb["id"], 5000, 5.0, now=later, rates=RATES, charge_credits=True) is None
        assert await store.commit_usage(sb["id"], 4000, 4.0, now=later, rates=RATES, charge_credits=True) is None
        assert await store.commit_usage(sb["id"], 9000, 9.0, now=later, rates=RATES, charge_credits=True)
        # a report beyond the wall interval is capped at it
        far = await store.commit_usage(sb["id"], 99_000, 99.0, now=row.started_at + timedelta(seconds=12),
                                       rates=RATES, charge_credits=True)
        assert far is not None and far.to_s == pytest.approx(12.0)
        row = await store.get_sandbox(sb["id"])
        assert row.billed_run_s == pytest.approx(12.0) and row.vcpu_s == pytest.approx(24.0)
        assert row.gb_s == pytest.approx(12.0)
        team = await store.get_team(s.team_id)
        assert team.credits_usd == pytest.approx(5.0 - row.cost_usd)
        await c.delete(f"/v1/sandboxes/{sb['id']}")


async def test_final_cost_is_in_the_kill_answer_and_equals_lifetime(tmp_path, store_url) -> None:
    async with stack(tmp_path, db_url=store_url) as s, s.client() as c:
        sb = (await c.post("/v1/sandboxes", json={"template": "tiny", "vcpu": 2, "memory_mb": 2048})).json()
        await anyio.sleep(1.2)
        killed = (await c.delete(f"/v1/sandboxes/{sb['id']}")).json()
        from datetime import datetime
        life = (datetime.fromisoformat(killed["ended_at"]) - datetime.fromisoformat(killed["started_at"])).total_seconds()
        assert 1.0 < life < 3.0
        assert killed["vcpu_s"] == pytest.approx(2 * life, abs=0.01)
        assert killed["gb_s"] == pytest.approx(2 * life, abs=0.01)
        assert killed["cost_usd"] == pytest.approx(2 * life * 0.0000140 + 2 * life * 0.0000045, rel=1e-3)
        # it stays the same afterwards (ended sandboxes are not re-priced)
        await anyio.sleep(0.3)
        assert (await c.get(f"/v1/sandboxes/{sb['id']}")).json()["cost_usd"] == killed["cost_usd"]


async def test_running_sandbox_shows_cost_so_far(tmp_path, store_url) -> None:
    async with stack(tmp_path, db_url=store_url) as s, s.client() as c:
        sb = (await c.post("/v1/sandboxes", json={"template": "tiny"})).json()
        await anyio.sleep(0.5)
        a = (await c.get(f"/v1/sandboxes/{sb['id']}")).json()["vcpu_s"]
        await anyio.sleep(0.5)
        b = (await c.get(f"/v1/sandboxes/{sb['id']}")).json()["vcpu_s"]
        assert 0.3 < a < b
        rec = (await c.get("/v1/history")).json()["items"][0]
        assert rec["id"] == sb["id"] and rec["state"] == "running" and rec["cost_usd"] > 0


async def test_credits_run_out(tmp_path, store_url) -> None:
    billing = BillingSettings(grace_s=0.5, enforce_every_s=0.1)
    async with stack(tmp_path, db_url=store_url, billing=billing) as s:
        team = await s.cp.services.auth.create_team("poor", credits_usd=0.00004)
        key = (await s.cp.services.auth.create_key(team.id, "k")).secret
        async with s.client(key=key) as c:
            hog = (await c.post("/v1/sandboxes", json={"template": "tiny", "vcpu": 4, "memory_mb": 4096})).json()
            other = (await c.post("/v1/sandboxes", json={"template": "tiny"})).json()
            await anyio.sleep(0.6)
            await c.delete(f"/v1/sandboxes/{hog['id']}")          # commits ~0.6 s x 4 vCPU: over the balance
            usage = (await c.get("/v1/usage")).json()
            assert usage["credits_usd"] < 0 and not usage["credits_unlimited"]
            r = await c.post("/v1/sandboxes", json={"template": "tiny"})
            assert r.status_code == 402 and r.json()["error"]["code"] == "insufficient_credits"
            assert "pilldrops credits add poor 10" in r.json()["error"]["message"]
            with anyio.fail_after(10):
                while (await c.get(f"/v1/sandboxes/{other['id']}")).json()["state"] == "running":
                    await anyio.sleep(0.1)
            ended = (await c.get(f"/v1/sandboxes/{other['id']}")).json()
            assert ended["end_reason"] == "credits_exhausted" and ended["cost_usd"] > 0
            assert len((await c.get("/v1/history")).json()["items"]) == 2     # history stays
        await s.cp.store.add_credits(team.id, 1.0)
        async with s.client(key=key) as c:
            r = await c.post("/v1/sandboxes", json={"template": "tiny"})
            assert r.status_code == 201
            await c.delete(f"/v1/sandboxes/{r.json()['id']}")
        # the default team was never touched
        async with s.client() as c:
            assert (await c.post("/v1/sandboxes", json={"template": "tiny"})).status_code == 201


async def test_unlimited_credits(tmp_path, store_url) -> None:
    async with stack(tmp_path, db_url=store_url, billing=BillingSettings(credits_enabled=False)) as s:
        team = await s.cp.services.auth.create_team("free", credits_usd=0)
        key = (await s.cp.services.auth.create_key(team.id, "k")).secret
        async with s.client(key=key) as c:
            r = await c.post("/v1/sandboxes", json={"template": "tiny"})
            assert r.status_code == 201
            await c.delete(f"/v1/sandboxes/{r.json()['id']}")
            usage = (await c.get("/v1/usage")).json()
            assert usage["credits_usd"] is None and usage["credits_unlimited"] and usage["cost_usd"] > 0


async def test_history_filters_usage_and_team_isolation(tmp_path, store_url) -> None:
    async with stack(tmp_path, db_url=store_url) as s, s.client() as c:
        ids = []
        for i, (tpl, vcpu) in enumerate([("tiny", 1), ("tiny", 2), ("tiny", 0.5)]):
            r = await c.post("/v1/sandboxes", json={"template": tpl, "vcpu": vcpu, "metadata": {"exp": str(i % 2)}})
            ids.append(r.json()["id"])
        await anyio.sleep(0.3)
        for sid in ids[:2]:
            await c.delete(f"/v1/sandboxes/{sid}")
        hist = (await c.get("/v1/history")).json()["items"]
        assert [h["id"] for h in hist] == list(reversed(ids))
        assert set(hist[0]) >= {"id", "template", "vcpu", "memory_mb", "vcpu_s", "gb_s", "storage_gb_s", "cost_usd",
                                "started_at", "ended_at", "state", "end_reason", "metadata"}
        assert [h["id"] for h in (await c.get("/v1/history", params={"state": "stopped"})).json()["items"]] == \
            [ids[1], ids[0]]
        assert [h["id"] for h in (await c.get("/v1/history", params={"metadata.exp": "0"})).json()["items"]] == \
            [ids[2], ids[0]]
        assert (await c.get("/v1/history", params={"template": "nope"})).json()["items"] == []
        future = (Clock().now() + timedelta(hours=1)).isoformat()
        assert (await c.get("/v1/history", params={"since": future})).json()["items"] == []
        assert len((await c.get("/v1/history", params={"until": future})).json()["items"]) == 3
        page = (await c.get("/v1/history", params={"limit": 2})).json()
        assert len(page["items"]) == 2 and page["next_cursor"]
        usage = (await c.get("/v1/usage")).json()
        killed = [h for h in hist if h["state"] == "stopped"]
        assert usage["sandboxes"] == 2
        assert usage["cost_usd"] == pytest.approx(sum(h["cost_usd"] for h in killed), rel=1e-6)
        assert usage["credits_usd"] == pytest.approx(5.0 - usage["cost_usd"], rel=1e-6)
        assert (await c.get("/v1/rates")).json() == {"vcpu_s_usd": 0.000014, "gb_s_usd": 0.0000045,
                                                     "storage_gb_month_usd": 0.15}
        other = await s.new_team_key("b")
        async with s.client(key=other) as b:
            assert (await b.get("/v1/history")).json()["items"] == []
            assert (await b.get("/v1/usage")).json()["cost_usd"] == 0
        await c.delete(f"/v1/sandboxes/{ids[2]}")
