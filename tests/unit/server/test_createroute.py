"""The control plane's create as a raw ASGI handler (``server/api/createroute.py``, issue 15) answers as the
FastAPI route does: the same fields, statuses (201, 200 for a replay), typed errors and bounds."""

from __future__ import annotations

import json

import httpx
import pytest

from pilldrops.server.api import createroute
from pilldrops.server.api.app import create_app
from pilldrops.server.api.createroute import CreateRoute
from tests.stack import stack
from tests.unit.rawroutes import check_bounded, same_fields, strip, without

pytestmark = pytest.mark.anyio

URL = "/v1/sandboxes"
_OWN = {"id", "access_token", "created_at", "started_at", "end_at", "node_id", "envd_url", "vcpu_s", "gb_s",
        "storage_gb_s", "cost_usd", "disk_used_bytes"}        # each sandbox's own (or its clock's)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"      # the control plane runs on asyncio (serving.run_served)


async def test_create_and_its_errors_match_the_fastapi_route(tmp_path, monkeypatch) -> None:
    async with stack(tmp_path) as st:
        plain_app = without(create_app(st.cp.services), CreateRoute)
        auth = {"authorization": f"Bearer {st.key}"}
        fast = httpx.AsyncClient(transport=httpx.ASGITransport(app=st.cp.app), base_url="http://cp")
        plain = httpx.AsyncClient(transport=httpx.ASGITransport(app=plain_app), base_url="http://cp")
        async with fast, plain:
            body = {"template": "tiny", "vcpu": 1, "memory_mb": 256, "metadata": {"ep": "1"}, "envs": {"A": "b"},
                    "timeout": 120}
            a = await fast.post(URL, json=body, headers=auth)
            b = await plain.post(URL, json=body, headers=auth)
            assert a.status_code == b.status_code == 201, (a.text, b.text)
            assert a.headers["content-type"] == b.headers["content-type"] == "application/json"
            assert a.headers["x-request-id"].startswith("req_")
            ja = same_fields(a, b, _OWN)
            assert ja["state"] == "running" and ja["access_token"] and ja["envd_url"]
            got = (await fast.get(f"{URL}/{ja['id']}", headers=auth)).json()      # a read right after it
            assert got["state"] == "running" and got["started_at"] == ja["started_at"]
            # idempotent retries: replayed (200, the same sandbox), and a different body is a conflict
            for client in (fast, plain):
                h = {**auth, "Idempotency-Key": f"ep-{id(client)}"}
                first = await client.post(URL, json=body, headers=h)
                again = await client.post(URL, json=body, headers=h)
                assert (first.status_code, again.status_code) == (201, 200)
                assert again.json()["id"] == first.json()["id"]
            conflicts = [await c.post(URL, json={**body, "vcpu": 2}, headers={**auth, "Idempotency-Key": f"ep-{id(c)}"})
                         for c in (fast, plain)]
            assert conflicts[0].status_code == conflicts[1].status_code == 409
            assert conflicts[0].json()["error"]["code"] == conflicts[1].json()["error"]["code"] == "conflict"
            long_key = {**auth, "Idempotency-Key": "k" * 257}
            cases = [
                (b"{not json", auth),
                (b"", auth),
                (json.dumps({"template": "Bad Name"}).encode(), auth),
                (json.dumps({"template": "tiny", "vcpu": "many"}).encode(), auth),
                (json.dumps({"template": "tiny", "nope": 1}).encode(), auth),
                (json.dumps({"template": "tiny", "memory_mb": 1}).encode(), auth),
                (json.dumps({"template": "tiny", "isolation": "vm9"}).encode(), auth),
                (json.dumps(["tiny"]).encode(), auth),
                (json.dumps({"template": "no-such-template"}).encode(), auth),
                (json.dumps({"template": "tiny", "disk_mb": 10_000_000}).encode(), auth),
                (json.dumps({"template": "tiny"}).encode(), long_key),
                (json.dumps({"template": "tiny", "vcpu": "many"}).encode(), long_key),
                (json.dumps({"template": "tiny"}).encode(), {}),
                (json.dumps({"template": "tiny"}).encode(), {"authorization": "Bearer pd_wrong"}),
            ]
            for raw, headers in cases:
                ra = await fast.post(URL, content=raw, headers={**headers, "content-type": "application/json"})
                rb = await plain.post(URL, content=raw, headers={**headers, "content-type": "application/json"})
                assert ra.status_code == rb.status_code and ra.status_code >= 400, (raw, ra.text, rb.text)
                assert ra.headers["x-request-id"] == ra.json()["error"]["request_id"]
                ea, eb = strip(ra.json()), strip(rb.json())
                assert ea["error"]["code"] == eb["error"]["code"], (raw, ea, eb)
                if raw not in (b"{not json", b""):      # the decode position and message are the parser's own
                    assert ea == eb, (raw, ea, eb)
            # bounded before it is buffered: by the declared length, and by what arrives
            # (the key is checked before the body is read: a stranger's oversized body is never buffered)
            await check_bounded(fast, URL, createroute, monkeypatch, big={"template": "tiny", "envs": {"X": "x" * 2048}},
                                head=b'{"template": "tiny", "envs": {"X": "', tail=b'"}}', headers=auth,
                                stranger={"authorization": "Bearer pd_wrong"}, stranger_code=(401, "unauthenticated"))
            # the other routes still reach FastAPI, and the schema still documents the create
            ra = await fast.get(URL, headers=auth)
            assert ra.status_code == 200 and len(ra.json()["items"]) == 4
            spec = (await fast.get("/openapi.json")).json()
            assert "post" in spec["paths"]["/v1/sandboxes"]
            assert spec["paths"]["/v1/sandboxes"]["post"]["responses"]["201"]
