"""The control plane's kill as a raw ASGI handler (``server/api/killroute.py``, issue 15) answers as the
FastAPI route does: the same final record, typed errors, tenancy and request ids; SQLite and PostgreSQL
(``store_url``)."""

from __future__ import annotations

from urllib.parse import quote

import httpx
import pytest

from pilldrops.server.api.app import create_app
from pilldrops.server.api.killroute import KillRoute
from tests.stack import stack
from tests.unit.rawroutes import same_fields, strip, without

pytestmark = pytest.mark.anyio

URL = "/v1/sandboxes"
_OWN = {"id", "created_at", "started_at", "end_at", "ended_at", "node_id", "vcpu_s", "gb_s", "storage_gb_s",
        "cost_usd"}        # each sandbox's own (or its clock's)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"      # the control plane runs on asyncio (serving.run_served)


async def test_kill_and_its_errors_match_the_fastapi_route(tmp_path, store_url, monkeypatch) -> None:
    async with stack(tmp_path, db_url=store_url) as st:
        answered: list[str] = []           # kills the raw route answered (the other app has none in front)
        real = KillRoute.answer

        async def spy(self, scope, receive):  # type: ignore[no-untyped-def]
            answered.append(scope["path_params"]["sandbox_id"])
            return await real(self, scope, receive)

        monkeypatch.setattr(KillRoute, "answer", spy)
        auth = {"authorization": f"Bearer {st.key}"}
        fast = httpx.AsyncClient(transport=httpx.ASGITransport(app=st.cp.app), base_url="http://cp")
        plain = httpx.AsyncClient(transport=httpx.ASGITransport(app=without(create_app(st.cp.services), KillRoute)),
                                  base_url="http://cp")
        async with fast, plain:
            body = {"template": "tiny", "metadata": {"ep": "1"}, "timeout": 120}
            ids = [(await fast.post(URL, json=body, headers=auth)).json()["id"] for _ in range(3)]
            # a fresh kill through each route: the same fields, field by field (but each sandbox's own)
            a = await fast.delete(f"{URL}/{ids[0]}", headers=auth)
            b = await plain.delete(f"{URL}/{ids[1]}", headers=auth)
            assert a.status_code == b.status_code == 200, (a.text, b.text)
            assert a.headers["content-type"] == b.headers["content-type"] == "application/json"
            assert a.headers["x-request-id"].startswith("req_") and b.headers["x-request-id"].startswith("req_")
            ja = same_fields(a, b, _OWN)
            assert (ja["state"], ja["end_reason"], ja["access_token"]) == ("stopped", "killed", None)
            assert ja["ended_at"] and ja["id"] == ids[0]
            assert st.agent.sandboxes.get(ids[0]) is None and st.agent.sandboxes.get(ids[1]) is None
            assert answered == [ids[0]]
            got = (await fast.get(f"{URL}/{ids[0]}", headers=auth)).json()        # a read right after it
            assert got["state"] == "stopped" and got["ended_at"] == ja["ended_at"]
            # an ended sandbox (idempotent): its final record, byte for byte the same through either route,
            # and a query (the FastAPI route has no parameter: a reason is not taken from it) changes nothing
            for sid, first in ((ids[0], a), (ids[1], b)):
                again = [await c.delete(f"{URL}/{sid}", headers=auth, params=q)
                         for c in (fast, plain) for q in ({}, {"reason": "timeout"})]
                assert {r.status_code for r in again} == {200}
                assert {r.content for r in again} == {first.content}, [r.text for r in again]
            # another team's id is an unknown id (no oracle of other teams' ids); its sandbox runs on
            other = {"authorization": f"Bearer {await st.new_team_key('other')}"}
            weird = ["sb_nope", "kill", "not a valid id!", "x" * 300, "\u2713", "...", "a\x00b", "%00", "🦀" * 5]
            cases = [(ids[2], other), *((w, auth) for w in weird), (ids[2], {}),
                     (ids[2], {"authorization": "Bearer pd_wrong"}), (ids[2], {"x-api-key": "pd_wrong"}),
                     (ids[2], {"authorization": "Basic abc"}), ("sb_nope", {})]
            for sid, headers in cases:
                path = f"{URL}/{quote(sid, safe='')}"
                ra = await fast.delete(path, headers=headers)
                rb = await plain.delete(path, headers=headers)
                want = (400,) if "\x00" in sid else (401, 404)       # a NUL in the URL: NulGuard, before both
                assert ra.status_code == rb.status_code and ra.status_code in want, (sid, ra.text, rb.text)
                assert ra.headers["x-request-id"] == ra.json()["error"]["request_id"]
                assert strip(ra.json()) == strip(rb.json()), (sid, ra.text, rb.text)
            assert (await fast.get(f"{URL}/{ids[2]}", headers=auth)).json()["state"] == "running"
            assert st.agent.sandboxes.get(ids[2]) is not None
            # what is not this route still reaches FastAPI, the same way through either app: a trailing
            # slash (redirected), the collection, a sub-path, another method
            for method, path in (("DELETE", f"{URL}/{ids[2]}/"), ("DELETE", URL), ("DELETE", f"{URL}/{ids[2]}/run"),
                                 ("PATCH", f"{URL}/{ids[2]}")):
                ra = await fast.request(method, path, headers=auth)
                rb = await plain.request(method, path, headers=auth)
                assert ra.status_code == rb.status_code and ra.status_code in (307, 404, 405), (path, ra.text)
                if ra.status_code != 307:
                    assert strip(ra.json()) == strip(rb.json()), (path, ra.text, rb.text)
            assert (await fast.get(f"{URL}/{ids[2]}", headers=auth)).json()["state"] == "running"
            # E2B's routing still gets its own traffic: sandbox traffic by header is never this route's
            r = await fast.delete(f"{URL}/{ids[2]}", headers={**auth, "e2b-sandbox-id": ids[2]})
            assert r.status_code != 200 and "error" not in r.json(), r.text      # envd's own answer (E2B's shape)
            assert (await fast.get(f"{URL}/{ids[2]}", headers=auth)).json()["state"] == "running"
            assert st.agent.sandboxes.get(ids[2]) is not None
            # every other request above went on to FastAPI (the raw route answered only its own kills)
            assert answered == [ids[0], ids[0], ids[0], ids[1], ids[1], *(sid for sid, _ in cases if "\x00" not in sid)]
            # the schema still documents the kill
            spec = (await fast.get("/openapi.json")).json()
            assert spec["paths"][f"{URL}/{{sandbox_id}}"]["delete"]["responses"]["200"]
            # and the third one, killed through the raw route by its own team
            r = await fast.delete(f"{URL}/{ids[2]}", headers=auth)
            assert r.status_code == 200 and r.json()["state"] == "stopped"
