"""The E2B REST surface and the router on the in-process stack (fake runtime, real SQLite; no root): status
codes, required fields, list filters and pages, connect semantics, idempotency, error shapes, and what
sandbox traffic for an unknown sandbox gets."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from tests.stack import Stack, stack

pytestmark = pytest.mark.anyio
REQUIRED_DETAIL = {"templateID", "sandboxID", "clientID", "startedAt", "endAt", "envdVersion", "cpuCount",
                   "memoryMB", "diskSizeMB", "state"}


@pytest.fixture
async def st(tmp_path: Path) -> AsyncIterator[Stack]:
    async with stack(tmp_path, templates=("base", "code-interpreter")) as s:
        yield s


def e2b(st: Stack, key: str | None = None) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=st.cp.app), base_url="http://cp",
                             headers={"X-API-Key": key or st.key})


async def test_create_get_kill(st: Stack) -> None:
    async with e2b(st) as c:
        r = await c.post("/v2/sandboxes", json={"templateID": "base", "metadata": {}, "envVars": {"A": "1"},
                                                "autoPause": True, "mcp": {"x": 1}})
        assert r.status_code == 201
        sb = r.json()
        assert {"templateID", "sandboxID", "clientID", "envdVersion", "envdAccessToken"} <= set(sb)
        assert sb["sandboxID"].isalnum() and sb["domain"] is None and sb["trafficAccessToken"] is None
        d = (await c.get(f"/sandboxes/{sb['sandboxID']}")).json()
        assert REQUIRED_DETAIL <= set(d) and d["state"] == "running" and d["envdAccessToken"] == sb["envdAccessToken"]
        row = await st.cp.services.sandboxes.get_row(st.team_id, "sb_" + sb["sandboxID"][2:])
        assert row.envs == {"A": "1"} and row.timeout == 300                    # E2B's default timeout
        assert (await c.delete(f"/sandboxes/{sb['sandboxID']}")).status_code == 204
        assert (await c.delete(f"/sandboxes/{sb['sandboxID']}")).status_code == 404
        r = await c.get(f"/sandboxes/{sb['sandboxID']}")
        assert r.status_code == 404 and r.json()["code"] == 404 and r.json()["error"]["code"] == "sandbox_not_found"


async def test_list_filters_and_pages(st: Stack) -> None:
    async with e2b(st) as c:
        ids = [(await c.post("/v2/sandboxes", json={"templateID": "base", "metadata": {"run": str(i % 2)}}))
               .json()["sandboxID"] for i in range(3)]
        r = await c.get("/v2/sandboxes", params={"metadata": "run=0"})
        assert sorted(s["sandboxID"] for s in r.json()) == sorted([ids[0], ids[2]])
        seen, token = [], None
        while True:
            r = await c.get("/v2/sandboxes", params={"limit": 1, **({"nextToken": token} if token else {})})
            seen += [s["sandboxID"] for s in r.json()]
            token = r.headers.get("x-next-token")
            if not token:
                break
        assert sorted(seen) == sorted(ids)
        assert (await c.get("/v2/sandboxes", params={"state": "paused"})).json() == []
        r = await c.get("/v2/sandboxes", params={"state": "bogus"})
        assert r.status_code == 400 and r.json()["code"] == 400
        assert len((await c.get("/sandboxes")).json()) == 3                                  # v1 list


async def test_connect_extends_only(st: Stack) -> None:
    async with e2b(st) as c:
        sid = (await c.post("/sandboxes", json={"templateID": "base", "timeout": 1000})).json()["sandboxID"]
        end = (await c.get(f"/sandboxes/{sid}")).json()["endAt"]
        r = await c.post(f"/v2/sandboxes/{sid}/connect", json={"timeout": 10})
        assert r.status_code == 200 and (await c.get(f"/sandboxes/{sid}")).json()["endAt"] == end   # never shortens
        assert (await c.post(f"/sandboxes/{sid}/connect", json={"timeout": 5000})).status_code == 200
        assert (await c.get(f"/sandboxes/{sid}")).json()["endAt"] > end
        assert (await c.post(f"/sandboxes/{sid}/timeout", json={"timeout": 10})).status_code == 204
        assert (await c.get(f"/sandboxes/{sid}")).json()["endAt"] < end                      # set_timeout does
        assert (await c.post(f"/sandboxes/{sid}/timeout", json={})).status_code == 400
        assert (await c.post("/v2/sandboxes/sbnope/connect", json={})).status_code == 404


async def test_idempotency_and_errors(st: Stack) -> None:
    async with e2b(st) as c:
        h = {"Idempotency-Key": "same-key"}
        a = await c.post("/v2/sandboxes", json={"templateID": "base"}, headers=h)
        b = await c.post("/v2/sandboxes", json={"templateID": "base"}, headers=h)
        assert a.status_code == b.status_code == 201 and a.json()["sandboxID"] == b.json()["sandboxID"]
        r = await c.post("/v2/sandboxes", json={"templateID": "code-interpreter-v1"}, headers=h)
        assert r.status_code == 409 and r.json()["code"] == 409                # same key, other body
        r = await c.post("/v2/sandboxes", json={"templateID": "nope"})
        assert r.status_code == 404 and "nope" in r.json()["message"]
        r = await c.post("/v2/sandboxes", json=["not", "an", "object"])
        assert r.status_code == 400
        r = await c.post("/v2/sandboxes", json={"templateID": "base", "metadata": "x"})
        assert r.status_code == 400
    async with e2b(st, key="wrong") as c:
        r = await c.get("/v2/sandboxes")
        assert r.status_code == 401 and r.json()["message"] == "Invalid API key"
    other = await st.new_team_key("other")
    async with e2b(st) as c, e2b(st, key=other) as o:
        sid = (await c.post("/v2/sandboxes", json={"templateID": "base"})).json()["sandboxID"]
        assert (await o.get(f"/sandboxes/{sid}")).status_code == 404         # another team's: not found
        assert (await o.delete(f"/sandboxes/{sid}")).status_code == 404
        assert (await o.get("/v2/sandboxes")).json() == []


async def test_sandbox_traffic_routing(st: Stack) -> None:
    async with e2b(st) as c:
        for port in ("49983", "49999", "8080"):
            r = await c.get("/health", headers={"E2b-Sandbox-Id": "sbnosuch", "E2b-Sandbox-Port": port})
            assert r.status_code == 502
            assert r.json()["message"] == "The sandbox was not found" and r.json()["sandboxId"] == "sbnosuch"
        r = await c.get("/health", headers={"Host": "8080-sbnosuch.sandbox.test"})
        assert r.status_code == 502
        r = await c.get("/health", headers={"E2b-Sandbox-Id": "bad id!", "E2b-Sandbox-Port": "49983"})
        assert r.status_code == 400
        sid = (await c.post("/v2/sandboxes", json={"templateID": "base"})).json()["sandboxID"]
        r = await c.get("/health", headers={"E2b-Sandbox-Id": sid, "E2b-Sandbox-Port": "49999"})
        assert r.status_code == 200 and r.text == "OK"
        await c.delete(f"/sandboxes/{sid}")
        r = await c.get("/health", headers={"E2b-Sandbox-Id": sid, "E2b-Sandbox-Port": "49999"})
        assert r.status_code == 502                            # killed: gone at once
    async with st.client() as ours:                           # our own API is untouched
        assert (await ours.get("/v1/whoami")).status_code == 200


async def test_egress_fields_map_onto_the_policy(st: Stack) -> None:
    """E2B's allow_internet_access (absent: off, our default) and network.allowOut/denyOut (allow wins)."""
    from tests.stack import fake_egress
    fake = fake_egress(st)
    async with e2b(st) as c:
        plain = (await c.post("/v2/sandboxes", json={"templateID": "base"})).json()
        d = (await c.get(f"/sandboxes/{plain['sandboxID']}")).json()
        assert d["allowInternetAccess"] is False and d["network"] is None
        r = await c.post("/v2/sandboxes", json={"templateID": "base", "allow_internet_access": True,
                                                "network": {"allowOut": ["198.18.0.1"], "denyOut": ["0.0.0.0/0"],
                                                            "allowPublicTraffic": True}})
        assert r.status_code == 201, r.text
        sid = r.json()["sandboxID"]
        d = (await c.get(f"/sandboxes/{sid}")).json()
        assert d["allowInternetAccess"] is True
        assert d["network"] == {"allowOut": ["198.18.0.1/32"], "denyOut": ["0.0.0.0/0"]}
        net = fake.attached["sb_" + sid[2:]]
        assert net.allow_internet_access and net.allow_out == ["198.18.0.1/32"] and net.deny_out == ["0.0.0.0/0"]
        r = await c.post("/v2/sandboxes", json={"templateID": "base", "network": {"allowOut": ["bad"]}})
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_request"
        st.cp.services.sandboxes.ctx.egress = type(st.cp.services.sandboxes.ctx.egress)(enabled=False)
        legacy = await c.post("/sandboxes", json={"templateID": "base", "allow_internet_access": True})
        assert legacy.status_code == 201                      # older SDKs always send true: ignored here
        assert (await c.get(f"/sandboxes/{legacy.json()['sandboxID']}")).json()["allowInternetAccess"] is False
        r = await c.post("/v2/sandboxes", json={"templateID": "base", "network": {"allowOut": ["198.18.0.1"]}})
        assert r.status_code == 403 and r.json()["error"]["code"] == "egress_forbidden"
