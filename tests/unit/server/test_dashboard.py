"""The dashboard's server side: the static page and its assets with a strict CSP (and nothing else served
from disk), and `GET /v1/history/stats`, the chart aggregates (pure rules here; the endpoint on the
in-process stack, both stores)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pilldrops.server.domain.billing import Rates
from pilldrops.server.domain.stats import Episode, compute, histogram, quantile
from tests.stack import stack

RATES = Rates()
T0 = datetime(2026, 1, 1, tzinfo=UTC)


def at(s: float) -> datetime:
    return T0 + timedelta(seconds=s)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


# ---- pure aggregates ---------------------------------------------------------------------------------

def test_series_spreads_cost_over_running_time_and_counts_concurrency() -> None:
    eps = [Episode(at(0), at(10), 1.0), Episode(at(5), at(10), 0.5), Episode(at(0), at(20), 2.0)]
    s = compute(eps, now=at(100), rates=RATES, buckets=4)
    assert (s.start, s.end, s.bucket_s, len(s.series)) == (at(0), at(20), 5.0, 4)
    assert [round(b.spend_usd, 9) for b in s.series] == [0.5 + 0.5, 0.5 + 0.5 + 0.5, 0.5, 0.5]
    assert sum(b.spend_usd for b in s.series) == pytest.approx(s.cost_usd) == pytest.approx(3.5)
    assert [b.running_max for b in s.series] == [2, 3, 1, 1]
    assert [round(b.running_avg, 6) for b in s.series] == [2, 3, 1, 1]


def test_a_paused_interval_is_not_running_and_carries_only_the_storage_cost() -> None:
    storage_gb_s = 10.0
    storage_cost = storage_gb_s * RATES.storage_gb_s_usd
    ep = Episode(at(0), at(30), 1.0 + storage_cost, storage_gb_s=storage_gb_s, pauses=[(at(10), at(20))])
    s = compute([ep], now=at(100), rates=RATES, buckets=3)
    assert [b.running_max for b in s.series] == [1, 0, 1]
    assert [round(b.running_avg, 6) for b in s.series] == [1, 0, 1]
    assert s.series[1].spend_usd == pytest.approx(storage_cost)
    assert s.series[0].spend_usd == pytest.approx(0.5) == pytest.approx(s.series[2].spend_usd)


def test_live_episodes_run_until_now_and_unstarted_ones_only_count_in_the_histogram() -> None:
    s = compute([Episode(at(0), None, 0.2), Episode(None, None, 0.0)], now=at(60), rates=RATES, buckets=6)
    assert s.end == at(60) and s.sandboxes == 2 and len(s.series) == 6
    assert all(b.running_max == 1 for b in s.series)
    assert sum(c for _, _, c in s.histogram) == 2


def test_empty_batch() -> None:
    s = compute([], now=at(0), rates=RATES)
    assert (s.sandboxes, s.series, s.histogram, s.quantiles["p99"]) == (0, [], [], 0.0)


def test_histogram_and_quantiles() -> None:
    assert histogram([1, 1, 1], 5) == [(1, 1, 3)]
    assert histogram([0.0, 5e-324], 20) == [(0.0, 5e-324, 2)]      # a spread that underflows a bin width
    bins = histogram([0, 1, 2, 3, 4, 10], 5)
    assert [c for *_, c in bins] == [2, 2, 1, 0, 1] and bins[0][0] == 0 and bins[-1][1] == 10
    vals = sorted(float(i) for i in range(1, 101))
    assert (quantile(vals, 0.5), quantile(vals, 0.9), quantile(vals, 0.99), quantile([], 0.5)) == (50, 90, 99, 0)


@given(st.lists(st.tuples(st.floats(0, 1000), st.floats(0, 1000), st.floats(0, 5)), min_size=1, max_size=40),
       st.integers(1, 80))
def test_spend_adds_up_to_the_cost_and_peaks_bound_averages(raw: list, buckets: int) -> None:  # type: ignore[type-arg]
    eps = [Episode(at(a), at(a + d), c) for a, d, c in raw]
    s = compute(eps, now=at(5000), rates=RATES, buckets=buckets)
    assert sum(b.spend_usd for b in s.series) == pytest.approx(s.cost_usd, rel=1e-6, abs=1e-9)
    assert len(s.series) <= max(buckets, 1)
    for b in s.series:
        assert 0 <= b.running_avg <= b.running_max + 1e-9 <= len(eps) + 1e-9
    assert sum(c for *_, c in s.histogram) == len(eps)


# ---- HTTP ----------------------------------------------------------------------------------------------

@pytest.mark.anyio
async def test_page_and_assets_carry_a_strict_csp_and_nothing_else_is_served(tmp_path) -> None:
    async with stack(tmp_path) as s, s.client(key="") as c:
        page = await c.get("/")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        csp = page.headers["content-security-policy"]
        assert "default-src 'none'" in csp and "script-src 'self'" in csp and "frame-ancestors 'none'" in csp
        assert "unsafe-inline" not in csp and "unsafe-eval" not in csp
        assert 'type="password"' in page.text and "<script>" not in page.text   # no inline script
        for name, ctype in [("app.js", "text/javascript"), ("api.js", "text/javascript"),
                            ("charts.js", "text/javascript"), ("style.css", "text/css")]:
            r = await c.get(f"/dashboard/{name}")
            assert r.status_code == 200 and r.headers["content-type"].startswith(ctype), name
            assert r.headers["content-security-policy"] == csp and r.headers["x-content-type-options"] == "nosniff"
        js = (await c.get("/dashboard/app.js")).text + (await c.get("/dashboard/api.js")).text
        assert "innerHTML" not in js and "localStorage" not in js and "document.cookie" not in js
        for bad in ["/dashboard/..%2F__init__.py", "/dashboard/__init__.py", "/dashboard/nope.js"]:
            r = await c.get(bad)
            assert r.status_code == 404 and r.json()["error"]["code"] in ("not_found",), bad
        assert (await c.get("/v1/history/stats")).json()["error"]["code"] == "unauthenticated"


@pytest.mark.anyio
async def test_stats_endpoint_aggregates_the_filtered_history(tmp_path, store_url) -> None:
    async with stack(tmp_path, db_url=store_url) as s, s.client() as c:
        ids = []
        for i in range(3):
            r = await c.post("/v1/sandboxes", json={"template": "tiny", "metadata": {"run": "a" if i < 2 else "b"}})
            ids.append(r.json()["id"])
        live = (await c.get("/v1/history/stats", params={"metadata.run": "b"})).json()    # still running
        assert live["sandboxes"] == 1 and live["series"][-1]["running_max"] == 1
        for sid in ids:
            await c.delete(f"/v1/sandboxes/{sid}")
        st = (await c.get("/v1/history/stats", params={"metadata.run": "a", "buckets": 10, "bins": 4})).json()
        hist = (await c.get("/v1/history", params={"metadata.run": "a"})).json()["items"]
        assert st["sandboxes"] == 2 and not st["truncated"]
        assert st["cost_usd"] == pytest.approx(sum(h["cost_usd"] for h in hist), rel=1e-9)    # final costs
        assert sum(p["spend_usd"] for p in st["series"]) == pytest.approx(st["cost_usd"], rel=1e-6)
        assert 1 <= len(st["series"]) <= 10 and st["bucket_s"] >= 1
        assert max(p["running_max"] for p in st["series"]) >= 1
        assert sum(b["count"] for b in st["cost_histogram"]) == 2
        assert set(st["cost_quantiles"]) == {"p50", "p90", "p99", "max"}
        assert (await c.get("/v1/history/stats", params={"metadata.run": "zzz"})).json()["sandboxes"] == 0
        bad = await c.get("/v1/history/stats", params={"buckets": 0})
        assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_request"


@given(st.lists(st.tuples(st.floats(0, 500), st.floats(0, 500), st.floats(0, 1), st.floats(0, 1),
                          st.floats(0, 5), st.floats(0, 1e6)), min_size=1, max_size=20), st.integers(1, 50))
def test_with_pauses_spend_still_adds_up_and_paused_time_is_not_running(raw: list, buckets: int) -> None:  # type: ignore[type-arg]
    eps = []
    for a, d, p0, p1, c, gb_s in raw:
        lo, hi = sorted((p0, p1))
        pause = (at(a + d * lo), at(a + d * hi))
        eps.append(Episode(at(a), at(a + d), c + gb_s * RATES.storage_gb_s_usd, storage_gb_s=gb_s, pauses=[pause]))
    s = compute(eps, now=at(5000), rates=RATES, buckets=buckets)
    assert sum(b.spend_usd for b in s.series) == pytest.approx(s.cost_usd, rel=1e-6, abs=1e-9)
    running_s = sum(b.running_avg * s.bucket_s for b in s.series)
    want = sum(d * (1 - abs(p1 - p0)) for _, d, p0, p1, _, _ in raw)
    assert running_s == pytest.approx(want, rel=1e-6, abs=1e-3)
