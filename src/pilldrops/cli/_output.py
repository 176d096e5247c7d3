"""Printing for the CLI: JSON for scripts (``--json``), rich tables for people, red errors on stderr."""

from __future__ import annotations

import json
import math
import os
import sys
from collections.abc import Iterable, Sequence
from datetime import datetime
from typing import Any

import click
from pydantic import BaseModel
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from pilldrops.errors import PillDropsError


def _width() -> int | None:
    """Tables piped to a file or another program keep their rows whole (rich would assume 80 columns)."""
    if sys.stdout.isatty() or os.environ.get("COLUMNS"):
        return None
    return 200


console = Console(highlight=False, width=_width())
err_console = Console(stderr=True, highlight=False)


def to_jsonable(items: BaseModel | Iterable[BaseModel]) -> Any:
    if isinstance(items, BaseModel):
        return items.model_dump(mode="json")
    return [m.model_dump(mode="json") for m in items]


def print_json(data: Any) -> None:
    """Plain JSON on stdout (no colour, no wrapping): safe to pipe into jq."""
    click.echo(json.dumps(data, indent=2, default=str))


def fmt_time(value: datetime | None) -> str:
    return value.strftime("%Y-%m-%d %H:%M") if value else "-"


def print_table(columns: Sequence[str], rows: Iterable[Sequence[Any]], *, empty: str = "nothing here") -> None:
    rows = list(rows)
    if not rows:
        console.print(f"[dim]{escape(empty)}[/dim]")
        return
    table = Table(show_edge=False, header_style="bold")
    for i, col in enumerate(columns):
        table.add_column(col, no_wrap=(i == 0), overflow="fold")
    for row in rows:
        table.add_row(*("-" if v is None else escape(str(v)) for v in row))
    console.print(table)


def print_error(exc: PillDropsError) -> None:
    """``Error: <message> (<code>)`` in red on stderr."""
    err_console.print(f"[bold red]Error:[/bold red] [red]{escape(str(exc))}[/red] [dim]({exc.code})[/dim]")


def parse_pairs(values: Iterable[str], what: str) -> dict[str, str]:
    """``("k=v", ...)`` from repeated options into a dict; a missing ``=`` is a usage error."""
    out: dict[str, str] = {}
    for raw in values:
        key, sep, value = raw.partition("=")
        if not sep or not key:
            raise click.BadParameter(f"expected KEY=VALUE, got {raw!r}", param_hint=what)
        out[key] = value
    return out


#: how many rows ``history`` and ``sandbox list`` show unless ``--limit`` says otherwise
DEFAULT_LIMIT = 100


def note_limit(shown: int, limit: int) -> None:
    """Say on stderr when a listing stopped at its limit (there may be more)."""
    if shown >= limit:
        click.echo(f"showing the newest {limit}; --limit N shows more", err=True)


def fmt_usd(value: float) -> str:
    """Dollars with at least four significant digits, so that small episodes can be told apart
    (0.00001625, not 0.000016), and six decimals for larger amounts."""
    if value == 0:
        return "0.000000"
    decimals = min(12, max(6, 3 - math.floor(math.log10(abs(value)))))
    return f"{value:.{decimals}f}"
