"""``pilldrops sandbox shell ID``, ``sandbox exec -it ID CMD`` and ``sandbox logs ID``: interactive terminals
and background-process output, over the node's data plane (``WS /processes/pty``, ``/processes``; docs/api.md).

The terminal is a real PTY inside the sandbox. This side puts the local terminal in raw mode, so every key
(Ctrl-C, Ctrl-D, Ctrl-Z, arrows) goes to the sandbox as it is and the sandbox's terminal does the rest:
Ctrl-C becomes SIGINT for the sandbox's foreground job. SIGWINCH here becomes a resize message there. The
command's exit code is this command's exit code. The shell needs the node's data plane to be reachable
from here (the address the create/connect answer gives); the control plane does not relay WebSockets.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import shutil
import signal
import sys
import threading
from typing import Any

import click
import httpx

from pilldrops.cli import _output
from pilldrops.cli.main import CliState
from pilldrops.cli.sandbox import sandbox
from pilldrops.errors import InvalidState, NotSupported, from_wire
from pilldrops.sdk._sync.sandbox import Sandbox

pass_state = click.make_pass_decorator(CliState, ensure=True)
DEFAULT_SHELL = "if command -v bash >/dev/null 2>&1; then exec bash -l; else exec sh -l; fi"


def _data_plane(state: CliState, sandbox_id: str) -> tuple[str, dict[str, str], str]:
    sb = Sandbox.connect(sandbox_id, **state.sdk_options())
    info = sb.info
    if not info.envd_url or not info.access_token:
        raise NotSupported(f"sandbox {sandbox_id}'s node data plane is not reachable from here (no address "
                           "in the connect answer): the shell and logs need it")
    return info.envd_url.rstrip("/"), {"X-Access-Token": info.access_token}, info.id


def _size() -> tuple[int, int]:
    cols, rows = shutil.get_terminal_size((80, 24))
    return rows, cols


def run_terminal(url: str, headers: dict[str, str], sandbox_id: str, cmd: str | list[str], *,
                 envs: dict[str, str], cwd: str | None) -> int:
    """Attach this terminal to a new PTY process in the sandbox until it exits; returns its exit code."""
    from websockets.exceptions import ConnectionClosed
    from websockets.sync.client import connect

    ws_url = "ws" + url[len("http"):] + f"/v1/sandboxes/{sandbox_id}/processes/pty"
    rows, cols = _size()
    term = os.environ.get("TERM", "xterm-256color")
    start = {"cmd": cmd, "envs": {"TERM": term, **envs}, "cwd": cwd, "pty": {"rows": rows, "cols": cols}}
    interactive = sys.stdin.isatty()
    with connect(ws_url, additional_headers=headers, max_size=2**22, open_timeout=15) as ws:
        ws.send(json.dumps(start))
        first = json.loads(ws.recv())
        if first.get("type") == "error":
            raise from_wire(400, {"error": first})
        done = threading.Event()
        saved = _raw_mode() if interactive else None
        old_winch = None
        if interactive and hasattr(signal, "SIGWINCH"):
            def on_winch(_sig: int, _frm: Any) -> None:
                r, c = _size()
                with contextlib.suppress(Exception):
                    ws.send(json.dumps({"type": "resize", "rows": r, "cols": c}))
            old_winch = signal.signal(signal.SIGWINCH, on_winch)

        def pump_stdin() -> None:
            fd = sys.stdin.fileno()
            try:
                while not done.is_set():
                    data = os.read(fd, 65536)
                    if not data:
                        ws.send(json.dumps({"type": "eof"}))
                        return
                    ws.send(data)
            except (OSError, ConnectionClosed):
                return

        threading.Thread(target=pump_stdin, daemon=True).start()
        code = 1
        out = sys.stdout.buffer
        try:
            for msg in ws:
                if isinstance(msg, bytes):
                    out.write(msg)
                    out.flush()
                    continue
                ev = json.loads(msg)
                if ev.get("type") == "exit":
                    code = int(ev.get("exit_code") if ev.get("exit_code") is not None else 1)
                    break
                if ev.get("type") == "error":          # not fatal: e.g. input after the terminal closed
                    sys.stderr.write(f"\r\npilldrops: {ev.get('message')}\r\n")
                    sys.stderr.flush()
        except ConnectionClosed:
            pass
        finally:
            done.set()
            if saved is not None:
                _restore(saved)
            if old_winch is not None:
                signal.signal(signal.SIGWINCH, old_winch)
    return code


def _raw_mode() -> Any:
    import termios
    import tty
    fd = sys.stdin.fileno()
    saved = termios.tcgetattr(fd)
    tty.setraw(fd, termios.TCSANOW)          # not TCSAFLUSH: keys typed ahead of the connection still count
    return saved


def _restore(saved: Any) -> None:
    import termios
    with contextlib.suppress(Exception):
        termios.tcsetattr(sys.stdin.fileno(), termios.TCSADRAIN, saved)


@sandbox.command("shell")
@click.argument("sandbox_id")
@click.option("--cwd", default=None, help="Working directory inside the sandbox.")
@click.option("--env", "-e", multiple=True, metavar="KEY=VALUE", help="Environment variable (repeatable).")
@pass_state
@click.pass_context
def shell(ctx: click.Context, state: CliState, sandbox_id: str, cwd: str | None, env: tuple[str, ...]) -> None:
    """An interactive shell in the sandbox (bash when it has one, else sh) on a real terminal.

    Keys go through as typed: Ctrl-C interrupts what runs in the sandbox, Ctrl-D at the prompt or `exit`
    leaves. The window size follows this terminal's. Exits with the shell's exit code.
    """
    url, headers, sid = _data_plane(state, sandbox_id)
    ctx.exit(run_terminal(url, headers, sid, DEFAULT_SHELL, envs=_output.parse_pairs(env, "--env"), cwd=cwd))


def exec_interactive(state: CliState, sandbox_id: str, cmd: tuple[str, ...], *, envs: dict[str, str],
                     cwd: str | None) -> int:
    """``exec -it``: the command on a terminal in the sandbox, attached to this one."""
    url, headers, sid = _data_plane(state, sandbox_id)
    command: str | list[str] = cmd[0] if len(cmd) == 1 else list(cmd)
    return run_terminal(url, headers, sid, command, envs=envs, cwd=cwd)


def exec_background(state: CliState, sandbox_id: str, cmd: tuple[str, ...], *, envs: dict[str, str],
                    cwd: str | None, timeout: float | None) -> int:
    """``exec --background``: start it, print its pid, return at once (its output: ``sandbox logs``)."""
    url, headers, sid = _data_plane(state, sandbox_id)
    command: str | list[str] = cmd[0] if len(cmd) == 1 else list(cmd)
    body = {"cmd": command, "envs": envs, "cwd": cwd, "timeout": timeout}
    with httpx.Client(base_url=url, headers=headers, timeout=30) as c:
        r = c.post(f"/v1/sandboxes/{sid}/processes", params={"detach": "true"}, json=body)
        _check(r)
        pid = json.loads(r.text.splitlines()[0])["pid"]
    click.echo(pid)
    return 0


def _check(r: httpx.Response) -> None:
    if r.status_code >= 300:
        r.read()
        try:
            body = r.json()
        except ValueError:
            body = None
        raise from_wire(r.status_code, body)


@sandbox.command("logs")
@click.argument("sandbox_id")
@click.option("--pid", type=int, default=None, help="Only this process.")
@click.option("--follow", "-f", is_flag=True, help="Then keep printing what it writes until it exits.")
@pass_state
def logs(state: CliState, sandbox_id: str, pid: int | None, follow: bool) -> None:
    """What the sandbox's background processes wrote.

    Kept for processes started through the process service (`exec --background`, `shell`, E2B
    `commands.run`): the newest 256 KiB of each, for the running ones and the last 8 that exited, while the
    sandbox lives. Output of `exec`/`run` commands is not kept (it was streamed to their caller), nor
    anything a sandbox's own daemons write elsewhere.
    """
    url, headers, sid = _data_plane(state, sandbox_id)
    base = f"/v1/sandboxes/{sid}/processes"
    with httpx.Client(base_url=url, headers=headers, timeout=httpx.Timeout(30, read=None)) as c:
        r = c.get(base)
        _check(r)
        procs = [p for p in r.json()["items"] if pid is None or p["pid"] == pid]
        if not procs:
            _output.err_console.print(f"no {'such ' if pid is not None else ''}background process in {sid}")
            return
        out = sys.stdout.buffer
        for p in procs:
            status = "running" if p["running"] else f"exited {p['exit_code']}"
            _output.err_console.print(f"[bold]== pid {p['pid']} ({status}): {' '.join(p['cmd'])}[/bold]")
            r = c.get(f"{base}/{p['pid']}/output")
            _check(r)
            body = r.json()
            if body.get("dropped_bytes"):
                _output.err_console.print(f"[yellow]({body['dropped_bytes']} older bytes not kept)[/yellow]")
            for ev in body["events"]:
                out.write(base64.b64decode(ev.get("data") or ""))
            out.flush()
        running = [p for p in procs if p["running"]]
        if follow and running:           # (nothing runs any more: what was kept is all there is)
            if len(running) != 1:
                raise InvalidState(f"--follow follows one process; {len(running)} run: pick one with --pid")
            with c.stream("GET", f"{base}/{running[0]['pid']}/events") as resp:
                _check(resp)
                for line in resp.iter_lines():
                    ev = json.loads(line) if line.strip() else {}
                    if ev.get("data"):
                        out.write(base64.b64decode(ev["data"]))
                        out.flush()
