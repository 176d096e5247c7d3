"""A real PillDrops for the port-URL tests: the session's shared `pilldrops up` (tests/up.py: free ports, the
port-URL listener on one of its own, its own data dir, config dir and node name, the real crun runtime), with
the templates `tiny` (busybox httpd) and `code-interpreter` (python3, for the WebSocket server) from the
machine's template cache. Every test is leak-checked; the session ends with SIGINT and checks that `up` tore
everything down."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from tests.up import Up, no_leaks_of


@pytest.fixture(scope="session")
def pd_up(shared_up: Up) -> Up:
    shared_up.seed("code-interpreter")
    return shared_up


@pytest.fixture(autouse=True)
def no_leaks(request: pytest.FixtureRequest) -> Iterator[None]:
    if "pd_up" not in request.fixturenames:
        yield
        return
    with no_leaks_of(request.getfixturevalue("pd_up")):
        yield


@pytest.fixture
def api(pd_up: Up) -> Iterator[httpx.Client]:
    with pd_up.client() as c:
        yield c


@pytest.fixture
def sdk_env(pd_up: Up, monkeypatch: pytest.MonkeyPatch) -> Up:
    monkeypatch.setenv("PILLDROPS_API_URL", pd_up.api_url)
    monkeypatch.setenv("PILLDROPS_API_KEY", pd_up.api_key)
    return pd_up
