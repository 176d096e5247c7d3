"""The run route's raw ASGI handler (``node/runroute.py``, issue 15) answers as the FastAPI route does."""

from __future__ import annotations

import json

import httpx
import pytest

from pilldrops.node import runroute
from pilldrops.node.api import create_node_app
from pilldrops.node.runroute import RunRoute
from tests.stack import TOKEN, stack
from tests.unit.rawroutes import check_bounded, strip, without

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"      # the node agent runs on asyncio (serving.run_served)


async def test_run_and_its_errors_match_the_fastapi_route(tmp_path, monkeypatch) -> None:
    async with stack(tmp_path) as st, st.client() as c:
        sb = (await c.post("/v1/sandboxes", json={"template": "tiny"})).json()
        url = f"/v1/sandboxes/{sb['id']}/run"
        auth = {"x-access-token": sb["access_token"]}
        fast = httpx.AsyncClient(transport=st.transport, base_url="http://node")
        plain = httpx.AsyncClient(transport=httpx.ASGITransport(app=without(create_node_app(st.agent, TOKEN), RunRoute)), base_url="http://node")
        async with fast, plain:
            r = await fast.post(url, json={"cmd": "echo hi; echo err >&2; exit 3"}, headers=auth)
            assert r.status_code == 200 and r.headers["content-type"] == "application/x-ndjson"
            assert r.headers["x-request-id"].startswith("req_")
            events = [json.loads(x) for x in r.text.splitlines()]
            assert events[0]["type"] == "start" and events[-1]["type"] == "exit" and events[-1]["exit_code"] == 3
            assert {e["type"] for e in events[1:-1]} == {"stdout", "stderr"}
            r2 = await plain.post(url, json={"cmd": "echo hi; echo err >&2; exit 3"}, headers=auth)
            assert [e["type"] for e in map(json.loads, r2.text.splitlines())] == [e["type"] for e in events]
            cases = [
                (b"{not json", auth),
                (json.dumps({"cmd": []}).encode(), auth),
                (json.dumps({"cmd": "true", "nope": 1}).encode(), auth),
                (json.dumps({"cmd": "true", "timeout": -1}).encode(), auth),
                (json.dumps(["true"]).encode(), auth),
                (json.dumps({"cmd": "true"}).encode(), {}),
                (json.dumps({"cmd": "true"}).encode(), {"x-access-token": "wrong"}),
                (json.dumps({"cmd": "true", "cwd": "relative"}).encode(), auth),
            ]
            for body, headers in cases:
                a = await fast.post(url, content=body, headers={**headers, "content-type": "application/json"})
                b = await plain.post(url, content=body, headers={**headers, "content-type": "application/json"})
                assert a.status_code == b.status_code, (body, a.text, b.text)
                assert a.headers["x-request-id"] == a.json()["error"]["request_id"]
                ea, eb = strip(a.json()), strip(b.json())
                assert ea["error"]["code"] == eb["error"]["code"], (body, ea, eb)
                if body != b"{not json":          # the decode position is the parser's own
                    assert ea == eb, (body, ea, eb)
            a = await fast.post("/v1/sandboxes/sb_nope/run", json={"cmd": "true"}, headers=auth)
            assert a.status_code == 404 and a.json()["error"]["code"] == "sandbox_not_found"
            # bounded before it is buffered: by the declared length, and by what arrives
            # (the token is checked before the body is read: a stranger's oversized body is never buffered)
            await check_bounded(fast, url, runroute, monkeypatch, big={"cmd": "true", "stdin": "x" * 2048},
                                head=b'{"cmd": "true", "stdin": "', tail=b'"}', headers=auth,
                                stranger={"x-access-token": "wrong"}, stranger_code=(404, "sandbox_not_found"))
            # a restarted agent that has not re-adopted yet: the same gate as every route
            monkeypatch.setattr(type(st.agent), "recovered", property(lambda self: False), raising=False)
            a = await fast.post(url, json={"cmd": "true"}, headers=auth)
            assert a.status_code == 502 and a.json()["error"]["code"] == "node_unavailable"


async def test_a_client_that_goes_away_ends_its_command(tmp_path) -> None:
    """The stream is cancelled when the client disconnects mid-run, and the command is killed."""
    import anyio

    async with stack(tmp_path) as st, st.client() as c:
        sb = (await c.post("/v1/sandboxes", json={"template": "tiny"})).json()
        app = create_node_app(st.agent, TOKEN)
        body = json.dumps({"cmd": "sleep 30"}).encode()
        scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
                 "method": "POST", "scheme": "http", "path": f"/v1/sandboxes/{sb['id']}/run", "raw_path": b"",
                 "query_string": b"", "root_path": "", "server": ("node", 80), "client": ("c", 1),
                 "headers": [(b"host", b"node"), (b"x-access-token", sb["access_token"].encode()),
                             (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]}
        sent: list[dict] = []  # type: ignore[type-arg]
        calls = 0

        async def receive() -> dict:  # type: ignore[type-arg]
            nonlocal calls
            calls += 1
            if calls == 1:
                return {"type": "http.request", "body": body, "more_body": False}
            await anyio.sleep(0.3)                 # the command runs; then the client hangs up
            return {"type": "http.disconnect"}

        async def send(msg: dict) -> None:  # type: ignore[type-arg]
            sent.append(msg)

        target = st.agent.get(sb["id"]).target
        with anyio.fail_after(10):
            await app(scope, receive, send)
            while target.active:
                await anyio.sleep(0.01)
        assert sent and sent[0]["type"] == "http.response.start" and sent[0]["status"] == 200
        assert not any(m.get("more_body") is False for m in sent)     # no exit line: it was cut
