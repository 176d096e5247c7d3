"""``GET /v1/history/stats``: the history records of a filter (the same filters as ``/v1/history``), paged
through the billing service, reduced to chart-ready aggregates by ``domain.stats``. At most
``MAX_RECORDS`` of the newest matching records are aggregated (``truncated`` says when more matched)."""

from __future__ import annotations

from datetime import datetime

from pilldrops.schema.stats import HistogramBin, HistoryStats, SeriesPoint
from pilldrops.server.domain import stats as agg
from pilldrops.server.service.billing import BillingService

MAX_RECORDS = 20_000
PAGE = 1000


async def history_stats(billing: BillingService, team_id: str, *, since: datetime | None, until: datetime | None,
                        states: list[str], template: str | None, labels: dict[str, str], buckets: int,
                        bins: int) -> HistoryStats:
    episodes: list[agg.Episode] = []
    cursor: str | None = None
    truncated = False
    while True:
        page = await billing.history(team_id, since=since, until=until, states=states, template=template,
                                     labels=labels, limit=PAGE, cursor=cursor)
        episodes += [agg.Episode(started_at=r.started_at, ended_at=r.ended_at, cost_usd=r.cost_usd,
                                 storage_gb_s=r.storage_gb_s,
                                 pauses=[(p.paused_at, p.resumed_at) for p in r.pauses]) for r in page.items]
        cursor = page.next_cursor
        if not cursor:
            break
        if len(episodes) >= MAX_RECORDS:
            truncated = True
            break
    s = agg.compute(episodes, now=billing.clock.now(), rates=billing.settings.rates, buckets=buckets, bins=bins)
    return HistoryStats(
        sandboxes=s.sandboxes, truncated=truncated, cost_usd=round(s.cost_usd, 12),
        mean_cost_usd=round(s.cost_usd / s.sandboxes, 12) if s.sandboxes else 0.0, since=since, until=until,
        start=s.start, end=s.end, bucket_s=s.bucket_s,
        series=[SeriesPoint(t=b.t, spend_usd=round(b.spend_usd, 12), running_avg=round(b.running_avg, 4),
                            running_max=b.running_max) for b in s.series],
        cost_histogram=[HistogramBin(lo=lo, hi=hi, count=c) for lo, hi, c in s.histogram],
        cost_quantiles=s.quantiles)
