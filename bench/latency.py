"""PillDrops latency vs raw crun, measured in one run on the same machine and the same rootfs.

    .venv/bin/python bench/latency.py [--n 200] [--template tiny] [--runs 5] [--warmup 5] [--json out.json]

Needs root and crun. What it does:

1. Starts its own ``pilldrops up`` (subprocess in its own session, free ports, a temp data dir named
   ``pilldrops-bench*``, its own XDG_CONFIG_HOME, ``--node-name bench<pid>``), reads the API key from the
   config file ``up`` writes, and stops it with SIGINT at the end (also on Ctrl-C or errors).
2. N times, sequentially, through the sync SDK: ``Sandbox.create(template, memory_mb=256)`` (returns only
   once the sandbox runs: "create->ready"), ``--runs`` x ``sb.run("true")``, ``sb.kill()``.
3. Interleaved with each iteration, the baselines on the same template layers: raw ``crun run --detach``
   of an equivalent bundle (``oci_spec.build_spec``, overlay over the same layers, same namespaces and
   limits, pd-init as PID 1; only the crun call is timed, stdio on /dev/null, stderr to a file — a detached
   crun inherits its stdio), raw ``crun exec <id> true``, raw ``crun delete --force``, and host fork+exec of
   ``/bin/true``. Raw containers use their own ``crun --root`` and cgroup parent ``pilldrops-benchraw<pid>``.
4. Prints a table (p50/p99, ratio and overhead vs the baseline) and optionally writes raw numbers as JSON.
5. Checks that nothing is left: no crun containers in either root, no mounts under the data dir, no
   ``pilldrops-bench*`` cgroups; then removes the temp dirs.
"""

from __future__ import annotations

import argparse
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
import tempfile
import time
from pathlib import Path

from rich import box
from rich.console import Console
from rich.table import Table

from pilldrops import Sandbox
from pilldrops.node.isolation import cgroups
from pilldrops.node.isolation.host import require_crun
from pilldrops.node.isolation.mounts import mount_overlay, mounts_under, umount_all_under
from pilldrops.node.runtime.base import SandboxSpec
from pilldrops.node.runtime.crun import _nofile_limit
from pilldrops.node.runtime.oci_spec import build_spec
from pilldrops.node.templates import TemplateStore

PID = os.getpid()
RAW_PARENT = f"pilldrops-benchraw{PID}"
MEMORY_MB = 256
console = Console(width=160)


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


class Up:
    """A `pilldrops up` subprocess with its own data dir, config dir, ports and node name."""

    def __init__(self, root: Path, template: str) -> None:
        self.data, self.config, self.log = root / "data", root / "config", root / "up.log"
        port, node_port = free_port(), free_port()
        env = {**os.environ, "XDG_CONFIG_HOME": str(self.config), "PYTHONUNBUFFERED": "1"}
        for k in ("PILLDROPS_API_KEY", "PILLDROPS_API_URL", "E2B_API_KEY"):
            env.pop(k, None)
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "pilldrops", "up", "--port", str(port), "--node-port", str(node_port),
                 "--data-dir", str(self.data), "--templates", template, "--node-name", f"bench{PID}"],
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

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
        try:
            return self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


class Raw:
    """Raw crun containers equivalent to a PillDrops sandbox (same spec builder, layers and init)."""

    def __init__(self, data: Path, template: str) -> None:
        self.crun = require_crun()
        self.tpl = TemplateStore(data).get(template)
        self.init = data / "node" / "bin" / "pd-init"       # built by the node at start
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
        spec = SandboxSpec(id=cid, layers=self.tpl.layers, vcpu=1, memory_mb=MEMORY_MB, pids_limit=1024,
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


def host_true() -> float:
    dt, r = timed(["/bin/true"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return ok(dt, r, "")


def iteration(i: str, up: Up, raw: Raw, template: str, runs: int, out: dict[str, list[float]] | None) -> None:
    """One PillDrops cycle, then one raw crun cycle, then host forks; records into ``out`` unless warm-up."""
    rec = (lambda k, v: out[k].append(v * 1000)) if out is not None else (lambda k, v: None)
    t = time.perf_counter()
    sb = Sandbox.create(template=template, memory_mb=MEMORY_MB, api_url=up.url, api_key=up.key)
    rec("pd_create", time.perf_counter() - t)
    try:
        for _ in range(runs):
            t = time.perf_counter()
            r = sb.run("true")
            rec("pd_run", time.perf_counter() - t)
            assert r.exit_code == 0, r
    finally:
        t = time.perf_counter()
        sb.kill()
        rec("pd_kill", time.perf_counter() - t)
    cid = f"raw{PID}-{i}"
    try:
        d = raw.prepare(cid)
        rec("raw_run", raw.run(cid, d))
        for _ in range(runs):
            rec("raw_exec", raw.exec_true(cid))
        rec("raw_delete", raw.delete(cid))
    finally:
        raw.cleanup(cid)
    for _ in range(runs):
        rec("host_true", host_true())


def leftovers(data: Path, roots: list[Path]) -> list[str]:
    found = []
    for root in roots:
        if root.exists():
            r = sh([require_crun(), "--root", str(root), "list", "-q"], capture_output=True, text=True)
            found += [f"crun container {c} in {root}" for c in r.stdout.split()]
    found += [f"mount {m}" for m in mounts_under(data)]
    with open("/proc/self/mountinfo") as f:
        found += [f"mount {ln.split()[4]}" for ln in f if "pilldrops-bench" in ln.split()[4]]
    found += [f"cgroup {p}" for p in Path("/sys/fs/cgroup").glob("*/*") if f"pilldrops-bench{PID}" in p.name
              or p.name == RAW_PARENT]
    return sorted(set(found))


def machine() -> dict[str, str]:
    crun_v = sh([require_crun(), "--version"], capture_output=True, text=True).stdout.split("\n")[0]
    now = datetime.datetime.now().astimezone().isoformat("T", "seconds")
    return {"cores": str(os.cpu_count()), "kernel": platform.release(), "crun": crun_v,
            "python": platform.python_version(), "date": now}


def report(res: dict[str, list[float]], n: int, runs: int, info: dict[str, str]) -> None:
    console.print(f"[bold]PillDrops latency[/] — N={n} sandboxes, {runs} runs each; {info['cores']} cores, "
                  f"kernel {info['kernel']}, {info['crun']}, Python {info['python']}, {info['date']}")
    t = Table(box=box.ASCII2)
    for c in ("operation", "PillDrops p50", "p99", "baseline", "baseline p50", "p99", "ratio p50", "overhead p50"):
        t.add_column(c, justify="left" if c in ("operation", "baseline") else "right")
    rows = [("create→ready", "pd_create", "crun run --detach", "raw_run"),
            ('run("true")', "pd_run", "crun exec <id> true", "raw_exec"),
            ('run("true")', "pd_run", "host fork+exec /bin/true", "host_true"),
            ("kill", "pd_kill", "crun delete --force", "raw_delete")]
    for name, pk, bname, bk in rows:
        p50, p99, b50, b99 = pct(res[pk], 50), pct(res[pk], 99), pct(res[bk], 50), pct(res[bk], 99)
        t.add_row(name, f"{p50:.1f} ms", f"{p99:.1f} ms", bname, f"{b50:.1f} ms", f"{b99:.1f} ms",
                  f"{p50 / b50:.2f}×", f"{p50 - b50:+.1f} ms")
    console.print(t)
    c, r = pct(res["pd_create"], 50) / pct(res["raw_run"], 50), pct(res["pd_run"], 50) - pct(res["raw_exec"], 50)
    console.print(f"Targets: create p50 ≤ 1.3× raw crun (now {c:.2f}×, {'met' if c <= 1.3 else 'NOT met'}); "
                  f"run overhead over crun exec ≤ 3 ms (now {r:+.1f} ms, {'met' if r <= 3 else 'NOT met'}).")
    how = ("pd-init's control socket (fast exec path, PILLDROPS_EXEC=supervisor)"
           if os.environ.get("PILLDROPS_EXEC", "supervisor").strip().lower() != "crun"
           else "`crun exec --no-new-privs --env.. --cwd --pid-file` (PILLDROPS_EXEC=crun)")
    console.print(f"Notes: PillDrops run(\"true\") is `sh -c true` via {how} behind HTTP;\n"
                  "       raw kill times only `crun delete --force` (PillDrops kill also unmounts, removes the cgroups and the bundle). Samples: create/kill N, run N×runs.")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=200, help="timed sandboxes")
    ap.add_argument("--template", default="tiny")
    ap.add_argument("--runs", type=int, default=5, help='sb.run("true") / crun exec per sandbox')
    ap.add_argument("--warmup", type=int, default=5, help="untimed iterations first")
    ap.add_argument("--json", type=Path, help="write raw numbers (ms) here")
    a = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("bench/latency.py needs root (crun, mounts, cgroups)")
    tmp = Path(tempfile.mkdtemp(prefix=f"pilldrops-bench{PID}-"))
    up = raw = None
    res: dict[str, list[float]] = {k: [] for k in ("pd_create", "pd_run", "pd_kill", "raw_run", "raw_exec",
                                                   "raw_delete", "host_true")}
    info = machine()
    code = 0
    try:
        console.print(f"starting pilldrops up (data in {tmp}) ...")
        up = Up(tmp, a.template)
        raw = Raw(up.data, a.template)
        for i in range(a.warmup):
            iteration(f"w{i}", up, raw, a.template, a.runs, None)
        with console.status("") as st:
            for i in range(a.n):
                st.update(f"iteration {i + 1}/{a.n}")
                iteration(str(i), up, raw, a.template, a.runs, res)
    except KeyboardInterrupt:
        console.print("[yellow]interrupted[/]: cleaning up")
        code = 130
    finally:
        if raw is not None:
            raw.cleanup_all()
        if up is not None:
            rc = up.stop()
            if rc != 0:
                console.print(f"[red]pilldrops up exited {rc}[/]:\n{up.log.read_text()[-2000:]}")
                code = code or 1
        roots = [tmp / "data" / "node" / "crun", tmp / "data" / "benchraw" / "crun"]
        for _ in range(50):                         # teardown may settle for a moment
            if not (left := leftovers(tmp, roots)):
                break
            time.sleep(0.1)
        if left:
            console.print(f"[red]left behind ({len(left)}); {tmp} kept:[/]\n" + "\n".join(left))
            code = code or 1
        else:
            shutil.rmtree(tmp)
    if code == 0 and res["pd_create"]:
        report(res, a.n, a.runs, info)
        if a.json:
            a.json.write_text(json.dumps({"n": a.n, "runs": a.runs, "template": a.template, "machine": info,
                                          "ms": res}, indent=1))
    return code


if __name__ == "__main__":
    sys.exit(main())
