"""``pilldrops template ...``: templates the nodes hold. ``template build`` comes from ``cli/local.py``."""

from __future__ import annotations

import click

from pilldrops.cli import _output
from pilldrops.cli.main import CliState
from pilldrops.schema.api import TemplateList
from pilldrops.sdk._base import parse_model
from pilldrops.sdk._sync.client import APIClient

pass_state = click.make_pass_decorator(CliState, ensure=True)


@click.group()
def template() -> None:
    """List (and, on a server host, build) sandbox templates."""


@template.command("list")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON array.")
@pass_state
def list_(state: CliState, as_json: bool) -> None:
    """List the templates available to sandboxes."""
    client = APIClient.from_options(state.api_url, state.api_key)
    items = parse_model(TemplateList, client.request("GET", "/v1/templates", idempotent=True)).items
    if as_json:
        _output.print_json(_output.to_jsonable(items))
        return
    _output.print_table(
        ["NAME", "DESCRIPTION", "SIZE_MB", "BUILT", "NODES"],
        [[t.name, t.description, f"{t.size_bytes / 2**20:.1f}", _output.fmt_time(t.built_at),
          ",".join(t.nodes)] for t in items],
        empty="no templates")
