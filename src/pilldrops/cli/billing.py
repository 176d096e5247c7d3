"""``pilldrops history`` and ``pilldrops usage``: what the team's sandboxes used and cost, and credits left."""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime
from typing import Any

import click
from rich.markup import escape

from pilldrops._internal.timeparse import parse_time
from pilldrops.cli import _output
from pilldrops.cli.main import CliState
from pilldrops.schema.api import HistoryRecord, SandboxState, UsageSummary
from pilldrops.sdk._sync.sandbox import Sandbox

pass_state = click.make_pass_decorator(CliState, ensure=True)

DEFAULT_LIMIT = _output.DEFAULT_LIMIT
HISTORY_COLUMNS = ["ID", "TEMPLATE", "VCPU", "MEMORY_MB", "VCPU_S", "GB_S", "COST_USD", "STARTED",
                   "ENDED/STATE", "END_REASON"]


def _parse_time(ctx: click.Context, param: click.Parameter, value: str | None) -> datetime | None:
    if value is None:
        return None
    try:
        return parse_time(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None


def _period_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    fn = click.option("--until", callback=_parse_time, metavar="WHEN",
                      help="Only sandboxes created before this time: ISO 8601 (no zone means UTC) "
                           "or a time ago (30m, 1h, 2d).")(fn)
    return click.option("--since", callback=_parse_time, metavar="WHEN",
                        help="Only sandboxes created at or after this time: ISO 8601 (no zone means UTC) "
                             "or a time ago (30m, 1h, 2d).")(fn)


fmt_usd = _output.fmt_usd


def fmt_seconds(value: float) -> str:
    return f"{value:.1f}"


def _history_row(r: HistoryRecord) -> list[object]:
    ended = _output.fmt_time(r.ended_at) if r.ended_at else r.state.value
    return [r.id, r.template, f"{r.vcpu:g}", r.memory_mb, fmt_seconds(r.vcpu_s), fmt_seconds(r.gb_s),
            fmt_usd(r.cost_usd), _output.fmt_time(r.started_at), ended,
            r.end_reason.value if r.end_reason else None]


def total_line(records: list[HistoryRecord]) -> str:
    """``TOTAL  3 sandboxes  vcpu_s 12.0  gb_s 6.0  storage_gb_s 0.0  cost_usd 0.000195``."""
    n = len(records)
    return (f"TOTAL  {n} sandbox{'' if n == 1 else 'es'}"
            f"  vcpu_s {fmt_seconds(sum(r.vcpu_s for r in records))}"
            f"  gb_s {fmt_seconds(sum(r.gb_s for r in records))}"
            f"  storage_gb_s {fmt_seconds(sum(r.storage_gb_s for r in records))}"
            f"  cost_usd {fmt_usd(sum(r.cost_usd for r in records))}")


@click.command("history")
@_period_options
@click.option("--state", "states", multiple=True, type=click.Choice([s.value for s in SandboxState],
                                                                   case_sensitive=False),
              help="Only these states (repeatable), e.g. stopped.")
@click.option("--template", default=None, help="Only sandboxes of this template.")
@click.option("--metadata", "-m", multiple=True, metavar="KEY=VALUE", help="Only with this metadata (repeatable).")
@click.option("--limit", type=click.IntRange(min=1), default=DEFAULT_LIMIT, show_default=True,
              help="Show at most N sandboxes (the newest).")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON array of the records.")
@pass_state
def history(state: CliState, since: datetime | None, until: datetime | None, states: tuple[str, ...],
            template: str | None, metadata: tuple[str, ...], limit: int, as_json: bool) -> None:
    """Sandboxes of the team with their usage and cost, newest first, and the total.

    Running sandboxes show their cost so far. --since/--until select sandboxes created in [since, until).
    """
    records = Sandbox.history(since=since, until=until, state=list(states) or None, template=template,
                              metadata=_output.parse_pairs(metadata, "--metadata"), limit=limit,
                              **state.sdk_options())
    if as_json:
        _output.print_json(_output.to_jsonable(records))
        return
    _output.print_table(HISTORY_COLUMNS, [_history_row(r) for r in records], empty="no sandboxes")
    if records:
        _output.console.print(f"[bold]{escape(total_line(records))}[/bold]")
    _output.note_limit(len(records), limit)


def _period_text(u: UsageSummary) -> str:
    if u.since and u.until:
        return f"{_output.fmt_time(u.since)} .. {_output.fmt_time(u.until)}"
    if u.since:
        return f"since {_output.fmt_time(u.since)}"
    if u.until:
        return f"until {_output.fmt_time(u.until)}"
    return "all time"


@click.command("usage")
@_period_options
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON.")
@pass_state
def usage(state: CliState, since: datetime | None, until: datetime | None, as_json: bool) -> None:
    """The team's usage totals (default: all time) and its credit balance."""
    u = Sandbox.usage(since=since, until=until, **state.sdk_options())
    if as_json:
        _output.print_json(_output.to_jsonable(u))
        return
    credits = "unlimited" if u.credits_unlimited or u.credits_usd is None else fmt_usd(u.credits_usd)
    _output.print_table(["FIELD", "VALUE"], [
        ["team", u.team_id],
        ["period", _period_text(u)],
        ["sandboxes", u.sandboxes],
        ["vcpu_s", fmt_seconds(u.vcpu_s)],
        ["gb_s", fmt_seconds(u.gb_s)],
        ["storage_gb_s", fmt_seconds(u.storage_gb_s)],
        ["cost_usd", fmt_usd(u.cost_usd)],
        ["credits_usd", credits],
    ])
