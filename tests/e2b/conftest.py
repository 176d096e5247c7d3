"""A real PillDrops for the E2B-compatibility tests: `pilldrops up` as a subprocess on free ports with its own
data dir, config dir and node name, the real crun runtime and the Debian templates `base` and
`code-interpreter` from the machine's template cache (built there once, minutes the first time). The stock
E2B clients are the drivers: they get only the three environment variables a user would set. Every test
is leak-checked; the session ends with SIGINT and checks that stopping `up` tore everything down.

Fixtures for the envd tests (another module's) live in ``envd_fixtures.py``."""

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


def _import_stock_clients() -> None:
    """This directory is called ``e2b`` too: with ``tests/`` on ``sys.path`` (other tiers' conftests put it
    there) ``import e2b`` would find it. The real packages are imported first, without that entry, and
    stay in ``sys.modules``."""
    tests_dir = str(Path(__file__).resolve().parent.parent)
    saved = list(sys.path)
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != tests_dir]
    try:
        import e2b  # noqa: F401
        import e2b_code_interpreter  # noqa: F401
    finally:
        sys.path[:] = saved


_import_stock_clients()

from tests import leakcheck
from tests.e2e.conftest import Server, stop_up
from tests.e2e.fleet import clean_env, free_port
from tests.e2e.test_pause_e2e import seed_templates

NAME = f"e2b{os.getpid()}"
MATCH = f"pilldrops-{NAME}"
TEMPLATES = "base,code-interpreter"


class Up(Server):
    """tests/e2e's server record, with this session's leak-check scope."""

    match = MATCH          # this session's leak-check scope (node name, cgroups, mounts)

    def snapshot(self) -> dict[str, object]:
        return leakcheck.snapshot([self.crun_root], match=self.match)

    @property
    def e2b_env(self) -> dict[str, str]:
        """The three lines of the README's "Coming from E2B"."""
        return {"E2B_API_URL": self.api_url, "E2B_SANDBOX_URL": self.api_url, "E2B_API_KEY": self.api_key}


def envd_available() -> bool:
    """envd (``pilldrops.e2b.envd``) is built by another branch; the tests that need it skip without it."""
    try:
        import pilldrops.e2b.envd.app  # noqa: F401
    except ImportError:
        return False
    return True


def _why_not_runnable() -> str | None:
    if os.geteuid() != 0:
        return "the E2B tests run a real `pilldrops up`, which needs root (mounts, cgroups, crun)"
    if not shutil.which("crun"):
        return "crun is not installed (run scripts/install-system-deps)"
    return None


def _seed_templates(request: pytest.FixtureRequest, data_dir: Path) -> None:
    """The Debian templates from the machine's template cache (built there once if missing, as for the
    other tiers that need them: ``tests.e2e.test_pause_e2e.seed_templates``). A first build takes minutes on a
    fresh machine (CI): longer than pytest-timeout's per-test limit, which counts this fixture's setup against
    the first test. The limit is paused for the build and set again for the rest of that test."""
    item = getattr(request, "_pyfuncitem", None)
    hook = request.config.hook
    paused = item is not None and hasattr(hook, "pytest_timeout_cancel_timer")
    if paused:
        hook.pytest_timeout_cancel_timer(item=item)
    try:
        seed_templates(data_dir, TEMPLATES.split(","))
    finally:
        if paused:
            try:
                import pytest_timeout
                settings = pytest_timeout._get_item_settings(item)
                if settings.timeout:
                    hook.pytest_timeout_set_timer(item=item, settings=settings)
            except (ImportError, AttributeError):
                pass


def _start(data_dir: Path, config_home: Path, log: Path) -> tuple[subprocess.Popen[bytes], str]:
    """`pilldrops up` on free ports; started again once if it exits at once (a port taken between
    ``free_port`` and its bind by another process on this shared machine)."""
    for attempt in range(2):
        mark = len(log.read_text()) if log.exists() else 0
        port, node_port = free_port(), free_port()
        with open(log, "ab") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", "pilldrops", "up", "--port", str(port), "--node-port", str(node_port), "--ports-port", "0",
                 "--data-dir", str(data_dir), "--templates", TEMPLATES, "--node-name", NAME],
                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env=clean_env(config_home, PYTHONUNBUFFERED="1"))
        deadline = time.monotonic() + 120
        try:
            while "is up at" not in log.read_text()[mark:]:
                busy = "already in use" in log.read_text()[mark:]
                if proc.poll() is not None and attempt == 0 and busy:
                    break
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"pilldrops up did not start:\n{log.read_text()[-3000:]}")
                time.sleep(0.2)
            else:
                return proc, f"http://127.0.0.1:{port}"
        except BaseException:        # incl. pytest-timeout: never leave an `up` running behind a failed start
            try:
                stop_up(proc)              # SIGINT: it tears down whatever it had started
            except subprocess.TimeoutExpired:
                proc.kill()
            raise
    raise AssertionError("unreachable")


@pytest.fixture(scope="session")
def pd_up(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Iterator[Up]:
    why = _why_not_runnable()
    if why:
        pytest.skip(why)
    root = tmp_path_factory.mktemp(MATCH, numbered=False)
    data_dir, config_home, log = root / "data", root / "config", root / "up.log"
    _seed_templates(request, data_dir)
    before = leakcheck.snapshot([data_dir / "node" / "crun"], match=MATCH)
    proc, url = _start(data_dir, config_home, log)
    key = json.loads((config_home / "pilldrops" / "config.json").read_text())["api_key"]
    up = Up(url, key, data_dir, config_home, proc, log)
    # one warm-up sandbox: the node's cgroup parent exists before the first per-test snapshot
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=60) as c:
        sid = c.post("/v1/sandboxes", json={"template": "base"}).raise_for_status().json()["id"]
        c.delete(f"/v1/sandboxes/{sid}").raise_for_status()
    try:
        yield up
    finally:
        code = stop_up(proc)
        assert code == 0, f"`pilldrops up` exited {code} on SIGINT:\n{log.read_text()[-3000:]}"
        leakcheck.assert_no_leaks(before, settle=5)


@pytest.fixture(autouse=True)
def no_leaks(request: pytest.FixtureRequest) -> Iterator[None]:
    """Every test that uses the server leaves no container, mount, cgroup or process behind."""
    if "pd_up" not in request.fixturenames:
        yield
        return
    up: Up = request.getfixturevalue("pd_up")
    before = up.snapshot()
    yield
    leakcheck.assert_no_leaks(before, settle=5)


@pytest.fixture
def e2b_env(pd_up: Up, monkeypatch: pytest.MonkeyPatch) -> Up:
    """The stock clients configured exactly as the README tells E2B users to: three variables."""
    for k in [k for k in os.environ if k.startswith(("E2B_", "PILLDROPS_"))]:
        monkeypatch.delenv(k)
    for k, v in pd_up.e2b_env.items():
        monkeypatch.setenv(k, v)
    return pd_up


@pytest.fixture
def api(pd_up: Up) -> Iterator[httpx.Client]:
    """Our own REST API (to check what E2B calls did, e.g. history)."""
    with httpx.Client(base_url=pd_up.api_url, headers={"Authorization": f"Bearer {pd_up.api_key}"},
                      timeout=60) as c:
        yield c


@pytest.fixture
def e2b_http(pd_up: Up) -> Iterator[httpx.Client]:
    """Raw HTTP with an E2B client's auth header, for wire-level checks."""
    with httpx.Client(base_url=pd_up.api_url, headers={"X-API-Key": pd_up.api_key}, timeout=60) as c:
        yield c


@pytest.fixture
def e2b_sandbox(e2b_env: Up) -> Iterator[object]:
    """A stock ``e2b.Sandbox`` on template ``base``, killed afterwards."""
    from e2b import Sandbox
    sb = Sandbox.create()
    try:
        yield sb
    finally:
        sb.kill()


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"
