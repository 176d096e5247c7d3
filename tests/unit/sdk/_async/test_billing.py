"""Per-episode cost, history, usage and credits against the FakeControlPlane. Written async; the sync twin
is generated."""

from __future__ import annotations

from datetime import UTC, date, datetime, timedelta
from typing import Any

import pytest

from pilldrops import (
    AsyncSandbox,
    HistoryRecord,
    InsufficientCredits,
    InvalidRequest,
    SandboxState,
    UsageSummary,
)
from pilldrops.sdk.testing import FakeControlPlane

SB = r"/v1/sandboxes/[^/]+"
VCPU_S, GB_S = 0.0000140, 0.0000045  # the fake's default rates (those of docs/api.md)


@pytest.mark.anyio
async def test_cost_so_far_then_final_cost_after_the_block(fake: FakeControlPlane, opts: dict[str, Any]) -> None:
    async def rollout() -> tuple[float, float]:
        async with await AsyncSandbox.create(vcpu=2, memory_mb=1024, **opts) as sb:
            assert sb.cost_usd == 0.0 and sb.info.vcpu_s == 0.0
            fake.advance(10)
            assert await sb.cost() == pytest.approx(20 * VCPU_S + 10 * GB_S)
            assert (sb.info.vcpu_s, sb.info.gb_s) == (pytest.approx(20), pytest.approx(10))  # refreshed
            fake.advance(5)
            reward = 1.0
        return reward, sb.info.cost_usd

    reward, cost = await rollout()
    assert reward == 1.0 and cost == pytest.approx(30 * VCPU_S + 15 * GB_S)
    (sid,) = fake.sandboxes
    gets = len(fake.requests_to("GET", SB))
    fake.advance(100)  # an ended sandbox accrues nothing more
    info = await AsyncSandbox.get_info_by_id(sid, **opts)
    assert info.state == SandboxState.stopped and info.cost_usd == pytest.approx(cost)
    assert len(fake.requests_to("GET", SB)) == gets + 1  # only the explicit get above


@pytest.mark.anyio
async def test_kill_stores_the_final_usage(fake: FakeControlPlane, opts: dict[str, Any]) -> None:
    sb = await AsyncSandbox.create(vcpu=1, memory_mb=512, **opts)
    fake.advance(4)
    final = await sb.kill()
    assert sb.info is final and sb.cost_usd == final.cost_usd
    assert (final.vcpu_s, final.gb_s, final.storage_gb_s) == (pytest.approx(4), pytest.approx(2), 0.0)
    assert final.cost_usd == pytest.approx(4 * VCPU_S + 2 * GB_S)
    fake.advance(50)
    assert (await sb.kill()).cost_usd == pytest.approx(final.cost_usd)  # idempotent, still final
    assert await sb.cost() == pytest.approx(final.cost_usd)


@pytest.mark.anyio
async def test_history_follows_cursors_newest_first(fake: FakeControlPlane, opts: dict[str, Any]) -> None:
    sbs = [await AsyncSandbox.create(metadata={"i": str(i)}, **opts) for i in range(5)]
    fake.advance(3)
    await sbs[0].kill()
    records = await AsyncSandbox.history(page_size=2, **opts)
    assert all(isinstance(r, HistoryRecord) for r in records)
    assert [r.id for r in records] == [s.id for s in sbs[::-1]]
    assert len(fake.requests_to("GET", "/v1/history")) == 3
    oldest = records[-1]
    assert oldest.state == SandboxState.stopped and oldest.ended_at is not None
    assert oldest.vcpu_s == pytest.approx(3, abs=0.01) and oldest.cost_usd > 0
    assert records[0].state == SandboxState.running and records[0].cost_usd > 0  # cost so far


@pytest.mark.anyio
async def test_history_filters_and_limit(fake: FakeControlPlane, opts: dict[str, Any]) -> None:
    a = await AsyncSandbox.create("code-interpreter", metadata={"run": "x"}, **opts)
    b = await AsyncSandbox.create(metadata={"run": "x"}, **opts)
    c = await AsyncSandbox.create(metadata={"run": "y"}, **opts)
    await b.kill()

    def ids(records: list[HistoryRecord]) -> list[str]:
        return [r.id for r in records]

    assert ids(await AsyncSandbox.history(template="code-interpreter", **opts)) == [a.id]
    assert ids(await AsyncSandbox.history(metadata={"run": "x"}, **opts)) == [b.id, a.id]
    assert ids(await AsyncSandbox.history(state="running", **opts)) == [c.id, a.id]
    assert ids(await AsyncSandbox.history(state=[SandboxState.stopped, "paused"], **opts)) == [b.id]
    assert ids(await AsyncSandbox.history(limit=2, page_size=1, **opts)) == [c.id, b.id]
    assert len(fake.requests_to("GET", "/v1/history")) == 4 + 2
    assert ids(await AsyncSandbox.history(limit=2, **opts)) == [c.id, b.id]
    assert fake.requests[-1].url.params["limit"] == "2"  # never asks for more than it returns


@pytest.mark.anyio
async def test_history_period(fake: FakeControlPlane, opts: dict[str, Any]) -> None:
    first = await AsyncSandbox.create(**opts)
    fake.advance(3600)
    second = await AsyncSandbox.create(**opts)
    cut = second.info.created_at
    assert [r.id for r in await AsyncSandbox.history(since=cut, **opts)] == [second.id]
    assert [r.id for r in await AsyncSandbox.history(until=cut, **opts)] == [first.id]
    # strings (ISO 8601, naive = UTC) and dates are accepted and sent as UTC with a Z
    naive = cut.astimezone(UTC).replace(tzinfo=None).isoformat()
    assert [r.id for r in await AsyncSandbox.history(since=naive, **opts)] == [second.id]
    assert fake.requests[-1].url.params["since"] == cut.astimezone(UTC).isoformat().replace("+00:00", "Z")
    plus2 = cut.astimezone(UTC).replace(tzinfo=None).isoformat() + "+02:00"  # 2 h earlier in UTC
    assert len(await AsyncSandbox.history(since=plus2, **opts)) == 2
    day = cut.date()
    assert len(await AsyncSandbox.history(since=day, until=day + timedelta(days=1), **opts)) == 2
    assert await AsyncSandbox.history(since=date(2100, 1, 1), **opts) == []


@pytest.mark.anyio
async def test_bad_history_arguments_fail_before_any_request(fake: FakeControlPlane,
                                                             opts: dict[str, Any]) -> None:
    for kw in ({"limit": 0}, {"page_size": 0}, {"since": "yesterday"}, {"until": "2025-13-01"}):
        with pytest.raises(InvalidRequest):
            await AsyncSandbox.history(**kw, **opts)
    with pytest.raises(InvalidRequest):
        await AsyncSandbox.usage(since="soon", **opts)
    assert fake.requests_to("GET", "/v1/(history|usage)") == []


@pytest.mark.anyio
async def test_usage_totals_and_credits(fake: FakeControlPlane, opts: dict[str, Any]) -> None:
    a = await AsyncSandbox.create(vcpu=2, memory_mb=2048, **opts)
    b = await AsyncSandbox.create(vcpu=1, memory_mb=1024, **opts)
    fake.advance(10)
    await a.kill()
    u = await AsyncSandbox.usage(**opts)
    assert isinstance(u, UsageSummary) and u.team_id == fake.team_id and u.sandboxes == 2
    # each create moves the fake clock by 1 ms (strictly increasing created_at): hence abs=0.01
    assert (u.vcpu_s, u.gb_s, u.storage_gb_s) == (pytest.approx(30, abs=0.01), pytest.approx(30, abs=0.01), 0.0)
    assert u.cost_usd == pytest.approx(30 * VCPU_S + 30 * GB_S, rel=1e-3)
    assert u.cost_usd == pytest.approx(a.cost_usd + await b.cost())
    assert u.credits_usd == pytest.approx(5.0 - u.cost_usd) and not u.credits_unlimited
    later = await AsyncSandbox.usage(since=datetime(2100, 1, 1, tzinfo=UTC), **opts)
    assert (later.sandboxes, later.cost_usd) == (0, 0.0) and later.since is not None
    assert later.credits_usd == pytest.approx(u.credits_usd)  # the balance is not per period

    unlimited = FakeControlPlane(credits_usd=None)
    u = await AsyncSandbox.usage(**unlimited.client_options())
    assert u.credits_usd is None and u.credits_unlimited


@pytest.mark.anyio
async def test_insufficient_credits_is_402_and_not_retried() -> None:
    fake = FakeControlPlane(credits_usd=0.001)
    opts = fake.client_options()
    async with await AsyncSandbox.create(**opts):
        fake.advance(120)  # 120 s x (1 vCPU + 0.5 GB) is more than $0.001
    with pytest.raises(InsufficientCredits) as info:
        await AsyncSandbox.create(**opts)
    assert info.value.status == 402 and info.value.code == "insufficient_credits"
    assert len(fake.requests_to("POST", "/v1/sandboxes")) == 2  # a 402 is not retried
    assert (await AsyncSandbox.usage(**opts)).credits_usd == 0.0
