"""A real PillDrops for the E2B-compatibility tests: the session's shared `pilldrops up` (tests/up.py: free
ports, its own data dir, config dir and node name, the real crun runtime) with the Debian templates `base`
and `code-interpreter` seeded from the machine's template cache (built there once, minutes the first time). The stock
E2B clients are the drivers: they get only the three environment variables a user would set. Every test
is leak-checked; the session ends with SIGINT and checks that stopping `up` tore everything down.

Fixtures for the envd tests (another module's) live in ``envd_fixtures.py``."""

from __future__ import annotations

import os
import sys
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

from tests.up import Up, no_leaks_of

TEMPLATES = ("base", "code-interpreter")


def envd_available() -> bool:
    """envd (``pilldrops.e2b.envd``) is built by another branch; the tests that need it skip without it."""
    try:
        import pilldrops.e2b.envd.app  # noqa: F401
    except ImportError:
        return False
    return True


def _seed_templates(request: pytest.FixtureRequest, up: Up) -> None:
    """The Debian templates from the machine's template cache (built there once if missing, as for the
    other tiers that need them: ``tests.up.seed_templates``). A first build takes minutes on a fresh
    machine (CI): longer than pytest-timeout's per-test limit, which counts this fixture's setup against the
    first test. The limit is paused for the build and set again for the rest of that test."""
    item = getattr(request, "_pyfuncitem", None)
    hook = request.config.hook
    paused = item is not None and hasattr(hook, "pytest_timeout_cancel_timer")
    if paused:
        hook.pytest_timeout_cancel_timer(item=item)
    try:
        up.seed(*TEMPLATES)
    finally:
        if paused:
            try:
                import pytest_timeout
                settings = pytest_timeout._get_item_settings(item)
                if settings.timeout:
                    hook.pytest_timeout_set_timer(item=item, settings=settings)
            except (ImportError, AttributeError):
                pass


@pytest.fixture(scope="session")
def pd_up(shared_up: Up, request: pytest.FixtureRequest) -> Up:
    """The session's shared `pilldrops up` (tests/conftest.py) with ``base`` and ``code-interpreter``
    seeded; the stock E2B clients get only the three environment variables a user would set."""
    _seed_templates(request, shared_up)
    return shared_up


@pytest.fixture(autouse=True)
def no_leaks(request: pytest.FixtureRequest) -> Iterator[None]:
    """Every test that uses the server leaves no container, mount, cgroup or process behind."""
    if "pd_up" not in request.fixturenames:
        yield
        return
    with no_leaks_of(request.getfixturevalue("pd_up")):
        yield


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
