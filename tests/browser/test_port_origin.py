"""A sandbox's page in a real browser: served by its port URL on the port-URL listener's origin, its script
cannot read the dashboard's session (the API key in sessionStorage, same tab), nor read the API's answers
(cross-origin, no CORS), and the dashboard's session is still there afterwards."""

from __future__ import annotations

import json
import time
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest

from tests.browser.conftest import sign_in
from tests.e2e.conftest import Server

pytestmark = pytest.mark.integration

PAGE = """<!doctype html><html><body><p id=out>running</p><script>
const out = {origin: location.origin};
try { out.key = sessionStorage.getItem('pilldrops.api_key'); out.n = sessionStorage.length; }
catch (e) { out.key = 'error ' + e; }
fetch(%s + '/v1/whoami').then(r => r.text()).then(t => { out.api = 'read: ' + t; },
                                                   e => { out.api = 'blocked'; })
  .finally(() => { document.getElementById('out').textContent = JSON.stringify(out); document.title = 'done'; });
</script></body></html>"""


def _run(api: httpx.Client, sid: str, cmd: str) -> int:
    r = api.post(f"/v1/sandboxes/{sid}/run", json={"cmd": cmd, "timeout": 30})
    r.raise_for_status()
    return next(json.loads(x)["exit_code"] for x in r.text.splitlines() if json.loads(x)["type"] == "exit")


def test_a_sandbox_page_cannot_read_the_dashboards_session(page: Any, dash_server: Server,
                                                          api: httpx.Client) -> None:
    sid = api.post("/v1/sandboxes", json={"template": "tiny", "memory_mb": 64, "timeout": 120}
                   ).raise_for_status().json()["id"]
    try:
        api.put(f"/v1/sandboxes/{sid}/files", params={"path": "/srv/index.html"},
                content=(PAGE % json.dumps(dash_server.api_url)).encode()).raise_for_status()
        assert _run(api, sid, "busybox httpd -p 127.0.0.1:8080 -h /srv") == 0
        deadline = time.monotonic() + 20
        while _run(api, sid, "busybox wget -q -O /dev/null http://127.0.0.1:8080/"):
            assert time.monotonic() < deadline
            time.sleep(0.2)
        url = api.post(f"/v1/sandboxes/{sid}/urls", json={"port": 8080}).raise_for_status().json()["url"]

        sign_in(page, dash_server.api_key)
        page.locator("#app").wait_for(state="visible")
        assert page.evaluate("sessionStorage.getItem('pilldrops.api_key')") == dash_server.api_key

        page.console_log.allow(r"CORS|Failed to load resource|ERR_FAILED")   # the blocked read, as expected
        page.goto(url)                                    # the same tab: the attack the separation stops
        page.wait_for_function("document.title === 'done'")
        seen = json.loads(page.locator("#out").inner_text())
        api_origin = "http://" + urlsplit(dash_server.api_url).netloc
        assert seen["origin"] != api_origin and seen["origin"] == "http://" + urlsplit(url).netloc
        assert seen["key"] is None and seen["n"] == 0
        assert seen["api"] == "blocked"
        assert "pd_token" not in page.url               # the token left the address bar (a cookie carries it)

        page.goto(dash_server.api_url + "/")              # back on the dashboard: its session is intact
        assert page.evaluate("sessionStorage.getItem('pilldrops.api_key')") == dash_server.api_key
    finally:
        api.delete(f"/v1/sandboxes/{sid}")
