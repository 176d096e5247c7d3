"""A sandbox claimed from a warm pool pauses and resumes like any other (its container keeps the member's
name inside the checkpoint), on its own node and when it moves."""

from __future__ import annotations

import anyio
import pytest

from tests.stack import stack

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def test_claimed_sandbox_pauses_resumes_and_moves(tmp_path) -> None:
    async with stack(tmp_path, nodes=2, capacity_vcpu=3, capacity_memory_mb=8192) as s, s.client() as c:
        shape = {"template": "tiny", "vcpu": 1, "memory_mb": 256}
        assert (await c.put("/v1/pools", json={**shape, "size": 1})).status_code == 200
        with anyio.fail_after(10):
            while not any(p.ready for a in (s.agent, s.others[0][0]) for p in a.pools.pools.values()):
                await anyio.sleep(0.02)
        sb = (await c.post("/v1/sandboxes", json=shape)).json()
        holder = s.agent if sb["node_id"] == s.agent.node_id else s.others[0][0]
        with anyio.fail_after(10):                     # a pre-issued member: its node is told after the answer
            while sb["id"] not in holder.live:
                await anyio.sleep(0.02)
        assert holder.live[sb["id"]].target.handle.id.startswith("pd-")        # claimed
        await c.post(f"/v1/sandboxes/{sb['id']}/run", json={"cmd": "echo kept > f"})
        for _ in range(2):                                                      # on its own node
            assert (await c.post(f"/v1/sandboxes/{sb['id']}/pause")).status_code == 200
            r = await c.post(f"/v1/sandboxes/{sb['id']}/resume")
            assert r.status_code == 200, r.text
        assert (await c.post(f"/v1/sandboxes/{sb['id']}/pause")).status_code == 200
        await c.post(f"/v1/nodes/{holder.node_id}/drain")                     # now it has to move
        r = await c.post(f"/v1/sandboxes/{sb['id']}/resume")
        assert r.status_code == 200, r.text
        assert r.json()["node_id"] != holder.node_id
        out = (await c.post(f"/v1/sandboxes/{sb['id']}/run", json={"cmd": "cat f"})).text
        assert "a2VwdAo=" in out                                                # base64 of "kept\n"
        await c.put("/v1/pools", json={**shape, "size": 0})
