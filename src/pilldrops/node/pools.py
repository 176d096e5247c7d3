"""Warm pools on one node: per (template, vcpu, memory_mb), ``size`` ready sandboxes that a create of that
shape claims instead of booting one (issue 5).

- A member is a sandbox made exactly like a cold one (own overlay, cgroup, namespaces, machine-id and
  hostname) that belongs to nobody yet: no deadline, no journal entry, never billed (billing starts at
  the claim). A restarted agent reaps unclaimed members like any unrecorded container, then refills.
- A claim hands a member to exactly one sandbox and it never returns to the pool: when that sandbox ends
  its container is destroyed like any other, so nothing of one tenant reaches another.
- A pool is also one egress policy (issue 14 part 3): members of a pool with ``network`` are made with
  their network attached (``attach``: veth, rules, resolv.conf, keyed by the member's id), so a create of
  that shape and policy claims one with nothing to set up. A create with egress that no pool of its
  policy can serve falls back to the loopback-only pool of its shape (the agent attaches at the claim);
  a create without egress never gets a member with a network. A destroyed member's network goes with
  it (``release``).
- Refill keeps ``ready + starting == size`` with at most ``concurrency`` creates in flight across all
  pools (a burst of claims never becomes a burst of boots that starves cold creates), oldest deficit
  first. After ``BREAKER_FAILURES`` consecutive failed refills a pool's breaker opens: no refills for a
  back-off that doubles from 2 s up to 5 minutes, then one trial create (half-open) that closes it again
  on success.
- Grants (issue 15): each ready member of a loopback-only pool carries a pre-issued sandbox id and access
  token, sent to the control plane with the heartbeat (woken at once when a member becomes ready). A control
  plane answers a create of the shape from that grant (one store write) and then tells the node (a create
  with the grant's id): ``claim_grant``. Once a grant was reported it is only ever claimed by its id, never by
  an anonymous ``claim``, so no member is handed out twice; requests for a granted id that arrive before the
  node was told wait for it (``wait_granted``). A grant carries the member's ``disk_mb`` (the control plane
  claims it only for a create of that disk). A member whose hand-over is refused, or whose grant id is
  killed before it was handed over (its record ended first), is retired (``retire_grant``): it can never
  be handed to anyone else, so it does not sit in the pool for ever.
"""

from __future__ import annotations

import logging
import secrets
import time
import uuid
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import anyio

from pilldrops._internal.ids import new_id
from pilldrops.node.runtime.base import Handle, Runtime, SandboxSpec
from pilldrops.schema.node import NodeGrant, NodeNetwork, NodePoolSpec, NodePoolStatus, network_key

log = logging.getLogger("pilldrops.node.pools")
Key = tuple[str, float, int, str]       # shape and the members' ``network_key`` ("" loopback only)
BREAKER_FAILURES = 5
BACKOFF_MIN_S = 2.0
BACKOFF_MAX_S = 300.0
TICK_S = 1.0


def key_of(template: str, vcpu: float, memory_mb: int, network: NodeNetwork | None = None) -> Key:
    return (template, round(float(vcpu), 3), int(memory_mb), network_key(network))


def spec_key(spec: NodePoolSpec) -> Key:
    return key_of(spec.template, spec.vcpu, spec.memory_mb, spec.network)


@dataclass(frozen=True)
class Claim:
    handle: Handle
    network_attached: bool    # the member's egress (the create's policy) is attached under its id already
    ready_mono: float | None = None   # CLOCK_MONOTONIC when it became ready: its usage never counts from before


@dataclass
class Member:
    handle: Handle
    version: object          # the template build it was made from: a rebuilt template retires it
    grant: NodeGrant | None = None     # pre-issued id and token (loopback pools; set when it becomes ready)
    reported: bool = False             # its grant went to a control plane: only claim_grant may take it
    ready_mono: float = field(default_factory=time.monotonic)    # when it became ready (pool time from here)


@dataclass
class Pool:
    spec: NodePoolSpec
    ready: deque[Member] = field(default_factory=deque)
    starting: int = 0
    hits: int = 0
    misses: int = 0
    failures: int = 0
    open_until: float = 0.0            # breaker open until then (monotonic); 0 = closed
    backoff: float = BACKOFF_MIN_S
    last_error: str | None = None

    @property
    def breaker_open(self) -> bool:
        return self.failures >= BREAKER_FAILURES

    def status(self, grants: bool = False) -> NodePoolStatus:
        given = [m.grant for m in self.ready if m.grant is not None] if grants else []
        return NodePoolStatus(**self.spec.model_dump(), grants=given, ready=len(self.ready), starting=self.starting,
                              hits=self.hits, misses=self.misses, failures=self.failures,
                              breaker_open=self.breaker_open, last_error=self.last_error)


class WarmPools:
    """Owned by the node agent. ``make_spec(pool_spec, member_id)`` builds a member's runtime spec (or
    raises when the template is not built here); ``has_template(name)`` filters the fleet-wide config."""

    def __init__(self, runtime: Runtime, make_spec: Callable[[NodePoolSpec, str], SandboxSpec],
                 has_template: Callable[[str], bool], *, concurrency: int = 2,
                 template_version: Callable[[str], object] = lambda name: None,
                 attach: Callable[[Handle, NodeNetwork], Awaitable[object]] | None = None,
                 release: Callable[[str], Awaitable[None]] | None = None,
                 grant_version: Callable[[str], str | None] = lambda name: None,
                 on_ready: Callable[[], None] = lambda: None) -> None:
        self.runtime = runtime
        self.grant_version = grant_version      # the template-store version a member is of (grants carry it)
        self.on_ready = on_ready                # a member became ready: report its grant now
        self._granted: dict[str, tuple[Pool, Member]] = {}     # grant id -> its ready member
        self._claimed: dict[str, anyio.Event] = {}             # grant id -> set once claimed or gone
        self.attach = attach
        self.release = release
        self.make_spec = make_spec
        self.has_template = has_template
        self.template_version = template_version
        self.concurrency = max(1, concurrency)
        self.pools: dict[Key, Pool] = {}
        self.in_flight = 0
        self._wake = anyio.Event()
        self._closing = False
        self._tg: anyio.abc.TaskGroup | None = None
        self._retired: list[Handle] = []

    # ---- configuration and claims --------------------------------------------------------------------

    def configure(self, specs: list[NodePoolSpec]) -> None:
        """Apply the fleet's pool config (from the control plane). Removed or shrunk pools give their
        surplus members back (destroyed by the refill loop); counters of kept pools carry on."""
        wanted = {spec_key(s): s for s in specs if s.size > 0}
        for key, spec in wanted.items():
            pool = self.pools.get(key)
            if pool is None:
                self.pools[key] = Pool(spec)
            elif pool.spec.size != spec.size:
                pool.spec = spec
        for key, pool in self.pools.items():
            if key not in wanted:
                pool.spec = pool.spec.model_copy(update={"size": 0})
        self.wake()

    def claim(self, template: str, vcpu: float, memory_mb: int, network: NodeNetwork | None = None) -> Claim | None:
        """A ready member of this shape, now the caller's (never handed out twice), or None (a miss): one of
        the pool of ``network``'s policy (its network attached), else, for a create with egress, one of the
        loopback-only pool (the caller attaches the network)."""
        for key in dict.fromkeys([key_of(template, vcpu, memory_mb, network), key_of(template, vcpu, memory_mb)]):
            handle = self._take(key)      # an empty pool counts a miss, also when the fallback then hits
            if handle is not None:
                return Claim(handle, network_attached=key[3] != "")
        return None

    def _take(self, key: Key) -> Handle | None:
        pool = self.pools.get(key)
        if pool is None or pool.spec.size == 0:
            return None
        self.wake()
        current = self.template_version(pool.spec.template)
        for member in list(pool.ready):
            if member.reported:
                continue                            # promised to a control plane: claimed by its grant only
            self._drop(pool, member)
            if member.version == current:
                pool.hits += 1
                return member.handle
            self._retired.append(member.handle)     # made from an older build: destroyed by the loop
        pool.misses += 1
        return None

    def claim_grant(self, grant_id: str, template: str, vcpu: float, memory_mb: int) -> Claim | None:
        """The ready (loopback-only) member pre-issued as ``grant_id`` if it is of this shape and of the
        template's current build, now the caller's; None when no such grant is held here (issue 15)."""
        found = self._granted.get(grant_id)
        if found is None or found[0] is not self.pools.get(key_of(template, vcpu, memory_mb)):
            return None
        pool, member = found
        if member.version != self.template_version(template):
            return None
        self._drop(pool, member)
        pool.hits += 1
        self.wake()
        return Claim(member.handle, network_attached=False, ready_mono=member.ready_mono)

    def granted(self, grant_id: str) -> NodeGrant | None:
        """The grant ``grant_id`` while its member is still ready (unclaimed)."""
        found = self._granted.get(grant_id)
        return found[1].grant if found is not None else None

    def retire_grant(self, grant_id: str) -> bool:
        """The member pre-issued as ``grant_id`` will never be handed over (its hand-over was refused, or
        its record ended before the node was told): destroyed by the refill loop, which makes another one.
        False when no such member is ready here."""
        found = self._granted.get(grant_id)
        if found is None:
            return False
        pool, member = found
        self._drop(pool, member)
        self._retired.append(member.handle)
        self.wake()
        log.info("retired pre-issued member %s (grant %s): it will never be handed over", member.handle.id, grant_id)
        return True

    async def wait_granted(self, grant_id: str, timeout: float) -> None:
        """Until the member of ``grant_id`` was claimed or is gone (at most ``timeout`` seconds)."""
        ev = self._claimed.get(grant_id)
        if ev is not None:
            with anyio.move_on_after(timeout):
                await ev.wait()

    def _drop(self, pool: Pool, member: Member) -> None:
        """``member`` leaves the ready list (claimed, retired or destroyed): its grant with it."""
        try:
            pool.ready.remove(member)
        except ValueError:
            pass
        if member.grant is not None:
            self._granted.pop(member.grant.id, None)
            ev = self._claimed.pop(member.grant.id, None)
            if ev is not None:
                ev.set()

    def statuses(self, grants: bool = False) -> list[NodePoolStatus]:
        """Each pool's status; ``grants``: with the ready members' grants (for a heartbeat), which from now
        on are claimed by their id only."""
        out = [p.status(grants) for p in self.pools.values() if p.spec.size > 0 and self.has_template(p.spec.template)]
        if grants:
            for pool in self.pools.values():
                for m in pool.ready:
                    if m.grant is not None:
                        m.reported = True
        return out

    def reserved(self) -> tuple[float, int]:
        """(vCPU, MiB) the pools hold: their target size, whatever is ready right now."""
        pools = [p for p in self.pools.values() if self.has_template(p.spec.template)]
        return (sum(p.spec.size * p.spec.vcpu for p in pools), sum(p.spec.size * p.spec.memory_mb for p in pools))

    def wake(self) -> None:
        self._wake.set()

    # ---- refill loop ---------------------------------------------------------------------------------

    async def run(self) -> None:
        async with anyio.create_task_group() as tg:
            self._tg = tg
            while True:
                await self._reconcile(tg)
                with anyio.move_on_after(TICK_S):
                    await self._wake.wait()
                self._wake = anyio.Event()

    async def _reconcile(self, tg: anyio.abc.TaskGroup) -> None:
        while self._retired:
            await self._destroy(self._retired.pop())
        for key, pool in list(self.pools.items()):
            if not self.has_template(pool.spec.template):      # the template is gone from this node
                pool.spec = pool.spec.model_copy(update={"size": 0})
            current = self.template_version(pool.spec.template)
            for member in [m for m in pool.ready if m.version != current]:   # rebuilt: retire old members
                self._drop(pool, member)
                await self._destroy(member.handle)
            while len(pool.ready) > pool.spec.size:            # shrunk or removed: destroy the surplus
                member = pool.ready[-1]
                self._drop(pool, member)
                await self._destroy(member.handle)
            if pool.spec.size == 0 and pool.starting == 0 and not pool.ready:
                self.pools.pop(key, None)
        now = time.monotonic()
        for pool in sorted(self.pools.values(), key=lambda p: len(p.ready) + p.starting - p.spec.size):
            if not self.has_template(pool.spec.template):
                continue
            deficit = pool.spec.size - len(pool.ready) - pool.starting
            if pool.breaker_open:
                if now < pool.open_until or pool.starting:
                    continue
                deficit = min(deficit, 1)                      # half-open: one trial
            while deficit > 0 and self.in_flight < self.concurrency and not self._closing:
                pool.starting += 1
                self.in_flight += 1
                deficit -= 1
                tg.start_soon(self._refill_one, pool)

    async def _refill_one(self, pool: Pool) -> None:
        member_id = f"pd-{uuid.uuid4().hex[:16]}"
        handle: Handle | None = None
        version = self.template_version(pool.spec.template)
        disk_mb: int | None = None
        try:
            rt_spec = self.make_spec(pool.spec, member_id)
            disk_mb = rt_spec.disk_mb
            handle = await self.runtime.create(rt_spec)
            if pool.spec.network is not None:
                try:
                    if self.attach is None:
                        raise RuntimeError("this node gives warm-pool members no network")
                    await self.attach(handle, pool.spec.network)
                except BaseException:
                    await self._destroy(handle)
                    handle = None
                    raise
        except Exception as exc:  # noqa: BLE001 - any failure counts towards the breaker
            pool.failures += 1
            pool.last_error = str(exc)[:500]
            if pool.breaker_open:
                pool.open_until = time.monotonic() + pool.backoff
                log.warning("warm pool %s/%g/%d: %d failed refills, pausing refills for %.0f s: %s",
                            pool.spec.template, pool.spec.vcpu, pool.spec.memory_mb, pool.failures,
                            pool.backoff, exc)
                pool.backoff = min(pool.backoff * 2, BACKOFF_MAX_S)
        else:
            pool.failures, pool.backoff, pool.last_error = 0, BACKOFF_MIN_S, None
        finally:
            pool.starting -= 1
            self.in_flight -= 1
            self.wake()
        if handle is not None:
            current = self.pools.get(spec_key(pool.spec))
            if current is pool and len(pool.ready) < pool.spec.size and not self._closing \
                    and version == self.template_version(pool.spec.template):
                grant = (NodeGrant(id=new_id("sb"), access_token=secrets.token_urlsafe(24),
                                   template_version=self.grant_version(pool.spec.template), disk_mb=disk_mb)
                         if pool.spec.network is None else None)       # loopback pools are pre-issued
                member = Member(handle, version, grant)
                pool.ready.append(member)
                if grant is not None:
                    self._granted[grant.id] = (pool, member)
                    self._claimed[grant.id] = anyio.Event()
                    self.on_ready()
            else:
                await self._destroy(handle)

    async def _destroy(self, handle: Handle) -> None:
        with anyio.CancelScope(shield=True):
            try:
                await self.runtime.destroy(handle)
            except Exception:  # a restarted agent reaps it as unrecorded
                log.exception("destroying pool member %s failed", handle.id)
            if self.release is not None:
                try:
                    await self.release(handle.id)        # its veth, rules and slot (nothing if it had none)
                except Exception:  # a restarted agent releases records no sandbox explains
                    log.exception("releasing the network of pool member %s failed", handle.id)

    async def close(self) -> None:
        """Destroy every ready member (agent shutdown); refills in flight destroy theirs when they finish."""
        self._closing = True
        while self._retired:
            await self._destroy(self._retired.pop())
        for pool in list(self.pools.values()):       # the refill loop may drop emptied pools meanwhile
            while pool.ready:
                member = pool.ready[-1]
                self._drop(pool, member)
                await self._destroy(member.handle)
        with anyio.move_on_after(30):
            while self.in_flight:
                await anyio.sleep(0.02)
