"""POST /v1/sandboxes/batch: each item on its own, queued under admission control, waiting for capacity,
idempotent per item."""

from __future__ import annotations

from typing import Any

import anyio
import pytest

from tests.stack import stack

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def test_batch_creates_each_item(tmp_path, store_url) -> None:
    async with stack(tmp_path, db_url=store_url) as s, s.client() as c:
        r = await c.post("/v1/sandboxes/batch", json={"template": "tiny", "count": 5, "metadata": {"run": "b1"}},
                         headers={"Idempotency-Key": "batch-1"})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["created"] == 5 and body["failed"] == 0
        assert [it["index"] for it in body["items"]] == list(range(5))
        ids = [it["sandbox"]["id"] for it in body["items"]]
        assert len(set(ids)) == 5 and all(it["sandbox"]["access_token"] for it in body["items"])
        assert len(s.agent.live) == 5
        again = (await c.post("/v1/sandboxes/batch", json={"template": "tiny", "count": 5, "metadata": {"run": "b1"}},
                              headers={"Idempotency-Key": "batch-1"})).json()
        assert [it["sandbox"]["id"] for it in again["items"]] == ids          # a retried batch replays
        assert len(s.agent.live) == 5


async def test_items_fail_on_their_own_and_wait_for_capacity(tmp_path, store_url) -> None:
    async with stack(tmp_path, db_url=store_url, capacity_vcpu=2, capacity_memory_mb=4096) as s, s.client() as c:
        r = (await c.post("/v1/sandboxes/batch",
                          json={"template": "tiny", "count": 4, "capacity_wait": 0})).json()
        assert r["created"] == 2 and r["failed"] == 2
        errs = [it["error"] for it in r["items"] if it["error"]]
        assert {e["code"] for e in errs} == {"capacity_unavailable"}
        made = [it["sandbox"]["id"] for it in r["items"] if it["sandbox"]]
        # the next batch waits for room: free it while the batch is queued
        result: dict = {}  # type: ignore[type-arg]

        async def batch() -> None:
            result.update((await c.post("/v1/sandboxes/batch",
                                        json={"template": "tiny", "count": 2, "capacity_wait": 20})).json())

        async with anyio.create_task_group() as tg:
            tg.start_soon(batch)
            await anyio.sleep(0.5)
            for sid in made:
                await c.delete(f"/v1/sandboxes/{sid}")
        assert result["created"] == 2 and result["failed"] == 0
        bad = await c.post("/v1/sandboxes/batch", json={"template": "tiny", "count": 0})
        assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_request"
        unknown = (await c.post("/v1/sandboxes/batch", json={"template": "nope", "count": 2})).json()
        assert unknown["failed"] == 2 and unknown["items"][0]["error"]["code"] == "template_not_found"


async def test_item_metadata_makes_each_episode_findable(tmp_path, store_url) -> None:
    async with stack(tmp_path, db_url=store_url) as s, s.client() as c:
        r = await c.post("/v1/sandboxes/batch", json={
            "template": "tiny", "count": 3, "metadata": {"run": "b2"},
            "item_metadata": [{"episode": str(i)} for i in range(3)]})
        assert r.status_code == 200, r.text
        got = [it["sandbox"]["metadata"] for it in r.json()["items"]]
        assert got == [{"run": "b2", "episode": str(i)} for i in range(3)]
        found = (await c.get("/v1/sandboxes", params={"metadata.episode": "1"})).json()["items"]
        assert [sb["metadata"]["episode"] for sb in found] == ["1"]
        bad = await c.post("/v1/sandboxes/batch", json={"template": "tiny", "count": 3, "item_metadata": [{}]})
        assert bad.status_code == 400 and "item_metadata has 1 entries for count 3" in bad.text
        assert len(s.agent.live) == 3


async def test_a_left_batch_spares_what_a_retry_replayed(tmp_path, store_url) -> None:
    """Reviewer finding 1: the client of a keyed batch leaves while an item still waits for room; its retry
    has meanwhile replayed the item that runs (its idempotency key): the left batch's drop must not kill what
    the retry now holds, and it still kills nothing else (no other item of it was made). The two items race
    for the node's one vCPU, so either may be the one that runs."""
    from pilldrops.schema.api import BatchCreateRequest
    async with stack(tmp_path, db_url=store_url, capacity_vcpu=1) as s:
        lc = s.cp.services.sandboxes.lifecycle
        req = BatchCreateRequest(template="tiny", count=2, vcpu=1, capacity_wait=30)
        left = anyio.Event()
        out: dict = {}  # type: ignore[type-arg]

        async def disconnected() -> bool:
            return left.is_set()

        async def batch() -> None:
            out["first"] = await lc.create_batch(s.team_id, req, "kb", disconnected=disconnected)

        async def running() -> tuple[int, Any] | None:
            for i in (0, 1):
                row = await s.cp.store.sandbox_by_idempotency_key(s.team_id, f"kb:{i}")
                if row is not None and row.state == "running":
                    return i, row
            return None

        async with anyio.create_task_group() as tg:
            tg.start_soon(batch)
            with anyio.fail_after(30):
                while (found := await running()) is None:
                    await anyio.sleep(0.05)
            i, row = found
            replayed, created = await lc.create(s.team_id, req.item_request(i), f"kb:{i}")   # the retry's item
            assert not created and replayed.id == row.id
            left.set()                       # the first client goes; the other item still waits for room
        first = out["first"]
        assert first.items[1 - i].error is not None and first.items[1 - i].error.code == "client_gone"
        now = await s.cp.store.get_sandbox(row.id)
        assert now.state == "running", "the drop killed a sandbox the retry was handed"
        assert now.idempotency_key == f"kb:{i}"          # a further retry replays it too
        again, created = await lc.create(s.team_id, req.item_request(i), f"kb:{i}")
        assert not created and again.id == row.id
