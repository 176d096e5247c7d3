"""``pilldrops template build NAME`` through the control plane: resolve the spec (and its parents that are
packaged or user specs, built first: each is a cache hit when unchanged), upload the build context by
digest, start the build and print its log as it streams."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import click
import httpx

from pilldrops import errors
from pilldrops.sdk._sync.client import APIClient
from pilldrops.sdk._template_build import ContextTooLarge, context_digest, pack_context

BUILD_TIMEOUT = httpx.Timeout(30.0, read=None)     # a Debian template takes minutes: no read timeout on the stream


def build(client: APIClient, name: str, *, document: dict[str, Any] | None, context: Path | None,
          force: bool, templates_dirs: tuple[Path, ...]) -> None:
    from pilldrops.cli.local import spec_chain  # reads spec files (node code: only through cli/local.py)
    chain: list[tuple[dict[str, Any], Path | None]] = []
    if document is not None:
        chain.append((document, context))
        base = document.get("from")
    else:
        base = name
    if isinstance(base, str):
        chain.extend(spec_chain(base, templates_dirs))
    if document is None and not chain:
        raise click.ClickException(f"no template spec named {name!r} here (packaged, ~/.config/pilldrops/"
                                   "templates or --templates-dir); for a Dockerfile use -f")
    for i, (doc, root) in enumerate(reversed(chain)):
        last = i == len(chain) - 1
        _build_one(client, doc, root, force=force and last)


def _build_one(client: APIClient, doc: dict[str, Any], root: Path | None, *, force: bool) -> None:
    name = doc["name"]
    try:
        data, doc = pack_context(root or Path("."), doc)
    except (ContextTooLarge, FileNotFoundError) as exc:
        raise click.ClickException(f"template {name}: {exc}") from None
    digest = None
    if data is not None:
        digest = context_digest(data)
        client.request("PUT", f"/v1/templates/contexts/{digest}", idempotent=True, content=data,
                       headers={"content-type": "application/x-tar"})
    from rich.console import Console
    console = Console(stderr=True)
    t0 = time.monotonic()
    result: dict[str, Any] | None = None
    with client.stream("POST", "/v1/templates/builds", idempotent=False,
                       json={"spec": doc, "context": digest, "force": force},
                       timeout=BUILD_TIMEOUT) as resp:
        for line in resp.iter_lines():
            try:
                ev = json.loads(line)
            except ValueError:
                continue
            kind = ev.get("type")
            if kind == "log":
                console.print(f"  [dim]{str(ev.get('line', ''))[:200]}[/]", markup=True, highlight=False)
            elif kind == "status":
                console.print(f"[bold]{name}[/]: {ev.get('message', '')}", highlight=False)
            elif kind == "error":
                err = ev.get("error") or {}
                exc = errors.from_wire(422, {"error": err})
                raise click.ClickException(f"template {name}: {exc.message} ({exc.code})")
            elif kind == "done":
                result = ev
    if result is None:
        raise click.ClickException(f"template {name}: the build stream ended without a result")
    t = result.get("template") or {}
    how = "up to date" if result.get("cached") else f"built in {time.monotonic() - t0:.1f}s"
    console.print(f"[green]✓[/] template [bold]{name}[/] v{t.get('version')} {how} "
                  f"({(t.get('size_bytes') or 0) / 2**20:.1f} MiB)")
    click.echo(f"{name} v{t.get('version')} {t.get('digest')} size={t.get('size_bytes')}")
    sys.stdout.flush()
