"""``pilldrops``: the command line.

Client commands (``sandbox``, ``keys``, ``template list``, ``history``, ``usage``) talk to a control plane
through the SDK.
The local commands (``up``, ``serve``, ``node``, ``template build``) live in :mod:`pilldrops.cli.local`
and need the server extras. A :class:`PillDropsError` prints ``Error: <message> (<code>)`` in red and
exits 1; usage errors exit 2; ``--debug`` adds the traceback.
"""

from __future__ import annotations

import sys
import traceback
from dataclasses import dataclass
from typing import Any

import click

from pilldrops import __version__
from pilldrops.cli import _output
from pilldrops.errors import PillDropsError


@dataclass
class CliState:
    """Global options, handed to every command as ``ctx.obj``."""

    api_url: str | None = None
    api_key: str | None = None
    debug: bool = False

    def sdk_options(self) -> dict[str, Any]:
        return {"api_url": self.api_url, "api_key": self.api_key}


class _Group(click.Group):
    """Turns any PillDropsError raised by a subcommand into a red message and exit status 1."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except PillDropsError as exc:
            state = ctx.find_object(CliState)
            report_error(exc, debug=bool(state and state.debug))
            ctx.exit(1)


def report_error(exc: PillDropsError, *, debug: bool = False) -> None:
    if debug:
        traceback.print_exception(exc, file=sys.stderr)
    _output.print_error(exc)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--api-url", envvar="PILLDROPS_API_URL", metavar="URL",
              help="Control plane URL [env PILLDROPS_API_URL; default from `pilldrops up` or http://127.0.0.1:7070].")
@click.option("--api-key", metavar="KEY",
              help="API key [env PILLDROPS_API_KEY, then the config file, then E2B_API_KEY].")
@click.option("--debug", is_flag=True, help="Show tracebacks on errors.")
@click.version_option(__version__, prog_name="pilldrops")
@click.pass_context
def cli(ctx: click.Context, api_url: str | None, api_key: str | None, debug: bool) -> None:
    """PillDrops: disposable sandboxes for RL rollouts and evals."""
    ctx.obj = CliState(api_url=api_url, api_key=api_key, debug=debug)


def _register() -> None:
    from pilldrops.cli.billing import history, usage
    from pilldrops.cli.keys import keys
    from pilldrops.cli.nodes import nodes
    from pilldrops.cli.pools import pools
    from pilldrops.cli.sandbox import sandbox
    from pilldrops.cli.templates import template

    cli.add_command(sandbox)
    cli.add_command(keys)
    cli.add_command(template)
    cli.add_command(history)
    cli.add_command(usage)
    cli.add_command(nodes)
    cli.add_command(pools)
    try:
        from pilldrops.cli import local
    except ImportError as exc:  # only a missing module is tolerated; a broken one must be loud
        if exc.name not in ("pilldrops.cli.local",):
            raise
        return
    for name in ("up", "serve", "node", "teams", "credits"):
        command = getattr(local, name, None)
        if isinstance(command, click.Command):
            cli.add_command(command, name=name)


_register()


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point."""
    try:
        cli.main(args=argv, prog_name="pilldrops")
    except PillDropsError as exc:  # raised outside a subcommand (the group catches the rest)
        report_error(exc, debug="--debug" in (argv if argv is not None else sys.argv[1:]))
        sys.exit(1)


if __name__ == "__main__":  # pragma: no cover
    main()
