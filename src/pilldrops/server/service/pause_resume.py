"""Pause and resume: running -> pausing -> paused (the node checkpoints it to disk) and paused ->
resuming -> running (on its own node when it has room, else on another node with the template: the
checkpoint moves there). Also the expiry of sandboxes paused for longer than the retention.

A request that dies after the node acted leaves the sandbox ``pausing``/``resuming``; the node's
reports settle it later (``reconcile.Reconciler.settle``). This process's own in-flight requests are in
``ctx.in_flight``, so its heartbeats never settle them under it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta

import anyio

from pilldrops import errors
from pilldrops.schema.api import EndReason, SandboxState
from pilldrops.schema.node import NodeResume
from pilldrops.server import scheduler
from pilldrops.server.domain.states import ENDED
from pilldrops.server.service import placement
from pilldrops.server.service.context import SandboxContext, log, outcome_unknown, timeout_left
from pilldrops.server.service.lifecycle import Lifecycle
from pilldrops.server.service.reconcile import Reconciler
from pilldrops.server.store.interface import NodeRecord, SandboxRecord

S = SandboxState


class PauseResume:
    def __init__(self, ctx: SandboxContext, lifecycle: Lifecycle, reconciler: Reconciler) -> None:
        self.ctx = ctx
        self.lifecycle = lifecycle
        self.reconciler = reconciler

    @contextmanager
    def _carrying_out(self, sandbox_id: str) -> Iterator[None]:
        """This process is pausing/resuming it: from before its state changes until the request ends, so
        our own heartbeats never settle it under us."""
        self.ctx.in_flight.add(sandbox_id)
        try:
            yield
        finally:
            self.ctx.in_flight.discard(sandbox_id)

    async def _move(self, row: SandboxRecord, src: S, via: S, target: S) -> SandboxRecord:
        """Compare-and-set ``src`` -> ``via``; anything else is a 409 naming the state it is in and the one
        asked for (of two concurrent requests exactly one passes)."""
        if row.state == src.value:
            moved = await self.ctx.store.update_sandbox(row.id, from_states=[src.value], state=via.value,
                                                        op_started_at=self.ctx.clock.now())
            if moved is not None:
                return moved
            row = await self.ctx.get_row(row.team_id, row.id)
        already = row.state in (target.value, via.value)
        raise errors.InvalidState(
            f"sandbox {row.id} is already {row.state} (asked for: {target.value})" if already else
            f"sandbox {row.id} is {row.state}, not {src.value}: it cannot go to {target.value}",
            current=row.state, target=target.value)

    # ---- pause ---------------------------------------------------------------------------------------

    async def pause(self, team_id: str, sandbox_id: str) -> SandboxRecord:
        """running -> pausing -> paused: the node checkpoints it to disk; it then holds no CPU or memory and
        bills storage only. Paused time does not count against its timeout."""
        with self._carrying_out(sandbox_id):
            row = await self._move(await self.ctx.get_row(team_id, sandbox_id), S.running, S.pausing, S.paused)
            return await self._pause(team_id, row)

    async def _pause(self, team_id: str, row: SandboxRecord) -> SandboxRecord:
        ctx = self.ctx
        sandbox_id = row.id
        try:
            node = await ctx.node_for(row)
            st = await ctx.nodes.pause(node.url, row.id)
        except BaseException as exc:
            if not outcome_unknown(exc):
                with anyio.CancelScope(shield=True):   # the node's contract: a failed checkpoint leaves it running
                    await ctx.store.update_sandbox(row.id, from_states=[S.pausing.value], state=S.running.value)
            # else the node may have done it: it stays `pausing` until the node's reports settle it
            raise
        if st.state in ENDED:                 # it ended on its own first (deadline, exit)
            await self.reconciler.apply_node_status(node.id, st)
            return await ctx.get_row(team_id, sandbox_id)
        await ctx.billing.commit(st)          # running time up to the checkpoint
        now = ctx.clock.now()
        paused = await ctx.store.record_pause(row.id, paused_at=now, checkpoint_bytes=st.checkpoint_bytes or 0,
                                              timeout_left=timeout_left(row, st, now))
        if paused is None:
            current = await ctx.get_row(team_id, sandbox_id)
            if current.state == S.paused.value:   # another control plane recorded it from a heartbeat
                return current
            with anyio.CancelScope(shield=True):   # killed while pausing: drop the checkpoint too
                await ctx.quiet_kill(node, row.id)
            return await ctx.get_row(team_id, sandbox_id)
        return paused

    # ---- resume --------------------------------------------------------------------------------------

    async def resume(self, team_id: str, sandbox_id: str) -> SandboxRecord:
        """paused -> resuming -> running, on its own node when it has room, else on another node with the
        template (the checkpoint moves there; the old node drops its copy and never runs it again)."""
        with self._carrying_out(sandbox_id):
            row = await self._move(await self.ctx.get_row(team_id, sandbox_id), S.paused, S.resuming, S.running)
            return await self._resume(team_id, row)

    async def _resume(self, team_id: str, row: SandboxRecord) -> SandboxRecord:
        ctx = self.ctx
        sandbox_id = row.id
        old = await ctx.store.get_node(row.node_id or "")
        node: NodeRecord | None = None
        try:
            if old is None:
                raise errors.NodeUnavailable(f"the node holding {row.id}'s checkpoint is gone")
            specs = await ctx.pools.specs() if ctx.pools else []
            want = scheduler.Request(row.template, row.vcpu, row.memory_mb, row.isolation)
            ref = await ctx.template_ref(row)
            node = await ctx.store.place_existing(row.id, S.resuming.value, lambda nodes, allocs: placement.for_resume(
                want, row.node_id, nodes, allocs, specs, ctx.clock.now(), ref))
            if node is None:
                raise errors.InvalidState(f"sandbox {row.id} changed state while resuming",
                                          current=(await ctx.get_row(team_id, sandbox_id)).state, target="running")
            left = row.timeout_left if row.timeout_left is not None else float(row.timeout)
            body = NodeResume(spec=ctx.node_spec(row, max(left, 1.0), ref), run_s=row.billed_run_s,
                              timeout_s=max(left, 1.0), source_url=None if node.id == old.id else old.url)
            st = await ctx.nodes.resume(node.url, row.id, body)
        except BaseException as exc:
            moved = node is not None and old is not None and node.id != old.id
            if moved or not outcome_unknown(exc):
                with anyio.CancelScope(shield=True):    # the checkpoint is intact where it was: still paused
                    if moved:
                        await ctx.quiet_kill(node, row.id)   # a restore there that we never heard of: stop it
                    await ctx.store.update_sandbox(row.id, from_states=[S.resuming.value], state=S.paused.value,
                                                   node_id=row.node_id)
            # else its own node may have restored it (and used up the image): `resuming` until settled
            raise
        now = ctx.clock.now()
        resumed = await ctx.billing.end_interval(
            row.id, from_states=[S.resuming.value], until=now, resumed=True, state=S.running.value,
            end_at=st.end_at or now + timedelta(seconds=body.timeout_s), timeout_left=None)
        with anyio.CancelScope(shield=True):
            if body.source_url and old is not None:      # moved: the old node forgets its copy
                await ctx.quiet_forget(old, row.id, "a stale checkpoint (dropped at its next heartbeat)")
            if resumed is None:
                current = await ctx.get_row(team_id, sandbox_id)
                if current.state == S.running.value:     # another control plane saw it running first
                    return current
                await ctx.quiet_kill(node, row.id)       # killed while resuming: stop it where it now runs
                return await ctx.get_row(team_id, sandbox_id)
        return resumed

    # ---- retention -----------------------------------------------------------------------------------

    async def expire_paused(self, retention_s: float) -> int:
        """Delete sandboxes paused for longer than the retention (``end_reason = paused_expired``)."""
        n = 0
        for row in await self.ctx.store.paused_before(self.ctx.clock.now() - timedelta(seconds=retention_s)):
            try:
                await self.lifecycle.kill(row.team_id, row.id, EndReason.paused_expired)
                n += 1
            except errors.PillDropsError as exc:
                log.warning("could not expire paused sandbox %s: %s", row.id, exc)
        return n
