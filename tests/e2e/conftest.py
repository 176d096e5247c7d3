"""A real PillDrops for end-to-end tests: the session's shared `pilldrops up` (tests/up.py, ``shared_up`` in
tests/conftest.py: free ports, its own data dir, config dir and node name, the real crun runtime and the
`tiny` template). Every test using it is leak-checked; the session ends with Ctrl-C (SIGINT) and checks that
stopping `up` tore everything down. Tests that restart or kill `up` start one of their own (``start_up``)."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from tests.e2e.fleet import clean_env, free_port  # noqa: F401  (re-exported for the tier's modules)
from tests.up import SHARED_NAME, Up, no_leaks_of, start_up, stop_up, why_not_root  # noqa: F401

NAME = SHARED_NAME
MATCH = f"pilldrops-{NAME}"
Server = Up


def _why_not_runnable() -> str | None:
    return why_not_root("end-to-end tests run a real `pilldrops up`")


@pytest.fixture(scope="session")
def server(shared_up: Up) -> Up:
    return shared_up


@pytest.fixture(autouse=True)
def no_leaks(request: pytest.FixtureRequest) -> Iterator[None]:
    """Every test must leave no container, mount, cgroup or process of its sandboxes behind."""
    if "server" not in request.fixturenames:
        yield
        return
    with no_leaks_of(request.getfixturevalue("server")):
        yield


@pytest.fixture
def sdk_env(server: Up, monkeypatch: pytest.MonkeyPatch) -> Up:
    monkeypatch.setenv("PILLDROPS_API_URL", server.api_url)
    monkeypatch.setenv("PILLDROPS_API_KEY", server.api_key)
    return server


@pytest.fixture
def api(server: Up) -> Iterator[httpx.Client]:
    with server.client() as c:
        yield c


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"
