"""A real fleet on this machine for tests: `pilldrops serve` (SQLite or PostgreSQL) and N `pilldrops node`
agents as separate processes, each with its own data dir, port, name and cgroup parent."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from tests import leakcheck


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def clean_env(config_home: Path, **extra: str) -> dict[str, str]:
    """This process's environment for a PillDrops process of its own: its own config dir, and none of the
    caller's PillDrops/E2B credentials or node token leaking in."""
    # sandbox egress (issue 14) never touches this machine's own uplinks or resolver in tests: no uplink to
    # turn forwarding on for and no DNS, unless a test (tests/network) names its own
    env = {**os.environ, "XDG_CONFIG_HOME": str(config_home), "PILLDROPS_EGRESS_UPLINKS": "",
           "PILLDROPS_EGRESS_DNS": "none", "PILLDROPS_EGRESS_POOL": f"10.213.{os.getpid() % 256}.0/24", **extra}
    for k in ("PILLDROPS_API_KEY", "PILLDROPS_API_URL", "E2B_API_KEY", "PILLDROPS_NODE_TOKEN"):
        env.pop(k, None)
    return env


def wait_for(log: Path, text: str, proc: subprocess.Popen[bytes], timeout: float = 120, after: int = 0) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        content = log.read_text()[after:] if log.exists() else ""
        if text in content:
            return content
        if proc.poll() is not None:
            raise AssertionError(f"exited {proc.returncode} before {text!r}:\n{content[-3000:]}")
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {text!r}:\n{log.read_text()[-3000:]}")


def spawn(args: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    """`python -m pilldrops ARGS` with its output appended to ``log``."""
    return subprocess.Popen([sys.executable, "-m", "pilldrops", *args], stdout=open(log, "ab"),
                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)


@dataclass
class Proc:
    args: list[str]
    log: Path
    proc: subprocess.Popen[bytes] | None = None

    def start(self, env: dict[str, str], ready: str) -> str:
        mark = len(self.log.read_text()) if self.log.exists() else 0
        self.proc = spawn(self.args, self.log, env)
        return wait_for(self.log, ready, self.proc, after=mark)

    def kill9(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=30)

    def stop(self) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
        return self.proc.wait(timeout=60)


@dataclass
class Fleet:
    root: Path
    name: str
    db: str | None = None
    env: dict[str, str] = field(default_factory=dict)
    cp: Proc | None = None
    nodes: list[Proc] = field(default_factory=list)
    node_names: list[str] = field(default_factory=list)
    url: str = ""
    key: str = ""
    token: str = ""

    def __post_init__(self) -> None:
        self.env = clean_env(self.root / "cfg")

    def crun_roots(self) -> list[Path]:
        return [self.root / f"node{i}" / "node" / "crun" for i in range(len(self.nodes) or 8)]

    def start_cp(self, *extra: str) -> None:
        port = int(self.url.rsplit(":", 1)[1]) if self.url else free_port()
        args = ["serve", "--port", str(port), "--ports-port", "0", "--data-dir", str(self.root / "cp"), "--heartbeat-interval", "0.5",
                "--unlimited-credits", *extra]
        if self.db:
            args += ["--db", self.db]
        if self.cp is None:
            self.cp = Proc(args, self.root / "serve.log")
        out = self.cp.start(self.env, "control plane at")
        self.url = f"http://127.0.0.1:{port}"
        if not self.key:
            self.key = re.search(r"PILLDROPS_API_KEY=(\S+)", out).group(1)  # type: ignore[union-attr]
            self.token = re.search(r"PILLDROPS_NODE_TOKEN=(\S+)", out).group(1)  # type: ignore[union-attr]

    def add_node(self, *, capacity_vcpu: float | None = None, templates: str = "tiny") -> Proc:
        """``templates=""``: a node that builds nothing itself (it fetches from the template store)."""
        i = len(self.nodes)
        name = f"{self.name}-n{i}"
        args = ["node", "--control-plane", self.url, "--node-token", self.token, "--port", str(free_port()),
                "--data-dir", str(self.root / f"node{i}"), "--name", name, "--templates", templates]
        if capacity_vcpu:
            args += ["--capacity-vcpu", str(capacity_vcpu)]
        p = Proc(args, self.root / f"node{i}.log")
        p.start(self.env, "serving at")
        self.nodes.append(p)
        self.node_names.append(name)
        return p

    def api(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {self.key}"}, timeout=60)

    def wait_nodes_ready(self, n: int, timeout: float = 30, template: str | None = "tiny") -> None:
        deadline = time.monotonic() + timeout
        with self.api() as c:
            while time.monotonic() < deadline:
                items = c.get("/v1/nodes").json()["items"]
                if sum(1 for x in items if x["state"] == "ready"
                       and (template is None or template in x["templates"])) >= n:
                    return
                time.sleep(0.1)
        raise AssertionError(f"{n} ready nodes not seen in {timeout}s")

    def stop(self) -> None:
        for p in [*self.nodes, self.cp]:
            if p is not None and p.proc is not None and p.proc.poll() is None:
                p.proc.send_signal(signal.SIGINT)
        for p in [*self.nodes, self.cp]:
            if p is not None and p.proc is not None:
                p.proc.wait(timeout=60)


@contextmanager
def running_fleet(root: Path, name: str, match: str, db: str | None = None) -> Iterator[Fleet]:
    """A fleet under ``root`` (its processes stopped at the end), checked for leaks of sandboxes whose
    names contain ``match``."""
    root.mkdir()
    f = Fleet(root, name, db=db)
    before = leakcheck.snapshot(f.crun_roots(), match=match)
    try:
        yield f
    finally:
        f.stop()
    leakcheck.assert_no_leaks(before, settle=5)
