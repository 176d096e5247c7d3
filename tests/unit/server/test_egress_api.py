"""Egress policy through the REST API (issue 14): validation, defaults (request, template, none), the
deployment's --no-egress and --egress-allow, isolation modes, what the node is asked, history. The node's
egress is a recording fake here (the real one: tests/network)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from pilldrops.server.service.egress import EgressSettings
from tests.stack import fake_egress as _fake
from tests.stack import stack

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def error_of(resp: Any) -> dict:
    body = resp.json()
    assert set(body["error"]) == {"code", "message", "details", "request_id"}, body
    return body["error"]


async def test_default_is_loopback_only_and_policy_is_recorded(tmp_path: Path) -> None:
    async with stack(tmp_path) as st, st.client() as c:
        fake = _fake(st)
        plain = (await c.post("/v1/sandboxes", json={"template": "tiny"})).json()
        assert plain["allow_internet_access"] is False and plain["network"] is None
        assert plain["id"] not in fake.attached                  # no interface at all
        body = {"template": "tiny", "allow_internet_access": True,
                "network": {"allow_out": ["198.18.0.5", "10.1.2.3/8"], "deny_out": ["198.18.0.0/15"]}}
        r = await c.post("/v1/sandboxes", json=body)
        assert r.status_code == 201, r.text
        sb = r.json()
        assert sb["allow_internet_access"] is True
        assert sb["network"] == {"allow_out": ["198.18.0.5/32", "10.0.0.0/8"], "deny_out": ["198.18.0.0/15"]}
        net = fake.attached[sb["id"]]
        assert net.allow_internet_access and net.allow_out == ["198.18.0.5/32", "10.0.0.0/8"] and net.cap is None
        got = (await c.get(f"/v1/sandboxes/{sb['id']}")).json()
        assert got["network"] == sb["network"] and got["allow_internet_access"] is True
        await c.delete(f"/v1/sandboxes/{sb['id']}")
        assert sb["id"] in fake.released
        hist = {h["id"]: h for h in (await c.get("/v1/history")).json()["items"]}
        assert hist[sb["id"]]["allow_internet_access"] is True and hist[sb["id"]]["network"] == sb["network"]
        assert hist[plain["id"]]["network"] is None


@pytest.mark.parametrize("network", [{"allow_out": ["nope"]}, {"deny_out": ["10.0.0.0/33"]},
                                     {"allow_out": ["fd00::1"]}, {"allow_out": [f"10.0.0.{i}" for i in range(65)]},
                                     {"allow": ["10.0.0.0/8"]}])
async def test_bad_policies_are_typed_400s(tmp_path: Path, network: dict) -> None:
    async with stack(tmp_path) as st, st.client() as c:
        for path, extra in (("/v1/sandboxes", {}), ("/v1/sandboxes/batch", {"count": 2})):
            r = await c.post(path, json={"template": "tiny", "network": network, **extra})
            assert r.status_code == 400, r.text
            assert error_of(r)["code"] == "invalid_request"


async def test_no_egress_deployment_refuses_with_a_stable_code(tmp_path: Path) -> None:
    async with stack(tmp_path, egress=EgressSettings.of(no_egress=True)) as st, st.client() as c:
        _fake(st)
        for body in ({"allow_internet_access": True}, {"network": {"allow_out": ["198.18.0.1"]}}):
            r = await c.post("/v1/sandboxes", json={"template": "tiny", **body})
            assert r.status_code == 403, r.text
            err = error_of(r)
            assert err["code"] == "egress_forbidden" and err["details"]["reason"] == "disabled"
        assert (await c.post("/v1/sandboxes", json={"template": "tiny"})).status_code == 201
        r = await c.post("/v1/sandboxes/batch", json={"template": "tiny", "count": 2, "allow_internet_access": True})
        assert [i["error"]["code"] for i in r.json()["items"]] == ["egress_forbidden"] * 2


async def test_cap_refuses_allow_out_outside_and_is_sent_to_the_node(tmp_path: Path) -> None:
    async with stack(tmp_path, egress=EgressSettings.of(allow=("198.18.0.0/15",))) as st, st.client() as c:
        fake = _fake(st)
        r = await c.post("/v1/sandboxes", json={"template": "tiny", "network": {"allow_out": ["10.0.0.0/8"]}})
        assert r.status_code == 403 and error_of(r)["details"]["reason"] == "outside_cap"
        sb = (await c.post("/v1/sandboxes", json={"template": "tiny", "allow_internet_access": True})).json()
        assert fake.attached[sb["id"]].cap == ["198.18.0.0/15"]


async def test_egress_in_another_isolation_mode_is_not_supported(tmp_path: Path) -> None:
    async with stack(tmp_path, isolation=("gvisor",)) as st, st.client() as c:
        _fake(st)
        r = await c.post("/v1/sandboxes", json={"template": "tiny", "isolation": "gvisor",
                                                "allow_internet_access": True})
        assert r.status_code == 501, r.text
        err = error_of(r)
        assert err["code"] == "not_supported" and "gvisor" in err["message"]


async def test_template_default_and_request_override(tmp_path: Path) -> None:
    async with stack(tmp_path) as st, st.client() as c:
        fake = _fake(st)
        object.__setattr__(st.agent.templates.get("tiny"), "network", {
            "allow_internet_access": True, "allow_out": [], "deny_out": ["198.18.9.0/24"]})
        st.agent.refresh_templates()
        await st.agent.control_plane.heartbeat()
        sb = (await c.post("/v1/sandboxes", json={"template": "tiny"})).json()
        assert sb["allow_internet_access"] is True and sb["network"]["deny_out"] == ["198.18.9.0/24"]
        assert fake.attached[sb["id"]].deny_out == ["198.18.9.0/24"]
        off = (await c.post("/v1/sandboxes", json={"template": "tiny", "allow_internet_access": False})).json()
        assert off["allow_internet_access"] is False and off["id"] not in fake.attached
        batch = (await c.post("/v1/sandboxes/batch", json={"template": "tiny", "count": 1})).json()
        assert batch["items"][0]["sandbox"]["allow_internet_access"] is True     # batch items: the template's
