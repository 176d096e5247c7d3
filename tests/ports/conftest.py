"""A real PillDrops for the port-URL tests: `pilldrops up` as a subprocess on free ports, its own data dir,
config dir and node name (this session's leak-check scope), the real crun runtime, the templates `tiny`
(busybox httpd) and `code-interpreter` (python3, for the WebSocket server) from the machine's template
cache. Every test is leak-checked; the session ends with SIGINT and checks that `up` tore everything down."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests import leakcheck
from tests.e2e.conftest import Server, stop_up
from tests.e2e.fleet import clean_env, free_port
from tests.e2e.test_pause_e2e import seed_templates

NAME = f"urls{os.getpid()}"
MATCH = f"pilldrops-{NAME}"
TEMPLATES = "tiny,code-interpreter"


class Up(Server):
    def snapshot(self) -> dict[str, object]:
        return leakcheck.snapshot([self.crun_root], match=MATCH)


def _why_not_runnable() -> str | None:
    if os.geteuid() != 0:
        return "the port-URL tests run a real `pilldrops up`, which needs root (mounts, cgroups, crun)"
    if not shutil.which("crun"):
        return "crun is not installed (run scripts/install-system-deps)"
    return None


def _start(data_dir: Path, config_home: Path, log: Path) -> tuple[subprocess.Popen[bytes], str]:
    for attempt in range(2):            # once more if a free port was taken before `up` bound it
        mark = len(log.read_text()) if log.exists() else 0
        port, node_port = free_port(), free_port()
        with open(log, "ab") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", "pilldrops", "up", "--port", str(port), "--node-port", str(node_port),
                 "--data-dir", str(data_dir), "--templates", TEMPLATES, "--node-name", NAME],
                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env=clean_env(config_home, PYTHONUNBUFFERED="1"))
        deadline = time.monotonic() + 120
        try:
            while "is up at" not in log.read_text()[mark:]:
                if proc.poll() is not None and attempt == 0 and "already in use" in log.read_text()[mark:]:
                    break
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"pilldrops up did not start:\n{log.read_text()[-3000:]}")
                time.sleep(0.1)
            else:
                return proc, f"http://127.0.0.1:{port}"
        except BaseException:
            try:
                stop_up(proc)
            except subprocess.TimeoutExpired:
                proc.kill()
            raise
    raise AssertionError("unreachable")


@pytest.fixture(scope="session")
def pd_up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Up]:
    why = _why_not_runnable()
    if why:
        pytest.skip(why)
    root = tmp_path_factory.mktemp(MATCH, numbered=False)
    data_dir, config_home, log = root / "data", root / "config", root / "up.log"
    seed_templates(data_dir, ["code-interpreter"])
    before = leakcheck.snapshot([data_dir / "node" / "crun"], match=MATCH)
    proc, url = _start(data_dir, config_home, log)
    key = json.loads((config_home / "pilldrops" / "config.json").read_text())["api_key"]
    up = Up(url, key, data_dir, config_home, proc, log)
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=60) as c:
        sid = c.post("/v1/sandboxes", json={"template": "tiny"}).raise_for_status().json()["id"]
        c.delete(f"/v1/sandboxes/{sid}").raise_for_status()     # the node's cgroup parent exists from now on
    try:
        yield up
    finally:
        code = stop_up(proc)
        assert code == 0, f"`pilldrops up` exited {code} on SIGINT:\n{log.read_text()[-3000:]}"
        leakcheck.assert_no_leaks(before, settle=5)


@pytest.fixture(autouse=True)
def no_leaks(request: pytest.FixtureRequest) -> Iterator[None]:
    if "pd_up" not in request.fixturenames:
        yield
        return
    up: Up = request.getfixturevalue("pd_up")
    before = up.snapshot()
    yield
    leakcheck.assert_no_leaks(before, settle=5)


@pytest.fixture
def api(pd_up: Up) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=pd_up.api_url, headers={"Authorization": f"Bearer {pd_up.api_key}"},
                      timeout=60) as c:
        yield c


@pytest.fixture
def sdk_env(pd_up: Up, monkeypatch: pytest.MonkeyPatch) -> Up:
    monkeypatch.setenv("PILLDROPS_API_URL", pd_up.api_url)
    monkeypatch.setenv("PILLDROPS_API_KEY", pd_up.api_key)
    return pd_up
