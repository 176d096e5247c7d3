"""Sandbox use cases: create (idempotent, scheduled), get, list, connect, set_timeout, kill, node events.

Ordering rules kept here:
- a placement and its reservation are recorded in one database transaction with the node rows locked, so
  racing creates (even from several control-plane processes) never over-commit a node;
- no store transaction is held while a node is called;
- every state change is a compare-and-set from the states it is legal from (``domain.states``).
"""

from __future__ import annotations

import hashlib
import logging
import secrets
import time
from datetime import datetime, timedelta
from typing import Any

import anyio
import httpx

from pilldrops import errors
from pilldrops._internal.clock import Clock
from pilldrops._internal.ids import new_id
from pilldrops.schema.api import (
    BatchCreateRequest, BatchCreateResponse, BatchItem, CreateSandboxRequest, EndReason, ErrorInfo, SandboxInfo,
    SandboxList, SandboxState,
)
from pilldrops.schema.node import NodeDeadline, NodeResume, NodeSandboxSpec, NodeSandboxStatus
from pilldrops.server import scheduler
from pilldrops.server.domain.states import ENDED, TRANSITIONS
from pilldrops.server.nodes.client import NodeClient
from pilldrops.server.service.billing import BillingService
from pilldrops.server.service.pools import PoolService, shape
from pilldrops.server.store.models import Node, Sandbox
from pilldrops.server.store.sql import DuplicateIdempotencyKey, Store

S = SandboxState
log = logging.getLogger("pilldrops.sandboxes")
NODE_CACHE_S = 5.0
SETTLE_AFTER = timedelta(seconds=660)   # longer than any pause/resume request (node calls time out at 600 s)
ADMISSION = 32          # node creates in flight per control-plane process; the rest queue here
IN_FLIGHT = (S.pausing.value, S.resuming.value)     # a request is moving these; reconciliation leaves them
_REPLAY_WAIT_S = 60.0
NODE_READY_WINDOW = timedelta(seconds=30)


def _outcome_unknown(exc: BaseException) -> bool:
    """The node call may have been carried out (sent, but no answer came back)."""
    if not isinstance(exc, errors.NodeUnavailable):
        return False
    return not isinstance(exc.__cause__, (httpx.ConnectError, httpx.ConnectTimeout))


def _error_info(exc: errors.PillDropsError) -> ErrorInfo:
    return ErrorInfo(code=exc.code, message=exc.message, details=exc.details)


def _from(target: SandboxState) -> list[str]:
    """States from which ``target`` is a legal transition."""
    return [s.value for s, allowed in TRANSITIONS.items() if target in allowed]


class SandboxService:
    def __init__(self, store: Store, nodes: NodeClient, clock: Clock, billing: BillingService,
                 pools: PoolService | None = None) -> None:
        self.store = store
        self.nodes = nodes
        self.clock = clock
        self.billing = billing
        self.pools = pools
        self._place_lock = anyio.Lock()
        self._admission = anyio.Semaphore(ADMISSION)
        self._nodes: dict[str, tuple[float, Node]] = {}
        self._ops: set[str] = set()          # pauses/resumes this process is carrying out
        # the last usage report of each running sandbox (billed every commit_every_s): what is billed when
        # its node is lost before the next commit
        self._last: dict[str, NodeSandboxStatus] = {}

    # ---- views ---------------------------------------------------------------------------------------

    async def _node(self, node_id: str) -> Node | None:
        """A node's record, cached for a few seconds (used for its URL and name, which change only when
        it re-registers)."""
        hit = self._nodes.get(node_id)
        if hit is not None and time.monotonic() - hit[0] < NODE_CACHE_S:
            return hit[1]
        node = await self.store.get_node(node_id)
        if node is not None:
            self._nodes[node_id] = (time.monotonic(), node)
        return node

    def forget_node(self, node_id: str) -> None:
        self._nodes.pop(node_id, None)

    async def _node_url(self, node_id: str) -> str | None:
        node = await self._node(node_id)
        return node.url if node else None

    async def info(self, row: Sandbox, *, with_token: bool = False) -> SandboxInfo:
        envd_url = await self._node_url(row.node_id) if with_token and row.node_id else None
        vcpu_s, gb_s, storage_gb_s, cost = self.billing.usage_of(row)
        return SandboxInfo(
            id=row.id, template=row.template, state=SandboxState(row.state), vcpu=row.vcpu,
            memory_mb=row.memory_mb, timeout=row.timeout, metadata=row.metadata_ or {}, node_id=row.node_id,
            created_at=row.created_at, started_at=row.started_at, end_at=row.end_at, ended_at=row.ended_at,
            end_reason=EndReason(row.end_reason) if row.end_reason else None, error=row.error,
            envd_url=envd_url, access_token=row.access_token if with_token else None,
            vcpu_s=round(vcpu_s, 6), gb_s=round(gb_s, 6), storage_gb_s=round(storage_gb_s, 6),
            cost_usd=round(cost, 12), paused_at=row.paused_at, checkpoint_bytes=row.checkpoint_bytes,
            timeout_left=round(row.timeout_left, 3) if row.timeout_left is not None else None,
        )

    async def get_row(self, team_id: str, sandbox_id: str) -> Sandbox:
        row = await self.store.get_sandbox(sandbox_id, team_id)
        if row is None:
            raise errors.SandboxNotFound(f"sandbox {sandbox_id!r} not found")
        return row

    # ---- create --------------------------------------------------------------------------------------

    async def create(self, team_id: str, req: CreateSandboxRequest,
                     idempotency_key: str | None = None) -> tuple[Sandbox, bool]:
        """Returns ``(row, created)``; ``created`` is False when an idempotent retry was replayed."""
        req_hash = hashlib.sha256(req.model_dump_json().encode()).hexdigest()
        if idempotency_key:
            existing = await self.store.sandbox_by_idempotency_key(team_id, idempotency_key)
            if existing is not None:
                return await self._replay(existing, req_hash), False
        await self.billing.check_can_create(team_id)
        now = self.clock.now()
        row = Sandbox(
            id=new_id("sb"), team_id=team_id, template=req.template, vcpu=req.vcpu, memory_mb=req.memory_mb,
            timeout=req.timeout, state=S.starting.value, metadata_=dict(req.metadata), envs=dict(req.envs),
            access_token=secrets.token_urlsafe(24), idempotency_key=idempotency_key, request_hash=req_hash,
            created_at=now, end_at=now + timedelta(seconds=req.timeout),
        )
        specs = await self.pools.specs() if self.pools else []
        async with self._place_lock:       # fewer lock waits in the database; correctness is its job
            try:
                node = await self.store.place_and_insert(
                    row, lambda nodes, allocs: self._choose(req, nodes, allocs, specs))
                duplicate = False
            except DuplicateIdempotencyKey:
                duplicate = True
        if duplicate:   # a concurrent request with the same key won the insert: replay it (outside the lock)
            existing = await self.store.sandbox_by_idempotency_key(team_id, idempotency_key or "")
            assert existing is not None
            return await self._replay(existing, req_hash), False
        spec = self._node_spec(row, float(req.timeout))
        self._nodes[node.id] = (time.monotonic(), node)
        try:
            async with self._admission:    # bursts queue here (in order) instead of piling onto the nodes
                status = await self.nodes.create(node.url, spec)
        except BaseException as exc:
            # the key is released so that a retry makes a fresh attempt instead of replaying a failure; if the
            # node did create it after all, its next heartbeat reports it running and it is stopped there
            with anyio.CancelScope(shield=True):
                await self.store.update_sandbox(
                    row.id, from_states=[S.starting.value], state=S.failed.value,
                    end_reason=EndReason.failed_start.value, ended_at=self.clock.now(), idempotency_key=None,
                    error=exc.message if isinstance(exc, errors.PillDropsError) else repr(exc))
            raise
        running = dict(state=S.running.value, started_at=self.clock.now(), end_at=status.end_at or spec.end_at)
        updated = None      # billing starts now, on the control plane's clock
        if await self.store.set_sandbox(row.id, from_states=[S.starting.value], **running):
            for k, v in running.items():
                setattr(row, k, v)
            updated = row
        if updated is None:
            # killed while it was starting: the node did not know it yet, so stop it there now
            with anyio.CancelScope(shield=True):
                try:
                    await self.nodes.kill(node.url, row.id)
                except errors.PillDropsError as exc:
                    log.warning("could not stop %s, killed while starting: %s", row.id, exc)
        return (updated or await self.get_row(team_id, row.id)), True

    async def create_batch(self, team_id: str, req: BatchCreateRequest,
                           idempotency_key: str | None = None) -> BatchCreateResponse:
        """``count`` creates of one spec, each on its own: a full fleet makes an item wait (up to
        ``capacity_wait``) rather than fail, other errors fail only that item. Item ``i`` uses the
        idempotency key ``<key>:<i>``, so a retried batch replays the same sandboxes."""
        items: list[BatchItem] = [BatchItem(index=i) for i in range(req.count)]
        await self.billing.check_can_create(team_id)       # a team without credits: one clear 402

        async def one(i: int) -> None:
            key = f"{idempotency_key}:{i}" if idempotency_key else None
            waited, delay = 0.0, 0.05
            while True:
                try:
                    row, _ = await self.create(team_id, req.item_request(i), key)
                    items[i] = BatchItem(index=i, sandbox=await self.info(row, with_token=True))
                    return
                except errors.CapacityUnavailable as exc:
                    if waited >= req.capacity_wait:
                        items[i] = BatchItem(index=i, error=_error_info(exc))
                        return
                    await anyio.sleep(delay)
                    waited += delay
                    delay = min(delay * 2, 2.0)
                except errors.PillDropsError as exc:
                    items[i] = BatchItem(index=i, error=_error_info(exc))
                    return
                except Exception as exc:  # noqa: BLE001 - one item's failure never takes the others down
                    log.exception("batch item %d failed", i)
                    items[i] = BatchItem(index=i, error=ErrorInfo(code="internal", message=repr(exc)))
                    return

        async with anyio.create_task_group() as tg:
            for i in range(req.count):
                tg.start_soon(one, i)
        created = sum(1 for it in items if it.sandbox is not None)
        return BatchCreateResponse(items=items, created=created, failed=req.count - created)

    def _node_spec(self, row: Sandbox, timeout_s: float) -> NodeSandboxSpec:
        return NodeSandboxSpec(id=row.id, template=row.template, vcpu=row.vcpu, memory_mb=row.memory_mb,
                               end_at=self.clock.now() + timedelta(seconds=timeout_s), envs=row.envs,
                               access_token=row.access_token, team_id=row.team_id, timeout_s=timeout_s)

    def _choose(self, req: CreateSandboxRequest, nodes: list[Node], allocs: dict[str, tuple[float, int]],
                pool_specs: list[Any] = ()) -> Node:  # type: ignore[assignment]
        """Best fit by vCPU and memory, with warm pools' target sizes counted as used; a create of a pooled
        shape goes to a node with a ready member first (it converts that member's reservation)."""
        now = self.clock.now()
        if not any(req.template in {t.get("name") for t in n.templates} for n in nodes):
            known = sorted({t.get("name") for n in nodes for t in n.templates})
            raise errors.TemplateNotFound(
                f"template {req.template!r} is not built on any node (available: {', '.join(known) or 'none'}); "
                f"build it with `pilldrops template build {req.template}`")
        want = shape(req.template, req.vcpu, req.memory_mb)
        pooled = any(shape(p.template, p.vcpu, p.memory_mb) == want for p in pool_specs)
        views, warm = [], set()
        for n in nodes:
            names = frozenset(t.get("name") for t in n.templates)
            cpu = sum(p.size * p.vcpu for p in pool_specs if p.template in names)
            mem = sum(p.size * p.memory_mb for p in pool_specs if p.template in names)
            if pooled and req.template in names and PoolService.ready_on(n, *want) > 0:
                warm.add(n.id)
                cpu, mem = cpu - req.vcpu, mem - req.memory_mb      # the claim takes a reserved member
            used = allocs.get(n.id, (0.0, 0))
            views.append(scheduler.NodeView(
                id=n.id, capacity_vcpu=n.capacity_vcpu, capacity_memory_mb=n.capacity_memory_mb,
                used_vcpu=used[0] + cpu, used_memory_mb=used[1] + mem,
                ready=n.state == "ready" and now - n.last_heartbeat_at < NODE_READY_WINDOW, draining=n.draining,
                templates=names))
        request = scheduler.Request(req.template, req.vcpu, req.memory_mb)
        if warm:
            first = scheduler.place(request, [v for v in views if v.id in warm])
            if not isinstance(first, scheduler.Unschedulable):
                return next(n for n in nodes if n.id == first.node_id)
        result = scheduler.place(request, views)
        if isinstance(result, scheduler.Unschedulable):
            if result.never:
                raise errors.InvalidRequest(f"request is larger than any node ({result.explain()})",
                                            details={"reasons": result.reasons})
            raise errors.CapacityUnavailable(result.explain(), details={"reasons": result.reasons})
        return next(n for n in nodes if n.id == result.node_id)

    async def _replay(self, row: Sandbox, req_hash: str) -> Sandbox:
        if row.state == S.failed.value and row.idempotency_key is None:
            raise errors.ServerError(f"sandbox failed to start: {row.error}")
        if row.request_hash != req_hash:
            raise errors.Conflict("Idempotency-Key was already used with a different request body",
                                  details={"sandbox_id": row.id})
        with anyio.move_on_after(_REPLAY_WAIT_S):
            while row.state == S.starting.value:   # the first attempt is still booting it
                await anyio.sleep(0.05)
                row = await self.get_row(row.team_id, row.id)
        return row

    # ---- reads ---------------------------------------------------------------------------------------

    async def list(self, team_id: str, *, states: list[str], labels: dict[str, str], limit: int,
                   cursor: str | None) -> SandboxList:
        try:
            page = await self.store.list_sandboxes(team_id, states=states, labels=labels, limit=limit,
                                                   cursor=cursor)
        except ValueError as exc:
            raise errors.InvalidRequest(str(exc)) from exc
        return SandboxList(items=[await self.info(r) for r in page.items], next_cursor=page.next_cursor)

    async def connect(self, team_id: str, sandbox_id: str) -> Sandbox:
        row = await self.get_row(team_id, sandbox_id)
        if row.state != S.running.value:
            hint = "; resume it first (`pilldrops sandbox resume ID`, sb.resume())" if row.state == "paused" else ""
            raise errors.InvalidState(f"sandbox {sandbox_id} is {row.state}, not running{hint}",
                                      current=row.state, target=S.running.value)
        return row

    async def node_for(self, row: Sandbox) -> Node:
        node = await self._node(row.node_id or "")
        if node is None:
            raise errors.NodeUnavailable(f"sandbox {row.id} has no reachable node")
        return node

    # ---- changes -------------------------------------------------------------------------------------

    async def set_timeout(self, team_id: str, sandbox_id: str, timeout: int) -> Sandbox:
        row = await self.get_row(team_id, sandbox_id)
        if row.state == S.paused.value:        # paused time does not count: this is the time left after resume
            updated = await self.store.update_sandbox(row.id, from_states=[S.paused.value],
                                                      timeout_left=float(timeout), timeout=timeout)
            if updated is not None:
                return updated
        row = await self.connect(team_id, sandbox_id)
        end_at = self.clock.now() + timedelta(seconds=timeout)
        node = await self.node_for(row)
        status = await self.nodes.set_deadline(node.url, row.id, NodeDeadline(end_at=end_at, timeout_s=float(timeout)))
        updated = await self.store.update_sandbox(row.id, from_states=[S.running.value],
                                                  end_at=status.end_at or end_at, timeout=timeout)
        return updated or await self.get_row(team_id, sandbox_id)

    async def kill(self, team_id: str, sandbox_id: str, reason: EndReason = EndReason.killed) -> Sandbox:
        row = await self.get_row(team_id, sandbox_id)
        if SandboxState(row.state) in ENDED:
            return row          # a lost one was billed up to the loss; a returning node's copy is stopped
        final: NodeSandboxStatus | None = None
        if row.node_id:
            node = await self.node_for(row)
            final = await self.nodes.kill(node.url, row.id)
        now = self.clock.now()
        row = await self.get_row(team_id, sandbox_id)         # a pause may have completed meanwhile
        ended_at = now if row.paused_at is not None or final is None else self.billing.end_time(row, final)
        if final is not None and final.end_reason not in (None, EndReason.killed):
            reason = final.end_reason         # it had already ended on its own (OOM, exit, deadline)
        self._last.pop(row.id, None)
        if final is not None:       # billed before it shows as stopped: a stopped sandbox shows its final cost
            await self.billing.commit(final)
        ended = dict(state=S.stopped.value, end_reason=reason.value, ended_at=ended_at)
        updated = None
        if row.paused_at is None:       # the common case: no paused interval to close (checked in the update)
            updated = await self.store.update_sandbox(row.id, from_states=_from(S.stopped), not_paused=True, **ended)
        if updated is None:             # paused (maybe just now): the interval closes, storage billed with it
            updated = await self.billing.close_pause(row.id, from_states=_from(S.stopped), until=now,
                                                     resumed=False, **ended)
        return updated or (await self.get_row(team_id, sandbox_id) if final else row)

    # ---- pause / resume --------------------------------------------------------------------------------

    async def _move(self, row: Sandbox, src: S, via: S, target: S) -> Sandbox:
        """Compare-and-set ``src`` -> ``via``; anything else is a 409 naming the state it is in and the one
        asked for (of two concurrent requests exactly one passes)."""
        if row.state == src.value:
            moved = await self.store.update_sandbox(row.id, from_states=[src.value], state=via.value,
                                                    op_started_at=self.clock.now())
            if moved is not None:
                return moved
            row = await self.get_row(row.team_id, row.id)
        already = row.state in (target.value, via.value)
        raise errors.InvalidState(
            f"sandbox {row.id} is already {row.state} (asked for: {target.value})" if already else
            f"sandbox {row.id} is {row.state}, not {src.value}: it cannot go to {target.value}",
            current=row.state, target=target.value)

    async def pause(self, team_id: str, sandbox_id: str) -> Sandbox:
        """running -> pausing -> paused: the node checkpoints it to disk; it then holds no CPU or memory and
        bills storage only. Paused time does not count against its timeout."""
        self._ops.add(sandbox_id)          # before the state changes: our own heartbeats never settle it
        try:
            row = await self._move(await self.get_row(team_id, sandbox_id), S.running, S.pausing, S.paused)
            return await self._pause(team_id, row)
        finally:
            self._ops.discard(sandbox_id)

    async def _pause(self, team_id: str, row: Sandbox) -> Sandbox:
        sandbox_id = row.id
        try:
            node = await self.node_for(row)
            st = await self.nodes.pause(node.url, row.id)
        except BaseException as exc:
            if not _outcome_unknown(exc):
                with anyio.CancelScope(shield=True):   # the node's contract: a failed checkpoint leaves it running
                    await self.store.update_sandbox(row.id, from_states=[S.pausing.value], state=S.running.value)
            # else the node may have done it: it stays `pausing` until the node's reports settle it (_settle)
            raise
        if st.state in ENDED:                 # it ended on its own first (deadline, exit)
            await self.apply_node_status(node.id, st)
            return await self.get_row(team_id, sandbox_id)
        await self.billing.commit(st)         # running time up to the checkpoint
        now = self.clock.now()
        # the node's own count (same instant as its running seconds, its clock), else the record's deadline
        left = st.timeout_left if st.timeout_left is not None else max(0.0, ((row.end_at or now) - now).total_seconds())
        paused = await self.store.record_pause(row.id, paused_at=now, checkpoint_bytes=st.checkpoint_bytes or 0,
                                               timeout_left=left)
        if paused is None:
            current = await self.get_row(team_id, sandbox_id)
            if current.state == S.paused.value:   # another control plane recorded it from a heartbeat
                return current
            with anyio.CancelScope(shield=True):   # killed while pausing: drop the checkpoint too
                await self._quiet_kill(node, row.id)
            return await self.get_row(team_id, sandbox_id)
        return paused

    async def resume(self, team_id: str, sandbox_id: str) -> Sandbox:
        """paused -> resuming -> running, on its own node when it has room, else on another node with the
        template (the checkpoint moves there; the old node drops its copy and never runs it again)."""
        self._ops.add(sandbox_id)
        try:
            row = await self._move(await self.get_row(team_id, sandbox_id), S.paused, S.resuming, S.running)
            return await self._resume(team_id, row)
        finally:
            self._ops.discard(sandbox_id)

    async def _resume(self, team_id: str, row: Sandbox) -> Sandbox:
        sandbox_id = row.id
        old = await self.store.get_node(row.node_id or "")
        node: Node | None = None
        try:
            if old is None:
                raise errors.NodeUnavailable(f"the node holding {row.id}'s checkpoint is gone")
            node = await self.store.place_existing(row.id, S.resuming.value,
                                                   lambda nodes, allocs: self._choose_resume(row, nodes, allocs))
            if node is None:
                raise errors.InvalidState(f"sandbox {row.id} changed state while resuming",
                                          current=(await self.get_row(team_id, sandbox_id)).state, target="running")
            left = row.timeout_left if row.timeout_left is not None else float(row.timeout)
            body = NodeResume(spec=self._node_spec(row, max(left, 1.0)), run_s=row.billed_run_s,
                              timeout_s=max(left, 1.0), source_url=None if node.id == old.id else old.url)
            st = await self.nodes.resume(node.url, row.id, body)
        except BaseException as exc:
            moved = node is not None and old is not None and node.id != old.id
            if moved or not _outcome_unknown(exc):
                with anyio.CancelScope(shield=True):    # the checkpoint is intact where it was: still paused
                    if moved:
                        await self._quiet_kill(node, row.id)   # a restore there that we never heard of: stop it
                    await self.store.update_sandbox(row.id, from_states=[S.resuming.value], state=S.paused.value,
                                                    node_id=row.node_id)
            # else its own node may have restored it (and used up the image): `resuming` until settled
            raise
        now = self.clock.now()
        resumed = await self.billing.close_pause(
            row.id, from_states=[S.resuming.value], until=now, resumed=True, state=S.running.value,
            end_at=st.end_at or now + timedelta(seconds=body.timeout_s), timeout_left=None)
        with anyio.CancelScope(shield=True):
            if body.source_url and old is not None:      # moved: the old node forgets its copy
                try:
                    await self.nodes.forget(old.url, row.id)
                except errors.PillDropsError as exc:
                    log.warning("node %s keeps a stale checkpoint of %s (dropped at its next heartbeat): %s",
                                old.name, row.id, exc)
            if resumed is None:
                current = await self.get_row(team_id, sandbox_id)
                if current.state == S.running.value:     # another control plane saw it running first
                    return current
                await self._quiet_kill(node, row.id)     # killed while resuming: stop it where it now runs
                return await self.get_row(team_id, sandbox_id)
        return resumed

    def _choose_resume(self, row: Sandbox, nodes: list[Node], allocs: dict[str, tuple[float, int]]) -> Node:
        req = CreateSandboxRequest(template=row.template, vcpu=row.vcpu, memory_mb=row.memory_mb)
        own = [n for n in nodes if n.id == row.node_id]
        try:
            return self._choose(req, own, allocs)       # its own node first: no checkpoint to move
        except errors.PillDropsError:
            return self._choose(req, nodes, allocs)

    async def _quiet_kill(self, node: Node, sandbox_id: str) -> None:
        try:
            await self.nodes.kill(node.url, sandbox_id)
        except errors.PillDropsError as exc:
            log.warning("could not stop %s on %s: %s", sandbox_id, node.name, exc)

    async def expire_paused(self, retention_s: float) -> int:
        """Delete sandboxes paused for longer than the retention (``end_reason = paused_expired``)."""
        n = 0
        for row in await self.store.paused_before(self.clock.now() - timedelta(seconds=retention_s)):
            try:
                await self.kill(row.team_id, row.id, EndReason.paused_expired)
                n += 1
            except errors.PillDropsError as exc:
                log.warning("could not expire paused sandbox %s: %s", row.id, exc)
        return n

    async def absorb(self, node: Node, statuses: list[NodeSandboxStatus], received: datetime) -> None:
        """A node's full report (register or heartbeat), in a few queries whatever the number of sandboxes:
        steady running ones only have their usage committed (together, in one transaction); state changes
        take the per-sandbox path; then missing ones are reconciled and orphans stopped."""
        rows = await self.store.get_sandboxes(st.id for st in statuses)
        steady: list[NodeSandboxStatus] = []
        for st in statuses:
            row = rows.get(st.id)
            if row is not None and row.node_id == node.id and row.id not in self._ops \
                    and await self._settle(row, st):
                continue
            if row is not None and row.node_id == node.id and (
                    (row.state == S.running.value and st.state == S.running)
                    or (row.state in (S.paused.value, *IN_FLIGHT) and st.state == S.paused)):
                if st.state == S.running:
                    steady.append(st)
                    self._last[st.id] = st
                continue
            await self.apply_node_status(node.id, st, row)
        await self.billing.commit_running(steady, rows)
        await self.reconcile_node(node.id, {st.id for st in statuses}, received)
        await self.stop_orphans(node, statuses, rows)

    async def _settle(self, row: Sandbox, st: NodeSandboxStatus) -> bool:
        """A pause or resume whose request died with its control plane (or timed out after the node acted):
        once it has been in flight for ``SETTLE_AFTER`` (no live request takes that long; a stale report
        can never undo a live one), the node's report settles it. True when it did something."""
        now = self.clock.now()
        if row.state not in IN_FLIGHT or row.op_started_at is None or now - row.op_started_at < SETTLE_AFTER:
            return False
        if st.state == S.paused and row.state == S.pausing.value:          # the pause did happen
            await self.billing.commit(st)
            left = st.timeout_left if st.timeout_left is not None else max(
                0.0, ((row.end_at or now) - now).total_seconds())
            await self.store.record_pause(row.id, paused_at=now, checkpoint_bytes=st.checkpoint_bytes or 0,
                                          timeout_left=left)
            return True
        if st.state == S.running and row.state == S.pausing.value:         # it did not
            await self.store.update_sandbox(row.id, from_states=[S.pausing.value], state=S.running.value)
            return True
        if st.state == S.running and row.state == S.resuming.value:        # the resume did happen
            await self.billing.close_pause(row.id, from_states=[S.resuming.value], until=now, resumed=True,
                                           state=S.running.value, end_at=st.end_at or now, timeout_left=None)
            return True
        if st.state == S.paused and row.state == S.resuming.value:         # it did not: still paused here
            await self.store.update_sandbox(row.id, from_states=[S.resuming.value], state=S.paused.value)
            return True
        return False

    async def apply_node_status(self, node_id: str, st: NodeSandboxStatus, row: Sandbox | None = None) -> None:
        """A node reported on a sandbox: usage so far, or an end it saw on its own (deadline, exit, OOM)."""
        row = row or await self.store.get_sandbox(st.id)
        if row is None or row.node_id != node_id or SandboxState(row.state) in (S.lost, S.failed, S.stopped):
            return                           # ended rows stay as recorded; see stop_orphans
        if row.state == S.starting.value and st.state == S.running:
            # the control plane died (or timed out) while the node was creating it: it runs, so it is
            # running since the node says, and billed from then
            started = self.clock.now() - timedelta(seconds=max(st.run_s or 0.0, 0.0))
            await self.store.update_sandbox(st.id, from_states=[S.starting.value], state=S.running.value,
                                            started_at=max(started, row.created_at), end_at=st.end_at or row.end_at)
        await self.billing.commit(st)        # before the end is visible, so an ended sandbox shows its cost
        if st.state in ENDED:
            self._last.pop(st.id, None)
            now = self.clock.now()
            ended_at = now if row.paused_at is not None else self.billing.end_time(row, st)
            await self.billing.close_pause(
                st.id, from_states=_from(st.state), until=now, resumed=False, state=st.state.value,
                end_reason=(st.end_reason or EndReason.exited).value, ended_at=ended_at, error=st.error)

    async def mark_lost(self, node_id: str, last_seen: datetime) -> None:
        """The node is gone: its live sandboxes are ``lost`` (``node_lost``), ended and billed up to when
        the node was last heard from."""
        for row in await self.store.live_sandboxes_on(node_id):
            if (last := self._last.pop(row.id, None)) is not None:
                await self.billing.commit(last)
            ended_at = max(last_seen, row.started_at) if row.started_at else last_seen
            if row.paused_at is not None:
                ended_at = max(last_seen, row.paused_at)
            await self.billing.close_pause(row.id, from_states=_from(S.lost), until=ended_at, resumed=False,
                                           state=S.lost.value, end_reason=EndReason.node_lost.value,
                                           ended_at=ended_at, error="the node stopped heartbeating")

    async def stop_orphans(self, node: Node, statuses: list[NodeSandboxStatus],
                           rows: dict[str, Sandbox] | None = None) -> None:
        """A node runs sandboxes whose record has ended (declared lost while the node was away; a create that
        failed or timed out on our side after the node made it; killed while starting): stop them there.
        They were billed up to their recorded end and their owners were told they ended; nothing runs twice.
        ``rows``: the records as read for this report (re-read here for the few that look orphaned)."""
        for st in statuses:
            if st.state == S.paused:
                row = (rows or {}).get(st.id)
                if rows is not None and row is not None and row.node_id == node.id and row.state not in (
                        S.stopped.value, S.failed.value, S.lost.value):
                    continue
                row = await self.store.get_sandbox(st.id)
                if row is not None and row.state in IN_FLIGHT:
                    continue  # a resume elsewhere may still be copying this checkpoint: resume() drops it
                if row is None or row.node_id != node.id or SandboxState(row.state) in ENDED:
                    try:      # a checkpoint that moved to another node (or whose sandbox ended): drop it
                        await self.nodes.forget(node.url, st.id)
                    except errors.PillDropsError as exc:
                        log.warning("could not drop stale checkpoint %s on %s: %s", st.id, node.name, exc)
                continue
            if st.state != S.running:
                continue
            row = (rows or {}).get(st.id)
            if rows is not None and row is not None and row.node_id == node.id \
                    and SandboxState(row.state) not in ENDED:
                continue
            row = await self.store.get_sandbox(st.id)     # fresh: it may have changed since the report
            if row is None or (row.node_id == node.id and SandboxState(row.state) in ENDED) or (
                    row.node_id != node.id and row.state not in IN_FLIGHT):
                # ended here, or it belongs to another node (a restore here whose answer was lost): stop it
                try:
                    await self.nodes.kill(node.url, st.id)
                except errors.PillDropsError as exc:
                    log.warning("could not stop orphan sandbox %s on %s: %s", st.id, node.name, exc)

    async def reconcile_node(self, node_id: str, live_ids: set[str], received: datetime | None = None) -> None:
        """Sandboxes the store thinks run on a node that no longer has them are lost (with a grace period,
        from when the report was received, so a report composed before a create finished does not count)."""
        cutoff = (received or self.clock.now()) - NODE_READY_WINDOW
        for row in await self.store.live_sandboxes_on(node_id):
            if row.id in live_ids or row.created_at > cutoff or row.state in IN_FLIGHT:
                continue
            if (last := self._last.pop(row.id, None)) is not None:
                await self.billing.commit(last)
            now = self.clock.now()
            await self.billing.close_pause(row.id, from_states=_from(S.lost), until=now, resumed=False,
                                           state=S.lost.value, end_reason=EndReason.node_lost.value,
                                           ended_at=now, error="the node no longer has this sandbox")


