"""Billing: committing node usage reports, credits, the usage history and period totals.

- Nodes report each sandbox's cumulative running seconds (monotonic) with a sequence number that only
  grows; ``commit`` turns a report into a ledger row exactly once (see ``Store.commit_usage``).
- Start and end times come from the control plane's clock; an ended sandbox's ``ended_at`` is its start
  plus the node's final running seconds plus the time it spent paused (never later than when we learnt
  of it), so billed running seconds equal the sandbox's lifetime outside its pauses.
- Paused intervals bill storage only, once, when they end (``end_interval``: resume, kill, loss, expiry).
- Credits: a new team starts with ``initial_credits``; at zero creates are refused (402) and, after
  ``grace_s``, its live sandboxes (paused ones included) are stopped with ``end_reason = credits_exhausted``.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta

import anyio

from pilldrops import errors
from pilldrops._internal.clock import Clock, TTLCache
from pilldrops.schema.api import (
    EndReason,
    HistoryPage,
    HistoryRecord,
    PauseInterval,
    SandboxState,
    UsageSummary,
)
from pilldrops.schema.node import NodeSandboxStatus
from pilldrops.server.domain.billing import Rates, end_time, running_usage, storage_usage
from pilldrops.server.domain.states import LIVE
from pilldrops.server.service.egress import view as egress_view
from pilldrops.server.store.interface import Ended, EndSandbox, PauseRecord, SandboxRecord, Store, UsageRecord

log = logging.getLogger("pilldrops.billing")
CREDITS_CACHE_S = 1.0
FAULT_ENV = "PILLDROPS_FAULT_CRASH_BEFORE_USAGE_COMMIT"   # test hook: os._exit on the N-th usage commit


@dataclass(frozen=True)
class BillingSettings:
    rates: Rates = field(default_factory=Rates)
    credits_enabled: bool = True
    initial_credits: float = 5.0
    grace_s: float = 60.0
    enforce_every_s: float = 1.0
    # running sandboxes are billed at most this often from heartbeats (always at pause and end); their
    # cost in views is accrued from the clock in between
    commit_every_s: float = 30.0


def _fault_hook() -> Callable[[], None] | None:
    """Crash between computing a usage commit and committing it (for the exactly-once test)."""
    raw = os.environ.get(FAULT_ENV)
    if not raw:
        return None
    remaining = [int(raw)]

    def hook() -> None:
        remaining[0] -= 1
        if remaining[0] <= 0:
            log.error("fault injection: exiting before a usage commit")
            os._exit(137)

    return hook


class BillingService:
    def __init__(self, store: Store, clock: Clock, settings: BillingSettings | None = None) -> None:
        self.store = store
        self.clock = clock
        self.settings = settings or BillingSettings()
        self._before_commit = _fault_hook()
        self._balances: TTLCache[str, float] = clock.ttl_cache(CREDITS_CACHE_S)    # team -> balance

    # ---- metering ------------------------------------------------------------------------------------

    def end_time(self, row: SandboxRecord, st: NodeSandboxStatus) -> datetime:
        """When an ended sandbox ended, on the control plane's clock: start + the node's running seconds."""
        return end_time(row.started_at, row.billed_run_s, row.paused_s, st.run_s, self.clock.now())

    async def commit_running(self, reports: list[NodeSandboxStatus], rows: dict[str, SandboxRecord]) -> None:
        """Usage of running sandboxes from one heartbeat, in one transaction; a sandbox is billed once
        ``commit_every_s`` of new running time has accrued (its end and pauses are billed at once)."""
        due = [(st.id, st.seq, st.run_s) for st in reports
               if st.run_s is not None and st.seq is not None and st.id in rows
               and st.seq > rows[st.id].billed_seq
               and st.run_s - rows[st.id].billed_run_s >= self.settings.commit_every_s]
        entries = await self.store.commit_usage_many(due, now=self.clock.now(), rates=self.settings.rates,  # type: ignore[arg-type]
                                           charge_credits=self.settings.credits_enabled,
                                           before_commit=self._before_commit)
        self._charged(entries)

    def _charged(self, entries: list[UsageRecord]) -> None:
        for e in entries:
            self._balances.adjust(e.team_id, lambda balance, cost=e.cost_usd: balance - cost)

    async def commit(self, st: NodeSandboxStatus) -> None:
        if st.run_s is None or st.seq is None:
            return
        entry = await self.store.commit_usage(st.id, st.seq, st.run_s, now=self.clock.now(),
                                              rates=self.settings.rates, charge_credits=self.settings.credits_enabled,
                                              before_commit=self._before_commit)
        self._charged([entry] if entry else [])

    async def end(self, ends: list[EndSandbox], *, from_states: list[str]) -> Ended:
        """End these sandboxes in one transaction, their final usage billed and ``ended_at`` computed
        from the locked rows (``Store.end_sandboxes``)."""
        done = await self.store.end_sandboxes(ends, from_states=from_states, now=self.clock.now(),
                                              rates=self.settings.rates,
                                              charge_credits=self.settings.credits_enabled,
                                              before_commit=self._before_commit)
        self._charged(done.entries)
        if done.storage_charged:
            self._balances.clear()        # storage charged: read balances afresh
        return done

    async def end_interval(self, sandbox_id: str, *, from_states: list[str], until: datetime, resumed: bool,
                           **values: object) -> SandboxRecord | None:
        """Move the sandbox to ``values`` (its new state) and end its billing interval at ``until``: an open
        paused interval's storage is billed exactly once, in the same transaction (``Store.end_interval``)."""
        self._balances.clear()        # storage charged: read balances afresh
        return await self.store.end_interval(sandbox_id, from_states=from_states, until=until,
                                            rates=self.settings.rates, charge_credits=self.settings.credits_enabled,
                                            resumed=resumed, **values)

    # ---- credits -------------------------------------------------------------------------------------

    async def check_can_create(self, team_id: str) -> None:
        if not self.settings.credits_enabled:
            return
        seen = self._balances.get(team_id)
        if seen is not None and seen > 0:
            return       # a positive balance read just now, minus what this process charged since
        team = await self.store.get_team(team_id)
        if team is not None:
            self._balances.put(team_id, team.credits_usd)
        if team is not None and team.credits_usd <= 0:
            raise errors.InsufficientCredits(
                f"team {team.name!r} has no credits left (balance ${team.credits_usd:.6f}); new sandboxes are "
                f"refused until credits are added: `pilldrops credits add {team.name} 10` on the control "
                "plane's host (or run it with --unlimited-credits)",
                details={"credits_usd": team.credits_usd, "team": team.name,
                         "fix": f"pilldrops credits add {team.name} 10"})

    async def enforce_credits(self, stop: Callable[[str, str], Awaitable[object]]) -> int:
        """Stop the running sandboxes of teams whose credits ran out more than ``grace_s`` ago."""
        if not self.settings.credits_enabled:
            return 0
        before = self.clock.now() - timedelta(seconds=self.settings.grace_s)
        stopped = 0
        for team in await self.store.exhausted_teams(before):
            page = await self.store.list_sandboxes(team.id, states=[s.value for s in LIVE], limit=1000)
            for row in page.items:
                try:
                    await stop(team.id, row.id)
                    stopped += 1
                except errors.PillDropsError as exc:
                    log.warning("could not stop %s of exhausted team %s: %s", row.id, team.id, exc)
        return stopped

    async def run_enforcer(self, stop: Callable[[str, str], Awaitable[object]]) -> None:
        while True:
            try:
                await self.enforce_credits(stop)
            except Exception:  # a store outage must not kill the loop (nor reap anything)
                log.exception("credit enforcement pass failed")
            await anyio.sleep(self.settings.enforce_every_s)

    # ---- views ---------------------------------------------------------------------------------------

    def usage_of(self, row: SandboxRecord) -> tuple[float, float, float, float]:
        """(vcpu_s, gb_s, storage_gb_s, cost_usd): committed for ended sandboxes, accrued so far for live
        ones (the wall time since start, or what was committed if that is more)."""
        if SandboxState(row.state) in LIVE and row.started_at is not None:
            now = self.clock.now()
            paused_now = (now - row.paused_at).total_seconds() if row.paused_at is not None else 0.0
            running = (now - row.started_at).total_seconds() - (row.paused_s or 0.0) - paused_now
            so_far = running_usage(row.vcpu, row.memory_mb, running)
            vcpu_s, gb_s = max(so_far.vcpu_s, row.vcpu_s), max(so_far.gb_s, row.gb_s)
            storage = storage_usage(row.checkpoint_bytes or 0, paused_now)
            rates = self.settings.rates
            extra = ((vcpu_s - row.vcpu_s) * rates.vcpu_s_usd + (gb_s - row.gb_s) * rates.gb_s_usd
                     + storage.cost(rates))
            return vcpu_s, gb_s, row.storage_gb_s + storage.storage_gb_s, row.cost_usd + extra
        return row.vcpu_s, row.gb_s, row.storage_gb_s, row.cost_usd

    def record(self, row: SandboxRecord, pauses: list[PauseRecord] | None = None) -> HistoryRecord:
        vcpu_s, gb_s, storage_gb_s, cost = self.usage_of(row)
        intervals = [PauseInterval(paused_at=p.paused_at, resumed_at=p.resumed_at, checkpoint_bytes=p.checkpoint_bytes,
                                   storage_gb_s=round(self._pause_storage(row, p), 6)) for p in pauses or []]
        return HistoryRecord(id=row.id, template=row.template, isolation=row.isolation, **egress_view(row.network),
                             vcpu=row.vcpu,
                             memory_mb=row.memory_mb,
                             vcpu_s=round(vcpu_s, 6), gb_s=round(gb_s, 6), storage_gb_s=round(storage_gb_s, 6),
                             cost_usd=round(cost, 12), started_at=row.started_at, ended_at=row.ended_at,
                             state=SandboxState(row.state),
                             end_reason=EndReason(row.end_reason) if row.end_reason else None,
                             metadata=row.metadata_ or {}, pauses=intervals)

    def _pause_storage(self, row: SandboxRecord, p: PauseRecord) -> float:
        """A closed interval's billed storage, or what the open one (the current pause) has accrued."""
        if p.resumed_at is None and row.paused_at == p.paused_at:
            return storage_usage(p.checkpoint_bytes, (self.clock.now() - p.paused_at).total_seconds()).storage_gb_s
        return p.storage_gb_s

    async def history(self, team_id: str, *, since: datetime | None, until: datetime | None, states: list[str],
                      template: str | None, labels: dict[str, str], limit: int, cursor: str | None) -> HistoryPage:
        try:
            page = await self.store.list_sandboxes(team_id, states=states, labels=labels, limit=limit,
                                                   cursor=cursor, template=template, since=since, until=until)
        except ValueError as exc:
            raise errors.InvalidRequest(str(exc)) from exc
        pauses = await self.store.pauses_of(r.id for r in page.items if r.pause_count)
        return HistoryPage(items=[self.record(r, pauses.get(r.id)) for r in page.items], next_cursor=page.next_cursor)

    async def usage(self, team_id: str, since: datetime | None, until: datetime | None) -> UsageSummary:
        n, vcpu_s, gb_s, storage_gb_s, cost = await self.store.usage_totals(team_id, since, until)
        team = await self.store.get_team(team_id)
        enabled = self.settings.credits_enabled
        return UsageSummary(team_id=team_id, since=since, until=until, sandboxes=n, vcpu_s=round(vcpu_s, 6),
                            gb_s=round(gb_s, 6), storage_gb_s=round(storage_gb_s, 6), cost_usd=round(cost, 12),
                            credits_usd=round(team.credits_usd, 12) if enabled and team else None,
                            credits_unlimited=not enabled)
