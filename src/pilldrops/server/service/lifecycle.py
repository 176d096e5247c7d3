"""A sandbox's life from the API: create (idempotent, placed, admission-controlled), batch create, reads,
connect, set_timeout and kill.

A placement and its reservation are recorded in one database transaction with the node rows locked
(``Store.place_and_insert``), so racing creates (even from several control-plane processes) never
over-commit a node; the node is called only after that transaction.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import secrets
from collections.abc import Awaitable, Callable
from datetime import timedelta

import anyio

from pilldrops import errors
from pilldrops._internal.ids import new_id
from pilldrops.schema.api import (
    DEFAULT_DISK_MB,
    DEFAULT_MAX_DISK_MB,
    MAX_BATCH,
    BatchCreateRequest,
    BatchCreateResponse,
    BatchItem,
    CreateSandboxRequest,
    EndReason,
    ErrorInfo,
    KillItem,
    KillSandboxesRequest,
    KillSandboxesResponse,
    SandboxInfo,
    SandboxList,
    SandboxState,
)
from pilldrops.schema.node import NodeDeadline, NodeGrant, NodeSandboxStatus, network_key
from pilldrops.server import scheduler
from pilldrops.server.domain.states import ENDED, LIVE
from pilldrops.server.service import egress, isolation, placement
from pilldrops.server.service.context import SandboxContext, legal_from, log, outcome_unknown
from pilldrops.server.store.interface import (
    Allocations,
    DuplicateIdempotencyKey,
    Ended,
    EndSandbox,
    NewSandbox,
    NodeRecord,
    SandboxRecord,
)

S = SandboxState
ADMISSION = 32          # node creates in flight per control-plane process; the rest queue here
_REPLAY_WAIT_S = 60.0


def _error_info(exc: errors.PillDropsError) -> ErrorInfo:
    return ErrorInfo(code=exc.code, message=exc.message, details=exc.details)


class Lifecycle:
    def __init__(self, ctx: SandboxContext) -> None:
        self.ctx = ctx
        self.default_isolation = isolation.DEFAULT_ISOLATION   # `up/serve --default-isolation`
        self.default_disk_mb = DEFAULT_DISK_MB                  # `up/serve --default-disk-mb`
        self.max_disk_mb = DEFAULT_MAX_DISK_MB                  # `up/serve --max-disk-mb`
        self._place_lock = anyio.Lock()
        self._admission = anyio.Semaphore(ADMISSION)
        self._telling: set[asyncio.Task[None]] = set()         # claims the node is being told of

    # ---- views ---------------------------------------------------------------------------------------

    async def info(self, row: SandboxRecord, *, with_token: bool = False) -> SandboxInfo:
        node = await self.ctx.node(row.node_id) if with_token and row.node_id else None
        vcpu_s, gb_s, storage_gb_s, cost = self.ctx.billing.usage_of(row)
        return SandboxInfo(
            id=row.id, template=row.template, isolation=row.isolation, **egress.view(row.network),
            state=SandboxState(row.state), vcpu=row.vcpu,
            memory_mb=row.memory_mb, timeout=row.timeout, metadata=row.metadata_ or {}, node_id=row.node_id,
            disk_mb=row.disk_mb, disk_used_bytes=self._disk_used(row),
            created_at=row.created_at, started_at=row.started_at, end_at=row.end_at, ended_at=row.ended_at,
            end_reason=EndReason(row.end_reason) if row.end_reason else None, error=row.error,
            envd_url=node.url if node else None, access_token=row.access_token if with_token else None,
            vcpu_s=round(vcpu_s, 6), gb_s=round(gb_s, 6), storage_gb_s=round(storage_gb_s, 6),
            cost_usd=round(cost, 12), paused_at=row.paused_at, checkpoint_bytes=row.checkpoint_bytes,
            timeout_left=round(row.timeout_left, 3) if row.timeout_left is not None else None,
            public_ports=list(row.public_ports or []), public=bool(row.public),
        )

    def _disk_used(self, row: SandboxRecord) -> int | None:
        """Bytes in its writable layer at the node's last report (running sandboxes only)."""
        last = self.ctx.last_usage.get(row.id) if row.state == S.running.value else None
        return last[0].disk_used_bytes if last is not None else None

    def _check_disk(self, disk_mb: int, what: str) -> int:
        if disk_mb > self.max_disk_mb:
            raise errors.InvalidRequest(f"{what} {disk_mb} MiB is past this deployment's maximum of "
                                        f"{self.max_disk_mb} MiB", details={"field": "disk_mb", "disk_mb": disk_mb,
                                                                           "max_disk_mb": self.max_disk_mb})
        return disk_mb

    async def list(self, team_id: str, *, states: list[str], labels: dict[str, str], limit: int,
                   cursor: str | None) -> SandboxList:
        try:
            page = await self.ctx.store.list_sandboxes(team_id, states=states, labels=labels, limit=limit,
                                                       cursor=cursor)
        except ValueError as exc:
            raise errors.InvalidRequest(str(exc)) from exc
        return SandboxList(items=[await self.info(r) for r in page.items], next_cursor=page.next_cursor)

    async def connect(self, team_id: str, sandbox_id: str) -> SandboxRecord:
        row = await self.ctx.get_row(team_id, sandbox_id)
        if row.state != S.running.value:
            hint = "; resume it first (`pilldrops sandbox resume ID`, sb.resume())" if row.state == "paused" else ""
            if row.ended_at is not None:     # say why and when it ended: an ended sandbox never comes back
                reason = row.end_reason or row.state
                hint = f" ({reason} at {row.ended_at:%Y-%m-%d %H:%M:%S} UTC); an ended sandbox cannot come back"
            raise errors.InvalidState(f"sandbox {sandbox_id} is {row.state}, not running{hint}",
                                      current=row.state, target=S.running.value)
        return row

    # ---- create --------------------------------------------------------------------------------------

    async def create(self, team_id: str, req: CreateSandboxRequest,
                     idempotency_key: str | None = None) -> tuple[SandboxRecord, bool]:
        """Returns ``(row, created)``; ``created`` is False when an idempotent retry was replayed."""
        req_hash = hashlib.sha256(req.model_dump_json().encode()).hexdigest()
        made: list[str] = []         # the rows this call inserted (an error after its insert is its own)
        try:
            return await self._create(team_id, req, idempotency_key, req_hash, made)
        except errors.PillDropsError:
            # a create checks its key by its insert (the unique index), not by a read before it (a store
            # round trip on every create; the SDK sends a key with each): a retry refused before its insert
            # (no capacity or credits left now, perhaps because of its own first attempt) replays that one, and
            # one with another body is refused as a conflict, as before. An error after this call's own
            # insert (its node failed or timed out) is answered as such: the row is this call's, not an
            # earlier attempt's to replay
            if (replayed := await self._earlier(team_id, idempotency_key, req_hash, made)) is not None:
                return replayed, False
            raise

    async def _create(self, team_id: str, req: CreateSandboxRequest, idempotency_key: str | None,
                      req_hash: str, made: list[str]) -> tuple[SandboxRecord, bool]:
        ctx = self.ctx
        claimable = req.isolation in (None, "container") and req.disk_mb is None and ctx.grants.size() > 0
        if req.disk_mb is not None:
            self._check_disk(req.disk_mb, "disk_mb")
        await ctx.billing.check_can_create(team_id)
        now = ctx.clock.now()
        new = NewSandbox(
            id=new_id("sb"), team_id=team_id, template=req.template, vcpu=req.vcpu, memory_mb=req.memory_mb,
            timeout=req.timeout, state=S.starting.value, metadata=dict(req.metadata), envs=dict(req.envs),
            access_token=secrets.token_urlsafe(24), idempotency_key=idempotency_key, request_hash=req_hash,
            created_at=now, end_at=now + timedelta(seconds=req.timeout), public_ports=list(req.public_ports),
            public=req.public)
        specs = await ctx.pools.specs() if ctx.pools else []
        ref = await ctx.templates.current(req.template) if ctx.templates is not None else None
        new.template_version = ref.version if ref is not None else None
        if claimable:
            try:
                if (claimed := await self._claim(req, new, ref, made)) is not None:
                    return claimed, True
            except DuplicateIdempotencyKey:
                pass        # an earlier attempt holds the key: replayed below
            if (replayed := await self._earlier(team_id, idempotency_key, req_hash)) is not None:
                return replayed, False

        def choose(nodes: list[NodeRecord], allocs: Allocations) -> NodeRecord:
            # the mode: the request's, else the template's default (as the nodes report it), else the deployment's
            new.isolation = isolation.resolve(req.isolation, nodes, req.template, self.default_isolation,
                                              ref.isolation if ref is not None else None)
            # the disk: the request's, else the template's default, else the deployment's
            tpl_disk = ((ref.disk_mb if ref is not None else None) or isolation.template_disk_mb(nodes, req.template)
                        if req.disk_mb is None else None)
            new.disk_mb = req.disk_mb or (self._check_disk(tpl_disk, f"template {req.template}'s disk_mb")
                                          if tpl_disk else self.default_disk_mb)
            new.network = egress.resolve(req, nodes, new.isolation, ctx.egress,
                                         ref.network if ref is not None else None)
            want = scheduler.Request(req.template, req.vcpu, req.memory_mb, new.isolation,
                                     network_key(egress.node_network(new.network, ctx.egress)))
            return placement.for_create(want, nodes, allocs, specs, ctx.clock.now(), ref)

        async with self._place_lock:       # fewer lock waits in the database; correctness is its job
            try:
                node, row = await ctx.store.place_and_insert(new, choose)
                made.append(row.id)
                duplicate = False
            except DuplicateIdempotencyKey:
                duplicate = True
        if duplicate:   # a concurrent request with the same key won the insert: replay it (outside the lock)
            if (replayed := await self._earlier(team_id, idempotency_key, req_hash)) is not None:
                return replayed, False
            return await self._create(team_id, req, idempotency_key, req_hash, made)   # that one failed: a fresh one
        spec = ctx.node_spec(row, float(req.timeout), ref)
        ctx.node_cache.put(node.id, node)
        ctx.creating.add(row.id)           # heartbeats do not fail it as abandoned while it queues or boots
        try:
            async with self._admission:    # bursts queue here (in order) instead of piling onto the nodes
                status = await ctx.nodes.create(node.url, spec)
        except BaseException as exc:
            ctx.creating.discard(row.id)
            # the key is released so that a retry makes a fresh attempt instead of replaying a failure; if the
            # node did create it after all, its next heartbeat reports it running and it is stopped there
            with anyio.CancelScope(shield=True):
                await ctx.store.update_sandbox(
                    row.id, from_states=[S.starting.value], state=S.failed.value,
                    end_reason=EndReason.failed_start.value, ended_at=ctx.clock.now(), idempotency_key=None,
                    error=exc.message if isinstance(exc, errors.PillDropsError) else repr(exc))
            raise
        # billing starts when the node started it: now on the control plane's clock, or the node's own start
        # time when earlier (the answer can reach a busy, just restarted control plane seconds late), never
        # before the record was made (clock skew)
        started = ctx.clock.now()
        if status.started_at is not None:
            started = max(row.created_at, min(started, status.started_at))
        running = {"state": S.running.value, "started_at": started, "end_at": status.end_at or spec.end_at}
        updated = None
        try:
            if await ctx.store.set_sandbox(row.id, from_states=[S.starting.value], **running):
                for k, v in running.items():
                    setattr(row, k, v)
                updated = row
        finally:
            ctx.creating.discard(row.id)
        if updated is None and (now := await ctx.store.get_sandbox(row.id)) is not None \
                and now.state == S.running.value and now.node_id == node.id:
            updated = now      # a node report recorded its start first (it runs): the create succeeded
        if updated is None:
            # killed while it was starting: the node did not know it yet, so stop it there now
            with anyio.CancelScope(shield=True):
                await ctx.quiet_kill(node, row.id, "(killed while starting) ")
        return (updated or await ctx.get_row(team_id, row.id)), True

    # ---- warm claims from pre-issued grants (issue 15; failure analysis in ``service.claims``) ---------

    async def _claim(self, req: CreateSandboxRequest, new: NewSandbox, ref: object,
                     made: list[str]) -> SandboxRecord | None:
        """The create answered from a ready warm member a node pre-issued, with ONE store write; None when no
        grant fits (the regular path then places it, and may still claim an unreported member there)."""
        ctx = self.ctx                       # (members are containers with the template's default disk)
        version = str(ref.version) if ref is not None else None       # type: ignore[attr-defined]
        stored_isolation = getattr(ref, "isolation", None)

        def disk_of(node: NodeRecord) -> int:        # what a create of this template gets on that node
            return isolation.template_disk_mb([node], req.template) or self.default_disk_mb

        def fits(node_id: str, grant: NodeGrant) -> bool:   # the member's disk is the create's (None: not said)
            n = ctx.node_cache.get(node_id)
            return grant.disk_mb is None or n is None or grant.disk_mb == disk_of(n)

        skipped: list[tuple[str, NodeGrant]] = []    # of another disk (node not cached): offered again after
        try:
            return await self._claim_one(req, new, ref, version, stored_isolation, disk_of, fits, skipped, made)
        finally:
            for node_id, grant in skipped:
                ctx.grants.give_back(node_id, grant, req.template, req.vcpu, req.memory_mb)

    async def _claim_one(self, req: CreateSandboxRequest, new: NewSandbox, ref: object, version: str | None,
                         stored_isolation: str | None, disk_of: Callable[[NodeRecord], int],
                         fits: Callable[[str, NodeGrant], bool],
                         skipped: list[tuple[str, NodeGrant]], made: list[str]) -> SandboxRecord | None:
        ctx = self.ctx
        while (got := ctx.grants.pop(req.template, req.vcpu, req.memory_mb, version,
                                     lambda node_id: (n := ctx.node_cache.get(node_id)) is None
                                     or (n.state == "ready" and not n.draining), fits)) is not None:
            node_id, grant = got
            node = await ctx.node(node_id)
            if node is None or node.state != "ready" or node.draining:
                continue
            if grant.disk_mb is not None and grant.disk_mb != disk_of(node):
                skipped.append((node_id, grant))    # another disk than this create's: the regular path
                continue
            nodes = [node]
            now, claimed_mono = ctx.clock.now(), ctx.clock.monotonic()    # the claim: billed from here
            inserted = False
            try:           # a create refused here (or replayed) gives the grant back: no member is stranded
                iso = isolation.resolve(req.isolation, nodes, req.template, self.default_isolation,
                                        stored_isolation)
                if iso != "container":
                    return None
                tpl_disk = isolation.template_disk_mb(nodes, req.template)
                claim = dataclasses.replace(
                    new, id=grant.id, access_token=grant.access_token, state=S.running.value, isolation=iso,
                    disk_mb=self._check_disk(tpl_disk, f"template {req.template}'s disk_mb") if tpl_disk
                    else self.default_disk_mb, network=egress.resolve(req, nodes, iso, ctx.egress),
                    created_at=now, end_at=now + timedelta(seconds=req.timeout))
                policy = network_key(egress.node_network(claim.network, ctx.egress))
                if policy and ctx.pools is not None and any(
                        network_key(p.network) == policy and (p.template, p.vcpu, p.memory_mb) == (
                            req.template, req.vcpu, req.memory_mb) for p in await ctx.pools.specs()):
                    # a pool of this very egress policy exists for this shape: the node picks a member made
                    # with it (another policy takes this loopback member, its network attached at the tell)
                    return None
                row = await ctx.store.insert_claimed(claim, node.id, now)
                inserted = True
                if row is not None:
                    made.append(row.id)
            finally:
                if not inserted:
                    ctx.grants.give_back(node.id, grant, req.template, req.vcpu, req.memory_mb)
            if row is None:                  # its id is recorded: another control plane claimed this member
                ctx.grants.discard(grant.id)     # first, or an earlier claim of it ended; never tried again
                continue
            ctx.creating.add(row.id)
            if row.network is not None:      # its egress is attached by the node: answered once it is
                await self._tell(node, row, ref, claimed_mono, raise_=True)
            else:                            # the node is told right after the answer
                task = asyncio.get_running_loop().create_task(self._tell(node, row, ref, claimed_mono))
                self._telling.add(task)
                task.add_done_callback(self._telling.discard)
            return row
        return None

    async def _tell(self, node: NodeRecord, row: SandboxRecord, ref: object, claimed_mono: float | None = None,
                    raise_: bool = False) -> None:
        """Hand the claimed member over on its node (``create`` with the grant's id). The spec is made when
        it is sent: the deadline the record has left, and how long ago the claim was (``claimed_s``: this
        process's monotonic clock since ``claimed_mono``, else the wall clock since the record's
        ``started_at``), so the node's running seconds count from the claim however late it is told (billing
        starts at the claim; the member's pool time before it is never billed). A refusal ends the record
        ``failed`` (never billed: the node reported no running time); an unknown outcome is left to the
        node's next heartbeat (``Reconciler.reconcile_node`` tells it again, or ends the record)."""
        ctx = self.ctx
        try:
            now = ctx.clock.now()
            since = (ctx.clock.monotonic() - claimed_mono if claimed_mono is not None
                     else (now - (row.started_at or now)).total_seconds())
            left = max(1.0, ((row.end_at or now) - now).total_seconds())
            spec = ctx.node_spec(row, left, ref).model_copy(update={"claimed_s": max(0.0, since)})  # type: ignore[arg-type]
            await ctx.nodes.create(node.url, spec)
            ctx.told.add(row.id)
        except Exception as exc:
            if not outcome_unknown(exc):     # (the node retires the member; its grant is never offered again)
                log.warning("node %s refused pre-issued member %s: %s", node.name, row.id, exc)
                ctx.grants.discard(row.id)
                with anyio.CancelScope(shield=True):
                    await ctx.store.update_sandbox(
                        row.id, from_states=[S.running.value], state=S.failed.value,
                        end_reason=EndReason.failed_start.value, ended_at=row.started_at, idempotency_key=None,
                        error=exc.message if isinstance(exc, errors.PillDropsError) else repr(exc))
            if raise_:
                raise
        finally:
            ctx.creating.discard(row.id)

    async def resync_claim(self, node: NodeRecord, row: SandboxRecord) -> None:
        """A claim recorded whose node was never told (its control plane died in between; the node still
        lists the grant): tell it now, with the deadline the record has left."""
        ctx = self.ctx
        if row.id in ctx.creating or row.id in ctx.told:
            return       # being told, or told a moment ago (the heartbeat was composed before it)
        ctx.creating.add(row.id)
        try:
            ref = await ctx.template_ref(row)
        except BaseException:
            ctx.creating.discard(row.id)
            raise
        log.info("telling node %s of claimed member %s again (its create's control plane never did)",
                 node.name, row.id)
        await self._tell(node, row, ref)

    async def create_batch(self, team_id: str, req: BatchCreateRequest, idempotency_key: str | None = None,
                           disconnected: Callable[[], Awaitable[bool]] | None = None) -> BatchCreateResponse:
        """``count`` creates of one spec, each on its own: a full fleet makes an item wait (up to
        ``capacity_wait``) rather than fail, other errors fail only that item. Item ``i`` uses the
        idempotency key ``<key>:<i>``, so a retried batch replays the same sandboxes.

        At most ``ADMISSION`` items of one batch are being created at a time. ``disconnected`` (the
        client's connection, polled): once it says the client left, no further item starts (the waiting
        ones fail with ``client_gone``) and every sandbox the batch made is killed, its idempotency key
        released: nobody holds them, so nobody is billed for them (issue 16 item 6)."""
        items: list[BatchItem] = [BatchItem(index=i) for i in range(req.count)]
        await self.ctx.billing.check_can_create(team_id)       # a team without credits: one clear 402
        slots = anyio.Semaphore(ADMISSION)
        gone = anyio.Event()
        waiting: set[anyio.CancelScope] = set()

        async def wait_unless_gone(aw: Callable[[], Awaitable[object]]) -> bool:
            """Run ``aw`` (a wait: a slot, a back-off) unless the client leaves first; False if it left."""
            with anyio.CancelScope() as scope:
                waiting.add(scope)
                try:
                    if gone.is_set():
                        return False
                    await aw()
                finally:
                    waiting.discard(scope)
            return not scope.cancelled_caught and not gone.is_set()

        def left(i: int) -> None:
            items[i] = BatchItem(index=i, error=ErrorInfo(code="client_gone", message=(
                "the client of this batch disconnected before this item was created: not created")))

        async def one(i: int) -> None:
            if not await wait_unless_gone(slots.acquire):
                left(i)
                return
            try:
                await attempt(i)
            finally:
                slots.release()

        async def attempt(i: int) -> None:
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
                    if not await wait_unless_gone(lambda d=delay: anyio.sleep(d)):
                        left(i)
                        return
                    waited += delay
                    delay = min(delay * 2, 2.0)
                except errors.PillDropsError as exc:
                    items[i] = BatchItem(index=i, error=_error_info(exc))
                    return
                except Exception as exc:  # noqa: BLE001 - one item's failure never takes the others down
                    log.exception("batch item %d failed", i)
                    items[i] = BatchItem(index=i, error=ErrorInfo(code="internal", message=repr(exc)))
                    return

        async def watch(done: anyio.Event) -> None:
            while not done.is_set():
                with anyio.move_on_after(0.2):
                    await done.wait()
                if not done.is_set() and disconnected is not None and await disconnected():
                    gone.set()
                    for scope in list(waiting):
                        scope.cancel()
                    return

        done = anyio.Event()
        async with anyio.create_task_group() as outer:
            if disconnected is not None:
                outer.start_soon(watch, done)
            async with anyio.create_task_group() as tg:
                for i in range(req.count):
                    tg.start_soon(one, i)
            done.set()
        if gone.is_set():
            await self._drop_batch(team_id, items, idempotency_key)
        created = sum(1 for it in items if it.sandbox is not None)
        return BatchCreateResponse(items=items, created=created, failed=req.count - created)

    async def _drop_batch(self, team_id: str, items: list[BatchItem], key: str | None) -> None:
        """Kill what a batch whose client left made, unless a retry (same key) was handed it meanwhile: the
        key is released first (a compare-and-set against ``_replay``'s claim), so a later retry makes a
        fresh one and a sandbox a retry holds is never killed."""
        made = [(it.index, it.sandbox.id) for it in items if it.sandbox is not None]
        log.warning("batch client left: killing the %d sandboxes made for it", len(made))
        with anyio.CancelScope(shield=True):
            doomed = []
            for i, sid in made:
                if key and not await self.ctx.store.release_unclaimed_key(sid, f"{key}:{i}"):
                    log.info("%s of a left batch was handed to a retry: it stays", sid)
                    continue
                doomed.append(sid)
            if doomed:      # one node call per node, one store transaction (``kill_many``)
                res = await self.kill_many(team_id, KillSandboxesRequest(ids=doomed))
                for it in res.items:
                    if it.error is not None:
                        log.warning("could not kill %s of a left batch: %s", it.id, it.error.message)

    async def _earlier(self, team_id: str, key: str | None, req_hash: str,
                       made: list[str] | tuple[()] = ()) -> SandboxRecord | None:
        """The sandbox an earlier attempt with ``key`` made, handed out as its replay (``_replay``); None
        when there is none to hand out: no key, no row holds it, the row is one this call made itself
        (``made``), or that attempt failed to start and released the key."""
        if not key:
            return None
        existing = await self.ctx.store.sandbox_by_idempotency_key(team_id, key)
        if existing is None or existing.id in made:
            return None
        return await self._replay(existing, req_hash)

    async def _replay(self, row: SandboxRecord, req_hash: str) -> SandboxRecord | None:
        """The sandbox an earlier request with the same key made, once it is past ``starting``; None when that
        attempt failed to start and released the key (its node refused, or its control plane died before the
        node made it; or a batch whose client left released it to kill the sandbox), so that the caller makes
        a fresh attempt. Handing it out is a claim on it (``Store.claim_replay``)."""
        if row.request_hash != req_hash:
            raise errors.Conflict("Idempotency-Key was already used with a different request body",
                                  details={"sandbox_id": row.id})
        with anyio.move_on_after(_REPLAY_WAIT_S):
            while row.state == S.starting.value:   # the first attempt is still booting it
                await anyio.sleep(0.05)
                row = await self.ctx.get_row(row.team_id, row.id)
        key = row.idempotency_key
        if key is None or not await self.ctx.store.claim_replay(row.id, key, self.ctx.clock.now()):
            return None
        return row

    # ---- changes -------------------------------------------------------------------------------------

    async def set_timeout(self, team_id: str, sandbox_id: str, timeout: int) -> SandboxRecord:
        ctx = self.ctx
        row = await ctx.get_row(team_id, sandbox_id)
        if row.state == S.paused.value:        # paused time does not count: this is the time left after resume
            updated = await ctx.store.update_sandbox(row.id, from_states=[S.paused.value],
                                                     timeout_left=float(timeout), timeout=timeout)
            if updated is not None:
                return updated
        row = await self.connect(team_id, sandbox_id)
        end_at = ctx.clock.now() + timedelta(seconds=timeout)
        node = await ctx.node_for(row)
        status = await ctx.nodes.set_deadline(node.url, row.id, NodeDeadline(end_at=end_at, timeout_s=float(timeout)))
        updated = await ctx.store.update_sandbox(row.id, from_states=[S.running.value],
                                                 end_at=status.end_at or end_at, timeout=timeout)
        return updated or await ctx.get_row(team_id, sandbox_id)

    async def kill(self, team_id: str, sandbox_id: str, reason: EndReason = EndReason.killed) -> SandboxRecord:
        ctx = self.ctx
        row = await ctx.get_row(team_id, sandbox_id)
        if SandboxState(row.state) in ENDED:
            return row          # a lost one was billed up to the loss; a returning node's copy is stopped
        final: NodeSandboxStatus | None = None
        if row.node_id:
            node = await ctx.node_for(row)
            final = await ctx.nodes.kill(node.url, row.id)
        done = await self._end([(row.id, final)], reason)
        return done.rows.get(row.id) or row

    async def _end(self, finals: list[tuple[str, NodeSandboxStatus | None]], reason: EndReason) -> Ended:
        """Record these sandboxes as stopped, each with the node's final status (None: the node had no such
        sandbox, or it has no node), in ONE store transaction: the final usage billed before (with) the
        end, ``ended_at`` from the locked row (``Store.end_sandboxes``; a pause that completed meanwhile
        is closed there too)."""
        ends = []
        for sid, final in finals:
            why = reason
            if final is not None and final.end_reason not in (None, EndReason.killed):
                why = final.end_reason         # it had already ended on its own (OOM, exit, deadline)
            self.ctx.last_usage.pop(sid, None)
            self.ctx.killed.add(sid)           # its node answered the kill (or has no such sandbox)
            ends.append(EndSandbox(sid, S.stopped.value, why.value, final=final is not None,
                                   seq=final.seq if final is not None else None,
                                   run_s=final.run_s if final is not None else None))
        return await self.ctx.billing.end(ends, from_states=legal_from(S.stopped))

    async def kill_many(self, team_id: str, req: KillSandboxesRequest) -> KillSandboxesResponse:
        """Kill many sandboxes of ``team_id`` in one call (by ids, or every live one matching labels): one
        node call per node (concurrently), then one store transaction for all of them. An id that is not
        the team's is ``sandbox_not_found`` (as a single kill: no oracle of other teams' ids); an ended one
        answers its final record (idempotent); a node that fails fails only its own sandboxes."""
        ctx = self.ctx
        if (req.ids is None) == (req.labels is None):
            raise errors.InvalidRequest("give exactly one of ids or labels", details={"fields": ["ids", "labels"]})
        if req.ids is not None:
            if not req.ids:
                raise errors.InvalidRequest("ids is empty: name at least one sandbox", details={"field": "ids"})
            ids = list(dict.fromkeys(req.ids))
            found = await ctx.store.get_sandboxes(ids)
            rows = {sid: r for sid, r in found.items() if r.team_id == team_id}
        else:
            if not req.labels:
                raise errors.InvalidRequest("labels must name at least one key=value pair (to kill every live "
                                            "sandbox, list them first)", details={"field": "labels"})
            rows = await self._live_matching(team_id, req.labels)
            ids = list(rows)
        errs: dict[str, ErrorInfo] = {sid: ErrorInfo(code=errors.SandboxNotFound.code,
                                                    message=f"sandbox {sid!r} not found")
                                      for sid in ids if sid not in rows}
        live = [r for r in rows.values() if SandboxState(r.state) not in ENDED]
        by_node: dict[str, list[str]] = {}
        for r in live:
            by_node.setdefault(r.node_id or "", []).append(r.id)
        finals: dict[str, NodeSandboxStatus | None] = {sid: None for sid in by_node.pop("", [])}

        async def on_node(node_id: str, sids: list[str]) -> None:
            try:
                node = await ctx.node(node_id)
                if node is None:
                    raise errors.NodeUnavailable(f"node {node_id} of these sandboxes is not known")
                answers = await ctx.nodes.kill_many(node.url, sids)
            except errors.PillDropsError as exc:
                for sid in sids:
                    errs[sid] = _error_info(exc)
                return
            for sid in sids:
                got = answers.get(sid)
                if got is not None and got.error_code is not None:
                    errs[sid] = ErrorInfo(code=got.error_code, message=got.error or got.error_code)
                else:
                    finals[sid] = got.status if got is not None else None

        async with anyio.create_task_group() as tg:
            for node_id, sids in by_node.items():
                tg.start_soon(on_node, node_id, sids)
        done = await self._end(list(finals.items()), EndReason.killed) if finals else Ended()
        items: list[KillItem] = []
        for sid in ids:
            row = done.rows.get(sid) or rows.get(sid)
            if sid in errs or row is None:
                items.append(KillItem(id=sid, error=errs.get(sid)))
            else:
                items.append(KillItem(id=sid, sandbox=await self.info(row)))
        killed = sum(1 for it in items if it.sandbox is not None)
        return KillSandboxesResponse(items=items, killed=killed, failed=len(items) - killed)

    async def _live_matching(self, team_id: str, labels: dict[str, str]) -> dict[str, SandboxRecord]:
        rows: dict[str, SandboxRecord] = {}
        cursor = None
        while True:
            page = await self.ctx.store.list_sandboxes(team_id, states=[st.value for st in LIVE], labels=labels,
                                                       limit=1000, cursor=cursor)
            rows.update((r.id, r) for r in page.items)
            if page.next_cursor is None or len(rows) >= MAX_BATCH:
                return rows
            cursor = page.next_cursor
