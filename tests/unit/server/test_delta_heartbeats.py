"""Delta heartbeats (issue 15): a node sends only what changed or is due, plus the count and digest of what it
reports; the control plane reads only those rows, and reconciles the node fully when the digest disagrees,
after either side restarts, and every ``FULL_EVERY``-th beat. On SQLite and PostgreSQL (``store_url``)."""

from __future__ import annotations

import dataclasses
from datetime import timedelta
from typing import Any

import pytest

from pilldrops.schema.node import NodeHeartbeat, NodeSandboxStatus, live_digest
from pilldrops.server.service.beats import Beats
from pilldrops.server.service.billing import BillingSettings
from tests.stack import stack

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


class Spy:
    """The heartbeats the control plane receives and the rows each one made it read."""

    def __init__(self, st: Any) -> None:
        self.beats: list[NodeHeartbeat] = []
        self.replies: list[Any] = []
        self.read: list[list[str]] = []       # ids read by key (``get_sandboxes``)
        self.full_reads = 0                   # every live row of a node (``live_sandboxes_on``)
        nodes, store = st.cp.services.nodes, st.cp.store
        real_hb, real_get, real_live = nodes.heartbeat, store.get_sandboxes, store.live_sandboxes_on

        async def heartbeat(node_id: str, hb: NodeHeartbeat) -> Any:
            self.beats.append(hb)
            reply = await real_hb(node_id, hb)
            self.replies.append(reply)
            return reply

        async def get_sandboxes(ids: Any) -> Any:
            ids = list(ids)
            self.read.append(ids)
            return await real_get(ids)

        async def live_sandboxes_on(node_id: str) -> Any:
            self.full_reads += 1
            return await real_live(node_id)

        nodes.heartbeat, store.get_sandboxes, store.live_sandboxes_on = heartbeat, get_sandboxes, live_sandboxes_on

    def reset(self) -> None:
        self.beats.clear()
        self.replies.clear()
        self.read.clear()
        self.full_reads = 0


async def _baseline(st: Any) -> None:
    """Beat until the node's beats are deltas the control plane takes (its first after a register is full)."""
    for _ in range(3):
        await st.agent._heartbeat()
    assert st.agent.control_plane._epoch == st.cp.services.sandboxes.ctx.beats.epoch


async def _new(c: Any, n: int) -> list[str]:
    return [(await c.post("/v1/sandboxes", json={"template": "tiny"})).json()["id"] for _ in range(n)]


async def test_a_delta_beat_carries_and_reads_only_the_sandboxes_that_changed(tmp_path, store_url) -> None:
    async with stack(tmp_path, db_url=store_url) as st, st.client() as c:
        ids = await _new(c, 3)
        await _baseline(st)
        spy = Spy(st)
        await st.agent._heartbeat()                   # nothing changed
        hb, = spy.beats
        assert hb.delta_of is not None and hb.sandboxes == [] and hb.count == 3
        assert hb.digest == live_digest(ids) and spy.read in ([], [[]]) and spy.full_reads == 0
        assert not spy.replies[0].full

        # one sandbox changes on the node (a new deadline), another is killed: the next delta carries the
        # first and the end (still in the outbox until a beat carried it), the one after only drops the
        # ended id (``gone``)
        end_at = st.agent.now() + timedelta(seconds=120)
        st.agent.set_deadline(ids[0], end_at)
        assert (await c.delete(f"/v1/sandboxes/{ids[1]}")).json()["state"] == "stopped"
        spy.reset()
        await st.agent._heartbeat()
        hb, = spy.beats
        assert sorted(s.id for s in hb.sandboxes) == sorted(ids[:2]) and hb.count == 3 and not hb.gone
        assert spy.full_reads == 0 and {i for r in spy.read for i in r} == {ids[0], ids[1]}
        assert not spy.replies[0].full
        spy.reset()
        await st.agent._heartbeat()
        hb, = spy.beats
        assert hb.sandboxes == [] and hb.gone == [ids[1]] and hb.count == 2 and not spy.replies[0].full
        assert spy.full_reads == 0 and {i for r in spy.read for i in r} <= {ids[1]}
        assert [(await c.get(f"/v1/sandboxes/{i}")).json()["state"] for i in ids] == ["running", "stopped", "running"]


async def test_a_digest_mismatch_makes_a_full_beat_that_finds_a_missing_and_an_extra_sandbox(
        tmp_path, store_url, monkeypatch) -> None:
    from pilldrops.server.service import reconcile

    monkeypatch.setattr(reconcile, "NODE_READY_WINDOW", timedelta(0))    # no grace for just-made rows
    async with stack(tmp_path, db_url=store_url) as st, st.client() as c:
        missing, extra = await _new(c, 2)
        await _baseline(st)
        cp = st.agent.control_plane
        # the node loses ``missing`` without a word (and without the delta's ``gone``: a lost report) ...
        sb = st.agent.sandboxes._by_id.pop(missing)
        await st.runtime.destroy(sb.target.handle)
        del cp._acked[missing]
        # ... and ``extra``'s record ended while the node kept running it (its kill never reached it)
        await st.cp.store.update_sandbox(extra, from_states=["running"], state="stopped", end_reason="killed",
                                         ended_at=st.cp.services.sandboxes.ctx.clock.now())
        spy = Spy(st)
        await st.agent._heartbeat()
        delta, full = spy.beats                  # the delta is refused (count 1, digest of one id) ...
        assert delta.delta_of is not None and delta.count == 1 and spy.replies[0].full
        assert full.delta_of is None and [s.id for s in full.sandboxes] == [extra]   # ... a full beat at once
        assert spy.full_reads == 1
        assert (await c.get(f"/v1/sandboxes/{missing}")).json()["state"] == "lost"
        assert extra not in await st.runtime.list_ids()           # the orphan was stopped on the node
        spy.reset()
        await st.agent._heartbeat()
        assert spy.beats[0].delta_of is not None and not spy.replies[0].full    # deltas again


async def test_a_delta_that_only_drops_an_id_is_reconciled_for_that_id(tmp_path, store_url, monkeypatch) -> None:
    """A sandbox that vanished from the node without an end (its ``gone`` arrives, the digest agrees) is
    lost, as a full report's missing one is; nothing else is read."""
    from pilldrops.server.service import reconcile

    monkeypatch.setattr(reconcile, "NODE_READY_WINDOW", timedelta(0))
    async with stack(tmp_path, db_url=store_url) as st, st.client() as c:
        sid, kept = await _new(c, 2)
        await _baseline(st)
        sb = st.agent.sandboxes._by_id.pop(sid)
        await st.runtime.destroy(sb.target.handle)
        spy = Spy(st)
        await st.agent._heartbeat()
        hb, = spy.beats
        assert hb.gone == [sid] and not spy.replies[0].full and spy.full_reads == 0
        assert (await c.get(f"/v1/sandboxes/{sid}")).json()["state"] == "lost"
        assert (await c.get(f"/v1/sandboxes/{kept}")).json()["state"] == "running"


async def test_a_restarted_control_plane_gets_a_full_beat_and_every_nth_beat_is_full(tmp_path, store_url) -> None:
    async with stack(tmp_path, db_url=store_url) as st, st.client() as c:
        ids = await _new(c, 2)
        await _baseline(st)
        ctx = st.cp.services.sandboxes.ctx
        old = ctx.beats.epoch
        ctx.beats = Beats()                     # what a restart leaves: a new epoch, no view of any node
        spy = Spy(st)
        await st.agent._heartbeat()
        delta, full = spy.beats
        assert delta.delta_of == old and spy.replies[0].full and spy.replies[0].epoch == ctx.beats.epoch
        assert full.delta_of is None and sorted(s.id for s in full.sandboxes) == sorted(ids)
        assert spy.full_reads == 1 and spy.replies[1].epoch == ctx.beats.epoch
        # the safety net: the FULL_EVERY-th delta is refused, and a full beat follows
        ctx.beats.full_every = 3
        spy.reset()
        for _ in range(3):
            await st.agent._heartbeat()
        assert [b.delta_of is None for b in spy.beats] == [False, False, False, True]
        assert spy.full_reads == 1


async def test_usage_without_a_state_change_is_billed_on_its_cadence(tmp_path, store_url) -> None:
    async with stack(tmp_path, db_url=store_url, billing=BillingSettings(commit_every_s=1.0)) as st, \
            st.client() as c:
        import anyio

        sid, = await _new(c, 1)
        await _baseline(st)
        spy = Spy(st)
        await st.agent._heartbeat()
        before = (await st.cp.store.get_sandbox(sid)).billed_run_s
        await anyio.sleep(1.2)                   # more new running time than the cadence
        await st.agent._heartbeat()
        assert [[s.id for s in b.sandboxes] for b in spy.beats][-1] == [sid]
        row = await st.cp.store.get_sandbox(sid)
        assert row.billed_run_s >= before + 1.0 and row.billed_seq > 0
        billing = st.cp.services.sandboxes.ctx.billing                   # the next reply says 3600 s
        billing.settings = dataclasses.replace(billing.settings, commit_every_s=3600.0)
        await st.agent._heartbeat()              # (composed with the 1 s cadence; not billed at 3600 s)
        spy.reset()
        await st.agent._heartbeat()              # not due again yet: nothing carried, nothing billed
        assert spy.beats[0].sandboxes == []
        assert (await st.cp.store.get_sandbox(sid)).billed_run_s == row.billed_run_s


def test_usage_is_due_from_the_last_billed_report_not_the_last_sent_one() -> None:
    """A report sent for another reason (a disk step, a pause in flight) is not a commit: the next commit
    is still due ``commit_every_s`` after the last billed one, not after that report."""
    from pilldrops.node.control_plane import _changed
    from pilldrops.schema.node import NodeSandboxStatus

    def at(run_s: float) -> NodeSandboxStatus:
        return NodeSandboxStatus(id="sb_x", state="running", run_s=run_s)
    assert not _changed(at(29.0), at(31.0), 30.0, billed=10.0)      # 21 s since the last commit
    assert _changed(at(29.0), at(41.0), 30.0, billed=10.0)          # 31 s since it, 12 s since the last sent


async def test_a_lost_node_bills_up_to_its_last_delta(tmp_path) -> None:
    """Deltas carry usage only every ``commit_every_s``; a node lost in between is billed up to its last
    (digest-checked) heartbeat all the same, as with full beats."""
    async with stack(tmp_path) as st, st.client() as c:
        import anyio

        sid, = await _new(c, 1)
        await _baseline(st)
        await anyio.sleep(1.0)
        await st.agent._heartbeat()            # a delta without it (30 s cadence)
        ctx = st.cp.services.sandboxes.ctx
        heard = ctx.beats.verified_at(st.agent.node_id)
        node = await st.cp.store.get_node(st.agent.node_id)
        await st.cp.services.sandboxes.mark_lost(node.id, node.last_heartbeat_at)
        lost = (await c.get(f"/v1/sandboxes/{sid}")).json()
        assert lost["state"] == "lost"
        row = await st.cp.store.get_sandbox(sid)
        assert heard is not None and row.billed_run_s >= 1.0, row.billed_run_s


async def test_an_older_node_s_full_beat_is_taken_and_answered_as_before(tmp_path, store_url) -> None:
    async with stack(tmp_path, db_url=store_url) as st, st.client() as c:
        ids = await _new(c, 2)
        nodes = st.cp.services.nodes
        statuses: list[NodeSandboxStatus] = st.agent.statuses()
        reply = await nodes.heartbeat(st.agent.node_id, NodeHeartbeat(sandboxes=statuses))   # no digest
        assert set(reply.model_dump(mode="json")) == {"ok", "pools"}                      # no new fields
        assert [(await c.get(f"/v1/sandboxes/{i}")).json()["state"] for i in ids] == ["running", "running"]
