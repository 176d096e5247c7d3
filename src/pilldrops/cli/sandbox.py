"""``pilldrops sandbox ...``: create, list, inspect, exec in, copy to/from and kill sandboxes."""

from __future__ import annotations

import sys

import click

from pilldrops.cli import _output
from pilldrops.cli.main import CliState
from pilldrops.schema.api import (
    DEFAULT_TIMEOUT_S,
    DEFAULT_URL_EXPIRES_S,
    ISOLATION_MODES,
    MAX_URL_EXPIRES_S,
    SandboxInfo,
    SandboxState,
)
from pilldrops.schema.api import LIVE_STATES as schema_live_states
from pilldrops.sdk._sync.sandbox import Sandbox

pass_state = click.make_pass_decorator(CliState, ensure=True)

#: States a sandbox can be killed in: what ``list`` shows by default and ``kill --all`` kills.
LIVE_STATES = [s.value for s in schema_live_states]
#: ``--state`` values; a wrong one is a usage error listing these.
STATE_CHOICE = click.Choice([s.value for s in SandboxState], case_sensitive=False)
PAUSED_STATES = (SandboxState.pausing, SandboxState.paused, SandboxState.resuming)


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
@click.option("--disk-mb", type=int, default=None,
              help="Size of the writable layer in MiB [default: the template's, else the deployment's (10240)].")
@click.option("--timeout", type=int, default=DEFAULT_TIMEOUT_S, show_default=True,
              help="Seconds until the sandbox is killed.")
@click.option("--metadata", "-m", multiple=True, metavar="KEY=VALUE", help="Metadata (repeatable).")
@click.option("--env", "-e", multiple=True, metavar="KEY=VALUE", help="Environment variable (repeatable).")
@click.option("--isolation", type=click.Choice(ISOLATION_MODES), default=None,
              help="container (crun), gvisor (runsc) or microvm (QEMU) [default: the template's, else the "
                   "deployment's]")
@click.option("--public-port", "public_ports", multiple=True, type=click.IntRange(1, 65535), metavar="PORT",
              help="Serve this port by URL without a token (repeatable).")
@click.option("--public", is_flag=True, help="Serve every port by URL without a token.")
@click.option("--allow-internet/--no-internet", "allow_internet", default=None,
              help="Egress to the internet (NAT through the node) [default: the template's, else none].")
@click.option("--allow-out", multiple=True, metavar="CIDR", help="Always reachable, even without "
              "--allow-internet (repeatable; an IP or a CIDR).")
@click.option("--deny-out", multiple=True, metavar="CIDR", help="Never reachable unless also in --allow-out "
              "(repeatable).")
@click.option("--json", "as_json", is_flag=True, help="Print the full record as JSON.")
@pass_state
def create(state: CliState, template: str, vcpu: float, memory_mb: int, disk_mb: int | None, timeout: int,
           metadata: tuple[str, ...], env: tuple[str, ...], isolation: str | None, public_ports: tuple[int, ...],
           public: bool, allow_internet: bool | None, allow_out: tuple[str, ...], deny_out: tuple[str, ...],
           as_json: bool) -> None:
    """Create a sandbox (left running) and print its id. It has loopback only unless its template's
    [network] or --allow-internet / --allow-out give it egress."""
    network = {"allow_out": list(allow_out), "deny_out": list(deny_out)} if allow_out or deny_out else None
    sb = Sandbox.create(template, vcpu=vcpu, memory_mb=memory_mb, disk_mb=disk_mb, timeout=timeout,
                        isolation=isolation,
                        public_ports=list(public_ports), public=public,
                        metadata=_output.parse_pairs(metadata, "--metadata"),
                        envs=_output.parse_pairs(env, "--env"), allow_internet_access=allow_internet,
                        network=network, **state.sdk_options())
    if as_json:
        _output.print_json(_output.to_jsonable(sb.info))
    else:
        click.echo(sb.id)


@sandbox.command("list")
@click.option("--state", "states", multiple=True, type=STATE_CHOICE,
              help="Only these states (repeatable), e.g. stopped. Default: live ones (running, starting, paused).")
@click.option("--all", "all_", is_flag=True, help="Every state, ended sandboxes included.")
@click.option("--metadata", "-m", multiple=True, metavar="KEY=VALUE", help="Only with this metadata.")
@click.option("--limit", type=click.IntRange(min=1), default=_output.DEFAULT_LIMIT, show_default=True,
              help="Show at most N sandboxes (the newest).")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON array.")
@pass_state
def list_(state: CliState, states: tuple[str, ...], all_: bool, metadata: tuple[str, ...], limit: int,
          as_json: bool) -> None:
    """List sandboxes, newest first: live ones unless --all or --state."""
    if all_ and states:
        raise click.UsageError("--all and --state are exclusive: --state already picks the states")
    items = Sandbox.list(state=list(states) or None, include_ended=all_, limit=limit,
                         metadata=_output.parse_pairs(metadata, "--metadata"), **state.sdk_options())
    if as_json:
        _output.print_json(_output.to_jsonable(items))
        return
    _output.print_table(_COLUMNS, _rows(items),
                        empty="no sandboxes" if all_ or states else "no live sandboxes (--all shows ended ones)")
    _output.note_limit(len(items), limit)


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
    if info.state in PAUSED_STATES:
        # paused time does not count against the timeout: end_at is set again at resume
        fields.pop("end_at", None)
        left = info.timeout_left
        fields["timeout_left"] = f"{left:.0f} s (counted again from resume)" if left is not None else None
    else:
        fields.pop("timeout_left", None)
    if info.disk_used_bytes is not None:
        used = info.disk_used_bytes / 2**20
        fields["disk_used_bytes"] = (f"{info.disk_used_bytes} ({used:.1f} MiB of {info.disk_mb} MiB)"
                                     if info.disk_mb else info.disk_used_bytes)
    _output.print_table(["FIELD", "VALUE"], [[k, getattr(v, "value", v)] for k, v in fields.items()])


@sandbox.command("exec", context_settings={"ignore_unknown_options": True})
@click.argument("sandbox_id")
@click.argument("cmd", nargs=-1, required=True, type=click.UNPROCESSED)
@click.option("--timeout", type=float, default=None, help="Kill the command after this many seconds.")
@click.option("--cwd", default=None, help="Working directory inside the sandbox.")
@click.option("--env", "-e", multiple=True, metavar="KEY=VALUE", help="Environment variable (repeatable).")
@click.option("--no-stdin", is_flag=True, help="Do not pass this command's stdin through (when not a TTY).")
@click.option("--interactive", "-i", is_flag=True, help="With -t: keep stdin attached (as docker exec -it).")
@click.option("--tty", "-t", is_flag=True, help="Run it on a terminal in the sandbox, attached to this one.")
@click.option("--background", "-d", is_flag=True, help="Start it, print its pid and return (see `logs`).")
@pass_state
@click.pass_context
def exec_(ctx: click.Context, state: CliState, sandbox_id: str, cmd: tuple[str, ...], timeout: float | None,
          cwd: str | None, env: tuple[str, ...], no_stdin: bool, interactive: bool, tty: bool,
          background: bool) -> None:
    """Run a command and stream its output; exit with its exit code.

    One argument is a shell command line (`-- 'ls | wc -l'`); several are an argv run without a shell
    (`-- python -c 'print(1)'`). When stdin is not a terminal it is read to the end and fed to the command
    (`echo hi | pilldrops sandbox exec ID -- cat`); --no-stdin turns that off. A command that hits
    --timeout is killed and exits with 124. `-it` runs it on a real terminal (like `sandbox shell`);
    `-d` leaves it running in the background (`sandbox logs ID` shows what it wrote).
    """
    if tty or interactive or background:
        from pilldrops.cli import shell
        envs = _output.parse_pairs(env, "--env")
        if background:
            ctx.exit(shell.exec_background(state, sandbox_id, cmd, envs=envs, cwd=cwd, timeout=timeout))
        ctx.exit(shell.exec_interactive(state, sandbox_id, cmd, envs=envs, cwd=cwd))
    stdin = None if no_stdin else _piped_stdin()
    sb = Sandbox.connect(sandbox_id, **state.sdk_options())

    def out(text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()

    def err(text: str) -> None:
        sys.stderr.write(text)
        sys.stderr.flush()

    command: str | list[str] = cmd[0] if len(cmd) == 1 else list(cmd)
    result = sb.run(command, timeout=timeout, cwd=cwd, envs=_output.parse_pairs(env, "--env"), stdin=stdin,
                    on_stdout=out, on_stderr=err)
    if result.timed_out:
        after = timeout if timeout is not None else result.duration
        _output.err_console.print(f"[yellow]command timed out after {after:g} s[/yellow]")
    if result.truncated:
        _output.err_console.print("[yellow]warning: output was truncated[/yellow]")
    ctx.exit(result.exit_code)


def _piped_stdin() -> str | None:
    """This process's stdin, read to the end, when it is a pipe or a file (not a terminal); else None."""
    stream = sys.stdin
    try:
        if stream is None or stream.isatty():
            return None
        raw = getattr(stream, "buffer", None)
        data = raw.read().decode("utf-8", errors="replace") if raw is not None else stream.read()
    except (OSError, ValueError):  # closed or unreadable: nothing to pass
        return None
    return data or None


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


@sandbox.command("url")
@click.argument("sandbox_id")
@click.argument("port", type=click.IntRange(1, 65535))
@click.option("--expires-in", type=click.IntRange(1, MAX_URL_EXPIRES_S), default=DEFAULT_URL_EXPIRES_S,
              show_default=True, help="Seconds the URL's token stays valid.")
@click.option("--path", default="/", show_default=True, help="Path (and query) inside the sandbox's server.")
@click.option("--json", "as_json", is_flag=True, help="Print {url, port, expires_at, public} as JSON.")
@pass_state
def url(state: CliState, sandbox_id: str, port: int, expires_in: int, path: str, as_json: bool) -> None:
    """Print a URL (signed, expiring) that reaches PORT inside the sandbox, for a browser or curl."""
    info = Sandbox.connect(sandbox_id, **state.sdk_options()).get_url_info(port, expires_in=expires_in, path=path)
    if as_json:
        _output.print_json(_output.to_jsonable(info))
    else:
        click.echo(info.url)


@sandbox.command("kill")
@click.argument("sandbox_ids", nargs=-1)
@click.option("--all", "all_", is_flag=True, help="Kill every live sandbox of the team.")
@click.option("--metadata", "--label", "-m", "metadata", multiple=True, metavar="KEY=VALUE",
              help="Kill every live sandbox with this metadata (repeatable: all pairs must match).")
@pass_state
def kill(state: CliState, sandbox_ids: tuple[str, ...], all_: bool, metadata: tuple[str, ...]) -> None:
    """Kill sandboxes by id, or all live ones (--all), or all live ones matching --metadata/--label
    (idempotent). Several at once go in one request (per 1,000).

    Prints `killed <id>` for each; an id that could not be killed is named on stderr (exit status 1).
    """
    if sandbox_ids and (all_ or metadata):
        raise click.UsageError("give sandbox ids, or --all / --metadata, not both")
    if not sandbox_ids and not (all_ or metadata):
        raise click.UsageError("give sandbox ids to kill, or --all, or --metadata KEY=VALUE")
    options = state.sdk_options()
    if len(sandbox_ids) == 1:
        click.echo(f"killed {Sandbox.kill_by_id(sandbox_ids[0], **options).id}")
        return
    pairs = _output.parse_pairs(metadata, "--metadata")
    if sandbox_ids:
        res = Sandbox.kill_many(list(sandbox_ids), **options)
    elif pairs:
        res = Sandbox.kill_many(metadata=pairs, **options)
    else:                   # --all: every live one of the team
        ids = [s.id for s in Sandbox.list(state=LIVE_STATES, **options)]
        res = Sandbox.kill_many(ids, **options) if ids else None
    if res is None or not res.items:
        _output.err_console.print("[dim]no live sandboxes" + (" match" if pairs else "") + "[/dim]")
        return
    for item in res.items:
        if item.sandbox is not None:
            click.echo(f"killed {item.id}")
    failed = [it for it in res.items if it.sandbox is None]
    for item in failed:
        err = item.error
        _output.err_console.print(f"could not kill {item.id}: {err.code if err else 'error'}: "
                                  f"{err.message if err else ''}", markup=False, highlight=False)
    if failed:
        raise SystemExit(1)


def _fmt_bytes(n: int | None) -> str:
    if n is None:
        return "?"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n} B"
        n /= 1024  # type: ignore[assignment]
    return str(n)


@sandbox.command("pause")
@click.argument("sandbox_id")
@click.option("--json", "as_json", is_flag=True, help="Print the full record as JSON.")
@pass_state
def pause(state: CliState, sandbox_id: str, as_json: bool) -> None:
    """Pause a running sandbox: its processes and memory go to disk, it holds no RAM or CPU and bills
    storage only until `pilldrops sandbox resume ID`. Paused time does not count against its timeout."""
    info = Sandbox.pause(sandbox_id, **state.sdk_options())
    if as_json:
        _output.print_json(_output.to_jsonable(info))
    else:
        click.echo(f"paused {info.id} (checkpoint {_fmt_bytes(info.checkpoint_bytes)}, "
                   f"{info.timeout_left or 0:.0f} s of timeout left)")


@sandbox.command("resume")
@click.argument("sandbox_id")
@click.option("--json", "as_json", is_flag=True, help="Print the full record as JSON.")
@pass_state
def resume(state: CliState, sandbox_id: str, as_json: bool) -> None:
    """Resume a paused sandbox exactly where it left off (possibly on another node of the fleet)."""
    sb = Sandbox.resume(sandbox_id, **state.sdk_options())
    if as_json:
        _output.print_json(_output.to_jsonable(sb.info))
    else:
        click.echo(f"resumed {sb.id} on node {sb.info.node_id}")


from pilldrops.cli import shell as _shell  # noqa: F401  (registers `shell` and `logs`)
