"""The standing hostile suite (issue 16 part 4): what an attacker inside a sandbox, or a careless client
outside one, tries, as tests.

Two kinds of fixture:

- ``up``: one real `pilldrops up` for the session (own data dir, config dir, ports and node name
  ``hst<pid>``; crun, and gVisor when runsc works here; the ``tiny`` template; 16 GiB of offered memory so
  that over-capacity cases are cheap), with ``api`` (team A's client) and ``other`` (a second team's key).
  Every test using it is leak-checked (no container, mount, cgroup or process of it left), and so is the
  end of the session (SIGINT, exit 0, nothing left).
- ``rcase`` / ``runtime``: the runtime contract's ``RuntimeCase`` (tests/contract/conftest.py) for the
  runtime-level cases, parametrized over the runtimes cheap enough here: crun always, gVisor when runsc
  works; the microVM (QEMU under TCG on this machine kind: a boot of seconds) only with
  ``PILLDROPS_HOSTILE_MICROVM=1``.

``ISOLATIONS`` is the API-level twin: the isolation modes the session's node can run (container always).
"""

from __future__ import annotations

import os
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import anyio
import httpx
import pytest

from pilldrops.node.runtime.base import Handle, Runtime
from tests import leakcheck
from tests.contract.conftest import RUNTIMES, RuntimeCase
from tests.up import Up, running
from tests.up import why_not_root as _why_not_root

NAME = f"hst{os.getpid()}"
MATCH = f"pilldrops-{NAME}"
CAPACITY_MEMORY_MB = 16_384


def why_not_root() -> str | None:
    return _why_not_root("the hostile suite runs a real `pilldrops up`")


def second_team_key(data_dir: Path, name: str) -> str:
    """A key of a new team, made on the store directly (as `pilldrops teams create` does)."""
    from pilldrops._internal.clock import Clock
    from pilldrops.server.service.auth import AuthService
    from pilldrops.server.store.sql import Store, sqlite_url

    async def make() -> str:
        store = await Store.open(sqlite_url(data_dir / "pilldrops.db"))
        try:
            auth = AuthService(store, Clock())
            team = await auth.create_team(f"{name}-{time.monotonic_ns()}")
            return (await auth.create_key(team.id, "b")).secret
        finally:
            await store.close()

    return anyio.run(make)


@pytest.fixture(scope="session")
def up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Up]:
    """Its own `up`, not the session's shared one: 16 GiB of offered memory (the shared one offers the
    default, which the end-to-end tier's fan-outs need), and attacks that should not share a node with
    other tiers' tests."""
    why = why_not_root()
    if why:
        pytest.skip(why)
    srv = Up(tmp_path_factory.mktemp(MATCH, numbered=False), NAME,
             extra=("--capacity-memory-mb", str(CAPACITY_MEMORY_MB)))
    with running(srv):
        yield srv


@pytest.fixture(autouse=True)
def no_leaks(request: pytest.FixtureRequest) -> Iterator[None]:
    """Every test that starts sandboxes leaves none of their containers, mounts, cgroups or processes. The
    baseline is the session's (taken after the warm-up): one snapshot per test, at its end (a snapshot
    scans every process of this shared machine). Tests that start no sandbox use ``bare_api``."""
    if "up" not in request.fixturenames or "bare_api" in request.fixturenames:
        yield
        return
    before = request.getfixturevalue("baseline")
    yield
    try:
        leakcheck.assert_no_leaks(before, settle=8)
    except AssertionError:
        before["items"] = request.getfixturevalue("up").snapshot()["items"]
        raise                   # (re-based: the next test is checked for its own leaks, not this one's)


@pytest.fixture(scope="session")
def baseline(up: Up) -> dict[str, object]:
    return up.snapshot()


@pytest.fixture
def api(up: Up, baseline: dict[str, object]) -> Iterator[httpx.Client]:
    with up.client() as c:
        yield c


@pytest.fixture
def bare_api(up: Up) -> Iterator[httpx.Client]:
    """``api`` for tests that start no sandbox (no leak check)."""
    with up.client() as c:
        yield c


@pytest.fixture(scope="session")
def other_key(up: Up) -> str:
    return second_team_key(up.data_dir, "other")


@pytest.fixture(params=["container", "gvisor"])
def isolation(request: pytest.FixtureRequest, up: Up) -> str:
    """An isolation mode the session's node runs (gVisor skipped, with the reason, where runsc does not)."""
    if request.param not in up.isolations:
        pytest.skip(f"{request.param} is not available on this node")
    return request.param


# ---- the runtime-level cases: the contract's RuntimeCase ----------------------------------------------

HOSTILE_RUNTIMES = ["crun", "gvisor"] + (["microvm"] if os.environ.get("PILLDROPS_HOSTILE_MICROVM") == "1" else [])


@pytest.fixture(scope="session", params=HOSTILE_RUNTIMES)
def rcase(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RuntimeCase]:
    cls = RUNTIMES[request.param]
    why = cls.unavailable()
    if why:
        pytest.skip(f"{cls.name}: {why}")
    c = cls(tmp_path_factory.mktemp(f"pilldrops-hrt{os.getpid()}-{cls.name}", numbered=False))
    try:
        yield c
    finally:
        c.close()


@pytest.fixture
def rt_leaks(rcase: RuntimeCase) -> Iterator[None]:
    before = rcase.snapshot()
    yield
    rcase.assert_no_leaks(before)


@pytest.fixture
async def runtime(rcase: RuntimeCase, rt_leaks: None) -> AsyncIterator[Runtime]:
    rt = await rcase.make()
    try:
        yield rt
    finally:
        for sid in await rt.list_ids():
            await rt.destroy(Handle(id=sid))
        for inst in rcase.instances:
            await inst.close()  # type: ignore[attr-defined]
        rcase.instances.clear()


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"
