"""Colour-free helpers of ``Template.build`` (``_async/template.py`` and its generated twin): the wire of a
control-plane build (query, NDJSON events) and a build on this machine through the ``pilldrops`` CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pilldrops.errors import InvalidRequest, PermissionDenied, RequestTimeout, ServerError, from_wire

LOG_TAIL = 200          # build-log lines kept on the result (all of them go to on_log)


@dataclass(frozen=True)
class BuiltTemplate:
    """A built template: create sandboxes with ``template=built.name``."""

    name: str
    hash: str | None = None
    size_bytes: int = 0
    log: list[str] = field(default_factory=list)       # the last LOG_TAIL lines of the build log


def build_params(build_args: dict[str, str] | None, force: bool) -> list[tuple[str, str]]:
    params = [("build_arg", f"{k}={v}") for k, v in (build_args or {}).items()]
    return params + ([("force", "true")] if force else [])


def _keep(log: list[str], line: str, on_log: Callable[[str], None] | None) -> None:
    log.append(line)
    del log[:-LOG_TAIL]
    if on_log is not None:
        on_log(line)


def build_event(line: str, log: list[str], on_log: Callable[[str], None] | None) -> BuiltTemplate | None:
    """One NDJSON line of a build stream: a log line (kept, passed to ``on_log``), the result, or an error
    (raised, typed by its code)."""
    if not line.strip():
        return None
    try:
        ev = json.loads(line)
    except ValueError:
        raise ServerError(f"unreadable build event: {line[:200]!r}") from None
    kind = ev.get("type") if isinstance(ev, dict) else None
    if kind == "log":
        _keep(log, str(ev.get("line", "")), on_log)
        return None
    if kind == "error":
        raise from_wire(500, {"error": ev.get("error") if isinstance(ev.get("error"), dict) else {}})
    if kind == "done":
        tpl: dict[str, Any] = ev.get("template") or {}
        return BuiltTemplate(name=str(tpl.get("name", "")), hash=tpl.get("hash"),
                             size_bytes=int(tpl.get("size_bytes") or 0), log=list(log))
    return None


def local_build(name: str, dockerfile: Path, context: Path, build_args: dict[str, str], force: bool,
                on_log: Callable[[str], None] | None, data_dir: str | Path | None, timeout: float) -> BuiltTemplate:
    """``pilldrops template build NAME -f DOCKERFILE CONTEXT`` on this machine (as root), its log passed on
    line by line; a failure is :class:`InvalidRequest` with the CLI's one-line reason."""
    if os.geteuid() != 0:
        raise PermissionDenied("a local template build needs root (chroot, mount): run it as root, or build on "
                               "a control plane (local=False)")
    argv = [sys.executable, "-m", "pilldrops", "template", "build", name, str(context), "-f", str(dockerfile)]
    for k, v in build_args.items():
        argv += ["--build-arg", f"{k}={v}"]
    if force:
        argv.append("--force")
    if data_dir is not None:
        argv += ["--data-dir", str(data_dir)]
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, errors="replace", env={**os.environ, "COLUMNS": "200"})
    timer = threading.Timer(timeout, proc.kill)
    timer.start()
    log: list[str] = []
    try:
        assert proc.stderr is not None and proc.stdout is not None
        for raw in proc.stderr:
            _keep(log, raw.rstrip("\n"), on_log)
        out = proc.stdout.read()
        code = proc.wait()
    finally:
        timer.cancel()
    if code < 0:
        raise RequestTimeout(f"the local build of {name} took longer than {timeout:.0f} s and was stopped")
    if code != 0:
        reason = next((ln[len("Error: "):] for ln in reversed(log) if ln.startswith("Error: ")),
                      log[-1] if log else f"exit {code}")
        raise InvalidRequest(reason, details={"template": name, "log": log[-20:]})
    last = out.strip().splitlines()[-1].split() if out.strip() else []
    size = next((int(p.split("=", 1)[1]) for p in last if p.startswith("size=")), 0)
    return BuiltTemplate(name=last[0] if last else name, hash=last[1] if len(last) > 1 else None,
                         size_bytes=size, log=log)
