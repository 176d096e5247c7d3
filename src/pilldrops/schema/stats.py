"""Wire models of ``GET /v1/history/stats``: chart-ready aggregates of a filtered batch of the history."""

from __future__ import annotations

from datetime import datetime

from pydantic import BaseModel, ConfigDict, Field


class _Response(BaseModel):
    model_config = ConfigDict(extra="ignore")


class SeriesPoint(_Response):
    t: datetime = Field(..., description="start of the bucket")
    spend_usd: float = Field(..., description="cost accrued in the bucket")
    running_avg: float = Field(..., description="sandboxes running, averaged over the bucket")
    running_max: int = Field(..., description="most sandboxes running at once in the bucket")


class HistogramBin(_Response):
    lo: float
    hi: float
    count: int


class HistoryStats(_Response):
    sandboxes: int = Field(..., description="records aggregated")
    truncated: bool = Field(False, description="more records matched than were aggregated (the newest are kept)")
    cost_usd: float
    mean_cost_usd: float
    since: datetime | None = None
    until: datetime | None = None
    start: datetime | None = Field(None, description="first start in the batch")
    end: datetime | None = Field(None, description="last end in the batch (now while some still run)")
    bucket_s: float
    series: list[SeriesPoint]
    cost_histogram: list[HistogramBin]
    cost_quantiles: dict[str, float] = Field(..., description="p50, p90, p99, max of cost per sandbox")
