"""Aggregates of a batch of history records for charts (pure: no I/O, no clock — ``now`` is passed in).

- ``series``: the time from the batch's first start to its last end (or ``now`` for live ones) cut into
  equal buckets; per bucket the spend (each sandbox's compute cost spread evenly over its running
  intervals, its storage cost over its paused intervals) and the number of sandboxes running (time average
  and peak). Paused intervals are not running.
- ``histogram``: cost per sandbox in ``bins`` equal-width bins between the cheapest and the dearest.
- ``quantiles``: p50, p90, p99 and max of cost per sandbox (nearest rank).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from pilldrops.server.domain.billing import Rates

MIN_BUCKET_S = 1.0


@dataclass(frozen=True)
class Episode:
    """What the aggregates need of one history record."""

    started_at: datetime | None
    ended_at: datetime | None               # None while live
    cost_usd: float
    storage_gb_s: float = 0.0
    pauses: Sequence[tuple[datetime, datetime | None]] = ()   # (paused_at, resumed_at or None)


@dataclass
class Bucket:
    t: datetime
    spend_usd: float = 0.0
    running_avg: float = 0.0
    running_max: int = 0


@dataclass
class Stats:
    sandboxes: int
    cost_usd: float
    start: datetime | None
    end: datetime | None
    bucket_s: float
    series: list[Bucket] = field(default_factory=list)
    histogram: list[tuple[float, float, int]] = field(default_factory=list)   # (lo, hi, count)
    quantiles: dict[str, float] = field(default_factory=dict)


def _intervals(ep: Episode, now: datetime) -> tuple[list[tuple[datetime, datetime]], list[tuple[datetime, datetime]]]:
    """(running intervals, paused intervals) of a started episode."""
    assert ep.started_at is not None
    end = ep.ended_at or now
    running: list[tuple[datetime, datetime]] = []
    paused: list[tuple[datetime, datetime]] = []
    cur = ep.started_at
    for p_at, r_at in sorted(ep.pauses):
        p_end = min(r_at or end, end)
        if p_at > cur:
            running.append((cur, min(p_at, end)))
        if p_end > p_at:
            paused.append((p_at, p_end))
        cur = max(cur, p_end)
    if end > cur:
        running.append((cur, end))
    return running, paused


def _spread(acc: list[float], t0: datetime, width: float, a: datetime, b: datetime, amount: float,
            total_s: float) -> None:
    """Add ``amount × (overlap / total_s)`` of the interval [a, b) to each bucket of ``acc`` it overlaps."""
    lo, hi = (a - t0).total_seconds(), (b - t0).total_seconds()
    first, last = max(0, int(lo // width)), min(len(acc) - 1, int(hi // width))
    for i in range(first, last + 1):
        overlap = min(hi, (i + 1) * width) - max(lo, i * width)
        if overlap > 0:
            acc[i] += amount * overlap / total_s


def _peaks(buckets: list[Bucket], t0: datetime, width: float, running: list[tuple[datetime, datetime]]) -> None:
    """The most sandboxes running at once in each bucket (an end and a start at one instant do not overlap)."""
    events = sorted([((a - t0).total_seconds(), 1) for a, _ in running] +
                    [((b - t0).total_seconds(), -1) for _, b in running], key=lambda e: (e[0], e[1]))
    cur, j = 0, 0
    for i, bk in enumerate(buckets):
        start, edge = i * width, (i + 1) * width
        while j < len(events) and (events[j][0] < start or (events[j][0] <= start and events[j][1] < 0)):
            cur += events[j][1]        # everything before the bucket, and ends at its very start
            j += 1
        bk.running_max = cur
        while j < len(events) and events[j][0] < edge:
            cur += events[j][1]
            j += 1
            bk.running_max = max(bk.running_max, cur)


def quantile(sorted_values: Sequence[float], q: float) -> float:
    """Nearest-rank quantile of an ascending sequence (0 when empty)."""
    if not sorted_values:
        return 0.0
    rank = max(1, math.ceil(q * len(sorted_values)))
    return sorted_values[min(rank, len(sorted_values)) - 1]


def histogram(values: Sequence[float], bins: int) -> list[tuple[float, float, int]]:
    if not values:
        return []
    lo, hi = min(values), max(values)
    width = (hi - lo) / bins
    if width <= 0:          # all equal, or a spread too small to split (it underflows: 5e-324 / 20 == 0)
        return [(lo, hi, len(values))]
    counts = [0] * bins
    for v in values:
        counts[min(bins - 1, int((v - lo) / width))] += 1
    return [(lo + i * width, lo + (i + 1) * width, c) for i, c in enumerate(counts)]


def compute(episodes: Sequence[Episode], *, now: datetime, rates: Rates, buckets: int = 60,
            bins: int = 20) -> Stats:
    costs = sorted(e.cost_usd for e in episodes)
    started = [e for e in episodes if e.started_at is not None]
    stats = Stats(sandboxes=len(episodes), cost_usd=sum(costs), start=None, end=None, bucket_s=0.0,
                  histogram=histogram(costs, bins),
                  quantiles={"p50": quantile(costs, 0.5), "p90": quantile(costs, 0.9),
                             "p99": quantile(costs, 0.99), "max": costs[-1] if costs else 0.0})
    if not started:
        return stats
    t0 = min(e.started_at for e in started)  # type: ignore[type-var]
    t1 = max((e.ended_at or now) for e in started)
    span = max((t1 - t0).total_seconds(), MIN_BUCKET_S)
    width = max(span / buckets, MIN_BUCKET_S)
    n = max(1, min(buckets, math.ceil(span / width)))
    spend, running_s = [0.0] * n, [0.0] * n
    all_running: list[tuple[datetime, datetime]] = []
    for ep in started:
        running, paused = _intervals(ep, now)
        all_running += running
        storage_cost = min(ep.cost_usd, ep.storage_gb_s * rates.storage_gb_s_usd)
        if not running or not paused:                   # all of it where the time is
            storage_cost = ep.cost_usd if not running else 0.0
        run_s = sum((b - a).total_seconds() for a, b in running)
        pause_s = sum((b - a).total_seconds() for a, b in paused)
        for a, b in running:
            _spread(spend, t0, width, a, b, ep.cost_usd - storage_cost, run_s)
            _spread(running_s, t0, width, a, b, 1.0, 1.0)          # running seconds in each bucket
        for a, b in paused:
            _spread(spend, t0, width, a, b, storage_cost, pause_s)
        if not running and not paused:                  # started and ended in the same instant
            spend[min(n - 1, int((ep.started_at - t0).total_seconds() // width))] += ep.cost_usd  # type: ignore[operator]
    series = [Bucket(t=t0 + timedelta(seconds=i * width), spend_usd=spend[i], running_avg=running_s[i] / width)
              for i in range(n)]
    _peaks(series, t0, width, all_running)
    stats.start, stats.end, stats.bucket_s, stats.series = t0, t1, width, series
    return stats
