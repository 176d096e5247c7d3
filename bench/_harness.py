"""Shared pieces of the benchmarks: their own ``pilldrops up``, raw crun containers as a baseline, the
leak check, machine facts, /proc/meminfo and percentiles.

Everything a benchmark starts is named after its pid: the temp dir ``pilldrops-bench<pid>-*``, the node
``bench<pid>`` (so its cgroup parent is ``pilldrops-bench<pid>-<instance>``) and the raw containers'
cgroup parent ``pilldrops-benchraw<pid>``, so benchmarks and tests running at the same time never see
each other's sandboxes.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from pilldrops.node.isolation import cgroups
from pilldrops.node.isolation.host import require_crun
from pilldrops.node.isolation.mounts import mount_overlay, mounts_under, umount_all_under
from pilldrops.node.runtime.base import SandboxSpec
from pilldrops.node.runtime.crun import _nofile_limit
from pilldrops.node.runtime.oci_spec import build_spec
from pilldrops.node.templates import TemplateStore

PID = os.getpid()
NODE_NAME = f"bench{PID}"
MATCH = f"pilldrops-bench{PID}"          # temp dir, node cgroup parent (raw: pilldrops-benchraw<pid>)
RAW_PARENT = f"pilldrops-benchraw{PID}"
DEFAULT_DATA_DIR = Path(os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share") / "pilldrops"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pct(xs: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100) of a non-empty list."""
    s = sorted(xs)
    return s[max(0, math.ceil(q / 100 * len(s)) - 1)]


def sh(argv: list[str], **kw: object) -> subprocess.CompletedProcess:
    return subprocess.run(argv, stdin=subprocess.DEVNULL, check=False, **kw)  # type: ignore[call-overload]


def timed(argv: list[str], **kw: object) -> tuple[float, subprocess.CompletedProcess]:
    t = time.perf_counter()
    r = sh(argv, **kw)
    return time.perf_counter() - t, r


def ok(dt: float, r: subprocess.CompletedProcess, err: str | bytes) -> float:
    if r.returncode:
        raise RuntimeError(f"{' '.join(map(str, r.args))} exited {r.returncode}: {err!r}")
    return dt


def seed_templates(data: Path, names: list[str], cache: Path = DEFAULT_DATA_DIR) -> None:
    """Make the built templates ``names`` (and their parents) of the data dir ``cache`` usable in ``data``
    without rebuilding them: build them in ``cache`` if needed (a Debian template takes a minute the
    first time), then copy their manifests. A manifest names its layers by absolute path, so the
    benchmark's sandboxes use the cached read-only layers directly."""
    store = TemplateStore(cache)
    todo = list(names)
    while todo:
        name = todo.pop()
        tpl = store.ensure(name, progress=lambda m: print(f"  {m}", flush=True))
        src = cache / "templates" / name / tpl.hash
        dst = data / "templates" / name / tpl.hash
        dst.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src / "manifest.json", dst / "manifest.json")
        base = store.spec(name).base
        if not store.spec(name).is_builder:
            todo.append(base)


class Up:
    """A `pilldrops up` subprocess with its own data dir, config dir, ports and node name."""

    def __init__(self, root: Path, template: str, extra: list[str] | None = None,
                 seed: list[str] | None = None) -> None:
        self.data, self.config, self.log = root / "data", root / "config", root / "up.log"
        if seed:
            seed_templates(self.data, seed)
        port, node_port = free_port(), free_port()
        env = {**os.environ, "XDG_CONFIG_HOME": str(self.config), "PYTHONUNBUFFERED": "1"}
        for k in ("PILLDROPS_API_KEY", "PILLDROPS_API_URL", "E2B_API_KEY"):
            env.pop(k, None)
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "pilldrops", "up", "--port", str(port), "--node-port", str(node_port),
                 "--data-dir", str(self.data), "--templates", template, "--node-name", NODE_NAME,
                 *(extra or [])],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                start_new_session=True)      # our Ctrl-C must not reach it: we stop it ourselves
        self.url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 180
        while "is up at" not in self.log.read_text():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"pilldrops up did not start:\n{self.log.read_text()[-3000:]}")
            time.sleep(0.1)
        self.key = json.loads((self.config / "pilldrops" / "config.json").read_text())["api_key"]

    def stop(self, timeout: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


class Raw:
    """Raw crun containers equivalent to a PillDrops sandbox (same spec builder, layers and init)."""

    def __init__(self, data: Path, template: str, memory_mb: int = 256) -> None:
        self.crun = require_crun()
        self.tpl = TemplateStore(data).get(template)
        self.init = data / "node" / "bin" / "pd-init"       # built by the node at start
        self.memory_mb = memory_mb
        self.dir = data / "benchraw"
        self.root = self.dir / "crun"
        self.root.mkdir(parents=True)

    def cmd(self, *args: str) -> list[str]:
        return [self.crun, "--root", str(self.root), *args]

    def prepare(self, cid: str) -> Path:
        d = self.dir / cid
        for p in ("rootfs", "upper", "work"):
            (d / p).mkdir(parents=True)
        mount_overlay(d / "rootfs", list(self.tpl.layers), d / "upper", d / "work")
        spec = SandboxSpec(id=cid, layers=self.tpl.layers, vcpu=1, memory_mb=self.memory_mb, pids_limit=1024,
                           envs=dict(self.tpl.env), workdir=self.tpl.workdir or "/", hostname=cid)
        cfg = build_spec(spec, rootfs=d / "rootfs", init_path=self.init, cgroup_parent=RAW_PARENT,
                         nofile=_nofile_limit())
        (d / "config.json").write_text(json.dumps(cfg))
        return d

    def run(self, cid: str, d: Path) -> float:
        with open(d / "crun.err", "wb") as err:                  # never a pipe for a detached crun
            dt, r = timed(self.cmd("run", "--detach", "--bundle", str(d), cid), stdout=subprocess.DEVNULL,
                          stderr=err)
        return ok(dt, r, (d / "crun.err").read_text())

    def exec_true(self, cid: str) -> float:
        dt, r = timed(self.cmd("exec", cid, "true"), capture_output=True)
        return ok(dt, r, r.stderr)

    def delete(self, cid: str) -> float:
        dt, r = timed(self.cmd("delete", "--force", cid), capture_output=True)
        return ok(dt, r, r.stderr)

    def cleanup(self, cid: str) -> None:
        sh(self.cmd("delete", "--force", cid), capture_output=True)
        cgroups.remove_tree(f"{RAW_PARENT}/{cid}")
        umount_all_under(self.dir / cid)
        shutil.rmtree(self.dir / cid, ignore_errors=True)

    def cleanup_all(self) -> None:
        r = sh(self.cmd("list", "--format", "json"), capture_output=True)
        ids = {c["id"] for c in json.loads(r.stdout or b"[]") or []}
        ids |= {p.name for p in self.dir.iterdir() if p.is_dir() and p.name != "crun"}
        for cid in ids:
            self.cleanup(cid)
        cgroups.remove_tree(RAW_PARENT)


def leftovers(data: Path, roots: list[Path], procs: bool = False) -> list[str]:
    """What a benchmark left: crun containers in ``roots``, mounts under ``data`` or named like our temp
    dir, our cgroups (either parent, any depth of interest) and, with ``procs``, live processes in them."""
    found = []
    for root in roots:
        if root.exists():
            r = sh([require_crun(), "--root", str(root), "list", "-q"], capture_output=True, text=True)
            found += [f"crun container {c} in {root}" for c in r.stdout.split()]
    found += [f"mount {m}" for m in mounts_under(data)]
    with open("/proc/self/mountinfo") as f:
        found += [f"mount {ln.split()[4]}" for ln in f if MATCH in ln.split()[4]]
    found += [f"cgroup {p}" for p in Path("/sys/fs/cgroup").glob("*/*") if f"{MATCH}" in p.name
              or p.name == RAW_PARENT]
    if procs:
        for p in Path("/proc").iterdir():
            if not p.name.isdigit():
                continue
            try:
                cg = (p / "cgroup").read_text()
                stat = (p / "stat").read_bytes()
            except OSError:
                continue
            if (MATCH in cg or RAW_PARENT in cg) and not stat[stat.rindex(b")") + 2:].startswith(b"Z"):
                found.append(f"process {p.name}")
    return sorted(set(found))


def check_leaks(tmp: Path, roots: list[Path], settle: float = 5.0, procs: bool = True) -> list[str]:
    """``leftovers`` after up to ``settle`` seconds for teardown to finish; empty when clean."""
    deadline = time.monotonic() + settle
    while (left := leftovers(tmp, roots, procs)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


def machine() -> dict[str, str]:
    crun_v = sh([require_crun(), "--version"], capture_output=True, text=True).stdout.split("\n")[0]
    now = datetime.datetime.now().astimezone().isoformat("T", "seconds")
    mem = meminfo()["MemTotal"] / 1024**2
    return {"cores": str(os.cpu_count()), "kernel": platform.release(), "crun": crun_v,
            "python": platform.python_version(), "date": now, "mem": f"{mem:.1f} GiB"}


def meminfo() -> dict[str, int]:
    """/proc/meminfo in bytes."""
    out = {}
    with open("/proc/meminfo") as f:
        for line in f:
            k, v = line.split(":", 1)
            parts = v.split()
            out[k] = int(parts[0]) * (1024 if parts[1:] == ["kB"] else 1)
    return out


def rss(pid: int) -> int:
    """Resident set size of one process, bytes (0 when gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return next(int(ln.split()[1]) * 1024 for ln in f if ln.startswith("VmRSS:"))
    except (OSError, StopIteration):
        return 0
