"""The dashboard in a real browser against a real `pilldrops up`: sign-in (a wrong key shows what to do;
the key stays in sessionStorage, never in the URL or a cookie), a running and an ended sandbox with its
cost, the charts drawn from the history, kill (and pause/resume where CRIU works) from the page, nodes and
warm pools, and a metadata filter that selects a batch."""

from __future__ import annotations

import re
import time
from typing import Any

import httpx
import pytest

from pilldrops.node.isolation import criu
from tests.browser.conftest import sign_in
from tests.e2e.conftest import Server

pytestmark = pytest.mark.integration


def wait_state(api: httpx.Client, sid: str, want: str, timeout: float = 30) -> dict:  # type: ignore[type-arg]
    deadline = time.monotonic() + timeout
    while True:
        info = api.get(f"/v1/sandboxes/{sid}").json()
        if info["state"] == want or time.monotonic() > deadline:
            return info
        time.sleep(0.2)


def test_a_wrong_key_shows_an_error_that_says_what_to_do(page: Any, dash_server: Server) -> None:
    page.console_log.allow(r"status of 401")      # the browser logs the refused /v1/whoami itself
    sign_in(page, "pd_not-a-real-key")
    err = page.locator("#signin-error")
    err.wait_for(state="visible")
    assert re.search(r"not accepted.*pilldrops keys create", err.inner_text(), re.DOTALL)
    assert page.locator("#app").is_hidden()
    assert page.evaluate("sessionStorage.length") == 0
    page.fill("#api-key", "")
    page.click("#signin-form button[type=submit]")        # empty: the browser's own `required` check
    assert page.locator("#app").is_hidden()


def test_sandboxes_costs_charts_and_kill(page: Any, dash_server: Server, api: httpx.Client) -> None:
    tag = {"suite": f"browser-{time.time_ns()}"}
    ended = []
    for i in range(3):
        sid = api.post("/v1/sandboxes", json={"template": "tiny", "memory_mb": 64,
                                              "metadata": {**tag, "ep": str(i)}}).raise_for_status().json()["id"]
        api.post(f"/v1/sandboxes/{sid}/run", json={"cmd": "echo hi"}).raise_for_status()
        time.sleep(0.3)
        ended.append(api.delete(f"/v1/sandboxes/{sid}").raise_for_status().json())
    live = api.post("/v1/sandboxes", json={"template": "tiny", "memory_mb": 64, "timeout": 300,
                                           "metadata": {**tag, "ep": "live"}}).raise_for_status().json()
    try:
        sign_in(page, dash_server.api_key)
        page.locator("#app").wait_for(state="visible")
        assert dash_server.api_key not in page.url and page.context.cookies() == []
        assert page.evaluate("sessionStorage.getItem('pilldrops.api_key')") == dash_server.api_key

        # the running sandbox, live, with its node and a kill button; the ended ones in the history
        row = page.locator(f"#live-table tr[data-id='{live['id']}']")
        row.wait_for()
        assert "running" in row.inner_text() and dash_server.log.exists()
        assert row.locator("td").nth(4).inner_text() == dash_server.name   # node name (admin key)
        assert re.search(r"\$0\.0\d+", row.locator("td.cost").inner_text())
        hist = page.locator(f"#history-table tr[data-id='{ended[0]['id']}']")
        hist.wait_for()
        assert hist.locator("td.end-reason").inner_text() == "killed"
        cost = hist.locator("td.cost").inner_text()
        assert cost.startswith("$0.0") and float(cost[1:]) == pytest.approx(ended[0]["cost_usd"], rel=0.05)

        # select the batch by a metadata chip: 4 sandboxes, the charts drawn from them
        hist.locator("button.chip", has_text="suite=").click()
        page.wait_for_function("() => document.getElementById('batch').textContent.startsWith('4 sandboxes')")
        assert "metadata.suite=" in page.url and page.locator("#f-meta").input_value() == f"suite={tag['suite']}"
        assert page.locator("#history-table tbody tr").count() == 4
        page.wait_for_function("() => document.querySelectorAll('#chart-spend svg rect.bar').length > 0")
        assert page.locator("#chart-hist svg rect.bar").count() >= 1
        peak = page.locator("#chart-running svg path.line.peak").get_attribute("d") or ""
        assert peak.startswith("M") and peak.count("H") >= 1          # a level held over each bucket
        heights = [float(h) for h in page.locator("#chart-spend svg rect.bar").evaluate_all(
            "rs => rs.map(r => r.getAttribute('height'))")]
        assert max(heights) > 10
        hist_total = sum(int(re.search(r": (\d+) sandbox", t).group(1)) for t in page.locator(  # type: ignore[union-attr]
            "#chart-hist svg rect.bar title").all_text_contents())
        assert hist_total == 4

        # usage cards, nodes (admin key), pools' empty state
        usage = api.get("/v1/usage").json()
        credits = page.locator("#credits").inner_text()
        if usage["credits_unlimited"]:
            assert credits == "unlimited"
        else:
            assert float(credits[1:]) == pytest.approx(usage["credits_usd"], abs=1e-4)
        assert int(page.locator("#count").inner_text()) >= 4
        assert page.locator("#nodes-table tbody tr").count() == 1
        assert "%" in page.locator("#nodes-table tbody tr td").nth(2).inner_text()
        assert "pilldrops pools set" in page.locator("#pools-empty").inner_text()

        if criu.unavailable_reason() is None:
            row.locator("button.pause").click()
            page.locator(f"#live-table tr[data-id='{live['id']}'][data-state='paused'] button.resume").click()
            assert wait_state(api, live["id"], "running")["state"] == "running"
            page.locator(f"#live-table tr[data-id='{live['id']}'][data-state='running']").wait_for()

        page.screenshot(path=str(_artifact("dashboard-batch.png")), full_page=True)
        page.locator(f"#live-table tr[data-id='{live['id']}'] button.kill").click()
        page.locator("#toast", has_text=f"Killed {live['id']}").wait_for()
        page.locator(f"#live-table tr[data-id='{live['id']}']").wait_for(state="detached")
        info = api.get(f"/v1/sandboxes/{live['id']}").json()
        assert (info["state"], info["end_reason"]) == ("stopped", "killed") and info["cost_usd"] > 0
        page.locator(f"#history-table tr[data-id='{live['id']}'] td.end-reason", has_text="killed").wait_for()

        # updates without a reload: a sandbox made now shows up on its own
        later = api.post("/v1/sandboxes", json={"template": "tiny", "memory_mb": 64,
                                                "metadata": {**tag, "ep": "later"}}).json()
        page.locator(f"#live-table tr[data-id='{later['id']}']").wait_for()
        api.delete(f"/v1/sandboxes/{later['id']}")
        page.wait_for_function("() => document.getElementById('batch').textContent.startsWith('5 sandboxes')")
    finally:
        api.delete(f"/v1/sandboxes/{live['id']}")


def test_session_only_key_sign_out_and_empty_filter(page: Any, dash_server: Server) -> None:
    sign_in(page, dash_server.api_key)
    page.locator("#app").wait_for(state="visible")
    page.reload()                                              # same tab: still signed in
    page.locator("#app").wait_for(state="visible")
    page.fill("#f-meta", "suite=no-such-batch")
    page.click("#filter button[type=submit]")
    page.locator("#history-empty", has_text="No sandbox matches this filter").wait_for()
    assert "No spend" in (page.locator("#chart-spend svg text.empty-chart").text_content() or "")
    page.click("#f-clear")
    page.locator("#history-table tbody tr").first.wait_for()          # earlier tests' sandboxes
    page.fill("#f-since", "2999-01-01T00:00:00")                       # created from: the far future
    page.click("#filter button[type=submit]")
    page.locator("#history-empty", has_text="No sandbox matches this filter").wait_for()
    assert "since=2999-01-0" in page.url or "since=2998-12-31" in page.url       # local time, sent as UTC
    page.click("#signout")
    page.locator("#signin").wait_for(state="visible")
    assert page.evaluate("sessionStorage.length") == 0 and page.context.cookies() == []
    other = page.context.browser.new_context(base_url=dash_server.api_url).new_page()   # a new session
    other.goto("/")
    assert other.locator("#signin").is_visible() and other.locator("#app").is_hidden()
    other.context.close()


def _artifact(name: str) -> Any:
    from tests.browser.conftest import ARTIFACTS
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    return ARTIFACTS / name


def test_warm_pool_hit_rate_and_a_non_admin_key(page: Any, dash_server: Server, api: httpx.Client) -> None:
    shape = {"template": "tiny", "vcpu": 1, "memory_mb": 48}
    api.put("/v1/pools", json={**shape, "size": 1}).raise_for_status()
    try:
        deadline = time.monotonic() + 30
        while not any(p["ready"] for p in api.get("/v1/pools").json()["items"]):
            assert time.monotonic() < deadline, api.get("/v1/pools").json()
            time.sleep(0.2)
        api.delete(f"/v1/sandboxes/{api.post('/v1/sandboxes', json=shape).json()['id']}")     # a hit
        api.delete(f"/v1/sandboxes/{api.post('/v1/sandboxes', json={**shape, 'memory_mb': 40}).json()['id']}")
        deadline = time.monotonic() + 30
        while not api.get("/v1/pools").json()["items"][0]["hits"]:
            assert time.monotonic() < deadline
            time.sleep(0.2)
        sign_in(page, dash_server.api_key)
        row = page.locator("#pools-table tbody tr").first
        row.wait_for()
        cells = row.locator("td").all_inner_texts()
        assert cells[0] == "tiny" and cells[1] == "1 vCPU, 48 MiB" and int(cells[5]) >= 1
        assert cells[7].endswith("%") and float(cells[7][:-1]) > 0
        page.screenshot(path=str(_artifact("pools-and-nodes.png")), full_page=True)
        page.click("#signout")
    finally:
        api.put("/v1/pools", json={**shape, "size": 0}).raise_for_status()
    # a key of a team without admin rights: no node view, a message saying which key can see it
    team_key = api.post("/v1/keys", json={"name": "browser-nonadmin"}).json()
    page.console_log.allow(r"status of 40[13]")        # the refused /v1/nodes, then the revoked key
    sign_in(page, team_key["secret"])
    page.locator("#nodes-empty", has_text="admin key only").wait_for()
    assert page.locator("#nodes-table").is_hidden()
    api.delete(f"/v1/keys/{team_key['id']}")
    page.locator("#signin-error", has_text="sign in with a valid one").wait_for(timeout=20_000)   # revoked
    deadline = time.monotonic() + 30
    while api.get("/v1/pools").json()["items"]:
        assert time.monotonic() < deadline, "the pool was not removed"
        time.sleep(0.2)
