"""The node's create route as a raw ASGI handler (``node/createroute.py``, issue 15) answers as the FastAPI
route does: the same status fields, the same typed errors, the same gate and token check."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta

import httpx
import pytest

from pilldrops.node import createroute
from pilldrops.node.api import create_node_app
from pilldrops.node.createroute import CreateRoute
from tests.stack import TOKEN, stack
from tests.unit.rawroutes import check_bounded, strip, without

pytestmark = pytest.mark.anyio

URL = "/node/v1/sandboxes"
AUTH = {"authorization": f"Bearer {TOKEN}"}


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"      # the node agent runs on asyncio (serving.run_served)


def _spec(sid: str, **kw: object) -> dict:  # type: ignore[type-arg]
    end = datetime.now(UTC) + timedelta(seconds=300)
    return {"id": sid, "template": "tiny", "vcpu": 1, "memory_mb": 256, "end_at": end.isoformat(),
            "envs": {"A": "1"}, "access_token": "tok-" + sid, "team_id": "team_x", "timeout_s": 300.0, **kw}


async def test_create_and_its_errors_match_the_fastapi_route(tmp_path, monkeypatch) -> None:
    async with stack(tmp_path) as st:
        fast = httpx.AsyncClient(transport=st.transport, base_url="http://node")
        plain = httpx.AsyncClient(transport=httpx.ASGITransport(app=without(create_node_app(st.agent, TOKEN), CreateRoute)), base_url="http://node")
        async with fast, plain:
            # a fresh create through each route: the same fields, field by field (but the clocks' own)
            a = await fast.post(URL, json=_spec("sb_lean1"), headers=AUTH)
            b = await plain.post(URL, json=_spec("sb_lean2"), headers=AUTH)
            assert a.status_code == b.status_code == 200, (a.text, b.text)
            assert a.headers["content-type"] == b.headers["content-type"] == "application/json"
            assert a.headers["x-request-id"].startswith("req_")
            ja, jb = a.json(), b.json()
            assert list(ja) == list(jb)
            for k in ja:
                if k in ("id", "pid", "started_at", "end_at", "run_s", "seq"):
                    assert type(ja[k]) is type(jb[k]), (k, ja[k], jb[k])
                else:
                    assert ja[k] == jb[k], (k, ja[k], jb[k])
            assert ja["id"] == "sb_lean1" and ja["state"] == "running"
            # a retried create (the same id) through either route: the same sandbox
            again_a = (await fast.post(URL, json=_spec("sb_lean2"), headers=AUTH)).json()
            again_b = (await plain.post(URL, json=_spec("sb_lean2"), headers=AUTH)).json()
            for k in ("id", "state", "pid", "started_at", "end_at"):
                assert again_a[k] == again_b[k] == jb[k], k
            cases = [
                (b"{not json", AUTH),
                (json.dumps({"id": "sb_x"}).encode(), AUTH),                       # fields missing
                (json.dumps(_spec("sb_x", nope=1)).encode(), AUTH),                # extra field
                (json.dumps(_spec("sb_x", vcpu="many")).encode(), AUTH),           # wrong type
                (json.dumps(_spec("sb_x", claimed_s=-1)).encode(), AUTH),          # out of range
                (json.dumps(["sb_x"]).encode(), AUTH),                             # not an object
                (b"", AUTH),
                (json.dumps(_spec("sb_x", template="no-such")).encode(), AUTH),    # the agent's own error
                (json.dumps(_spec("sb_y")).encode(), {}),
                (json.dumps(_spec("sb_y")).encode(), {"authorization": "Bearer wrong"}),
                (json.dumps(_spec("sb_y")).encode(), {"x-api-key": "wrong"}),
            ]
            for body, headers in cases:
                ra = await fast.post(URL, content=body, headers={**headers, "content-type": "application/json"})
                rb = await plain.post(URL, content=body, headers={**headers, "content-type": "application/json"})
                assert ra.status_code == rb.status_code, (body, ra.text, rb.text)
                assert ra.status_code >= 400, (body, ra.text)
                assert ra.headers["x-request-id"] == ra.json()["error"]["request_id"]
                ea, eb = strip(ra.json()), strip(rb.json())
                assert ea["error"]["code"] == eb["error"]["code"], (body, ea, eb)
                if body not in (b"{not json", b""):      # the decode position and message are the parser's own
                    assert ea == eb, (body, ea, eb)
            assert st.agent.sandboxes.get("sb_x") is None and st.agent.sandboxes.get("sb_y") is None
            # bounded before it is buffered: by the declared length, and by what arrives
            # (the token is checked before the body is read: a stranger's oversized body is never buffered)
            big = _spec("sb_big", envs={"X": "x" * 2048})
            await check_bounded(fast, URL, createroute, monkeypatch, big=big, head=json.dumps(big).encode()[:-2],
                                tail=b'"}', headers=AUTH, stranger={"authorization": "Bearer wrong"},
                                stranger_code=(401, "unauthenticated"))
            assert st.agent.sandboxes.get("sb_big") is None
            # other routes under the same prefix still reach FastAPI
            ra = await fast.get(URL, headers=AUTH)
            assert ra.status_code == 200 and {s["id"] for s in ra.json()["items"]} >= {"sb_lean1", "sb_lean2"}
            # a restarted agent that has not re-adopted yet: the same gate as every route
            monkeypatch.setattr(type(st.agent), "recovered", property(lambda self: False), raising=False)
            ra = await fast.post(URL, json=_spec("sb_z"), headers=AUTH)
            rb = await plain.post(URL, json=_spec("sb_z"), headers=AUTH)
            assert ra.status_code == rb.status_code == 502
            assert strip(ra.json()) == strip(rb.json()) and ra.json()["error"]["code"] == "node_unavailable"


async def test_the_control_plane_creates_through_the_lean_route(tmp_path) -> None:
    """A create through the public API reaches the node's raw handler (not FastAPI's) and comes back typed."""
    async with stack(tmp_path) as st, st.client() as c:
        seen: list[str] = []
        real = st.agent.create

        async def spy(spec):  # type: ignore[no-untyped-def]
            seen.append(spec.id)
            return await real(spec)

        st.agent.create = spy  # type: ignore[method-assign]
        r = await c.post("/v1/sandboxes", json={"template": "tiny"})
        assert r.status_code == 201, r.text
        sb = r.json()
        assert sb["state"] == "running" and seen == [sb["id"]]
        got = (await c.get(f"/v1/sandboxes/{sb['id']}")).json()
        assert got["state"] == "running" and got["started_at"] == sb["started_at"]
