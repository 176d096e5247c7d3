"""A real PillDrops for end-to-end tests: `pilldrops up` as a subprocess on free ports, its own data dir,
config dir and node name (so its cgroups and mounts are its own), the real crun runtime and the `tiny`
template. Every test is leak-checked; the session ends with Ctrl-C (SIGINT) and checks that stopping
`up` tore everything down."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import leakcheck

from tests.e2e.fleet import clean_env, free_port

NAME = f"e2e{os.getpid()}"
MATCH = f"pilldrops-{NAME}"


@dataclass
class Server:
    api_url: str
    api_key: str
    data_dir: Path
    config_home: Path
    proc: subprocess.Popen[bytes]
    log: Path

    @property
    def crun_root(self) -> Path:
        return self.data_dir / "node" / "crun"

    @property
    def runsc_root(self) -> Path:
        return self.data_dir / "node" / "runtimes" / "gvisor" / "runsc"

    def snapshot(self) -> dict[str, object]:
        return leakcheck.snapshot([self.crun_root], match=MATCH, runsc_roots=[self.runsc_root],
                                  qemu_dirs=[self.data_dir / "node" / "runtimes" / "microvm",
                                             *([Path(c)] if (c := os.environ.get("PILLDROPS_MICROVM_CACHE")) else [])])


def start_up(data_dir: Path, config_home: Path, log: Path, *extra: str) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    node_port = free_port()
    env = clean_env(config_home, PYTHONUNBUFFERED="1")
    mark = len(log.read_text()) if log.exists() else 0     # a restart appends to the same log
    proc = subprocess.Popen(
        [sys.executable, "-m", "pilldrops", "up", "--port", str(port), "--node-port", str(node_port), "--ports-port", "0",
         "--data-dir", str(data_dir), "--templates", "tiny", "--node-name", NAME, *extra],
        stdout=open(log, "ab"), stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"pilldrops up exited {proc.returncode}:\n{log.read_text()[-3000:]}")
        if "is up at" in log.read_text()[mark:]:
            return proc, url
        time.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"pilldrops up did not start:\n{log.read_text()[-3000:]}")


def stop_up(proc: subprocess.Popen[bytes], sig: int = signal.SIGINT, timeout: float = 60) -> int:
    if proc.poll() is None:
        proc.send_signal(sig)
    return proc.wait(timeout=timeout)


def _why_not_runnable() -> str | None:
    if os.geteuid() != 0:
        return "end-to-end tests need root (mounts, cgroups, crun)"
    if not shutil.which("crun"):
        return "crun is not installed (run scripts/install-system-deps)"
    return None


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    why = _why_not_runnable()
    if why:
        pytest.skip(why)
    root = tmp_path_factory.mktemp(MATCH, numbered=False)
    data_dir, config_home, log = root / "data", root / "config", root / "up.log"
    before = leakcheck.snapshot([data_dir / "node" / "crun"], match=MATCH,
                                runsc_roots=[data_dir / "node" / "runtimes" / "gvisor" / "runsc"])
    proc, url = start_up(data_dir, config_home, log)
    key = json.loads((config_home / "pilldrops" / "config.json").read_text())["api_key"]
    srv = Server(url, key, data_dir, config_home, proc, log)
    # One warm-up sandbox: the node's cgroup parent (kept for the life of `up`, removed when it stops,
    # which the session-end check covers) exists before the first per-test snapshot.
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=60) as c:
        sid = c.post("/v1/sandboxes", json={"template": "tiny"}).raise_for_status().json()["id"]
        c.delete(f"/v1/sandboxes/{sid}").raise_for_status()
        (node,) = c.get("/v1/nodes").raise_for_status().json()["items"]
        if node["isolation"]["gvisor"]["available"]:     # the gVisor runtime's cgroup parent, likewise
            sid = c.post("/v1/sandboxes", json={"template": "tiny", "isolation": "gvisor"}).raise_for_status().json()["id"]
            c.delete(f"/v1/sandboxes/{sid}").raise_for_status()
    try:
        yield srv
    finally:
        code = stop_up(proc)
        assert code == 0, f"`pilldrops up` exited {code} on SIGINT:\n{log.read_text()[-3000:]}"
        leakcheck.assert_no_leaks(before, settle=5)


@pytest.fixture(autouse=True)
def no_leaks(request: pytest.FixtureRequest) -> Iterator[None]:
    """Every test must leave no container, mount, cgroup or process of its sandboxes behind."""
    if "server" not in request.fixturenames:
        yield
        return
    srv: Server = request.getfixturevalue("server")
    before = srv.snapshot()
    yield
    leakcheck.assert_no_leaks(before, settle=5)


@pytest.fixture
def sdk_env(server: Server, monkeypatch: pytest.MonkeyPatch) -> Server:
    monkeypatch.setenv("PILLDROPS_API_URL", server.api_url)
    monkeypatch.setenv("PILLDROPS_API_KEY", server.api_key)
    return server


@pytest.fixture
def api(server: Server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.api_url, headers={"Authorization": f"Bearer {server.api_key}"},
                      timeout=60) as c:
        yield c


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"
