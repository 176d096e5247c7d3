# DO NOT EDIT — generated from _async by scripts/unasync.py
"""Per-episode cost, history, usage and credits against the FakeControlPlane. Written async; the sync twin
is generated."""

from __future__ import annotations

from datetime import UTC, date, datetime, timedelta
from typing import Any

import pytest

from pilldrops import (
    Sandbox,
    HistoryRecord,
    InsufficientCredits,
    InvalidRequest,
    SandboxState,
    UsageSummary,
)
from pilldrops.sdk.testing import FakeControlPlane

SB = r"/v1/sandboxes/[^/]+"
VCPU_S, GB_S = 0.0000140, 0.0000045  # the fake's default rates (those of docs/api.md)


def test_cost_so_far_then_final_cost_after_the_block(fake: FakeControlPlane, opts: dict[str, Any]) -> None:
    def rollout() -> tuple[float, float]:
        with Sandbox.create(vcpu=2, memory_mb=1024, **opts) as sb:
            assert sb.cost_usd == 0.0 and sb.info.vcpu_s == 0.0
            fake.advance(10)
            assert sb.cost() == pytest.approx(20 * VCPU_S + 10 * GB_S)
            assert (sb.info.vcpu_s, sb.info.gb_s) == (pytest.approx(20), pytest.approx(10))  # refreshed
            fake.advance(5)
            reward = 1.0
        return reward, sb.info.cost_usd

    reward, cost = rollout()
    assert reward == 1.0 and cost == pytest.approx(30 * VCPU_S + 15 * GB_S)
    (sid,) = fake.sandboxes
    gets = len(fake.requests_to("GET", SB))
    fake.advance(100)  # an ended sandbox accrues nothing more
    info = Sandbox.get_info_by_id(sid, **opts)
    assert info.state == SandboxState.stopped and info.cost_usd == pytest.approx(cost)
    assert len(fake.requests_to("GET", SB)) == gets + 1  # only the explicit get above


def test_kill_stores_the_final_usage(fake: FakeControlPlane, opts: dict[str, Any]) -> None:
    sb = Sandbox.create(vcpu=1, memory_mb=512, **opts)
    fake.advance(4)
    final = sb.kill()
    assert sb.info is final and sb.cost_usd == final.cost_usd
    assert (final.vcpu_s, final.gb_s, final.storage_gb_s) == (pytest.approx(4), pytest.approx(2), 0.0)
    assert final.cost_usd == pytest.approx(4 * VCPU_S + 2 * GB_S)
    fake.advance(50)
    assert (sb.kill()).cost_usd == pytest.approx(final.cost_usd)  # idempotent, still final
    assert sb.cost() == pytest.approx(final.cost_usd)


def test_history_follows_cursors_newest_first(fake: FakeControlPlane, opts: dict[str, Any]) -> None:
    sbs = [Sandbox.create(metadata={"i": str(i)}, **opts) for i in range(5)]
    fake.advance(3)
    sbs[0].kill()
    records = Sandbox.history(page_size=2, **opts)
    assert all(isinstance(r, HistoryRecord) for r in records)
    assert [r.id for r in records] == [s.id for s in sbs[::-1]]
    assert len(fake.requests_to("GET", "/v1/history")) == 3
    oldest = records[-1]
    assert oldest.state == SandboxState.stopped and oldest.ended_at is not None
    assert oldest.vcpu_s == pytest.approx(3, abs=0.01) and oldest.cost_usd > 0
    assert records[0].state == SandboxState.running and records[0].cost_usd > 0  # cost so far


def test_history_filters_and_limit(fake: FakeControlPlane, opts: dict[str, Any]) -> None:
    a = Sandbox.create("code-interpreter", metadata={"run": "x"}, **opts)
    b = Sandbox.create(metadata={"run": "x"}, **opts)
    c = Sandbox.create(metadata={"run": "y"}, **opts)
    b.kill()

    def ids(records: list[HistoryRecord]) -> list[str]:
        return [r.id for r in records]

    assert ids(Sandbox.history(template="code-interpreter", **opts)) == [a.id]
    assert ids(Sandbox.history(metadata={"run": "x"}, **opts)) == [b.id, a.id]
    assert ids(Sandbox.history(state="running", **opts)) == [c.id, a.id]
    assert ids(Sandbox.history(state=[SandboxState.stopped, "paused"], **opts)) == [b.id]
    assert ids(Sandbox.history(limit=2, page_size=1, **opts)) == [c.id, b.id]
    assert len(fake.requests_to("GET", "/v1/history")) == 4 + 2
    assert ids(Sandbox.history(limit=2, **opts)) == [c.id, b.id]
    assert fake.requests[-1].url.params["limit"] == "2"  # never asks for more than it returns


def test_history_period(fake: FakeControlPlane, opts: dict[str, Any]) -> None:
    first = Sandbox.create(**opts)
    fake.advance(3600)
    second = Sandbox.create(**opts)
    cut = second.info.created_at
    assert [r.id for r in Sandbox.history(since=cut, **opts)] == [second.id]
    assert [r.id for r in Sandbox.history(until=cut, **opts)] == [first.id]
    # strings (ISO 8601, naive = UTC) and dates are accepted and sent as UTC with a Z
    naive = cut.astimezone(UTC).replace(tzinfo=None).isoformat()
    assert [r.id for r in Sandbox.history(since=naive, **opts)] == [second.id]
    assert fake.requests[-1].url.params["since"] == cut.astimezone(UTC).isoformat().replace("+00:00", "Z")
    plus2 = cut.astimezone(UTC).replace(tzinfo=None).isoformat() + "+02:00"  # 2 h earlier in UTC
    assert len(Sandbox.history(since=plus2, **opts)) == 2
    day = cut.date()
    assert len(Sandbox.history(since=day, until=day + timedelta(days=1), **opts)) == 2
    assert Sandbox.history(since=date(2100, 1, 1), **opts) == []


def test_bad_history_arguments_fail_before_any_request(fake: FakeControlPlane,
                                                             opts: dict[str, Any]) -> None:
    for kw in ({"limit": 0}, {"page_size": 0}, {"since": "yesterday"}, {"until": "2025-13-01"}):
        with pytest.raises(InvalidRequest):
            Sandbox.history(**kw, **opts)
    with pytest.raises(InvalidRequest):
        Sandbox.usage(since="soon", **opts)
    assert fake.requests_to("GET", "/v1/(history|usage)") == []


def test_usage_totals_and_credits(fake: FakeControlPlane, opts: dict[str, Any]) -> None:
    a = Sandbox.create(vcpu=2, memory_mb=2048, **opts)
    b = Sandbox.create(vcpu=1, memory_mb=1024, **opts)
    fake.advance(10)
    a.kill()
    u = Sandbox.usage(**opts)
    assert isinstance(u, UsageSummary) and u.team_id == fake.team_id and u.sandboxes == 2
    # each create moves the fake clock by 1 ms (strictly increasing created_at): hence abs=0.01
    assert (u.vcpu_s, u.gb_s, u.storage_gb_s) == (pytest.approx(30, abs=0.01), pytest.approx(30, abs=0.01), 0.0)
    assert u.cost_usd == pytest.approx(30 * VCPU_S + 30 * GB_S, rel=1e-3)
    assert u.cost_usd == pytest.approx(a.cost_usd + b.cost())
    assert u.credits_usd == pytest.approx(5.0 - u.cost_usd) and not u.credits_unlimited
    later = Sandbox.usage(since=datetime(2100, 1, 1, tzinfo=UTC), **opts)
    assert (later.sandboxes, later.cost_usd) == (0, 0.0) and later.since is not None
    assert later.credits_usd == pytest.approx(u.credits_usd)  # the balance is not per period

    unlimited = FakeControlPlane(credits_usd=None)
    u = Sandbox.usage(**unlimited.client_options())
    assert u.credits_usd is None and u.credits_unlimited


def test_insufficient_credits_is_402_and_not_retried() -> None:
    fake = FakeControlPlane(credits_usd=0.001)
    opts = fake.client_options()
    with Sandbox.create(**opts):
        fake.advance(120)  # 120 s x (1 vCPU + 0.5 GB) is more than $0.001
    with pytest.raises(InsufficientCredits) as info:
        Sandbox.create(**opts)
    assert info.value.status == 402 and info.value.code == "insufficient_credits"
    assert len(fake.requests_to("POST", "/v1/sandboxes")) == 2  # a 402 is not retried
    assert (Sandbox.usage(**opts)).credits_usd == 0.0
