"""The SQLite store's small calls on the event loop's thread (issue 15): they never wait for a lock there.
While another connection (here another process's, a plain sqlite3 one) holds the write lock, a read still
answers at once, and a write goes to the worker thread, which waits for the lock and then commits; nothing
is written twice and nothing is lost."""

from __future__ import annotations

import sqlite3
from datetime import UTC, datetime, timedelta
from typing import Any

import anyio
import pytest

from pilldrops.server.domain.billing import Rates
from pilldrops.server.store.interface import EndSandbox, NewSandbox
from pilldrops.server.store.sql import _QUICK_ROWS, Store, sqlite_url

pytestmark = pytest.mark.anyio
RATES = Rates()


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def _new(team_id: str, sid: str, now: datetime, key: str | None = None) -> NewSandbox:
    return NewSandbox(id=sid, team_id=team_id, template="tiny", vcpu=1, memory_mb=256, timeout=60, state="running",
                      metadata={"k": "v"}, envs={}, access_token="t" * 32, idempotency_key=key,
                      request_hash="h" * 64, created_at=now, end_at=now + timedelta(seconds=60))


async def test_quick_calls_read_under_a_held_write_lock_and_write_once_it_is_released(tmp_path) -> None:
    path = tmp_path / "store.sqlite"
    store = await Store.open(sqlite_url(path))
    try:
        now = datetime.now(UTC)
        team = await store.create_team("t", now)
        node = await store.upsert_node(name="n", url="http://127.0.0.1:1", capacity_vcpu=4, capacity_memory_mb=4096,
                                       templates=[], now=now)
        first = await store.insert_claimed(_new(team.id, "sb_onloop000000000001", now, "k1"), node.id, now)
        assert first is not None and first.state == "running"

        other = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        other.execute("BEGIN IMMEDIATE")            # another writer holds the lock (e.g. `pilldrops credits`)
        try:
            with anyio.fail_after(30):              # a read does not wait for the lock (it would wait 60 s)
                got = await store.get_sandbox(first.id)
            assert got is not None and got.id == first.id
            made: list[Any] = []

            async def write() -> None:
                made.append(await store.insert_claimed(_new(team.id, "sb_onloop000000000002", now, "k2"), node.id,
                                                       now))

            with anyio.fail_after(30):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(write)
                    while store._hot_lock.borrowed_tokens == 0:   # the write went to the worker thread...
                        await anyio.sleep(0.01)
                    for _ in range(3):                           # ...and while it waits, the loop serves
                        assert (await store.get_sandbox(first.id)) is not None
                        await anyio.sleep(0.01)
                    assert not made                              # it is waiting for the lock, not done
                    await anyio.to_thread.run_sync(other.execute, "COMMIT")
            second = made[0]
            assert second is not None and second.node_id == node.id
            assert await store.set_sandbox(second.id, from_states=["running"], state="killing")
        finally:
            other.close()
        # written once each, labels included; a duplicate key is still the unique index's to refuse
        rows = await store.get_sandboxes([first.id, second.id])
        assert rows[second.id].state == "killing" and rows[second.id].metadata_ == {"k": "v"}
        check = sqlite3.connect(path)
        try:
            assert check.execute("SELECT count(*) FROM sandbox_labels").fetchone()[0] == 2
        finally:
            check.close()
    finally:
        await store.close()


async def test_a_kill_ends_on_the_loop_and_under_a_held_write_lock_bills_once(tmp_path, monkeypatch) -> None:
    """``end_sandboxes`` of one row (and a usage commit of one report) runs on the loop's connection (no
    worker-thread hop); while another writer holds the lock it goes to the worker thread, which waits and
    then commits it: the final report billed once, the team charged once, the fault hook before the commit
    called once. A batch of more than ``_QUICK_ROWS`` rows goes to the worker thread."""
    path = tmp_path / "store.sqlite"
    store = await Store.open(sqlite_url(path))
    hops: list[Any] = []
    real_hop = anyio.to_thread.run_sync

    async def hop(*a: Any, **kw: Any) -> Any:
        hops.append(a[0])
        return await real_hop(*a, **kw)

    monkeypatch.setattr(anyio.to_thread, "run_sync", hop)
    try:
        now = datetime.now(UTC)
        team = await store.create_team("t", now)
        node = await store.upsert_node(name="n", url="http://127.0.0.1:1", capacity_vcpu=64,
                                       capacity_memory_mb=65536, templates=[], now=now)
        ids = [f"sb_onloop{i:012d}" for i in range(2 + _QUICK_ROWS + 1)]
        for sid in ids:
            assert await store.insert_claimed(_new(team.id, sid, now), node.id, now) is not None
        later = now + timedelta(seconds=10)
        hooked: list[int] = []

        async def end(sids: list[str]) -> Any:
            return await store.end_sandboxes(
                [EndSandbox(sid, "stopped", "killed", final=True, seq=4000, run_s=4.0) for sid in sids],
                from_states=["running"], now=later, rates=RATES, charge_credits=True,
                before_commit=lambda: hooked.append(1))

        hops.clear()                                        # a usage commit of one report: on the loop too
        assert await store.commit_usage(ids[0], 2000, 2.0, now=later, rates=RATES, charge_credits=True)
        first = await end([ids[0]])                         # bills 2 s more: from 2.0 to 4.0
        assert hops == [] and first.ended == {ids[0]} and len(first.entries) == 1 and hooked == [1]

        other = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        other.execute("BEGIN IMMEDIATE")
        done: list[Any] = []

        async def ending() -> None:
            done.append(await end([ids[1]]))

        try:
            with anyio.fail_after(30):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(ending)
                    while store._hot_lock.borrowed_tokens == 0:     # refused on the loop: the worker waits
                        await anyio.sleep(0.01)
                    assert not done and hooked == [1]
                    await anyio.to_thread.run_sync(other.execute, "COMMIT")
        finally:
            other.close()
        assert done[0].ended == {ids[1]} and len(done[0].entries) == 1 and hooked == [1, 1]

        hops.clear()
        batch = await end(ids[2:])                          # more than _QUICK_ROWS rows: one worker hop
        assert len(hops) == 1 and batch.ended == set(ids[2:]) and hooked == [1, 1, 1]

        # each billed once: 4 s of 1 vCPU, 256 MiB; the team charged the ledger's sum, once
        rows = await store.get_sandboxes(ids)
        assert all(r.state == "stopped" and r.billed_run_s == pytest.approx(4.0) for r in rows.values())
        assert all(r.ended_at == now + timedelta(seconds=4) for r in rows.values())
        n, vcpu_s, _, _, cost = await store.usage_totals(team.id, None, None)
        assert n == len(ids) and vcpu_s == pytest.approx(4.0 * len(ids))     # 2 + 2 s of the first included
        assert (await store.get_team(team.id)).credits_usd == pytest.approx(5.0 - cost)
        check = sqlite3.connect(path)
        try:
            assert check.execute("SELECT count(*) FROM usage_ledger").fetchone()[0] == len(ids) + 1
        finally:
            check.close()
    finally:
        await store.close()
