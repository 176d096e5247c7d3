"""Colour-free helpers of ``Template.build`` (``_async/template.py`` and its generated twin).

The control-plane wire (the template store's, issue 19): the Dockerfile becomes a spec document here
(``pilldrops.dockerfile``, no node code); the files its COPY/ADD read go up as a tar named by its digest
(``PUT /v1/templates/contexts/{digest}``); ``POST /v1/templates/builds {"spec", "context", "force"}``
answers NDJSON events (``status``/``log``, then ``done`` or ``error``). A packaged parent (tiny, base,
code-interpreter) is sent first, as the CLI does: a cache hit when the store already holds it.
A build on this machine runs the ``pilldrops`` CLI instead."""

from __future__ import annotations

import hashlib
import io
import json
import os
import subprocess
import sys
import tarfile
import threading
import tomllib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pilldrops.dockerfile import DockerfileError, ParsedDockerfile, parse_dockerfile
from pilldrops.errors import InvalidRequest, PermissionDenied, RequestTimeout, ServerError, from_wire

PACKAGED = Path(__file__).resolve().parent.parent / "templates"     # the packaged specs (data files)
BUILDERS = ("busybox", "debootstrap")

LOG_TAIL = 200          # build-log lines kept on the result (all of them go to on_log)


@dataclass(frozen=True)
class BuiltTemplate:
    """A built template: create sandboxes with ``template=built.name``."""

    name: str
    hash: str | None = None            # the layer hash (local) or the store's top-layer digest
    size_bytes: int = 0
    log: list[str] = field(default_factory=list)       # the last LOG_TAIL lines of the build log
    version: int | None = None         # the template store's version (control plane)
    cached: bool = False               # the store already held this exact build


def _clean(info: tarfile.TarInfo) -> tarfile.TarInfo:
    info.mtime, info.uid, info.gid, info.uname, info.gname = 0, 0, 0, "", ""
    return info


def context_tar(parsed: ParsedDockerfile) -> bytes | None:
    """The files the Dockerfile's COPY/ADD read, at their context-relative paths, as a deterministic tar (the
    same files give the same digest); None when nothing is copied."""
    if not parsed.context_files and not parsed.context_dirs:
        return None
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for rel in sorted({*parsed.context_dirs, *parsed.context_files}):
            if rel != ".":
                tar.add(str(parsed.context / rel), arcname=rel, recursive=False, filter=_clean)
    return buf.getvalue()


def context_digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def _packaged(name: str) -> dict[str, Any] | None:
    f = PACKAGED / f"{name}.toml"
    if not f.is_file():
        return None
    data = tomllib.loads(f.read_text())
    return {**data, "steps": list(data.get("steps", []))}


def remote_plan(dockerfile: Path, context: Path, name: str,
                build_args: dict[str, str]) -> list[tuple[dict[str, Any], bytes | None]]:
    """What to send, in order: (spec document, context tar) for each packaged parent, then the Dockerfile's."""
    try:
        parsed = parse_dockerfile(dockerfile, context, name=name, build_args=build_args)
    except DockerfileError as exc:
        raise InvalidRequest(str(exc), details={"line": exc.line, "instruction": exc.instruction}) from None
    chain: list[tuple[dict[str, Any], bytes | None]] = [(parsed.document, context_tar(parsed))]
    base, seen = parsed.base, {name}
    m = base.startswith("debian-") and base.removeprefix("debian-")
    if m:         # FROM debian:<suite> (not bookworm): the suite's debootstrap minbase, its own template
        chain.append(({"name": base, "description": f"Debian {m} minbase", "from": f"debootstrap:{m}",
                       "workdir": "/", "steps": []}, None))
    while base not in BUILDERS and base not in seen and (doc := _packaged(base)) is not None:
        seen.add(base)
        chain.append((doc, None))
        base = doc.get("from", "")
    return list(reversed(chain))


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
    if kind == "status":
        _keep(log, str(ev.get("message", "")), on_log)
        return None
    if kind == "done":
        tpl: dict[str, Any] = ev.get("template") or {}
        return BuiltTemplate(name=str(tpl.get("name", "")), hash=tpl.get("digest") or tpl.get("hash"),
                             size_bytes=int(tpl.get("size_bytes") or 0), log=list(log),
                             version=tpl.get("version"), cached=bool(ev.get("cached")))
    return None


def local_build(name: str, dockerfile: Path, context: Path, build_args: dict[str, str], force: bool,
                on_log: Callable[[str], None] | None, data_dir: str | Path | None, timeout: float) -> BuiltTemplate:
    """``pilldrops template build NAME -f DOCKERFILE CONTEXT`` on this machine (as root), its log passed on
    line by line; a failure is :class:`InvalidRequest` with the CLI's one-line reason."""
    if os.geteuid() != 0:
        raise PermissionDenied("a local template build needs root (chroot, mount): run it as root, or build on "
                               "a control plane (local=False)")
    argv = [sys.executable, "-m", "pilldrops", "template", "build", name, str(context), "-f", str(dockerfile),
            "--local"]
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
