"""``pilldrops template ...``: ``list`` (the template store's versions and the nodes holding them) and ``build``
(once, through the control plane: ``cli/template_remote.py``; ``--local``: on this machine, ``cli/local.py``)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

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
        ["NAME", "VERSION", "DIGEST", "SIZE_MB", "BUILT", "BUILD_S", "NODES", "DESCRIPTION"],
        [[t.name, f"v{t.version}" if t.version else "node-built", (t.digest or "")[:19],
          f"{t.size_bytes / 2**20:.1f}", _output.fmt_time(t.built_at),
          f"{t.build_seconds:.1f}" if t.build_seconds is not None else "", ",".join(t.nodes) or "-",
          t.description] for t in items],
        empty="no templates")


# ---- template build ---------------------------------------------------------------------------------

def _explicit(ctx: click.Context, name: str) -> bool:
    from click.core import ParameterSource
    return ctx.get_parameter_source(name) not in (ParameterSource.DEFAULT, None)


@template.command("build")
@click.argument("name")
@click.argument("context", required=False, type=click.Path(file_okay=False, path_type=Path))
@click.option("-f", "--file", "dockerfile", type=click.Path(dir_okay=False, exists=True, path_type=Path),
              help="build from this Dockerfile (CONTEXT, default: the Dockerfile's folder, holds what COPY/ADD "
                   "read)")
@click.option("--build-arg", "build_args", multiple=True, metavar="KEY=VALUE",
              help="a Dockerfile ARG's value (repeatable; KEY alone takes $KEY)")
@click.option("--force", is_flag=True, help="rebuild even when the store (or cache) holds this exact spec")
@click.option("--local", is_flag=True,
              help="build on this machine into its own data dir (root), not through the control plane")
@click.option("--data-dir", type=click.Path(path_type=Path), default=None, envvar="PILLDROPS_DATA_DIR",
              help="with --local: where the layers go [default: the node's data dir]; implies --local")
@click.option("--templates-dir", "templates_dirs", multiple=True, type=click.Path(path_type=Path),
              help="extra directory of template specs (*.toml)")
@pass_state
@click.pass_context
def build(ctx: click.Context, state: CliState, name: str, context: Path | None, dockerfile: Path | None,
          build_args: tuple[str, ...], force: bool, local: bool, data_dir: Path | None,
          templates_dirs: tuple[Path, ...]) -> None:
    """Build a template ONCE for the whole deployment.

    The control plane picks a node, which builds it and stores its layers (by digest) in the template
    store; every other node fetches them when a sandbox of it first lands there. The build log streams
    here. A spec unchanged since the last build is not built again; a changed one is the next version
    (running sandboxes keep theirs).

    NAME is a TOML spec (the packaged ones, ~/.config/pilldrops/templates/*.toml, --templates-dir), or
    with -f the name to give a Dockerfile's template. --local builds on this machine only (the old way)."""
    root = context or (dockerfile.parent if dockerfile else None)
    if local or (data_dir is not None and _explicit(ctx, "data_dir")):
        from pilldrops.cli.local import DEFAULT_DATA_DIR, local_build, local_dockerfile_build
        if dockerfile is not None:      # steps keep their Dockerfile lines for the log and errors
            local_dockerfile_build(name, data_dir or DEFAULT_DATA_DIR, dockerfile, root, _build_args(build_args),
                                   force, templates_dirs)
        else:
            local_build(name, data_dir or DEFAULT_DATA_DIR, force, templates_dirs)
        return
    document = _dockerfile_document(dockerfile, name, root, build_args) if dockerfile else None
    from pilldrops.cli import template_remote
    template_remote.build(APIClient.from_options(state.api_url, state.api_key), name, document=document,
                          context=root, force=force, templates_dirs=templates_dirs)


def _dockerfile_document(path: Path, name: str, context: Path | None, build_args: tuple[str, ...]) -> dict[str, Any]:
    try:
        from pilldrops import dockerfile  # type: ignore[attr-defined]   # issue 19 part 3 (branch dockerfile)
    except ImportError:
        raise click.ClickException("Dockerfile templates are not available in this version") from None
    try:
        parsed = dockerfile.parse_dockerfile(path, context or path.parent, name=name,
                                             build_args=_build_args(build_args))
    except ValueError as exc:
        raise click.ClickException(str(exc)) from None
    for w in parsed.warnings:
        click.echo(f"warning: {w}", err=True)
    return dict(parsed.document)


def _build_args(build_args: tuple[str, ...]) -> dict[str, str]:
    args = {}
    for item in build_args:
        key, sep, value = item.partition("=")
        if not key:
            raise click.BadParameter(f"{item!r} is not KEY=VALUE", param_hint="--build-arg")
        if not sep:                    # KEY alone takes $KEY, as docker build does
            if key not in os.environ:
                raise click.BadParameter(f"{key} is not set in the environment", param_hint="--build-arg")
            value = os.environ[key]
        args[key] = value
    return args
