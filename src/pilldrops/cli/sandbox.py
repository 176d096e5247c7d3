"""``pilldrops sandbox ...``: create, list, inspect, exec in, copy to/from and kill sandboxes."""

from __future__ import annotations

import sys

import click

from pilldrops.cli import _output
from pilldrops.cli.main import CliState
from pilldrops.schema.api import DEFAULT_TIMEOUT_S, SandboxInfo
from pilldrops.sdk._sync.sandbox import Sandbox

pass_state = click.make_pass_decorator(CliState, ensure=True)


def _rows(items: list[SandboxInfo]) -> list[list[object]]:
    return [[s.id, s.template, s.state.value, f"{s.vcpu:g}/{s.memory_mb}", _output.fmt_time(s.created_at),
             ",".join(f"{k}={v}" for k, v in s.metadata.items()) or None]
            for s in items]


_COLUMNS = ["ID", "TEMPLATE", "STATE", "VCPU/MiB", "CREATED", "METADATA"]


@click.group()
def sandbox() -> None:
    """Create, inspect and use sandboxes."""


@sandbox.command("create")
@click.option("--template", default="base", show_default=True, help="Template name.")
@click.option("--vcpu", type=float, default=1, show_default=True, help="CPU quota in cores.")
@click.option("--memory-mb", type=int, default=512, show_default=True, help="Memory limit in MiB.")
@click.option("--timeout", type=int, default=DEFAULT_TIMEOUT_S, show_default=True,
              help="Seconds until the sandbox is killed.")
@click.option("--metadata", "-m", multiple=True, metavar="KEY=VALUE", help="Metadata (repeatable).")
@click.option("--env", "-e", multiple=True, metavar="KEY=VALUE", help="Environment variable (repeatable).")
@click.option("--json", "as_json", is_flag=True, help="Print the full record as JSON.")
@pass_state
def create(state: CliState, template: str, vcpu: float, memory_mb: int, timeout: int, metadata: tuple[str, ...],
           env: tuple[str, ...], as_json: bool) -> None:
    """Create a sandbox (left running) and print its id."""
    sb = Sandbox.create(template, vcpu=vcpu, memory_mb=memory_mb, timeout=timeout,
                        metadata=_output.parse_pairs(metadata, "--metadata"),
                        envs=_output.parse_pairs(env, "--env"), **state.sdk_options())
    if as_json:
        _output.print_json(_output.to_jsonable(sb.info))
    else:
        click.echo(sb.id)


@sandbox.command("list")
@click.option("--state", "states", multiple=True, help="Only these states (repeatable), e.g. running.")
@click.option("--metadata", "-m", multiple=True, metavar="KEY=VALUE", help="Only with this metadata.")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON array.")
@pass_state
def list_(state: CliState, states: tuple[str, ...], metadata: tuple[str, ...], as_json: bool) -> None:
    """List sandboxes, newest first."""
    items = Sandbox.list(state=list(states) or None, metadata=_output.parse_pairs(metadata, "--metadata"),
                         **state.sdk_options())
    if as_json:
        _output.print_json(_output.to_jsonable(items))
    else:
        _output.print_table(_COLUMNS, _rows(items), empty="no sandboxes")


@sandbox.command("get")
@click.argument("sandbox_id")
@click.option("--json", "as_json", is_flag=True, help="Print the record as JSON.")
@pass_state
def get(state: CliState, sandbox_id: str, as_json: bool) -> None:
    """Show one sandbox."""
    info = Sandbox.get_info_by_id(sandbox_id, **state.sdk_options())
    if as_json:
        _output.print_json(_output.to_jsonable(info))
        return
    fields = info.model_dump(exclude={"envd_url", "access_token"})
    _output.print_table(["FIELD", "VALUE"], [[k, getattr(v, "value", v)] for k, v in fields.items()])


@sandbox.command("exec", context_settings={"ignore_unknown_options": True})
@click.argument("sandbox_id")
@click.argument("cmd", nargs=-1, required=True, type=click.UNPROCESSED)
@click.option("--timeout", type=float, default=None, help="Kill the command after this many seconds.")
@click.option("--cwd", default=None, help="Working directory inside the sandbox.")
@click.option("--env", "-e", multiple=True, metavar="KEY=VALUE", help="Environment variable (repeatable).")
@pass_state
@click.pass_context
def exec_(ctx: click.Context, state: CliState, sandbox_id: str, cmd: tuple[str, ...], timeout: float | None,
          cwd: str | None, env: tuple[str, ...]) -> None:
    """Run a command and stream its output; exit with its exit code.

    One argument is a shell command line (`-- 'ls | wc -l'`); several are an argv run without a shell
    (`-- python -c 'print(1)'`).
    """
    sb = Sandbox.connect(sandbox_id, **state.sdk_options())

    def out(text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()

    def err(text: str) -> None:
        sys.stderr.write(text)
        sys.stderr.flush()

    command: str | list[str] = cmd[0] if len(cmd) == 1 else list(cmd)
    result = sb.run(command, timeout=timeout, cwd=cwd, envs=_output.parse_pairs(env, "--env"),
                    on_stdout=out, on_stderr=err)
    if result.truncated:
        _output.err_console.print("[yellow]warning: output was truncated[/yellow]")
    ctx.exit(result.exit_code)


@sandbox.command("upload")
@click.argument("sandbox_id")
@click.argument("local", type=click.Path(exists=True, file_okay=True, dir_okay=True))
@click.argument("remote")
@pass_state
def upload(state: CliState, sandbox_id: str, local: str, remote: str) -> None:
    """Copy a local file or directory to REMOTE in the sandbox (a directory's contents become REMOTE)."""
    sb = Sandbox.connect(sandbox_id, **state.sdk_options())
    n = sb.upload(local, remote)
    click.echo(f"uploaded {n} entr{'y' if n == 1 else 'ies'} to {remote}")


@sandbox.command("download")
@click.argument("sandbox_id")
@click.argument("remote")
@click.argument("local", type=click.Path())
@pass_state
def download(state: CliState, sandbox_id: str, remote: str, local: str) -> None:
    """Copy REMOTE (a file or directory) out of the sandbox to LOCAL."""
    sb = Sandbox.connect(sandbox_id, **state.sdk_options())
    path = sb.download(remote, local)
    click.echo(f"downloaded {remote} to {path}")


@sandbox.command("kill")
@click.argument("sandbox_ids", nargs=-1, required=True)
@pass_state
def kill(state: CliState, sandbox_ids: tuple[str, ...]) -> None:
    """Kill sandboxes (idempotent)."""
    for sandbox_id in sandbox_ids:
        info = Sandbox.kill_by_id(sandbox_id, **state.sdk_options())
        click.echo(f"killed {info.id}")
