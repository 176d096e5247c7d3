"""``pilldrops nodes ...``: the fleet as the operator sees it (admin key)."""

from __future__ import annotations

from urllib.parse import quote

import click

from pilldrops.cli import _output
from pilldrops.cli.main import CliState
from pilldrops.schema.api import NodeInfo, NodeList
from pilldrops.sdk._base import parse_model
from pilldrops.sdk._sync.client import APIClient

pass_state = click.make_pass_decorator(CliState, ensure=True)


def _client(state: CliState) -> APIClient:
    return APIClient.from_options(state.api_url, state.api_key)


@click.group()
def nodes() -> None:
    """List, drain and undrain nodes (needs the operator's admin key)."""


@nodes.command("list")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON array.")
@pass_state
def list_(state: CliState, as_json: bool) -> None:
    """Nodes with their state, capacity, what is allocated on them and their templates."""
    items = parse_model(NodeList, _client(state).request("GET", "/v1/nodes", idempotent=True)).items
    if as_json:
        _output.print_json(_output.to_jsonable(items))
        return
    _output.print_table(
        ["ID", "NAME", "STATE", "SANDBOXES", "VCPU USED/CAP", "MiB USED/CAP", "TEMPLATES", "ISOLATION", "HEARTBEAT"],
        [[n.id, n.name, n.state + (" (draining)" if n.draining else ""), n.sandboxes,
          f"{n.used_vcpu:g}/{n.capacity_vcpu:g}", f"{n.used_memory_mb}/{n.capacity_memory_mb}",
          ",".join(n.templates), ",".join(m for m, s in n.isolation.items() if s.available) or "container",
          _output.fmt_time(n.last_heartbeat_at)] for n in items],
        empty="no nodes registered")


def _set(state: CliState, node: str, action: str) -> NodeInfo:
    return parse_model(NodeInfo, _client(state).request("POST", f"/v1/nodes/{quote(node, safe='')}/{action}",
                                                        idempotent=True))


@nodes.command("drain")
@click.argument("node")
@pass_state
def drain(state: CliState, node: str) -> None:
    """Stop placing new sandboxes on NODE (id or name); running ones keep running."""
    n = _set(state, node, "drain")
    click.echo(f"draining {n.name} ({n.id}); {n.sandboxes} sandbox(es) still running there")


@nodes.command("undrain")
@click.argument("node")
@pass_state
def undrain(state: CliState, node: str) -> None:
    """Place new sandboxes on NODE again."""
    n = _set(state, node, "undrain")
    click.echo(f"{n.name} ({n.id}) takes new sandboxes again")
