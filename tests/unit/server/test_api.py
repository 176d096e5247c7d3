"""Control plane REST behaviour against an in-process node agent on the FakeRuntime."""

from __future__ import annotations

import json

import anyio
import httpx
import pytest

from tests.stack import stack

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def error_of(resp) -> dict:
    body = resp.json()
    assert set(body) == {"error"}, body
    assert set(body["error"]) == {"code", "message", "details", "request_id"}, body
    assert body["error"]["request_id"].startswith("req_")
    return body["error"]


async def test_create_get_list_kill(tmp_path, store_url) -> None:
    async with stack(tmp_path, db_url=store_url) as st, st.client() as c:
        r = await c.post("/v1/sandboxes", json={"template": "tiny", "metadata": {"run": "a"}})
        assert r.status_code == 201, r.text
        sb = r.json()
        assert sb["id"].startswith("sb_") and sb["state"] == "running"
        assert sb["envd_url"] == "http://node" and sb["access_token"]
        assert (sb["vcpu"], sb["memory_mb"], sb["timeout"]) == (1.0, 512, 300)
        got = (await c.get(f"/v1/sandboxes/{sb['id']}")).json()
        assert got["access_token"] is None and got["node_id"] == sb["node_id"]
        listed = (await c.get("/v1/sandboxes", params={"state": "running"})).json()
        assert [s["id"] for s in listed["items"]] == [sb["id"]]
        killed = (await c.delete(f"/v1/sandboxes/{sb['id']}")).json()
        assert killed["state"] == "stopped" and killed["end_reason"] == "killed" and killed["ended_at"]
        again = await c.delete(f"/v1/sandboxes/{sb['id']}")
        assert again.status_code == 200 and again.json()["state"] == "stopped"
        assert await st.runtime.list_ids() == []


async def test_auth_required_and_typed(tmp_path, store_url) -> None:
    async with stack(tmp_path, db_url=store_url) as st:
        async with st.client(key="") as anon:
            r = await anon.get("/v1/sandboxes")
            assert r.status_code == 401 and error_of(r)["code"] == "unauthenticated"
        async with st.client(key="pd_wrong") as bad:
            r = await bad.post("/v1/sandboxes", json={"template": "tiny"})
            assert r.status_code == 401 and error_of(r)["code"] == "unauthenticated"
        async with st.client() as c:
            r = await c.get("/v1/sandboxes", headers={"Authorization": "", "X-API-Key": st.key})
            assert r.status_code == 200   # the E2B header works too


async def test_other_team_sees_404_exactly_like_unknown(tmp_path, store_url) -> None:
    async with stack(tmp_path, db_url=store_url) as st, st.client() as a:
        sb = (await a.post("/v1/sandboxes", json={"template": "tiny"})).json()
        other = await st.new_team_key("team-b")
        async with st.client(key=other) as b:
            for method, path in [("GET", ""), ("DELETE", ""), ("POST", "/connect"), ("POST", "/run")]:
                kw = {"json": {"cmd": "echo hi"}} if path == "/run" else {}
                theirs = await b.request(method, f"/v1/sandboxes/{sb['id']}{path}", **kw)
                unknown = await b.request(method, f"/v1/sandboxes/sb_doesnotexist{path}", **kw)
                assert theirs.status_code == unknown.status_code == 404
                assert error_of(theirs)["code"] == error_of(unknown)["code"] == "sandbox_not_found"
            assert (await b.get("/v1/sandboxes")).json()["items"] == []
        assert (await a.get(f"/v1/sandboxes/{sb['id']}")).json()["state"] == "running"


async def test_idempotent_create(tmp_path, store_url) -> None:
    async with stack(tmp_path, db_url=store_url) as st, st.client() as c:
        body = {"template": "tiny", "timeout": 60}
        h = {"Idempotency-Key": "episode-17"}
        r1, r2 = await c.post("/v1/sandboxes", json=body, headers=h), await c.post("/v1/sandboxes", json=body,
                                                                                   headers=h)
        assert r1.status_code == 201 and r2.status_code == 200
        assert r1.json()["id"] == r2.json()["id"] and r2.json()["access_token"]
        assert len(await st.runtime.list_ids()) == 1
        r3 = await c.post("/v1/sandboxes", json={**body, "timeout": 61}, headers=h)
        assert r3.status_code == 409 and error_of(r3)["code"] == "conflict"


async def test_idempotent_retry_replays_when_its_own_create_filled_the_node(tmp_path, store_url) -> None:
    """The key is checked by the insert, not by a read before placement: a retry that placement would now
    refuse (its own first attempt took the node's last slot) still replays that first sandbox."""
    async with stack(tmp_path, db_url=store_url, capacity_vcpu=1) as st, st.client() as c:
        body, h = {"template": "tiny", "vcpu": 1}, {"Idempotency-Key": "episode-1"}
        r1, r2 = await c.post("/v1/sandboxes", json=body, headers=h), await c.post("/v1/sandboxes", json=body,
                                                                                   headers=h)
        assert r1.status_code == 201 and r2.status_code == 200, r2.text
        assert r1.json()["id"] == r2.json()["id"]
        full = await c.post("/v1/sandboxes", json=body, headers={"Idempotency-Key": "episode-2"})
        assert full.status_code != 201 and "code" in error_of(full)
        other = await c.post("/v1/sandboxes", json={**body, "timeout": 61}, headers=h)
        assert other.status_code == 409 and error_of(other)["code"] == "conflict"


async def test_concurrent_idempotent_creates_make_one_sandbox(tmp_path, store_url) -> None:
    async with stack(tmp_path, db_url=store_url) as st, st.client() as c:
        ids: list[str] = []

        async def one() -> None:
            r = await c.post("/v1/sandboxes", json={"template": "tiny"}, headers={"Idempotency-Key": "k"})
            assert r.status_code in (200, 201), r.text
            ids.append(r.json()["id"])

        async with anyio.create_task_group() as tg:
            for _ in range(8):
                tg.start_soon(one)
        assert len(set(ids)) == 1 and len(await st.runtime.list_ids()) == 1


@pytest.mark.parametrize("body,where", [
    ({"template": "tiny", "timeout": 86_401}, "timeout"),
    ({"template": "tiny", "timeout": 0}, "timeout"),
    ({"template": "tiny", "vcpu": 0}, "vcpu"),
    ({"template": "tiny", "memory_mb": 1}, "memory_mb"),
    ({"template": "tiny", "colour": "red"}, "colour"),
    ({"template": "Bad Name!"}, "template"),
    ({"template": "tiny", "metadata": {"k": 5}}, "metadata"),
])
async def test_bad_create_input_is_400_with_details(tmp_path, store_url, body, where) -> None:
    async with stack(tmp_path, db_url=store_url) as st, st.client() as c:
        r = await c.post("/v1/sandboxes", json=body)
        err = error_of(r)
        assert r.status_code == 400 and err["code"] == "invalid_request"
        assert any(where in d["loc"] for d in err["details"]), err
        assert await st.runtime.list_ids() == []


async def test_malformed_json_and_unknown_route(tmp_path, store_url) -> None:
    async with stack(tmp_path, db_url=store_url) as st, st.client() as c:
        r = await c.post("/v1/sandboxes", content=b"{nope", headers={"content-type": "application/json"})
        assert r.status_code == 400 and error_of(r)["code"] == "invalid_request"
        r = await c.get("/v1/nothing-here")
        assert r.status_code == 404 and error_of(r)["code"] == "not_found"
        r = await c.get("/v1/sandboxes", params={"state": "sleeping"})
        assert r.status_code == 400 and "sleeping" in error_of(r)["message"]
        r = await c.get("/v1/sandboxes", params={"cursor": "garbage"})
        assert r.status_code == 400


async def test_unknown_template_and_capacity(tmp_path, store_url) -> None:
    async with stack(tmp_path, db_url=store_url, capacity_vcpu=8, capacity_memory_mb=1024) as st, st.client() as c:
        r = await c.post("/v1/sandboxes", json={"template": "nosuch"})
        assert r.status_code == 404 and error_of(r)["code"] == "template_not_found"
        assert "tiny" in error_of(r)["message"] and "did you mean" not in error_of(r)["message"]
        r = await c.post("/v1/sandboxes", json={"template": "tinyy"})       # a typo: the fix is named
        assert r.status_code == 404 and "did you mean 'tiny'?" in error_of(r)["message"]
        assert error_of(r)["details"]["did_you_mean"] == "tiny"
        r = await c.post("/v1/sandboxes", json={"template": "tiny", "memory_mb": 4096})
        msg = error_of(r)["message"]
        assert r.status_code == 400 and "larger than any node" in msg
        assert "memory_mb=4096 MiB is more than any node offers (largest: " in msg and "1024 MiB)" in msg
        ok = [await c.post("/v1/sandboxes", json={"template": "tiny", "memory_mb": 512}) for _ in range(2)]
        assert all(x.status_code == 201 for x in ok)
        r = await c.post("/v1/sandboxes", json={"template": "tiny", "memory_mb": 512})
        assert r.status_code == 503 and error_of(r)["code"] == "capacity_unavailable"
        msg = error_of(r)["message"]
        assert msg.startswith("0/1 nodes fit: 1 insufficient memory; node ")
        # the cap, the current use and the flag that changes it
        assert "offers 1024 MiB with 1024 MiB in use and this asks memory_mb=512 MiB" in msg
        assert "--capacity-memory-mb N" in msg
        assert r.headers["retry-after"]
        await c.delete(f"/v1/sandboxes/{ok[0].json()['id']}")   # capacity comes back after a kill
        assert (await c.post("/v1/sandboxes", json={"template": "tiny", "memory_mb": 512})).status_code == 201


async def test_vcpu_capacity_errors_name_the_cap_the_use_and_the_flag(tmp_path, store_url) -> None:
    async with stack(tmp_path, db_url=store_url, capacity_vcpu=2, capacity_memory_mb=65536) as st, st.client() as c:
        ok = [await c.post("/v1/sandboxes", json={"template": "tiny", "vcpu": 1}) for _ in range(2)]
        assert all(x.status_code == 201 for x in ok)
        r = await c.post("/v1/sandboxes", json={"template": "tiny", "vcpu": 1})
        msg = error_of(r)["message"]
        assert r.status_code == 503 and "1 insufficient vcpu" in msg
        assert "offers 2 vCPU with 2 in use and this asks 1" in msg and "--capacity-vcpu N" in msg
        r = await c.post("/v1/sandboxes", json={"template": "tiny", "vcpu": 4})
        assert r.status_code == 400 and "vcpu=4 is more than any node offers" in error_of(r)["message"]


async def test_failed_start_is_recorded(tmp_path, store_url) -> None:
    async with stack(tmp_path, db_url=store_url) as st, st.client() as c:
        st.runtime.fail_create = True
        r = await c.post("/v1/sandboxes", json={"template": "tiny"})
        assert r.status_code == 500 and "failed to start" in error_of(r)["message"]
        failed = (await c.get("/v1/sandboxes", params={"state": "failed"})).json()["items"]
        assert len(failed) == 1 and failed[0]["end_reason"] == "failed_start"


async def test_list_filters_and_cursor(tmp_path, store_url) -> None:
    async with stack(tmp_path, db_url=store_url) as st, st.client() as c:
        made = []
        for i in range(5):
            r = await c.post("/v1/sandboxes", json={"template": "tiny", "metadata": {"i": str(i), "g": str(i % 2)}})
            made.append(r.json()["id"])
        await c.delete(f"/v1/sandboxes/{made[0]}")
        seen, cursor = [], None
        while True:
            params = {"limit": 2, **({"cursor": cursor} if cursor else {})}
            page = (await c.get("/v1/sandboxes", params=params)).json()
            seen += [s["id"] for s in page["items"]]
            cursor = page["next_cursor"]
            if not cursor:
                break
        assert seen == list(reversed(made))           # newest first, each once
        evens = (await c.get("/v1/sandboxes", params={"metadata.g": "0"})).json()["items"]
        assert sorted(s["id"] for s in evens) == sorted(made[0::2])
        live_evens = (await c.get("/v1/sandboxes", params={"metadata.g": "0", "state": "running"})).json()
        assert sorted(s["id"] for s in live_evens["items"]) == sorted([made[2], made[4]])


async def test_set_timeout_and_node_enforced_deadline(tmp_path, store_url) -> None:
    async with stack(tmp_path, db_url=store_url) as st, st.client() as c:
        sb = (await c.post("/v1/sandboxes", json={"template": "tiny", "timeout": 1})).json()
        longer = (await c.post("/v1/sandboxes", json={"template": "tiny", "timeout": 1})).json()
        r = await c.post(f"/v1/sandboxes/{longer['id']}/timeout", json={"timeout": 600})
        assert r.status_code == 200 and r.json()["end_at"] > longer["end_at"]
        with anyio.fail_after(10):
            while (await c.get(f"/v1/sandboxes/{sb['id']}")).json()["state"] == "running":
                await anyio.sleep(0.1)
        ended = (await c.get(f"/v1/sandboxes/{sb['id']}")).json()
        assert ended["state"] == "stopped" and ended["end_reason"] == "timeout"
        assert (await c.get(f"/v1/sandboxes/{longer['id']}")).json()["state"] == "running"
        assert await st.runtime.list_ids() == [longer["id"]]
        r = await c.post(f"/v1/sandboxes/{sb['id']}/timeout", json={"timeout": 10})
        assert r.status_code == 409 and error_of(r)["code"] == "invalid_state"
        assert error_of(r)["details"] == {"from": "stopped", "to": "running"}


async def test_oom_of_init_is_reported(tmp_path, store_url) -> None:
    async with stack(tmp_path, db_url=store_url) as st, st.client() as c:
        sb = (await c.post("/v1/sandboxes", json={"template": "tiny"})).json()
        await st.runtime.simulate_oom(st.agent.live[sb["id"]].target.handle)
        with anyio.fail_after(10):
            while (await c.get(f"/v1/sandboxes/{sb['id']}")).json()["state"] == "running":
                await anyio.sleep(0.1)
        assert (await c.get(f"/v1/sandboxes/{sb['id']}")).json()["end_reason"] == "oom"


async def test_run_killed_by_the_memory_limit_says_so(tmp_path, store_url) -> None:
    """exit 137 while the sandbox's OOM-kill count grew: ``oom_killed``; a plain SIGKILL: not."""
    async with stack(tmp_path, db_url=store_url) as st, st.client() as c:
        sb = (await c.post("/v1/sandboxes", json={"template": "tiny"})).json()

        async def exit_event(cmd: str) -> dict:  # type: ignore[type-arg]
            r = await c.post(f"/v1/sandboxes/{sb['id']}/run", json={"cmd": cmd, "cwd": "/"})
            return json.loads(r.text.splitlines()[-1])

        oom = await exit_event("echo 1 > oom_kills; kill -9 $$")   # the fake's stand-in for the OOM killer
        assert oom["exit_code"] == 137 and oom["oom_killed"] is True
        plain = await exit_event("kill -9 $$")
        assert plain["exit_code"] == 137 and not plain.get("oom_killed")
        grew = await exit_event("echo 2 > oom_kills; exit 3")     # the count grew but it exited on its own
        assert grew["exit_code"] == 3 and not grew.get("oom_killed")


async def test_run_through_control_plane_proxy(tmp_path, store_url) -> None:
    async with stack(tmp_path, db_url=store_url) as st, st.client() as c:
        sb = (await c.post("/v1/sandboxes", json={"template": "tiny", "envs": {"A": "1"}})).json()
        r = await c.post(f"/v1/sandboxes/{sb['id']}/run", json={"cmd": "echo out-$A-$PD_TEMPLATE; echo err >&2; exit 3"})
        events = [json.loads(line) for line in r.text.splitlines()]
        assert next(e["type"] for e in events) == "start" and events[-1]["type"] == "exit"
        assert events[-1]["exit_code"] == 3
        import base64
        out = b"".join(base64.b64decode(e["data"]) for e in events if e["type"] == "stdout")
        assert out == b"out-1-tiny\n"
        r = await c.post(f"/v1/sandboxes/{sb['id']}/run", json={"cmd": "echo hi", "bogus": 1})
        assert r.status_code == 400 and error_of(r)["code"] == "invalid_request"


async def test_keys_create_list_revoke(tmp_path, store_url) -> None:
    async with stack(tmp_path, db_url=store_url) as st, st.client() as c:
        r = await c.post("/v1/keys", json={"name": "ci"})
        assert r.status_code == 201
        new = r.json()
        assert new["secret"].startswith("pd_") and new["prefix"] == new["secret"][:10]
        listed = (await c.get("/v1/keys")).json()["items"]
        assert {k["name"] for k in listed} == {"pilldrops-up", "ci"} and all("secret" not in k for k in listed)
        async with st.client(key=new["secret"]) as c2:
            assert (await c2.get("/v1/whoami")).json()["key_id"] == new["id"]
            assert (await c.delete(f"/v1/keys/{new['id']}")).json()["revoked_at"]
            assert (await c2.get("/v1/whoami")).status_code == 401
        other = await st.new_team_key("b")
        async with st.client(key=other) as b:
            assert (await b.delete(f"/v1/keys/{new['id']}")).status_code == 404


async def test_openapi_is_served(tmp_path, store_url) -> None:
    async with stack(tmp_path, db_url=store_url) as st, st.client() as c:
        spec = (await c.get("/openapi.json")).json()
        assert "/v1/sandboxes" in spec["paths"] and "/v1/sandboxes/{sandbox_id}/run" in spec["paths"]


async def test_connecting_to_an_ended_sandbox_says_why_and_when(tmp_path, store_url) -> None:
    async with stack(tmp_path, db_url=store_url) as st, st.client() as c:
        sid = (await c.post("/v1/sandboxes", json={"template": "tiny"})).json()["id"]
        await c.delete(f"/v1/sandboxes/{sid}")
        r = await c.post(f"/v1/sandboxes/{sid}/connect")
        msg = error_of(r)["message"]
        assert r.status_code == 409 and error_of(r)["code"] == "invalid_state"
        assert f"sandbox {sid} is stopped, not running (killed at 20" in msg and "cannot come back" in msg


async def test_memory_past_every_nodes_ram_is_refused_at_create(tmp_path) -> None:
    """Reviewer finding 6: the node offers 32x its RAM as capacity (limits are caps), so a memory_mb past
    the RAM of every node passed the capacity filter. It is refused at create (REST, batch and the E2B
    surface), naming the largest node's RAM; a size within it still starts."""
    async with stack(tmp_path, node_ram_mb=2048, capacity_memory_mb=65536, templates=("tiny", "base")) as st, \
            st.client() as c:
        r = await c.post("/v1/sandboxes", json={"template": "tiny", "memory_mb": 4096})
        err = error_of(r)
        assert r.status_code == 400 and err["code"] == "invalid_request", r.text
        assert "2048 MiB" in err["message"] and "node-a" in err["message"]
        assert err["details"]["max_memory_mb"] == 2048 and err["details"]["field"] == "memory_mb"
        b = (await c.post("/v1/sandboxes/batch", json={"template": "tiny", "count": 2, "memory_mb": 4096,
                                                       "capacity_wait": 30})).json()
        assert b["failed"] == 2 and {it["error"]["code"] for it in b["items"]} == {"invalid_request"}
        assert (await c.post("/v1/sandboxes", json={"template": "tiny", "memory_mb": 2048})).status_code == 201
    (tmp_path / "small").mkdir()
    async with stack(tmp_path / "small", node_ram_mb=256, templates=("base",)) as st, \
            httpx.AsyncClient(transport=httpx.ASGITransport(app=st.cp.app), base_url="http://cp",
                              headers={"X-API-Key": st.key}) as e2b:
        r = await e2b.post("/v2/sandboxes", json={"templateID": "base"})     # E2B's shape: 512 MiB
        assert r.status_code == 400 and "256 MiB" in r.text, r.text
