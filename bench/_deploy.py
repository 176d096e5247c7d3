"""Restartable deployments for the chaos and soak benchmarks: ``pilldrops up`` (control plane and node agent
in one process, SQLite) or the fleet form (``pilldrops serve`` on PostgreSQL or SQLite + ``pilldrops node``),
each process SIGKILL-able and restartable on the same ports and data dirs; a watcher of the node's crun
state dir (what the node really ran, and for how long); the control plane's history; and what a deployment
holds right now (containers, sandbox cgroups, mounts, processes, data-dir files).

Names follow ``_harness``: the temp dir is ``pilldrops-bench<pid>-*`` and the node is ``bench<pid>``, so its
cgroups are ``pilldrops-bench<pid>-<instance>/<sandbox>`` and never collide with other runs on the machine.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import httpx
from _harness import MATCH, NODE_NAME, free_port, seed_templates

from pilldrops.node.isolation.mounts import mounts_under

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from tests.e2e.fleet import clean_env
from tests.pg import Postgres


@dataclass
class Role:
    """One PillDrops process (``python -m pilldrops ARGS``), output appended to ``log``."""

    name: str
    args: list[str]
    log: Path
    env: dict[str, str]
    ready: str
    proc: subprocess.Popen[bytes] | None = None
    starts: int = 0
    start_s: list[float] = field(default_factory=list)     # seconds from spawn to ready, per start

    def start(self, timeout: float = 300) -> str:
        mark = self.log.stat().st_size if self.log.exists() else 0
        t0 = time.monotonic()
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen([sys.executable, "-m", "pilldrops", *self.args], stdout=out,
                                         stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=self.env,
                                         start_new_session=True)   # our Ctrl-C is ours to handle
        while True:
            with open(self.log, "rb") as f:
                f.seek(mark)
                text = f.read().decode(errors="replace")
            if self.ready in text:
                self.starts += 1
                self.start_s.append(time.monotonic() - t0)
                return text
            if self.proc.poll() is not None or time.monotonic() - t0 > timeout:
                self.kill9()
                raise RuntimeError(f"{self.name} did not start:\n{text[-3000:]}")
            time.sleep(0.05)

    @property
    def pid(self) -> int:
        return self.proc.pid if self.proc is not None and self.proc.poll() is None else 0

    def kill9(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=60)

    def stop(self, timeout: float = 300) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill9()
            return -9


class Deployment:
    """``form="up"``: one ``up`` process (roles ``up``); ``form="fleet"``: ``serve`` (role ``cp``) on ``db``
    (a URL, or None for SQLite) and one ``node`` (role ``node``). ``node_role``/``cp_role`` name the process
    holding each duty (the same one for ``up``)."""

    def __init__(self, root: Path, form: str, template: str, *, db: str | None = None,
                 heartbeat_s: float = 1.0, extra: list[str] | None = None) -> None:
        self.root, self.form, self.template = root, form, template
        self.env = clean_env(root / "config", PYTHONUNBUFFERED="1")
        port, node_port = free_port(), free_port()
        self.url = f"http://127.0.0.1:{port}"
        hb = ["--heartbeat-interval", str(heartbeat_s)]
        self.roles: dict[str, Role] = {}
        if form == "up":
            self.node_data = root / "data"
            seed_templates(self.node_data, [template]) if template != "tiny" else None
            self.roles["up"] = Role("up", ["up", "--port", str(port), "--node-port", str(node_port), "--ports-port", "0", "--data-dir",
                                           str(self.node_data), "--templates", template, "--node-name", NODE_NAME,
                                           "--unlimited-credits", *hb, *(extra or [])],
                                    root / "up.log", self.env, "is up at")
            self.node_role = self.cp_role = "up"
            self.roles["up"].start()
            self.key = json.loads((root / "config" / "pilldrops" / "config.json").read_text())["api_key"]
        else:
            self.node_data = root / "node"
            args = ["serve", "--port", str(port), "--ports-port", "0", "--data-dir", str(root / "cp"), "--unlimited-credits", *hb]
            self.roles["cp"] = Role("cp", args + (["--db", db] if db else []), root / "serve.log", self.env,
                                    "control plane at")
            out = self.roles["cp"].start()
            self.key = re.search(r"PILLDROPS_API_KEY=(\S+)", out).group(1)  # type: ignore[union-attr]
            token = re.search(r"PILLDROPS_NODE_TOKEN=(\S+)", out).group(1)  # type: ignore[union-attr]
            if template != "tiny":
                seed_templates(self.node_data, [template])
            self.roles["node"] = Role("node", ["node", "--control-plane", self.url, "--node-token", token, "--port",
                                               str(node_port), "--data-dir", str(self.node_data), "--name",
                                               NODE_NAME, "--templates", template, *(extra or [])],
                                      root / "node.log", self.env, "serving at")
            self.roles["node"].start()
            self.node_role, self.cp_role = "node", "cp"
        self.wait_ready()

    @property
    def crun_root(self) -> Path:
        return self.node_data / "node" / "crun"

    def api(self, timeout: float = 60) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {self.key}"}, timeout=timeout)

    def wait_ready(self, timeout: float = 120) -> float:
        """Until the control plane answers and lists the node ready with the template; seconds waited."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            try:
                with self.api(timeout=5) as c:
                    items = c.get("/v1/nodes").json()["items"]
                if any(n["state"] == "ready" and self.template in n["templates"] for n in items):
                    return time.monotonic() - t0
            except (httpx.HTTPError, KeyError, ValueError):
                pass
            time.sleep(0.1)
        raise RuntimeError(f"no ready node with {self.template} after {timeout} s")

    def stop(self) -> dict[str, int | None]:
        order = ["node", "cp"] if self.form == "fleet" else ["up"]
        return {r: self.roles[r].stop() for r in order}


_WATCH = r"""
import json, os, signal, sys, time
root, every, out = sys.argv[1], float(sys.argv[2]), sys.argv[3]
first, last, before, after, stop = {}, {}, {}, {}, []
prev, seen, gap = None, set(), 0.0      # the previous listing's time and ids; the longest gap between listings
signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
while not stop:
    now = time.time()
    try:
        ids = set(os.listdir(root))
    except OSError:
        ids = set()
    for cid in ids - seen:
        first[cid] = now                  # appeared in (prev, now]
        before[cid] = prev if prev is not None else now
    for cid in seen - ids:
        after[cid] = now                  # vanished in (last, now]
    for cid in ids:
        last[cid] = now
    if prev is not None:
        gap = max(gap, now - prev)
    prev, seen = now, ids
    time.sleep(every)
with open(out, "w") as f:
    json.dump({"first": first, "last": last, "before": before, "after": after, "gap": gap}, f)
"""


class CrunWatch:
    """What the node ran: a separate process at raised priority (the benchmark's own threads and a loaded
    machine must not starve it) listing the crun state dir every ``every`` s (one ``listdir``); for each
    container id the wall time (``time.time()``) it was first and last seen, and the listings around them:
    it appeared after ``before`` and vanished before ``after`` (exact bounds however late the listings came;
    ``gap`` is the longest time between two listings). The interval includes the container's creation and
    teardown, which are not billed. A container id that comes back (never, ids are unique) is not handled."""

    def __init__(self, crun_root: Path, every: float = 0.1) -> None:
        self.root, self.every = crun_root, every
        self.first: dict[str, float] = {}
        self.last: dict[str, float] = {}
        self.before: dict[str, float] = {}
        self.after: dict[str, float] = {}
        self.gap = 0.0
        self._out = crun_root.parent / "crun-watch.json"
        self._p = subprocess.Popen([sys.executable, "-c", _WATCH, str(crun_root), str(every), str(self._out)],
                                   stdin=subprocess.DEVNULL, preexec_fn=lambda: os.nice(-10))  # noqa: PLW1509

    def stop(self) -> None:
        if self._p.poll() is None:
            self._p.send_signal(signal.SIGTERM)
            self._p.wait(timeout=30)
        try:
            data = json.loads(self._out.read_text())
            self.first, self.last = data["first"], data["last"]
            self.before, self.after, self.gap = data["before"], data["after"], data["gap"]
        except (OSError, ValueError, KeyError):
            pass

    def lifetime(self, cid: str) -> float | None:
        """Seconds the node held the container (± ``every``), None if never seen."""
        if cid not in self.first:
            return None
        return self.last[cid] - self.first[cid] + self.every

    def held(self, cid: str) -> tuple[float, float] | None:
        """(appeared after, vanished before): the container's state dir existed only inside this interval
        (``inf`` as the end if it was still there at the last listing); None if never seen."""
        if cid not in self.first:
            return None
        return self.before[cid], self.after.get(cid, float("inf"))


def history(dep: Deployment) -> list[dict]:  # type: ignore[type-arg]
    """Every history record of the deployment's team (all pages)."""
    out: list[dict] = []  # type: ignore[type-arg]
    cursor = None
    with dep.api(timeout=120) as c:
        while True:
            page = c.get("/v1/history", params={"limit": 1000, **({"cursor": cursor} if cursor else {})})
            page.raise_for_status()
            body = page.json()
            out += body["items"]
            cursor = body.get("next_cursor")
            if not cursor:
                return out


def live_sandboxes(dep: Deployment) -> list[dict]:  # type: ignore[type-arg]
    """Sandboxes the control plane lists as not ended."""
    out: list[dict] = []  # type: ignore[type-arg]
    with dep.api() as c:
        for state in ("pending", "starting", "running", "paused", "pausing", "resuming", "stopping"):
            cursor = None
            while True:
                r = c.get("/v1/sandboxes", params={"state": state, "limit": 1000, **({"cursor": cursor} if cursor else {})})
                r.raise_for_status()
                out += r.json()["items"]
                cursor = r.json().get("next_cursor")
                if not cursor:
                    break
    return out


def containers(crun_root: Path) -> list[str]:
    r = subprocess.run(["crun", "--root", str(crun_root), "list", "-q"], capture_output=True, text=True,
                       check=False, stdin=subprocess.DEVNULL)
    return r.stdout.split()


def sandbox_cgroups() -> list[str]:
    """Per-sandbox cgroups under this run's node parents (the parents themselves live as long as the node)."""
    return sorted(str(p) for p in Path("/sys/fs/cgroup").glob(f"*/{MATCH}*/*") if p.is_dir())


def sandbox_processes() -> list[str]:
    """Live (non-zombie) processes in this run's sandbox cgroups."""
    found = []
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            cg = (p / "cgroup").read_text()
            stat = (p / "stat").read_bytes()
        except OSError:
            continue
        if MATCH in cg and not stat[stat.rindex(b")") + 2:].startswith(b"Z"):
            found.append(p.name)
    return found


def holdings(dep: Deployment) -> dict[str, list[str]]:
    """What the node holds on the host right now, sandbox by sandbox (a runtime's own tmpfs of the sandbox
    init, ``<state dir>/pd-init``, is the node's, kept while it runs: not counted here; `leaks after stop`
    sees it if it stays)."""
    return {"containers": containers(dep.crun_root), "cgroups": sandbox_cgroups(),
            "mounts": [str(m) for m in mounts_under(dep.root) if Path(m).name != "pd-init"],
            "processes": sandbox_processes()}


def data_dir_usage(path: Path, skip: tuple[str, ...] = ()) -> tuple[int, int]:
    """(files, bytes) under ``path`` (not following symlinks; dirs named in ``skip`` left out)."""
    n = size = 0
    for root, dirs, files in os.walk(path):
        dirs[:] = [d for d in dirs if d not in skip]
        for f in files:
            try:
                st = os.lstat(os.path.join(root, f))
            except OSError:
                continue
            n += 1
            size += st.st_size
    return n, size


def parse_time(s: str | None) -> float | None:
    return datetime.fromisoformat(s).timestamp() if s else None


__all__ = ["CrunWatch", "Deployment", "Postgres", "Role", "containers", "data_dir_usage", "history", "holdings",
           "live_sandboxes", "parse_time", "sandbox_cgroups", "sandbox_processes"]
