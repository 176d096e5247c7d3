"""The node's kill route as a raw ASGI handler (``node/killroute.py``, issue 15) answers as the FastAPI route
does: the same final status, the same typed errors, the same gate (first) and token check."""

from __future__ import annotations

from urllib.parse import quote

import httpx
import pytest

from pilldrops.node.api import create_node_app
from pilldrops.node.killroute import KillRoute
from tests.stack import TOKEN, stack
from tests.unit.rawroutes import same_fields, strip, without

pytestmark = pytest.mark.anyio

URL = "/node/v1/sandboxes"
AUTH = {"authorization": f"Bearer {TOKEN}"}
_OWN = {"id", "pid", "started_at", "end_at", "ended_at", "run_s", "seq"}      # each sandbox's own (or its clock's)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"      # the node agent runs on asyncio (serving.run_served)


async def test_kill_and_its_errors_match_the_fastapi_route(tmp_path, monkeypatch) -> None:
    async with stack(tmp_path) as st, st.client() as c:
        answered: list[str] = []           # kills the raw route answered (the other app has none in front)
        real = KillRoute.answer

        async def spy(self, scope, receive):  # type: ignore[no-untyped-def]
            answered.append(scope["path_params"]["sandbox_id"])
            return await real(self, scope, receive)

        monkeypatch.setattr(KillRoute, "answer", spy)

        async def no_beat() -> None:       # the ends stay in the outbox until this test delivers them
            return None

        monkeypatch.setattr(st.agent.control_plane, "heartbeat", no_beat)
        ids = [(await c.post("/v1/sandboxes", json={"template": "tiny"})).json()["id"] for _ in range(3)]
        fast = httpx.AsyncClient(transport=st.transport, base_url="http://node")
        plain = httpx.AsyncClient(transport=httpx.ASGITransport(app=without(create_node_app(st.agent, TOKEN), KillRoute)),
                                  base_url="http://node")
        async with fast, plain:
            # a fresh kill through each route: the same fields, field by field (but each sandbox's own)
            a = await fast.delete(f"{URL}/{ids[0]}", headers=AUTH)
            b = await plain.delete(f"{URL}/{ids[1]}", headers=AUTH)
            assert a.status_code == b.status_code == 200, (a.text, b.text)
            assert a.headers["content-type"] == b.headers["content-type"] == "application/json"
            assert a.headers["x-request-id"].startswith("req_") and b.headers["x-request-id"].startswith("req_")
            ja = same_fields(a, b, _OWN)
            assert (ja["id"], ja["state"], ja["end_reason"]) == (ids[0], "stopped", "killed") and ja["ended_at"]
            assert st.agent.sandboxes.get(ids[0]) is None and st.agent.sandboxes.get(ids[1]) is None
            assert await st.runtime.list_ids() == [ids[2]]
            assert answered == [ids[0]]
            # ended, its end not yet delivered (in the outbox): its final status again, byte for byte the same
            # through either route (and a query or a body, which the FastAPI route has no parameter for,
            # changes nothing)
            for sid, first in ((ids[0], a), (ids[1], b)):
                again = [await cl.request("DELETE", f"{URL}/{sid}", headers=AUTH, params=q, content=body)
                         for cl in (fast, plain) for q, body in (({}, b""), ({"reason": "timeout"}, b'{"x": 1}'))]
                assert {r.status_code for r in again} == {200}
                assert {r.content for r in again} == {first.content}, [r.text for r in again]
            # ended and delivered: not on this node (the control plane's client takes that as ended)
            await st.agent.control_plane.flush_outbox()
            assert st.agent.outbox == {}
            weird = ["sb_nope", "kill", "not a valid id!", "x" * 300, "\u2713", "...", "a\x00b", "%00", ids[0], ids[1]]
            cases = [*((w, AUTH) for w in weird), (ids[2], {}), (ids[2], {"authorization": "Bearer wrong"}),
                     (ids[2], {"x-api-key": "wrong"}), (ids[2], {"x-api-key": TOKEN}), ("sb_nope", {})]
            for sid, headers in cases:
                path = f"{URL}/{quote(sid, safe='')}"
                ra = await fast.delete(path, headers=headers)
                rb = await plain.delete(path, headers=headers)
                assert ra.status_code == rb.status_code, (sid, headers, ra.text, rb.text)
                assert ra.status_code in (404, 401) or (sid, headers) == (ids[2], {"x-api-key": TOKEN}), ra.text
                if ra.status_code >= 400:
                    assert ra.headers["x-request-id"] == ra.json()["error"]["request_id"]
                    assert strip(ra.json()) == strip(rb.json()), (sid, ra.text, rb.text)
            assert answered == [ids[0], *[ids[0]] * 2, *[ids[1]] * 2, *(sid for sid, _ in cases)]
            assert st.agent.sandboxes.get(ids[2]) is None        # the node token as X-API-Key killed it, as before
            # what is not this route still reaches FastAPI, the same way through either app: a trailing
            # slash (redirected), the collection, a sub-path (the checkpoint's own DELETE), another method
            for method, path in (("DELETE", f"{URL}/{ids[0]}/"), ("DELETE", URL),
                                 ("DELETE", f"{URL}/{ids[0]}/checkpoint"), ("PATCH", f"{URL}/{ids[0]}"),
                                 ("GET", f"{URL}/{ids[0]}")):
                ra = await fast.request(method, path, headers=AUTH)
                rb = await plain.request(method, path, headers=AUTH)
                assert ra.status_code == rb.status_code, (method, path, ra.text, rb.text)
                if ra.status_code >= 400:
                    assert strip(ra.json()) == strip(rb.json()), (method, path, ra.text, rb.text)
            assert len(answered) == 5 + len(cases)
            # a restarted agent that has not re-adopted yet: the same gate, before the token (as FastAPI
            # runs the app's dependency before the router's)
            monkeypatch.setattr(type(st.agent), "recovered", property(lambda self: False), raising=False)
            for headers in (AUTH, {"authorization": "Bearer wrong"}):
                ra = await fast.delete(f"{URL}/{ids[2]}", headers=headers)
                rb = await plain.delete(f"{URL}/{ids[2]}", headers=headers)
                assert ra.status_code == rb.status_code == 502, (ra.text, rb.text)
                assert strip(ra.json()) == strip(rb.json()) and ra.json()["error"]["code"] == "node_unavailable"
            # the node's schema still documents the kill
            monkeypatch.undo()
            spec = (await fast.get("/openapi.json")).json()
            assert spec["paths"][f"{URL}/{{sandbox_id}}"]["delete"]["responses"]["200"]


async def test_the_control_plane_kills_through_the_lean_route(tmp_path, monkeypatch) -> None:
    """A kill through the public API reaches the node's raw handler (not FastAPI's): the node's final
    status is what the control plane records."""
    async with stack(tmp_path) as st, st.client() as c:
        seen: list[str] = []
        real = st.agent.kill

        async def spy(sid):  # type: ignore[no-untyped-def]
            seen.append(sid)
            return await real(sid)

        answered: list[str] = []
        real_answer = KillRoute.answer

        async def spy_answer(self, scope, receive):  # type: ignore[no-untyped-def]
            answered.append(scope["path_params"]["sandbox_id"])
            return await real_answer(self, scope, receive)

        st.agent.kill = spy  # type: ignore[method-assign]
        monkeypatch.setattr(KillRoute, "answer", spy_answer)
        sb = (await c.post("/v1/sandboxes", json={"template": "tiny"})).json()
        r = await c.delete(f"/v1/sandboxes/{sb['id']}")
        assert r.status_code == 200, r.text
        assert r.json()["state"] == "stopped" and r.json()["end_reason"] == "killed"
        assert seen == [sb["id"]] and answered == [sb["id"]]
        assert await st.runtime.list_ids() == []
