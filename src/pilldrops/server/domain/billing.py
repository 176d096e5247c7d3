"""Pricing and metering rules (pure).

A sandbox is billed per second on what it was given: ``vcpu_s = vcpu × running s``, ``gb_s = memory GiB ×
running s`` (GiB = memory_mb / 1024), ``storage_gb_s`` only while paused. Running seconds come from the
node's monotonic clock, capped by the control plane's wall interval (``billable``): never negative, never
longer than the sandbox has existed.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

SECONDS_PER_MONTH = 30 * 24 * 3600


@dataclass(frozen=True)
class Rates:
    vcpu_s_usd: float = 0.0000140
    gb_s_usd: float = 0.0000045
    storage_gb_month_usd: float = 0.15

    @property
    def storage_gb_s_usd(self) -> float:
        return self.storage_gb_month_usd / SECONDS_PER_MONTH


@dataclass(frozen=True)
class Usage:
    vcpu_s: float = 0.0
    gb_s: float = 0.0
    storage_gb_s: float = 0.0

    def cost(self, rates: Rates) -> float:
        return (self.vcpu_s * rates.vcpu_s_usd + self.gb_s * rates.gb_s_usd
                + self.storage_gb_s * rates.storage_gb_s_usd)


def running_usage(vcpu: float, memory_mb: int, seconds: float) -> Usage:
    seconds = max(0.0, seconds)
    return Usage(vcpu_s=vcpu * seconds, gb_s=memory_mb / 1024 * seconds)


def storage_usage(checkpoint_bytes: int, seconds: float) -> Usage:
    """A paused sandbox bills its checkpoint's size (GiB) x paused seconds, nothing else."""
    return Usage(storage_gb_s=max(0, checkpoint_bytes) / 1024**3 * max(0.0, seconds))


def billable(reported_run_s: float, already_billed_s: float, wall_s: float) -> tuple[float, float]:
    """``(new_billed_total, delta)``: the node's cumulative running seconds, capped by the wall interval,
    minus what is already billed. Resends and out-of-order reports give a delta of 0."""
    total = max(already_billed_s, min(max(reported_run_s, 0.0), max(wall_s, 0.0)))
    return total, total - already_billed_s


def end_time(started_at: datetime | None, billed_run_s: float, paused_s: float | None, run_s: float | None,
             now: datetime) -> datetime:
    """When a sandbox whose node reports it ended ended, on the control plane's clock: its start + the
    node's final running seconds ``run_s`` (never less than what is billed) + its paused time, never after
    ``now`` (``now`` when nothing tells: not started, or no running seconds reported nor billed)."""
    if started_at is None or (run_s is None and billed_run_s == 0):
        return now
    ran = max(run_s if run_s is not None else 0.0, billed_run_s)
    return min(now, started_at + timedelta(seconds=ran + (paused_s or 0.0)))
