"""Node liveness (unreachable → lost, never doubled on return, no reaping on a store outage) and the
operator's node commands (list, drain, undrain; admin key only)."""

from __future__ import annotations

from datetime import datetime
from typing import Any

import anyio
import pytest

from tests.stack import stack

pytestmark = pytest.mark.anyio
# Short liveness thresholds, with room for a loaded CI machine (the unit run shares 2 cores with the
# sandbox tiers): a beat every 0.2 s, unreachable after 1.5 s of silence, lost after 3 s. With 0.6 s, a
# starved event loop once made the node unreachable before the test's first create (CI, session 8).
FAST = {"heartbeat_interval": 0.2, "unreachable_after": 1.5, "lost_after": 3.0}


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def wait_for(pred: Any, timeout: float = 10) -> None:
    with anyio.fail_after(timeout):
        while not await pred():
            await anyio.sleep(0.05)


async def create_running(c: Any, body: dict[str, Any] | None = None, timeout: float = 20) -> dict[str, Any]:
    """A created sandbox's record; a 503 while the node is (still, or under load briefly) not ready is
    retried, any other answer fails the test with its body."""
    with anyio.fail_after(timeout):
        while True:
            r = await c.post("/v1/sandboxes", json=body or {"template": "tiny"})
            if r.status_code != 503:
                assert r.status_code == 201, r.text
                return r.json()
            await anyio.sleep(0.1)


def silence(agent: Any) -> Any:
    """Make the node stop heartbeating (as if its network went away); returns an undo."""
    real = agent._heartbeat

    async def failing() -> None:
        raise OSError("network down")

    agent._heartbeat = failing
    return lambda: setattr(agent, "_heartbeat", real)


async def test_silent_node_becomes_unreachable_then_its_sandboxes_lost(tmp_path, store_url) -> None:
    async with stack(tmp_path, db_url=store_url, **FAST) as st, st.client() as c:
        sb = await create_running(c)
        undo = silence(st.agent)

        async def node_state() -> str:
            return (await c.get("/v1/nodes")).json()["items"][0]["state"]

        await wait_for(lambda: _eq(node_state(), "unreachable"))
        r = await c.post("/v1/sandboxes", json={"template": "tiny"})
        assert r.status_code == 503 and "not ready" in r.json()["error"]["message"]
        await wait_for(lambda: _eq(_state(c, sb["id"]), "lost"))
        lost = (await c.get(f"/v1/sandboxes/{sb['id']}")).json()
        assert lost["end_reason"] == "node_lost"
        node = (await c.get("/v1/nodes")).json()["items"][0]
        ended, last_hb = datetime.fromisoformat(lost["ended_at"]), datetime.fromisoformat(node["last_heartbeat_at"])
        assert ended == max(last_hb, datetime.fromisoformat(lost["started_at"]))   # billing stops there
        cost_at_loss = lost["cost_usd"]
        # the node comes back still running it: it is stopped there, stays lost, is not billed further
        assert sb["id"] in await st.runtime.list_ids()
        undo()
        await wait_for(lambda: _eq(node_state(), "ready"))
        await wait_for(lambda: _not_in(sb["id"], st.runtime.list_ids()))
        again = (await c.get(f"/v1/sandboxes/{sb['id']}")).json()
        assert again["state"] == "lost" and again["cost_usd"] == cost_at_loss
        assert (await c.post("/v1/sandboxes", json={"template": "tiny"})).status_code == 201


async def test_store_outage_never_reaps(tmp_path, store_url) -> None:
    async with stack(tmp_path, db_url=store_url, **FAST) as st, st.client() as c:
        sb = await create_running(c)
        store = st.cp.store
        real_list, real_hb = store.list_nodes, store.heartbeat

        async def down(*a: Any, **k: Any) -> Any:
            raise ConnectionError("store is down")

        store.list_nodes = down            # the liveness pass cannot read the store ...
        store.heartbeat = down             # ... and heartbeats cannot be recorded either
        await anyio.sleep(FAST["lost_after"] + 1)      # longer than lost_after
        store.list_nodes, store.heartbeat = real_list, real_hb
        await anyio.sleep(0.5)             # the window restarts when the store is back
        assert (await c.get(f"/v1/sandboxes/{sb['id']}")).json()["state"] == "running"
        assert (await c.get("/v1/nodes")).json()["items"][0]["state"] == "ready"


async def test_drain_and_admin_only(tmp_path, store_url) -> None:
    async with stack(tmp_path, db_url=store_url) as st, st.client() as c:
        nodes = (await c.get("/v1/nodes")).json()["items"]
        assert [(n["name"], n["state"], n["draining"], n["templates"]) for n in nodes] == \
            [("node-a", "ready", False, ["tiny"])]
        drained = (await c.post("/v1/nodes/node-a/drain")).json()       # by name or id
        assert drained["draining"] is True
        r = await c.post("/v1/sandboxes", json={"template": "tiny"})
        assert r.status_code == 503 and r.json()["error"]["message"] == "0/1 nodes fit: 1 draining"
        assert (await c.post(f"/v1/nodes/{nodes[0]['id']}/undrain")).json()["draining"] is False
        sb = (await c.post("/v1/sandboxes", json={"template": "tiny", "vcpu": 2, "memory_mb": 1024})).json()
        listed = (await c.get("/v1/nodes")).json()["items"][0]
        assert (listed["sandboxes"], listed["used_vcpu"], listed["used_memory_mb"]) == (1, 2.0, 1024)
        assert sb["node_id"] == nodes[0]["id"]
        other = await st.new_team_key("b")
        async with st.client(key=other) as b:
            r = await b.get("/v1/nodes")
            assert r.status_code == 403 and r.json()["error"]["code"] == "permission_denied"
            assert (await b.post("/v1/nodes/node-a/drain")).status_code == 403
        assert (await c.post("/v1/nodes/nope/drain")).status_code == 404


async def _eq(aw: Any, value: Any) -> bool:
    return (await aw) == value


async def _not_in(item: Any, aw: Any) -> bool:
    return item not in await aw


async def _state(c: Any, sid: str) -> str:
    return (await c.get(f"/v1/sandboxes/{sid}")).json()["state"]


async def test_two_control_planes_racing_never_overcommit(tmp_path, store_url) -> None:
    """Two control-plane processes (stateless, one database) race 24 creates for 8 slots of one node:
    exactly 8 win, the rest get 503, and the node's allocation never passes its capacity."""
    import httpx

    from pilldrops.node.api import create_node_app
    from pilldrops.server.main import build_control_plane
    from tests.stack import TOKEN

    async with stack(tmp_path, db_url=store_url, capacity_vcpu=8, capacity_memory_mb=1 << 20) as st:
        cp2 = await build_control_plane(store_url, TOKEN,
                                        node_transport=httpx.ASGITransport(app=create_node_app(st.agent, TOKEN)))
        try:
            clients = [st.client(), httpx.AsyncClient(transport=httpx.ASGITransport(app=cp2.app),
                                                      base_url="http://cp2",
                                                      headers={"Authorization": f"Bearer {st.key}"})]
            codes: list[int] = []

            async def one(i: int) -> None:
                r = await clients[i % 2].post("/v1/sandboxes", json={"template": "tiny", "vcpu": 1})
                codes.append(r.status_code)

            async with anyio.create_task_group() as tg:
                for i in range(24):
                    tg.start_soon(one, i)
            assert sorted(codes) == [201] * 8 + [503] * 16
            node = (await clients[0].get("/v1/nodes")).json()["items"][0]
            assert node["used_vcpu"] == 8 and node["sandboxes"] == 8
            assert len(await st.runtime.list_ids()) == 8
            for c in clients:
                await c.aclose()
        finally:
            await cp2.aclose()


async def test_node_names_belong_to_one_agent(tmp_path, store_url) -> None:
    """A second agent (another instance id) using a live node's name is refused; the same agent
    restarting on another port is the same node."""
    import httpx

    from tests.stack import TOKEN

    async with stack(tmp_path, db_url=store_url) as st:
        internal = httpx.AsyncClient(transport=httpx.ASGITransport(app=st.cp.app), base_url="http://cp",
                                     headers={"Authorization": f"Bearer {TOKEN}"})
        body = {"name": "node-a", "url": "http://elsewhere:9", "capacity_vcpu": 8, "capacity_memory_mb": 8192}
        r = await internal.post("/internal/v1/nodes/register", json={**body, "instance": "someone-else"})
        assert r.status_code == 409 and "--name" in r.json()["error"]["message"]
        r = await internal.post("/internal/v1/nodes/register", json={**body, "instance": st.agent.instance})
        assert r.status_code == 200 and r.json()["node_id"] == st.agent.node_id
        await internal.aclose()


async def test_create_abandoned_by_a_dead_control_plane_is_retried_fresh(tmp_path, store_url) -> None:
    """A control plane died between placing a create (the row is ``starting``, the key taken) and the node's
    answer, and the node never made it: the node's heartbeat fails that row (failed_start, key released, not
    billed) and the client's retry with the same key gets a fresh sandbox, not the dead row."""
    import hashlib
    import secrets
    from datetime import timedelta

    from pilldrops.schema.api import CreateSandboxRequest
    from pilldrops.server.store.interface import NewSandbox

    async with stack(tmp_path, db_url=store_url, **FAST) as st, st.client() as c:
        body = {"template": "tiny", "timeout": 60}
        req = CreateSandboxRequest.model_validate(body)
        now = st.cp.services.sandboxes.ctx.clock.now() - timedelta(seconds=45)   # older than the ready window
        new = NewSandbox(id="sb_abandoned000000001", team_id=st.team_id, template="tiny", vcpu=req.vcpu,
                         memory_mb=req.memory_mb, timeout=60, state="starting", access_token=secrets.token_urlsafe(8),
                         created_at=now, end_at=now + timedelta(seconds=60), idempotency_key="episode-3",
                         request_hash=hashlib.sha256(req.model_dump_json().encode()).hexdigest())
        await st.cp.store.place_and_insert(new, lambda nodes, allocs: nodes[0])
        await wait_for(lambda: _eq(_state(c, new.id), "failed"))
        dead = (await c.get(f"/v1/sandboxes/{new.id}")).json()
        assert dead["end_reason"] == "failed_start" and dead["cost_usd"] == 0, dead
        r = await c.post("/v1/sandboxes", json=body, headers={"Idempotency-Key": "episode-3"})
        assert r.status_code == 201, r.text
        fresh = r.json()
        assert fresh["id"] != new.id and fresh["state"] == "running"
        assert await st.runtime.list_ids() == [fresh["id"]]
        again = await c.post("/v1/sandboxes", json=body, headers={"Idempotency-Key": "episode-3"})
        assert again.status_code == 200 and again.json()["id"] == fresh["id"]


async def test_create_finished_by_the_node_after_its_control_plane_died_bills_from_the_nodes_start(
        tmp_path, store_url) -> None:
    """Found by bench/chaos.py: the node made a sandbox whose control plane died mid-create; the restarted
    control plane turned the ``starting`` row running from the node's report, started at "now - run_s",
    which is late by however long the report took to arrive and be processed (1.4-2.6 s under load), and its
    end (capped at start + running seconds) cut those seconds from the bill. The node's start time wins."""
    import hashlib
    import secrets
    from datetime import timedelta

    from pilldrops.schema.api import CreateSandboxRequest
    from pilldrops.schema.node import NodeSandboxStatus
    from pilldrops.server.store.interface import NewSandbox

    async with stack(tmp_path, db_url=store_url, **FAST) as st, st.client() as c:
        svc = st.cp.services.sandboxes
        now = svc.ctx.clock.now()
        req = CreateSandboxRequest.model_validate({"template": "tiny", "timeout": 60})
        new = NewSandbox(id="sb_finishedbynode0001", team_id=st.team_id, template="tiny", vcpu=req.vcpu,
                         memory_mb=req.memory_mb, timeout=60, state="starting", access_token=secrets.token_urlsafe(8),
                         created_at=now - timedelta(seconds=10), end_at=now + timedelta(seconds=50),
                         idempotency_key="k", request_hash=hashlib.sha256(req.model_dump_json().encode()).hexdigest())
        node, _ = await st.cp.store.place_and_insert(new, lambda nodes, allocs: nodes[0])
        started = now - timedelta(seconds=8)      # when the node started it
        report = NodeSandboxStatus(id=new.id, state="running", started_at=started, run_s=6.0, seq=6000)
        await svc.reconciler.apply_node_status(node.id, report)        # composed 2 s before it was processed
        row = await st.cp.store.get_sandbox(new.id)
        assert row.state == "running" and row.started_at == started, (row.started_at, started)
        # its end: 9 s of running when the node reports it killed; billed 9 s, not 7
        final = NodeSandboxStatus(id=new.id, state="stopped", end_reason="killed", run_s=9.0, seq=9000)
        svc.ctx.clock.now = lambda: started + timedelta(seconds=9.2)    # type: ignore[method-assign]
        await svc.reconciler.apply_node_status(node.id, final)
        rec = (await c.get(f"/v1/sandboxes/{new.id}")).json()
        assert rec["state"] == "stopped" and abs(rec["vcpu_s"] - 9.0) < 0.01, rec


async def test_create_the_restarted_node_reaped_half_made_is_retried_fresh(tmp_path, store_url) -> None:
    """Found by bench/chaos.py (``up`` SIGKILLed mid-create): the restarted agent reaped the half-made sandbox
    and reported ``failed_start``; the row failed but kept its idempotency key, so the client's retry got
    that failed sandbox back as its create's answer (201/200, state failed) and its upload failed. The key is
    released, as for any failed start: the retry makes a fresh sandbox."""
    import hashlib
    import secrets
    from datetime import timedelta

    from pilldrops.schema.api import CreateSandboxRequest
    from pilldrops.schema.node import NodeSandboxStatus
    from pilldrops.server.store.interface import NewSandbox

    async with stack(tmp_path, db_url=store_url, **FAST) as st, st.client() as c:
        svc = st.cp.services.sandboxes
        now = svc.ctx.clock.now()
        body = {"template": "tiny", "timeout": 60}
        req = CreateSandboxRequest.model_validate(body)
        new = NewSandbox(id="sb_reapedhalfmade0001", team_id=st.team_id, template="tiny", vcpu=req.vcpu,
                         memory_mb=req.memory_mb, timeout=60, state="starting", access_token=secrets.token_urlsafe(8),
                         created_at=now, end_at=now + timedelta(seconds=60), idempotency_key="episode-9",
                         request_hash=hashlib.sha256(req.model_dump_json().encode()).hexdigest())
        node, _ = await st.cp.store.place_and_insert(new, lambda nodes, allocs: nodes[0])
        await svc.reconciler.apply_node_status(node.id, NodeSandboxStatus(
            id=new.id, state="failed", end_reason="failed_start"))
        dead = (await c.get(f"/v1/sandboxes/{new.id}")).json()
        assert dead["state"] == "failed" and dead["cost_usd"] == 0
        r = await c.post("/v1/sandboxes", json=body, headers={"Idempotency-Key": "episode-9"})
        assert r.status_code == 201 and r.json()["id"] != new.id and r.json()["state"] == "running", r.text


async def test_node_calls_survive_a_keepalive_connection_the_node_closed() -> None:
    """Found by bench/soak.py: 1 of 10,000 creates failed (failed_start, "node ... did not answer:
    ReadError('')"): the control plane reused a pooled connection the node's server (5 s keep-alive, the
    same as httpx's default expiry) had just closed. Idle connections now expire sooner, and a create or
    kill that meets a closed connection is sent once more on a fresh one."""
    import httpx

    from pilldrops import errors
    from pilldrops.schema.node import NodeSandboxSpec
    from pilldrops.server.nodes.client import KEEPALIVE_EXPIRY_S, NodeClient

    assert KEEPALIVE_EXPIRY_S < 5                      # below uvicorn's timeout_keep_alive
    calls: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request.method)
        if len(calls) in (1, 3):
            raise httpx.ReadError("")
        if request.method == "POST":
            return httpx.Response(200, json={"id": "sb_x", "state": "running"})
        return httpx.Response(200, json={"id": "sb_x", "state": "stopped", "end_reason": "killed"})

    nc = NodeClient("tok", transport=httpx.MockTransport(handler))
    spec = NodeSandboxSpec(id="sb_x", template="tiny", vcpu=1, memory_mb=64, access_token="t",
                           end_at=datetime.now().astimezone())
    assert (await nc.create("http://n", spec)).state == "running"
    assert (await nc.kill("http://n", "sb_x")).end_reason == "killed"
    assert calls == ["POST", "POST", "DELETE", "DELETE"]
    calls.clear()

    def down(request: httpx.Request) -> httpx.Response:
        calls.append(request.method)
        raise httpx.ReadError("")

    nc2 = NodeClient("tok", transport=httpx.MockTransport(down))
    with pytest.raises(errors.NodeUnavailable):
        await nc2.create("http://n", spec)
    assert calls == ["POST", "POST"]                     # once more only
    await nc.aclose()
    await nc2.aclose()


async def test_a_heartbeat_racing_a_kill_leaves_no_usage_entry_behind(tmp_path) -> None:
    """Found reading the soak's control-plane RSS (+4.8 MiB over 10,000 sandboxes): a heartbeat read its rows
    while the sandbox ran, a kill finished meanwhile (dropping the sandbox's last usage report), and the
    heartbeat then stored that report again; nothing ever removed it. The node's report of the end does."""
    async with stack(tmp_path) as st, st.client() as c:
        sid = (await c.post("/v1/sandboxes", json={"template": "tiny"})).json()["id"]
        svc = st.cp.services.sandboxes
        ctx = svc.ctx
        node = await ctx.store.get_node(st.agent.node_id)
        report = st.agent.statuses()                       # it runs
        real = ctx.store.get_sandboxes

        async def read_then_killed(ids):  # type: ignore[no-untyped-def]
            rows = await real(ids)
            assert (await c.delete(f"/v1/sandboxes/{sid}")).json()["state"] == "stopped"
            return rows

        ctx.store.get_sandboxes = read_then_killed  # type: ignore[method-assign]
        await svc.reconciler.absorb(node, report, ctx.clock.now())
        ctx.store.get_sandboxes = real  # type: ignore[method-assign]
        await svc.reconciler.absorb(node, st.agent.statuses(), ctx.clock.now())   # the node's report of the end
        assert sid not in ctx.last_usage


async def test_a_create_answer_that_reaches_a_busy_control_plane_late_bills_from_the_nodes_start(tmp_path) -> None:
    """Found by bench/chaos.py (``cp`` and ``up`` runs): a container the node held 9.9 s was billed 1.4 s. A just
    restarted control plane, flooded by retried creates, resumed the create seconds after the node had
    answered, and started billing then ("now"); the end cap cut the difference. The node's start time wins
    when earlier, bounded by when the record was made."""
    import anyio

    async with stack(tmp_path) as st, st.client() as c:
        nodes = st.cp.node_client
        real = nodes.create

        async def late(url, spec):  # type: ignore[no-untyped-def]
            status = await real(url, spec)
            await anyio.sleep(1.5)                 # the answer is processed late
            return status

        nodes.create = late  # type: ignore[method-assign]
        sb = (await c.post("/v1/sandboxes", json={"template": "tiny"})).json()
        node_started = st.agent.live[sb["id"]].started_at
        row = await st.cp.store.get_sandbox(sb["id"])
        assert abs((row.started_at - node_started).total_seconds()) < 0.2, (row.started_at, node_started)
        assert row.started_at >= row.created_at
        await anyio.sleep(0.3)
        done = (await c.delete(f"/v1/sandboxes/{sb['id']}")).json()
        assert done["vcpu_s"] >= 1.7, done               # 1.5 s late + 0.3 s: all of it billed


async def test_a_heartbeat_racing_the_create_answer_never_kills_the_sandbox(tmp_path, store_url) -> None:
    """The node reports the sandbox running (a heartbeat) before its answer to the create reaches the control
    plane: the create still succeeds and the sandbox keeps running (it was once killed as 'killed while
    starting'). The node's liveness thresholds are not FAST's: a starved heartbeat must not make the node
    lost here (that is another test's subject), only the race may end the sandbox."""
    async with stack(tmp_path, db_url=store_url, **{**FAST, "unreachable_after": 10, "lost_after": 20}) as st, \
            st.client() as c:
        sbx = st.cp.services.sandboxes
        real = sbx.ctx.nodes.create

        async def create_then_heartbeat(url: str, spec: Any) -> Any:
            status = await real(url, spec)
            row = await sbx.ctx.store.get_sandbox(spec.id)
            await sbx.reconciler.apply_node_status(row.node_id, status)   # the report wins the race
            return status

        sbx.ctx.nodes.create = create_then_heartbeat
        r = await c.post("/v1/sandboxes", json={"template": "tiny"})
        assert r.status_code == 201 and r.json()["state"] == "running", r.text
        sid = r.json()["id"]
        await anyio.sleep(0.5)
        assert await _state(c, sid) == "running" and sid in await st.runtime.list_ids()
