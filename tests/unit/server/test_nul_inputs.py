"""A NUL character anywhere a request can carry text (a path parameter, a query value, a metadata pair, a
label, an environment variable, a key's name) is a typed 400 on both stores and loses nothing: PostgreSQL's
text refuses a NUL, and before ``NulGuard`` and the schema's ``refuse_nul`` such requests failed there as
500s (keys, nodes, listings, history, creates). Every route of the OpenAPI schema is tried, and the E2B
REST surface."""

from __future__ import annotations

import base64
import json
import re

import httpx
import pytest

from tests.stack import TOKEN, stack

pytestmark = pytest.mark.anyio

NUL = "\x00"
# JSON bodies with a NUL in every kind of text field the API takes (each route ignores or refuses what is not
# its own: the point is that none of them is a 500)
BODIES = [
    {"template": f"ti{NUL}ny"}, {"template": "tiny", "metadata": {f"k{NUL}": "v"}},
    {"template": "tiny", "metadata": {"k": f"v{NUL}"}}, {"template": "tiny", "envs": {"A": f"x{NUL}"}},
    {"template": "tiny", "count": 2, "item_metadata": [{"a": NUL}, {"a": "b"}]},
    {"labels": {"k": NUL}}, {"ids": [f"sb_{NUL}"]}, {"name": f"n{NUL}"}, {"size": 1, "template": f"t{NUL}"},
    {"reason": NUL}, {"cmd": f"echo {NUL}"}, {"allow_out": [f"1.2.3.4{NUL}"]}, {"timeout": 60, "x": NUL},
]
REFUSED = [("POST", "/v1/sandboxes", {"template": "tiny", "metadata": {f"k{NUL}": "v"}}),
           ("POST", "/v1/sandboxes", {"template": "tiny", "metadata": {"k": f"v{NUL}"}}),
           ("POST", "/v1/sandboxes", {"template": "tiny", "envs": {"A": f"x{NUL}"}}),
           ("POST", "/v1/sandboxes/batch", {"template": "tiny", "count": 2, "item_metadata": [{"a": NUL}, {}]}),
           ("POST", "/v1/sandboxes/batch", {"template": "tiny", "count": 2, "metadata": {"a": NUL}}),
           ("POST", "/v1/sandboxes/kill", {"labels": {"k": NUL}}),
           ("POST", "/v1/keys", {"name": f"n{NUL}"})]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"      # the control plane runs on asyncio (serving.run_served)


def _invalid(r: httpx.Response, what: object) -> None:
    assert r.status_code == 400, (what, r.status_code, r.text)
    body = r.json()
    assert body["error"]["code"] == "invalid_request", (what, r.text)
    assert body["error"]["request_id"] == r.headers["x-request-id"], (what, r.text)


async def _live(c: httpx.AsyncClient) -> set[str]:
    return {s["id"] for s in (await c.get("/v1/sandboxes", params={"limit": 1000})).json()["items"]}


async def test_every_route_refuses_a_nul_with_a_400_and_none_fails(tmp_path, store_url) -> None:
    async with stack(tmp_path, db_url=store_url) as st, st.client() as c:
        sid = (await c.post("/v1/sandboxes", json={"template": "tiny", "metadata": {"run": "nul"}})).json()["id"]
        spec = (await c.get("/openapi.json")).json()
        failed, tried = [], 0
        for path, ops in spec["paths"].items():
            for method, op in ops.items():
                method = method.upper()
                queries = [p["name"] for p in op.get("parameters", []) if p["in"] == "query"]
                if "{" in path:     # a NUL in the path parameters: refused before any route reads it
                    r = await c.request(method, re.sub(r"\{[^}]+\}", "x%00y", path))
                    _invalid(r, (method, path))
                for q in [*queries, "metadata.run"]:    # a NUL in each query value: the same
                    u = re.sub(r"\{[^}]+\}", sid, path)
                    _invalid(await c.request(method, u, params={q: f"a{NUL}b"}), (method, path, q))
                if method in ("GET", "DELETE", "HEAD"):
                    continue
                for body in BODIES:         # a NUL in the body's text: refused or ignored, never a 500
                    tried += 1
                    r = await c.request(method, re.sub(r"\{[^}]+\}", sid, path), content=json.dumps(body),
                                        headers={"content-type": "application/json"})
                    if r.status_code >= 500:
                        failed.append((method, path, body, r.status_code, r.text[:200]))
        assert tried > 100 and not failed, failed


async def test_nul_in_text_fields_is_invalid_request_and_creates_nothing(tmp_path, store_url) -> None:
    async with stack(tmp_path, db_url=store_url) as st:
        async with st.client() as c:
            keep = (await c.post("/v1/sandboxes", json={"template": "tiny", "metadata": {"run": "keep"}})).json()["id"]
            keys = len((await c.get("/v1/keys")).json()["items"])
            for method, path, body in REFUSED:
                _invalid(await c.request(method, path, json=body), (path, body))
            assert await _live(c) == {keep}
            assert len((await c.get("/v1/keys")).json()["items"]) == keys
            hist = (await c.get("/v1/history", params={"metadata.run": "keep"})).json()
            assert [s["id"] for s in hist["items"]] == [keep]
        # the E2B REST surface: its create, its listing's metadata filter (encoded twice: %2500), its ids
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=st.cp.app), base_url="http://cp",
                                     headers={"X-API-Key": st.key}) as e2b:
            for body in ({"templateID": "tiny", "metadata": {"k": NUL}}, {"templateID": "tiny", "envVars": {"A": NUL}}):
                _invalid(await e2b.post("/v2/sandboxes", json=body), body)
            for path in ("/sandboxes", "/v2/sandboxes"):
                _invalid(await e2b.get(path, params={"metadata": f"run={NUL}"}), path)
                _invalid(await e2b.get(f"{path}?metadata=run%3D%2500"), path)
            for method in ("GET", "DELETE"):
                _invalid(await e2b.request(method, "/sandboxes/x%00y"), method)
            ok = await e2b.get("/v2/sandboxes", params={"metadata": "run=keep"})
            assert [s["sandboxID"] for s in ok.json()] == [keep.replace("_", "")], ok.text   # E2B ids: no "_"


async def test_nul_decoded_twice_and_where_the_guard_stays_out(tmp_path, store_url) -> None:
    """What no URL check can see: a NUL inside a paging cursor (base64) is an invalid cursor, a node's
    registration with one a 4xx (never a 500 on PostgreSQL); and what the guard must leave alone: ``%2500``
    (the text "%00") in a filter, and a request for a sandbox's own port (the sandbox's to judge)."""
    async with stack(tmp_path, db_url=store_url) as st, st.client() as c:
        cursor = base64.urlsafe_b64encode(f"2026-01-01T00:00:00+00:00|sb_a{NUL}b".encode()).decode()
        for path in ("/v1/sandboxes", "/v1/history"):
            _invalid(await c.get(path, params={"cursor": cursor}), path)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=st.cp.app), base_url="http://cp",
                                     headers={"X-API-Key": st.key}) as e2b:
            for token in (cursor, "not-a-token"):          # (any token it did not give was a 500 too)
                r = await e2b.get("/v2/sandboxes", params={"nextToken": token})
                assert r.status_code == 400 and r.json()["code"] == 400, r.text   # E2B's shape, typed
            r = await e2b.get("/sandboxes/x%00y")
            assert r.status_code == 400 and r.json()["code"] == 400 and r.json()["message"], r.text
            assert r.json()["error"]["code"] == "invalid_request"
            # a sandbox's own port: not ours to refuse (the port gateway answers: no URL token here)
            sid = (await c.post("/v1/sandboxes", json={"template": "tiny"})).json()["id"]
            r = await e2b.get("/api/%00", params={"q": NUL},
                              headers={"E2b-Sandbox-Id": sid.replace("_", ""), "E2b-Sandbox-Port": "8080"})
            assert "NUL" not in r.text, r.text
        r = await c.get("/v1/sandboxes", params={"metadata.run": "%00"})       # sent as %2500: the text "%00"
        assert r.status_code == 200 and r.json()["items"] == [], r.text
        node = {"name": f"evil{NUL}", "url": "http://127.0.0.1:1", "capacity_vcpu": 1, "capacity_memory_mb": 512}
        r = await c.post("/internal/v1/nodes/register", json=node, headers={"authorization": f"Bearer {TOKEN}"})
        assert r.status_code in (400, 422) and r.json()["error"]["code"] == "invalid_request", r.text
