"""``pilldrops pools ...``: warm pools of ready sandboxes per template, shape and network policy (set needs
the admin key)."""

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
@click.option("--allow-internet/--no-internet", "allow_internet", default=None,
              help="Members' egress to the internet, attached before the claim [default: the template's, else none].")
@click.option("--allow-out", multiple=True, metavar="CIDR", help="Members' always-reachable CIDRs (repeatable).")
@click.option("--deny-out", multiple=True, metavar="CIDR", help="Members' never-reachable CIDRs (repeatable).")
@pass_state
def set_(state: CliState, template: str, size: int, vcpu: float, memory_mb: int, allow_internet: bool | None,
         allow_out: tuple[str, ...], deny_out: tuple[str, ...]) -> None:
    """Keep SIZE ready sandboxes of TEMPLATE with this shape and network policy on every node that has the
    template.

    Creates with exactly this template, --vcpu, --memory-mb and egress policy (as `sandbox create`'s
    --allow-internet / --allow-out / --deny-out, or the template's [network] default) claim one, its network
    already attached (billing starts at the claim); a create with egress that no pool of its policy serves
    claims a member of the loopback-only pool and gets its network attached then; other creates boot as
    usual. Members count as used capacity. Needs the operator's admin key.
    """
    fields: dict[str, object] = {}
    if allow_internet is not None:
        fields["allow_internet_access"] = allow_internet
    if allow_out or deny_out:
        fields["network"] = {"allow_out": list(allow_out), "deny_out": list(deny_out)}
    body = build_model(PoolSetRequest, template=template, vcpu=vcpu, memory_mb=memory_mb, size=size, **fields)
    client = APIClient.from_options(state.api_url, state.api_key)
    info = parse_model(PoolInfo, client.request("PUT", "/v1/pools", idempotent=True,
                                                json=body.model_dump(mode="json", exclude_unset=True)))
    if size == 0:
        click.echo(f"removed pool {template} {vcpu:g} vCPU / {memory_mb} MiB{_policy(info)}")
    else:
        click.echo(f"pool {info.template} {info.vcpu:g} vCPU / {info.memory_mb} MiB{_policy(info)}: size "
                   f"{info.size} per node (filling; `pilldrops pools list` shows how many are ready)")


def _egress(p: PoolInfo) -> str:
    """The members' egress, for humans ("" for loopback only)."""
    if not (p.allow_internet_access or (p.network and p.network.allow_out)):
        return ""
    parts = ["internet"] if p.allow_internet_access else []
    if p.network is not None:
        parts += [f"allow {c}" for c in p.network.allow_out] + [f"deny {c}" for c in p.network.deny_out]
    return ", ".join(parts)


def _policy(p: PoolInfo) -> str:
    return f" with egress ({_egress(p)})" if _egress(p) else ""


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
        ["TEMPLATE", "VCPU/MiB", "NETWORK", "SIZE", "NODES", "READY", "HITS", "MISSES", "HIT RATE", "BREAKER"],
        [[p.template, f"{p.vcpu:g}/{p.memory_mb}", _egress(p) or "loopback",
          p.size, p.nodes,
          f"{p.ready}" + (f" (+{p.starting})" if p.starting else ""), p.hits, p.misses,
          "-" if p.hit_rate is None else f"{p.hit_rate:.0%}",
          ("open: " + (p.last_error or "")[:60]) if p.breaker_open else "closed"] for p in items],
        empty="no warm pools (`pilldrops pools set TEMPLATE --size N`)")
