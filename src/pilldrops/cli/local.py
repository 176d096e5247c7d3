"""Commands that run PillDrops on this machine: ``up`` (embedded default), ``serve`` (control plane),
``node`` (node agent) and ``template build``. Server and node code is imported inside the commands so the
client CLI works with only the SDK installed."""

from __future__ import annotations

import logging
import os
import secrets
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import click

from pilldrops.schema.api import (
    DEFAULT_DISK_MB,
    DEFAULT_ISOLATION,
    DEFAULT_MAX_DISK_MB,
    DISK_MB_CAP,
    ISOLATION_MODES,
    MIN_DISK_MB,
)

DEFAULT_DATA_DIR = Path(os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share") / "pilldrops"
DEFAULT_TEMPLATES = "code-interpreter"


def _data_dir_option(f: Any) -> Any:
    return click.option("--data-dir", type=click.Path(path_type=Path), default=DEFAULT_DATA_DIR,
                        envvar="PILLDROPS_DATA_DIR", show_default=True,
                        help="where the store, templates and sandbox state live")(f)


def _control_plane_options(f: Any) -> Any:
    opts = [
        click.option("--unlimited-credits", is_flag=True, envvar="PILLDROPS_UNLIMITED_CREDITS",
                     help="turn credits off: no balance, never refuse or stop for lack of credits"),
        click.option("--credits-grace", type=float, default=60.0, show_default=True,
                     help="seconds running sandboxes keep going after their team's credits reach zero"),
        click.option("--rate-vcpu-s", type=float, default=0.0000140, show_default=True, help="USD per vCPU-second"),
        click.option("--rate-gb-s", type=float, default=0.0000045, show_default=True, help="USD per GB-second"),
        click.option("--rate-storage-gb-month", type=float, default=0.15, show_default=True,
                     help="USD per GB-month of paused storage"),
        click.option("--usage-commit-interval", type=float, default=30.0, show_default=True,
                     help="seconds of new running time after which a running sandbox's usage is committed to "
                          "the ledger (ends and pauses are committed at once; views accrue in between)"),
        click.option("--heartbeat-interval", type=float, default=5.0, show_default=True,
                     help="seconds between node heartbeats (which carry usage reports)"),
        click.option("--unreachable-after", type=float, default=None,
                     help="seconds without a heartbeat before a node is unreachable [default: 3 heartbeats]"),
        click.option("--lost-after", type=float, default=300.0, show_default=True,
                     help="seconds without a heartbeat before a node's sandboxes are lost (node_lost)"),
        click.option("--paused-retention", type=float, default=30 * 24 * 3600.0, show_default=True,
                     help="seconds a sandbox may stay paused before it is deleted (end_reason paused_expired)"),
        click.option("--public-host", default=None, envvar="PILLDROPS_PUBLIC_HOST", metavar="[SCHEME://]DOMAIN[:PORT]",
                     help="wildcard domain routed to this control plane: port URLs become "
                          "{port}-{id}.DOMAIN (host-based: an origin per sandbox port) instead of /ports/{id}/{port}/ on "
                          "the port-URL listener"),
        click.option("--ports-port", type=int, default=None, metavar="PORT",
                     help="port of the port-URL listener, which serves sandbox ports (/ports/{id}/{port}/) on an "
                          "origin of their own, never the API's and dashboard's [default: --port + 2; 0: any free]"),
        click.option("--ports-url", default=None, envvar="PILLDROPS_PORTS_URL", metavar="URL",
                     help="public address of the port-URL listener when a proxy is in front of it "
                          "(e.g. https://sandboxes.example.com) [default: the API's host on --ports-port]"),
        click.option("--default-isolation", type=click.Choice(ISOLATION_MODES), default=DEFAULT_ISOLATION,
                     show_default=True, envvar="PILLDROPS_DEFAULT_ISOLATION",
                     help="isolation of sandboxes whose create and template name none"),
        click.option("--default-disk-mb", type=click.IntRange(MIN_DISK_MB, DISK_MB_CAP), default=DEFAULT_DISK_MB,
                     show_default=True, envvar="PILLDROPS_DEFAULT_DISK_MB",
                     help="MiB of writable layer of sandboxes whose create and template name none"),
        click.option("--max-disk-mb", type=click.IntRange(MIN_DISK_MB, DISK_MB_CAP), default=DEFAULT_MAX_DISK_MB,
                     show_default=True, envvar="PILLDROPS_MAX_DISK_MB",
                     help="the largest disk_mb a create may ask for (past it: 400 invalid_request)"),
        click.option("--no-egress", is_flag=True, envvar="PILLDROPS_NO_EGRESS",
                     help="give sandboxes no network at all: a create asking for allow_internet_access or "
                          "network.allow_out is refused (egress_forbidden)"),
        click.option("--egress-allow", "egress_allow", multiple=True, metavar="CIDR",
                     help="cap egress (repeatable): sandboxes can only ever reach inside these CIDRs, whatever "
                          "their own policy; an allow_out outside them is refused (egress_forbidden)"),
    ]
    for opt in reversed(opts):
        f = opt(f)
    return f


def _liveness(kw: dict[str, Any]) -> dict[str, Any]:
    return {"heartbeat_interval": kw.pop("heartbeat_interval"), "unreachable_after": kw.pop("unreachable_after"),
            "lost_after": kw.pop("lost_after"), "paused_retention_s": kw.pop("paused_retention"),
            "default_isolation": kw.pop("default_isolation"), "default_disk_mb": kw.pop("default_disk_mb"),
            "max_disk_mb": kw.pop("max_disk_mb"), "public_host": kw.pop("public_host"),
            "ports_url": kw.pop("ports_url"), "egress": _egress(kw)}


def _egress(kw: dict[str, Any]) -> Any:
    from pilldrops.server.service.egress import EgressSettings
    try:
        return EgressSettings.of(kw.pop("no_egress"), kw.pop("egress_allow"))
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--egress-allow") from None


def _billing(kw: dict[str, Any], credits_usd: float | None) -> Any:
    """Billing settings; ``credits_usd`` None means no credit limit (``up``'s default)."""
    from pilldrops.server.domain.billing import Rates
    from pilldrops.server.service.billing import BillingSettings
    unlimited = kw.pop("unlimited_credits") or credits_usd is None
    return BillingSettings(
        rates=Rates(vcpu_s_usd=kw.pop("rate_vcpu_s"), gb_s_usd=kw.pop("rate_gb_s"),
                    storage_gb_month_usd=kw.pop("rate_storage_gb_month")),
        credits_enabled=not unlimited, initial_credits=credits_usd if credits_usd is not None else 5.0,
        grace_s=kw.pop("credits_grace"), commit_every_s=kw.pop("usage_commit_interval"))


def _templates_dir_option(f: Any) -> Any:
    return click.option("--templates-dir", "templates_dirs", multiple=True, type=click.Path(path_type=Path),
                        help="extra directory of template specs (*.toml); ~/.config/pilldrops/templates is "
                             "always read")(f)


def _template_store_options(f: Any) -> Any:
    f = click.option("--template-context-max-mb", type=int, default=256, show_default=True,
                     help="largest build context a `template build` may upload (MiB)")(f)
    return click.option("--template-store", type=click.Path(path_type=Path), default=None,
                        envvar="PILLDROPS_TEMPLATE_STORE",
                        help="directory of the template store: the layers of templates built once and "
                             "fetched by every node [default: DATA_DIR/template-store]; every control-plane "
                             "process of a fleet must name the same (shared) directory")(f)


_HELD: list[int] = []     # data-dir lock fds, held until the process exits


def _claim(data_dir: Path, roles: tuple[str, ...], ports: list[tuple[str, int, str]]) -> None:
    """Before any slow set-up: the data dir is ours (one control plane and one node agent per data dir) and
    the ports are free; either failing is one clear line, not a traceback minutes later."""
    from pilldrops._internal.serving import DataDirInUse, PortInUse, check_port, lock_data_dir
    taken: dict[int, str] = {}
    for _, port, option in ports:
        if port and port in taken:
            raise click.ClickException(f"{option} {port} is the same port as {taken[port]}: choose another")
        taken[port] = option
    try:
        for role in roles:
            _HELD.append(lock_data_dir(data_dir, role))
        for host, port, option in ports:
            check_port(host, port, option)
    except (DataDirInUse, PortInUse) as exc:
        raise click.ClickException(str(exc)) from None


def _logging(verbose: bool) -> None:
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def _console() -> Any:
    from rich.console import Console
    return Console(stderr=True)


@contextmanager
def _one_line_build_errors() -> Iterator[None]:
    """A failed template build is one clear line (what failed, its last output line, the log file), not a
    traceback."""
    from pilldrops.dockerfile import DockerfileError
    from pilldrops.node.templates import TemplateBuildError, TemplateSpecError
    try:
        yield
    except (TemplateBuildError, TemplateSpecError, DockerfileError) as exc:
        raise click.ClickException(str(exc)) from None


def build_templates(data_dir: Path, names: list[str], templates_dirs: tuple[Path, ...] = ()) -> None:
    """Build (or find cached) templates, with a live progress line per template."""
    with _one_line_build_errors():
        _build_templates(data_dir, names, templates_dirs)


def _build_templates(data_dir: Path, names: list[str], templates_dirs: tuple[Path, ...]) -> None:
    from pilldrops.node.templates import TemplateStore, default_spec_dirs
    store = TemplateStore(data_dir, spec_dirs=default_spec_dirs(templates_dirs))
    for name in names:
        try:
            store.get(name)
            continue
        except Exception:  # noqa: BLE001 - not built yet (or spec changed): build it below
            pass
        _with_progress(name, lambda progress, _name=name: store.ensure(_name, progress=progress))


def _with_progress(name: str, build: Any) -> Any:
    """Run ``build(progress)`` under a live status line (each step printed when stderr is not a terminal)."""
    console = _console()
    t0 = time.monotonic()
    if not console.is_terminal:     # no spinner in a log: say what the next minutes are spent on
        console.print(f"building template {name} (once; a few minutes for Debian templates) ...")
    with console.status(f"[bold]building template {name}[/] (once)") as status:
        def progress(line: str) -> None:
            status.update(f"[bold]building template {name}[/] {time.monotonic() - t0:5.0f}s [dim]{line[:90]}[/]")
            if not console.is_terminal and line.startswith(("[", "debootstrap", "building template")):
                console.print(f"  {line[:160]}", markup=False, emoji=False, highlight=False)  # each step
        tpl = build(progress)
    console.print(f"[green]✓[/] template [bold]{name}[/] built in {time.monotonic() - t0:.0f}s "
                  f"({tpl.size / 2**20:.0f} MiB)")
    return tpl


def _config_path() -> Path:
    from pilldrops._internal import config
    return config.config_path()


def _print_exports(api_url: str, secret: str | None, saved: Path | None) -> None:
    console = _console()
    if secret:
        console.print(f"[green]✓[/] API key created and saved to {saved}")
        click.echo(f"export PILLDROPS_API_URL={api_url} PILLDROPS_API_KEY={secret}")
    else:
        console.print(f"[green]✓[/] using the API key saved in {saved}")
        click.echo(f"export PILLDROPS_API_URL={api_url}")


async def _bootstrap_key(cp: Any, api_url: str) -> None:
    from pilldrops._internal import config
    saved = config.load_file().get("api_key")
    _, secret = await cp.services.auth.bootstrap(saved)
    path = config.config_path()
    if secret:
        path = config.save_file(api_url, secret)
    elif config.load_file().get("api_url") != api_url and saved:
        path = config.save_file(api_url, saved)
    _print_exports(api_url, secret, path)


# ---- up ---------------------------------------------------------------------------------------------

@click.command()
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", default=7070, show_default=True, type=int)
@click.option("--node-port", default=None, type=int, help="node agent / data plane port [default: port+1]")
@_data_dir_option
@click.option("--templates", "template_names", default=DEFAULT_TEMPLATES, show_default=True,
              help="comma-separated templates to build on first start")
@click.option("--keep-sandboxes", is_flag=True, help="leave running sandboxes alive when stopping")
@click.option("--node-name", default=None, help="name of the embedded node [default: hostname]")
@click.option("--capacity-vcpu", type=float, default=None,
              help="vCPU the node offers to the scheduler [default: cores × 512, sandbox CPU limits are caps]")
@click.option("--capacity-memory-mb", type=int, default=None, help="MiB the node offers [default: RAM × 32]")
@_templates_dir_option
@_control_plane_options
@click.option("--credits", "credits_usd", type=float, default=None, metavar="USD",
              help="give teams this many USD of credits and refuse creates at zero [default: no credit "
                   "limit on your own machine]")
@_template_store_options
@click.option("-v", "--verbose", is_flag=True)
def up(host: str, port: int, node_port: int | None, data_dir: Path, template_names: str,
       keep_sandboxes: bool, node_name: str | None, capacity_vcpu: float | None, capacity_memory_mb: int | None,
       templates_dirs: tuple[Path, ...], credits_usd: float | None, template_store: Path | None,
       template_context_max_mb: int, verbose: bool, **billing: Any) -> None:
    """Run the control plane and one node agent on this machine (SQLite), in the foreground.

    It is one person's machine: there is no credit limit unless --credits USD is given."""

    from pilldrops._internal.serving import run_served
    from pilldrops.node.agent import default_capacity
    _logging(verbose)
    ports_port = billing.pop("ports_port")
    ports_port = port + 2 if ports_port is None else ports_port
    _claim(data_dir, ("control-plane",),         # the node agent (a child process) takes the "node" lock
           [(host, port, "--port"), (host, node_port or port + 1, "--node-port"), (host, ports_port, "--ports-port")])
    names = [n.strip() for n in template_names.split(",") if n.strip()]
    build_templates(data_dir, names, templates_dirs)
    liveness = _liveness(billing)
    liveness.update(template_store=(template_store or data_dir / "template-store").resolve(),
                    max_context_bytes=template_context_max_mb << 20)
    cpu, mem = default_capacity()
    run_served(_up, host, (port, node_port or port + 1, ports_port), data_dir, keep_sandboxes, node_name,
              _billing(billing, credits_usd),
              liveness, (capacity_vcpu or cpu, capacity_memory_mb or mem), templates_dirs, verbose)


def _serve_ports(cp: Any, host: str, ports_port: int) -> Any:
    """The port-URL listener (bound now), and the URL service told the port it got."""
    from pilldrops._internal.serving import Served
    served = Served(cp.ports_app, host, ports_port)
    cp.services.urls.ports_port = served.port
    return served


async def _up(host: str, ports: tuple[int, int, int], data_dir: Path, keep: bool, node_name: str | None,
              billing: Any, liveness: dict[str, Any], capacity: tuple[float, int],
              templates_dirs: tuple[Path, ...], verbose: bool = False) -> None:
    """The control plane in this process, the node agent in a child process (``pilldrops node``, as in a
    fleet), so the two use both cores instead of sharing one interpreter lock. The child dies with us
    (SIGKILL included: its sandboxes live on and the next start re-adopts them); on Ctrl-C it tears its
    sandboxes down first, while the control plane still takes its reports, then the control plane stops."""
    import anyio

    from pilldrops._internal.serving import Served, wait_for_signal
    from pilldrops.cli._node_child import NodeChild
    from pilldrops.node.main import default_node_name
    from pilldrops.server.main import build_control_plane
    from pilldrops.server.store.sql import sqlite_url

    port, node_port, ports_port = ports
    token = secrets.token_urlsafe(32)
    api_url = f"http://{host}:{port}"
    name = node_name or default_node_name()
    cp = await build_control_plane(sqlite_url(data_dir / "pilldrops.db"), token, billing=billing, **liveness)
    cp_served = Served(cp.app, host, port)
    ports_served = _serve_ports(cp, host, ports_port)
    argv = ["--control-plane", api_url, "--host", host, "--port", str(node_port), "--name", name,
            "--capacity-vcpu", repr(capacity[0]), "--capacity-memory-mb", str(capacity[1]),
            "--data-dir", str(data_dir), "--templates", "",
            "--default-disk-mb", str(liveness["default_disk_mb"]), "--max-disk-mb", str(liveness["max_disk_mb"]),
            *(a for d in templates_dirs for a in ("--templates-dir", str(d))),
            *(["--keep-sandboxes"] if keep else []), *(["-v"] if verbose else [])]
    child = NodeChild(argv, token)
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(cp_served.serve)
            tg.start_soon(ports_served.serve)
            tg.start_soon(cp.run)
            try:
                node = await child.start_and_wait_registered(cp.store, name, f"http://{host}:{node_port}", tg)
            except (RuntimeError, TimeoutError) as exc:
                child.failed = str(exc) or "the node agent did not register in time"
            else:
                await _bootstrap_key(cp, api_url)
                _console().print("isolation: " + ", ".join(
                    f"{m} ({s.get('detail')})" if s.get("available") else f"[dim]{m}: no ({s.get('reason')})[/]"
                    for m, s in (node.isolation or {}).items()))
                _console().print(f"[green]✓[/] PillDrops is up at [bold]{api_url}[/] "
                                 f"(node {name}, data plane :{node_port}); Ctrl-C stops it")
                _console().print(f"  dashboard: [bold]{api_url}/[/] (sign in with the API key above, also in "
                                 f"{_config_path()})")
                _print_ports(cp, api_url)
                with anyio.CancelScope() as waiting:
                    child.on_lost = waiting.cancel         # the node agent keeps dying: stop too
                    await wait_for_signal()
                await child.stop()
            ports_served.stop()
            cp_served.stop()
            await anyio.sleep(0.2)
            tg.cancel_scope.cancel()
    finally:
        with anyio.CancelScope(shield=True):
            await child.kill()
            await cp.aclose()
    if child.failed:
        raise click.ClickException(child.failed)
    _console().print("stopped" + (" (sandboxes kept running)" if keep else ""))


def _print_ports(cp: Any, api_url: str) -> None:
    _console().print(f"  sandbox ports by URL: [bold]{cp.services.urls.ports_base(api_url)}/ports/…[/] "
                     f"(an origin of their own)")


# ---- serve ------------------------------------------------------------------------------------------

def _node_token(data_dir: Path, given: str | None) -> str:
    if given:
        return given
    path = data_dir / "node_token"
    if path.exists():
        return path.read_text().strip()
    token = secrets.token_urlsafe(32)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token)
    return token


@click.command()
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", default=7070, show_default=True, type=int)
@click.option("--db", default=None, help="database URL [default: SQLite in the data dir]")
@click.option("--node-token", envvar="PILLDROPS_NODE_TOKEN", default=None,
              help="token node agents must present [default: generated and kept in the data dir]")
@_data_dir_option
@_control_plane_options
@click.option("--free-credits", "--initial-credits", "free_credits", type=float, default=5.0, show_default=True,
              metavar="USD", help="USD of credits a new team starts with")
@_template_store_options
@click.option("-v", "--verbose", is_flag=True)
def serve(host: str, port: int, db: str | None, node_token: str | None, data_dir: Path, free_credits: float,
          template_store: Path | None, template_context_max_mb: int, verbose: bool, **billing: Any) -> None:
    """Run the control plane only. Nodes join with `pilldrops node --control-plane URL --node-token T`."""
    from pilldrops._internal.serving import run_served
    _logging(verbose)
    ports_port = billing.pop("ports_port")
    ports_port = port + 2 if ports_port is None else ports_port
    _claim(data_dir, ("control-plane",), [(host, port, "--port"), (host, ports_port, "--ports-port")])
    token = _node_token(data_dir, node_token)
    liveness = _liveness(billing)
    liveness.update(template_store=(template_store or data_dir / "template-store").resolve(),
                    max_context_bytes=template_context_max_mb << 20)
    run_served(_serve, host, (port, ports_port), db, token, data_dir, node_token is None,
               _billing(billing, free_credits), liveness)


async def _serve(host: str, ports: tuple[int, int], db: str | None, token: str, data_dir: Path, show_token: bool,
                 billing: Any, liveness: dict[str, Any]) -> None:
    import anyio

    from pilldrops._internal.serving import Served, wait_for_signal
    from pilldrops.server.main import build_control_plane
    from pilldrops.server.store.sql import sqlite_url

    data_dir.mkdir(parents=True, exist_ok=True)
    cp = await build_control_plane(db or sqlite_url(data_dir / "pilldrops.db"), token, billing=billing, **liveness)
    port, ports_port = ports
    served = Served(cp.app, host, port)
    ports_served = _serve_ports(cp, host, ports_port)
    api_url = f"http://{host}:{port}"
    try:
        await _bootstrap_key(cp, api_url)
        if show_token:
            _console().print(f"node token (kept in {data_dir / 'node_token'}):")
            click.echo(f"export PILLDROPS_NODE_TOKEN={token}")
        _console().print(f"[green]✓[/] control plane at [bold]{api_url}[/]")
        _print_ports(cp, api_url)
        async with anyio.create_task_group() as tg:
            tg.start_soon(served.serve)
            tg.start_soon(ports_served.serve)
            tg.start_soon(cp.run)
            await wait_for_signal()
            ports_served.stop()
            served.stop()
            await anyio.sleep(0.2)
            tg.cancel_scope.cancel()
    finally:
        await cp.aclose()


# ---- node -------------------------------------------------------------------------------------------

@click.command()
@click.option("--control-plane", "control_plane", required=True, envvar="PILLDROPS_CONTROL_PLANE",
              help="control plane URL, e.g. http://127.0.0.1:7070")
@click.option("--node-token", envvar="PILLDROPS_NODE_TOKEN", required=True)
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", default=7071, show_default=True, type=int)
@click.option("--public-url", default=None, help="URL clients use to reach this node [default: http://host:port]")
@click.option("--name", default=None, help="node name [default: hostname]")
@click.option("--capacity-vcpu", type=float, default=None, help="vCPU offered [default: cores × 512; sandbox CPU limits are caps]")
@click.option("--capacity-memory-mb", type=int, default=None, help="MiB offered [default: RAM × 32]")
@_data_dir_option
@click.option("--templates", "template_names", default="", help="comma-separated templates to build first")
@_templates_dir_option
@click.option("--keep-sandboxes", is_flag=True, help="leave running sandboxes alive when stopping")
@click.option("--default-disk-mb", type=click.IntRange(MIN_DISK_MB, DISK_MB_CAP), default=DEFAULT_DISK_MB,
              show_default=True, envvar="PILLDROPS_DEFAULT_DISK_MB",
              help="MiB of writable layer of a sandbox whose create names none (a control plane sends one)")
@click.option("--max-disk-mb", type=click.IntRange(MIN_DISK_MB, DISK_MB_CAP), default=DEFAULT_MAX_DISK_MB,
              show_default=True, envvar="PILLDROPS_MAX_DISK_MB", help="the largest disk this node gives a sandbox")
@click.option("-v", "--verbose", is_flag=True)
def node(control_plane: str, node_token: str, host: str, port: int, public_url: str | None, name: str | None,
         capacity_vcpu: float | None, capacity_memory_mb: int | None, data_dir: Path, template_names: str,
         templates_dirs: tuple[Path, ...], keep_sandboxes: bool, default_disk_mb: int, max_disk_mb: int,
         verbose: bool) -> None:
    """Run a node agent on this host (root) that registers with a control plane."""
    from pilldrops._internal.serving import run_served
    from pilldrops.cli._node_child import die_with_parent
    from pilldrops.node.agent import Settings, default_capacity
    from pilldrops.node.main import default_node_name
    die_with_parent()                     # started by `up`: die with it
    os.environ.pop("PILLDROPS_NODE_TOKEN", None)       # read already; not for the agent's subprocesses
    _logging(verbose)
    _claim(data_dir, ("node",), [(host, port, "--port")])
    build_templates(data_dir, [n.strip() for n in template_names.split(",") if n.strip()], templates_dirs)
    cpu, mem = default_capacity()
    settings = Settings(name=name or default_node_name(), public_url=public_url or f"http://{host}:{port}",
                        capacity_vcpu=capacity_vcpu or cpu, capacity_memory_mb=capacity_memory_mb or mem,
                        control_plane_url=control_plane.rstrip("/"), node_token=node_token,
                        keep_on_exit=keep_sandboxes, default_disk_mb=default_disk_mb, max_disk_mb=max_disk_mb)
    run_served(_node, settings, host, port, data_dir, templates_dirs, uvloop=False)


async def _node(settings: Any, host: str, port: int, data_dir: Path, templates_dirs: tuple[Path, ...]) -> None:
    import anyio

    from pilldrops._internal.serving import Served, wait_for_signal
    from pilldrops.node.main import build_node

    node = build_node(settings, data_dir, templates_dirs)
    served = Served(node.app, host, port)
    async with anyio.create_task_group() as tg:
        tg.start_soon(served.serve)
        await tg.start(node.agent.run)
        _console().print(f"[green]✓[/] node {settings.name} serving at {settings.public_url}, "
                         f"joining {settings.control_plane_url}")
        await wait_for_signal()
        await node.aclose()
        served.stop()
        await anyio.sleep(0.2)
        tg.cancel_scope.cancel()


def spec_chain(name: str, templates_dirs: tuple[Path, ...]) -> list[tuple[dict[str, Any], Path]]:
    """The spec documents of ``name`` and of its parents that are spec files here (packaged, the user's,
    ``--templates-dir``), child first, each with its folder (the root its copy sources are relative to)."""
    from pilldrops.node.templates import TemplateStore, default_spec_dirs, spec_document
    with _one_line_build_errors():
        specs = TemplateStore(Path("/nonexistent"), spec_dirs=default_spec_dirs(templates_dirs)).specs()
    out: list[tuple[dict[str, Any], Path]] = []
    seen: set[str] = set()
    while name in specs and name not in seen:
        seen.add(name)
        spec = specs[name]
        out.append((spec_document(spec), spec.path.parent))
        if spec.is_builder:          # built from debootstrap/busybox: the end of the chain
            break
        name = spec.base
    return out


# ---- template build on this machine (``template build --local``; the command is in cli/templates.py) ----

def local_build(name: str, data_dir: Path, force: bool, templates_dirs: tuple[Path, ...],
                dockerfile: Path | None = None, context: Path | None = None,
                build_args: dict[str, str] | None = None) -> None:
    """Build a template into a cached read-only layer on this machine (root): a spec by name, or with
    ``dockerfile`` a Dockerfile (its build context ``context``), each step labelled with its line."""
    from pilldrops.node.templates import TemplateStore, default_spec_dirs
    if os.geteuid() != 0:
        raise click.ClickException("building templates needs root (chroot, mount)")
    store = TemplateStore(data_dir, spec_dirs=default_spec_dirs(templates_dirs))
    if dockerfile is not None:
        from pilldrops.node.dockerfile import template_spec
        with _one_line_build_errors():
            spec, parsed = template_spec(dockerfile, context, name=name, build_args=build_args or {})
            for w in parsed.warnings:
                _console().print(f"[yellow]warning:[/] {w}", markup=True, emoji=False, highlight=False)
            tpl = _with_progress(name, lambda progress: store.build_spec(spec, progress, force=force))
    elif force:
        t0 = time.monotonic()
        with _one_line_build_errors(), _console().status(f"rebuilding {name}") as status:
            tpl = store.build(name, progress=lambda line: status.update(f"rebuilding {name}: {line[:90]}"),
                              force=True)
        _console().print(f"[green]✓[/] {name} rebuilt in {time.monotonic() - t0:.0f}s")
    else:
        build_templates(data_dir, [name], templates_dirs)
        tpl = store.get(name)
    click.echo(f"{tpl.name} {tpl.hash} layers={len(tpl.layers)} size={tpl.size}")
    sys.stdout.flush()


# ---- admin: teams and credits (on the store directly) ----------------------------------------------------

def _db_option(f: Any) -> Any:
    return click.option("--db", default=None, help="database URL [default: SQLite in the data dir]")(f)


def _admin(data_dir: Path, db: str | None, fn: Any) -> Any:
    import anyio

    from pilldrops._internal.clock import Clock
    from pilldrops.server.service.auth import AuthService
    from pilldrops.server.store.sql import Store, sqlite_url

    async def go() -> Any:
        store = await Store.open(db or sqlite_url(data_dir / "pilldrops.db"))
        try:
            return await fn(store, AuthService(store, Clock()))
        finally:
            await store.close()

    return anyio.run(go)


@click.group()
def teams() -> None:
    """Teams (admin, on this deployment's store)."""


@teams.command("create")
@click.argument("name")
@click.option("--credits", "credits_usd", type=float, default=5.0, show_default=True, help="starting credits, USD")
@_data_dir_option
@_db_option
@click.option("--json", "as_json", is_flag=True)
def teams_create(name: str, credits_usd: float, data_dir: Path, db: str | None, as_json: bool) -> None:
    """Create a team with its first API key (printed once)."""
    import json

    async def fn(store: Any, auth: Any) -> tuple[Any, Any]:
        if await store.team_by_id_or_name(name):
            raise click.ClickException(f"a team named {name!r} already exists")
        team = await auth.create_team(name, credits_usd)
        return team, await auth.create_key(team.id, "default")

    team, key = _admin(data_dir, db, fn)
    if as_json:
        click.echo(json.dumps({"id": team.id, "name": team.name, "credits_usd": team.credits_usd,
                               "api_key": key.secret}))
    else:
        click.echo(f"created team {team.name} ({team.id}) with ${team.credits_usd:.2f} of credits")
        click.echo(f"export PILLDROPS_API_KEY={key.secret}")


@teams.command("list")
@_data_dir_option
@_db_option
@click.option("--json", "as_json", is_flag=True)
def teams_list(data_dir: Path, db: str | None, as_json: bool) -> None:
    """List teams with their credit balance."""
    import json

    async def fn(store: Any, _auth: Any) -> list[Any]:
        return await store.list_teams()

    rows = [{"id": t.id, "name": t.name, "credits_usd": round(t.credits_usd, 9), "created_at": t.created_at.isoformat()}
            for t in _admin(data_dir, db, fn)]
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return
    from rich.console import Console
    from rich.table import Table
    table = Table("ID", "NAME", "CREDITS (USD)", "CREATED")
    for r in rows:
        table.add_row(r["id"], r["name"], f"{r['credits_usd']:.6f}", r["created_at"][:19])
    Console().print(table)


@click.group()
def credits() -> None:
    """Credits (admin, on this deployment's store)."""


@credits.command("add")
@click.argument("team")
@click.argument("amount", type=float)
@_data_dir_option
@_db_option
def credits_add(team: str, amount: float, data_dir: Path, db: str | None) -> None:
    """Add AMOUNT USD (negative to remove) to TEAM (id or name)."""
    async def fn(store: Any, _auth: Any) -> Any:
        found = await store.team_by_id_or_name(team)
        if found is None:
            raise click.ClickException(f"no team {team!r} (see `pilldrops teams list`)")
        return await store.add_credits(found.id, amount)

    t = _admin(data_dir, db, fn)
    click.echo(f"{t.name} ({t.id}): ${t.credits_usd:.6f}")
