"""``pilldrops keys ...``: API keys of the caller's team."""

from __future__ import annotations

import builtins

import click
from pydantic import BaseModel

from pilldrops.cli import _output
from pilldrops.cli.main import CliState
from pilldrops.schema.api import KeyCreated, KeyCreateRequest, KeyInfo
from pilldrops.sdk._base import build_model, parse_model
from pilldrops.sdk._sync.client import APIClient

pass_state = click.make_pass_decorator(CliState, ensure=True)


class _KeyList(BaseModel):
    items: builtins.list[KeyInfo]


def _client(state: CliState) -> APIClient:
    return APIClient.from_options(state.api_url, state.api_key)


@click.group()
def keys() -> None:
    """Create, list and revoke API keys."""


@keys.command("create")
@click.argument("name", required=False)
@click.option("--name", "name_opt", default=None, help="A label for the key (same as NAME)  [default: default]")
@click.option("--json", "as_json", is_flag=True, help="Print the record (with the secret) as JSON.")
@pass_state
def create(state: CliState, name: str | None, name_opt: str | None, as_json: bool) -> None:
    """Create a key labelled NAME (default: default) and print its secret (shown only once)."""
    if name is not None and name_opt is not None and name != name_opt:
        raise click.UsageError(f"two names given: {name!r} and --name {name_opt!r}")
    name = name if name is not None else name_opt if name_opt is not None else "default"
    body = build_model(KeyCreateRequest, name=name)
    key = parse_model(KeyCreated, _client(state).request("POST", "/v1/keys", json=body.model_dump(mode="json"),
                                                         idempotent=False))
    if as_json:
        _output.print_json(_output.to_jsonable(key))
        return
    click.echo(key.secret)
    _output.err_console.print(f"[dim]created {key.id} ({key.name}); the secret is not shown again[/dim]")


@keys.command("list")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON array.")
@pass_state
def list_(state: CliState, as_json: bool) -> None:
    """List the team's keys."""
    items = parse_model(_KeyList, _client(state).request("GET", "/v1/keys", idempotent=True)).items
    if as_json:
        _output.print_json(_output.to_jsonable(items))
        return
    _output.print_table(
        ["ID", "NAME", "PREFIX", "CREATED", "LAST USED", "REVOKED"],
        [[k.id, k.name, k.prefix, _output.fmt_time(k.created_at), _output.fmt_time(k.last_used_at),
          _output.fmt_time(k.revoked_at) if k.revoked_at else None] for k in items],
        empty="no keys")


@keys.command("revoke")
@click.argument("key_id")
@pass_state
def revoke(state: CliState, key_id: str) -> None:
    """Revoke a key (requests with it fail from now on)."""
    from urllib.parse import quote

    key = parse_model(KeyInfo, _client(state).request("DELETE", f"/v1/keys/{quote(key_id, safe='')}",
                                                      idempotent=True))
    click.echo(f"revoked {key.id}")
