"""Fixtures shared by every tier."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests import pg
from tests.up import SHARED_NAME, Up, running, why_not_root


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The real Debian template build (tests/e2e/test_debian_templates.py: `pilldrops template build
    code-interpreter`, debootstrap then pip) runs first, into the shared `up`'s data dir: it is then a
    build from nothing in every run, and the tiers that need `base` / `code-interpreter` afterwards (e2b,
    ports, pause, evals, the Debian Dockerfile) use that build instead of seeding (or, on a fresh machine,
    building again) the machine's template cache (``tests.up.seed_templates``)."""
    first = [i for i in items if i.nodeid.startswith("tests/e2e/test_debian_templates.py")]
    if first:
        items[:] = first + [i for i in items if i not in first]


@pytest.fixture(scope="session")
def postgres() -> Iterator[pg.Postgres]:
    """A throwaway PostgreSQL cluster for the session (skipped, with the reason, where it cannot run)."""
    why = pg.why_not()
    if why:
        pytest.skip(why)
    server = pg.Postgres()
    try:
        yield server
    finally:
        server.stop()


# heartbeats every second instead of 5: what tests wait for that rides one (pool members, disk usage, a
# seeded template) shows up in about a second; a node is unreachable only after 30 s without one (never
# because this shared 2-core machine is slow)
SHARED_FLAGS = ("--heartbeat-interval", "1", "--unreachable-after", "30")


@pytest.fixture(scope="session")
def shared_up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Up]:
    """The session's one `pilldrops up` for every tier whose tests need no `up` of their own (tests/e2e,
    e2b, ports, browser): free ports (the port-URL listener on one of its own), own data dir, config dir and
    node name (its leak-check scope), the `tiny` template; a tier that needs the Debian templates seeds
    them (``Up.seed``). Started on first use; stopped at the session's end, which must exit 0 and leave
    nothing of it. Each test using it is still leak-checked on its own (the tiers' ``no_leaks``)."""
    why = why_not_root()
    if why:
        pytest.skip(why)
    up = Up(tmp_path_factory.mktemp(f"pilldrops-{SHARED_NAME}", numbered=False), SHARED_NAME,
            ports_listener=True, extra=SHARED_FLAGS)
    with running(up):
        yield up


@pytest.fixture(scope="session", autouse=True)
def microvm_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """One microVM cache (root disks, initramfs, template snapshots) for the whole session, so the tiny
    template's guest boots once for the integration and the end-to-end tiers (a `pilldrops up` started by a
    test inherits ``PILLDROPS_MICROVM_CACHE``). Content-keyed: sharing it between data dirs is safe."""
    old = os.environ.get("PILLDROPS_MICROVM_CACHE")
    path = tmp_path_factory.mktemp("pilldrops-mvcache")
    os.environ["PILLDROPS_MICROVM_CACHE"] = str(path)
    try:
        yield path
    finally:
        if old is None:
            os.environ.pop("PILLDROPS_MICROVM_CACHE", None)
        else:
            os.environ["PILLDROPS_MICROVM_CACHE"] = old
