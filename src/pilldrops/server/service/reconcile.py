"""Reconciliation: what nodes report against what the store records.

- ``absorb``: a node's report (register or heartbeat, full or a delta): usage of steady running sandboxes
  committed together, state changes applied one by one, pauses/resumes whose request died settled, then
  sandboxes the node no longer has declared lost (a full report: every live row; a delta: its ``gone`` and
  claims the node may not have been told of) and orphans stopped;
- ``apply_node_status``: one sandbox's report (usage so far, or an end the node saw on its own);
- ``mark_lost``: a node stopped heartbeating: its live sandboxes are lost, billed up to when it was last
  heard from;
- ``stop_orphans``: a node runs (or keeps a checkpoint of) a sandbox whose record ended or moved away.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from datetime import datetime, timedelta

from pilldrops.schema.api import EndReason, SandboxState
from pilldrops.schema.node import NodeSandboxStatus
from pilldrops.server.domain.states import ENDED, LIVE
from pilldrops.server.service.context import IN_FLIGHT, SandboxContext, legal_from, timeout_left
from pilldrops.server.service.placement import NODE_READY_WINDOW
from pilldrops.server.store.interface import NodeRecord, SandboxRecord

S = SandboxState
SETTLE_AFTER = timedelta(seconds=660)   # longer than any pause/resume request (node calls time out at 600 s)


class Reconciler:
    def __init__(self, ctx: SandboxContext) -> None:
        self.ctx = ctx
        # tells a node of a claim it never heard of (``Lifecycle.resync_claim``; set by the facade)
        self.resync: Callable[[NodeRecord, SandboxRecord], Awaitable[None]] | None = None

    async def absorb(self, node: NodeRecord, statuses: list[NodeSandboxStatus], received: datetime,
                     live: set[str] | None = None, gone: Sequence[str] = ()) -> set[str]:
        """A node's report (register or heartbeat), in a few queries whatever the number of sandboxes:
        steady running ones only have their usage committed (together, in one transaction); state changes
        take the per-sandbox path; then missing ones are reconciled and orphans stopped.

        ``live``: the report is a delta (``statuses`` are only what changed or is due; ``live`` every id the
        node reports, its digest checked; ``gone`` the ids it stopped reporting): only its own rows are read,
        and of the store's other rows only those of ``gone`` (a sandbox that vanished without an end is lost
        there, as a full report's missing one) and the claims the node may never have been told of (grants
        it still lists) are reconciled. A full report (``live`` None) reconciles every live row of the node.
        Returns the ids whose rows are still
        in flight (a pause or resume): a delta must report them again, unchanged or not, until settled."""
        ctx = self.ctx
        rows = await ctx.store.get_sandboxes(st.id for st in statuses)
        steady: list[NodeSandboxStatus] = []
        unsettled: set[str] = set()
        for st in statuses:
            row = rows.get(st.id)
            if row is not None and row.state in IN_FLIGHT:
                unsettled.add(st.id)
            if row is not None and row.node_id == node.id and row.id not in ctx.in_flight \
                    and await self.settle(row, st):
                unsettled.discard(st.id)
                continue
            if row is not None and row.node_id == node.id and (
                    (row.state == S.running.value and st.state == S.running)
                    or (row.state in (S.paused.value, *IN_FLIGHT) and st.state == S.paused)):
                if st.state == S.running:
                    steady.append(st)
                    ctx.last_usage[st.id] = (st, received)
                continue
            await self.apply_node_status(node.id, st, row)
        await ctx.billing.commit_running(steady, rows)
        if live is None:
            await self.reconcile_node(node.id, {st.id for st in statuses}, received)
        else:
            await self.reconcile_node(node.id, live, received,
                                      only=[*gone, *(g for g in ctx.grants.listed_popped(node.id) if g not in live)])
        await self.stop_orphans(node, statuses, rows)
        return unsettled

    async def settle(self, row: SandboxRecord, st: NodeSandboxStatus) -> bool:
        """A pause or resume whose request died with its control plane (or timed out after the node acted):
        once it has been in flight for ``SETTLE_AFTER`` (no live request takes that long; a stale report
        can never undo a live one), the node's report settles it. True when it did something."""
        ctx = self.ctx
        now = ctx.clock.now()
        if row.state not in IN_FLIGHT or row.op_started_at is None or now - row.op_started_at < SETTLE_AFTER:
            return False
        if st.state == S.paused and row.state == S.pausing.value:          # the pause did happen
            await ctx.billing.commit(st)
            await ctx.store.record_pause(row.id, paused_at=now, checkpoint_bytes=st.checkpoint_bytes or 0,
                                         timeout_left=timeout_left(row, st, now))
            return True
        if st.state == S.running and row.state == S.pausing.value:         # it did not
            await ctx.store.update_sandbox(row.id, from_states=[S.pausing.value], state=S.running.value)
            return True
        if st.state == S.running and row.state == S.resuming.value:        # the resume did happen
            await ctx.billing.end_interval(row.id, from_states=[S.resuming.value], until=now, resumed=True,
                                           state=S.running.value, end_at=st.end_at or now, timeout_left=None)
            return True
        if st.state == S.paused and row.state == S.resuming.value:         # it did not: still paused here
            await ctx.store.update_sandbox(row.id, from_states=[S.resuming.value], state=S.paused.value)
            return True
        return False

    async def apply_node_status(self, node_id: str, st: NodeSandboxStatus,
                                row: SandboxRecord | None = None) -> None:
        """A node reported on a sandbox: usage so far, or an end it saw on its own (deadline, exit, OOM)."""
        ctx = self.ctx
        row = row or await ctx.store.get_sandbox(st.id)
        if row is None or row.node_id != node_id or SandboxState(row.state) in (S.lost, S.failed, S.stopped):
            if st.state in ENDED and (row is None or SandboxState(row.state) in ENDED):
                # a heartbeat that raced its kill may have stored its last report again after the kill dropped
                # it: the node's report of the end is the last word on it
                ctx.last_usage.pop(st.id, None)
            return                           # ended rows stay as recorded; see stop_orphans
        if row.state == S.starting.value and row.id in ctx.creating:
            return     # this process is creating it and will record its start from the node's answer
        if row.state == S.starting.value and st.state == S.running:
            # the control plane died (or timed out) while the node was creating it: it runs, so it is
            # running since the node says, and billed from then. Now minus its running seconds is late by
            # however long the report took to reach us and be processed (seconds, under load): the node's
            # own start time wins when earlier, never before the record was made
            started = ctx.clock.now() - timedelta(seconds=max(st.run_s or 0.0, 0.0))
            if st.started_at is not None:
                started = min(started, st.started_at)
            await ctx.store.update_sandbox(st.id, from_states=[S.starting.value], state=S.running.value,
                                           started_at=max(started, row.created_at), end_at=st.end_at or row.end_at)
        await ctx.billing.commit(st)         # before the end is visible, so an ended sandbox shows its cost
        if st.state in ENDED:
            ctx.last_usage.pop(st.id, None)
            now = ctx.clock.now()
            ended_at = now if row.paused_at is not None else ctx.billing.end_time(row, st)
            # a create the node never finished (its agent died mid-create and reaped it) releases its key, as
            # any failed start does: the client's retry with that key makes a fresh one instead of getting
            # this failed sandbox back as its create's answer
            release = {"idempotency_key": None} if st.state == S.failed and row.state == S.starting.value else {}
            await ctx.billing.end_interval(
                st.id, from_states=legal_from(st.state), until=now, resumed=False, state=st.state.value,
                end_reason=(st.end_reason or EndReason.exited).value, ended_at=ended_at, error=st.error, **release)

    async def _declare_lost(self, row: SandboxRecord, ended_at: datetime, error: str,
                            heard_at: datetime | None = None) -> None:
        """``lost`` (``node_lost``), ended at ``ended_at``: its last usage report is billed first. ``heard_at``:
        when its node last confirmed (a delta heartbeat whose digest matched) that nothing changed; a
        running sandbox's report is carried forward to then (its running seconds grow with the clock while
        it runs; any change would have been in that beat), so it is billed up to the node's last heartbeat
        as with full beats, though a delta carries its usage only every ``commit_every_s``."""
        if (last := self.ctx.last_usage.pop(row.id, None)) is not None:
            st, at = last
            if (heard_at is not None and st.run_s is not None and row.state == S.running.value
                    and (extra := (min(heard_at, ended_at) - at).total_seconds()) > 0):
                run_s = st.run_s + extra
                st = st.model_copy(update={"run_s": run_s, "seq": max(st.seq or 0, int(run_s * 1000))})
            await self.ctx.billing.commit(st)
        await self.ctx.billing.end_interval(row.id, from_states=legal_from(S.lost), until=ended_at, resumed=False,
                                            state=S.lost.value, end_reason=EndReason.node_lost.value,
                                            ended_at=ended_at, error=error)

    async def mark_lost(self, node_id: str, last_seen: datetime) -> None:
        """The node is gone: its live sandboxes are ``lost`` (``node_lost``), ended and billed up to when
        the node was last heard from."""
        heard_at = self.ctx.beats.verified_at(node_id)
        for row in await self.ctx.store.live_sandboxes_on(node_id):
            ended_at = max(last_seen, row.started_at) if row.started_at else last_seen
            if row.paused_at is not None:
                ended_at = max(last_seen, row.paused_at)
            await self._declare_lost(row, ended_at, "the node stopped heartbeating", heard_at)
        self.ctx.beats.forget(node_id)       # a node that comes back sends a full beat first

    async def reconcile_node(self, node_id: str, live_ids: set[str], received: datetime | None = None,
                             only: list[str] | None = None) -> None:
        """Sandboxes the store thinks run on a node that no longer has them are lost (with a grace period,
        from when the report was received, so a report composed before a create finished does not count).
        ``only``: just these ids' rows (a delta heartbeat's), not every live row of the node."""
        cutoff = (received or self.ctx.clock.now()) - NODE_READY_WINDOW
        if only is None:
            rows = await self.ctx.store.live_sandboxes_on(node_id)
        else:
            found = await self.ctx.store.get_sandboxes(only) if only else {}
            rows = [r for r in found.values() if r.node_id == node_id and SandboxState(r.state) in LIVE]
        for row in rows:
            if row.id in live_ids or row.state in IN_FLIGHT or row.id in self.ctx.creating:
                continue
            if row.state == S.running.value and self.resync is not None and self.ctx.grants.listed(node_id, row.id):
                # a claim answered from this node's pre-issued member, and the node was never told (its
                # control plane died in between): the member still waits for it
                if (node := await self.ctx.node(node_id)) is not None:
                    await self.resync(node, row)
                continue
            if row.created_at > cutoff:
                continue
            if row.state == S.starting.value:
                await self._fail_start(row)
                continue
            await self._declare_lost(row, self.ctx.clock.now(), "the node no longer has this sandbox")
        await self._retire_ended_grants(node_id, live_ids)

    async def _retire_ended_grants(self, node_id: str, live_ids: set[str]) -> None:
        """A grant the node still lists whose claim's record has ended (killed or timed out before the node
        was told, and the kill did not reach it): stopped there, so the node retires the member (it would
        otherwise stay reported for ever, which only its grant may claim), and never offered again."""
        ctx = self.ctx
        for gid in ctx.grants.listed_popped(node_id):
            if gid in live_ids or gid in ctx.creating or gid in ctx.killed:
                continue
            row = await ctx.store.get_sandbox(gid)
            if row is None or SandboxState(row.state) not in ENDED:
                continue
            ctx.grants.stopped(gid)
            if (node := await ctx.node(node_id)) is not None:
                await ctx.quiet_kill(node, gid, "(a claim that ended before its node was told) ")

    async def _fail_start(self, row: SandboxRecord) -> None:
        """A create that no control plane is carrying out (its process died between placing the row and the
        node's answer) and that the node never made: it failed to start, nothing was billed, and its
        idempotency key is released so that the client's retry makes a fresh attempt."""
        await self.ctx.store.update_sandbox(
            row.id, from_states=[S.starting.value], state=S.failed.value, end_reason=EndReason.failed_start.value,
            ended_at=self.ctx.clock.now(), idempotency_key=None,
            error="the control plane stopped while creating it and the node never made it")

    async def stop_orphans(self, node: NodeRecord, statuses: list[NodeSandboxStatus],
                           rows: dict[str, SandboxRecord] | None = None) -> None:
        """A node runs sandboxes whose record has ended (declared lost while the node was away; a create that
        failed or timed out on our side after the node made it; killed while starting): stop them there.
        They were billed up to their recorded end and their owners were told they ended; nothing runs twice.
        A paused one whose checkpoint moved to another node (or whose sandbox ended) has its copy dropped.
        ``rows``: the records as read for this report (re-read here for the few that look orphaned)."""
        ctx = self.ctx
        for st in statuses:
            if st.state == S.paused:
                row = (rows or {}).get(st.id)
                if rows is not None and row is not None and row.node_id == node.id and row.state not in (
                        S.stopped.value, S.failed.value, S.lost.value):
                    continue
                row = await ctx.store.get_sandbox(st.id)
                if row is not None and row.state in IN_FLIGHT:
                    continue  # a resume elsewhere may still be copying this checkpoint: resume() drops it
                if row is None or row.node_id != node.id or SandboxState(row.state) in ENDED:
                    await ctx.quiet_forget(node, st.id, "a stale checkpoint")
                continue
            if st.state != S.running:
                continue
            row = (rows or {}).get(st.id)
            if rows is not None and row is not None and row.node_id == node.id \
                    and SandboxState(row.state) not in ENDED:
                continue
            if st.id in ctx.killed:
                continue     # this process stopped it there a moment ago: the report was composed before
            row = await ctx.store.get_sandbox(st.id)     # fresh: it may have changed since the report
            if row is None or (row.node_id == node.id and SandboxState(row.state) in ENDED) or (
                    row.node_id != node.id and row.state not in IN_FLIGHT):
                # ended here, or it belongs to another node (a restore here whose answer was lost): stop it
                await ctx.quiet_kill(node, st.id, "orphan sandbox ")
