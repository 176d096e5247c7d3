"""``pilldrops pools ...``: warm pools of ready sandboxes per template and shape (set needs the admin key)."""

from __future__ import annotations

import click

from pilldrops.cli import _output
from pilldrops.cli.main import CliState
from pilldrops.schema.api import PoolInfo, PoolList, PoolSetRequest
from pilldrops.sdk._base import build_model, parse_model
from pilldrops.sdk._sync.client import APIClient

pass_state = click.make_pass_decorator(CliState, ensure=True)


@click.group()
def pools() -> None:
    """Warm pools: ready sandboxes a matching create claims instead of booting one."""


@pools.command("set")
@click.argument("template")
@click.option("--size", type=int, required=True, help="Ready sandboxes to keep on each node (0 removes the pool).")
@click.option("--vcpu", type=float, default=1, show_default=True, help="Shape: CPU quota in cores.")
@click.option("--memory-mb", type=int, default=512, show_default=True, help="Shape: memory limit in MiB.")
@pass_state
def set_(state: CliState, template: str, size: int, vcpu: float, memory_mb: int) -> None:
    """Keep SIZE ready sandboxes of TEMPLATE with this shape on every node that has the template.

    Creates with exactly this template, --vcpu and --memory-mb claim one (billing starts at the claim);
    other creates boot as usual. Members count as used capacity. Needs the operator's admin key.
    """
    body = build_model(PoolSetRequest, template=template, vcpu=vcpu, memory_mb=memory_mb, size=size)
    client = APIClient.from_options(state.api_url, state.api_key)
    info = parse_model(PoolInfo, client.request("PUT", "/v1/pools", json=body.model_dump(mode="json"),
                                                idempotent=True))
    if size == 0:
        click.echo(f"removed pool {template} {vcpu:g} vCPU / {memory_mb} MiB")
    else:
        click.echo(f"pool {info.template} {info.vcpu:g} vCPU / {info.memory_mb} MiB: size {info.size} per node "
                   f"(filling; `pilldrops pools list` shows how many are ready)")


@pools.command("list")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON array.")
@pass_state
def list_(state: CliState, as_json: bool) -> None:
    """Pools with their size per node, ready members, hit rate and misses (as the nodes last reported)."""
    client = APIClient.from_options(state.api_url, state.api_key)
    items = parse_model(PoolList, client.request("GET", "/v1/pools", idempotent=True)).items
    if as_json:
        _output.print_json(_output.to_jsonable(items))
        return
    _output.print_table(
        ["TEMPLATE", "VCPU/MiB", "SIZE", "NODES", "READY", "HITS", "MISSES", "HIT RATE", "BREAKER"],
        [[p.template, f"{p.vcpu:g}/{p.memory_mb}", p.size, p.nodes,
          f"{p.ready}" + (f" (+{p.starting})" if p.starting else ""), p.hits, p.misses,
          "-" if p.hit_rate is None else f"{p.hit_rate:.0%}",
          ("open: " + (p.last_error or "")[:60]) if p.breaker_open else "closed"] for p in items],
        empty="no warm pools (`pilldrops pools set TEMPLATE --size N`)")
