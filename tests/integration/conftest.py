"""Fixtures for the real crun runtime: a prepared host, the tiny template, a per-test CrunRuntime and an
autouse leak check (every integration test fails if it leaves a container, mount, cgroup or process).

Everything is named ``pilldrops-it<pid>`` so that other PillDrops runs on this machine never collide.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import anyio
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import leakcheck  # tests/leakcheck.py

SESSION = f"it{os.getpid()}"
MATCH = f"pilldrops-{SESSION}"


def _why_not_runnable() -> str | None:
    if os.geteuid() != 0:
        return "integration tests need root (mounts, cgroups, crun)"
    if not shutil.which("crun"):
        return "crun is not installed (run scripts/install-system-deps)"
    return None


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="session")
def host_ready() -> None:
    why = _why_not_runnable()
    if why:
        pytest.skip(why)
    from pilldrops.node.isolation.host import prepare_host
    prepare_host()


@pytest.fixture(scope="session")
def data_dir(host_ready: None, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp(MATCH, numbered=False)


@pytest.fixture(scope="session")
def init_path(data_dir: Path) -> Path:
    from pilldrops.node.runtime.init import build_init
    return build_init(data_dir)


@pytest.fixture(scope="session")
def template_store(data_dir: Path):  # type: ignore[no-untyped-def]
    from pilldrops.node.templates import TemplateStore
    return TemplateStore(data_dir)


@pytest.fixture(scope="session")
def tiny(template_store):  # type: ignore[no-untyped-def]
    return template_store.ensure("tiny")


@pytest.fixture
def crun_root(data_dir: Path) -> Path:
    return data_dir / "state" / "crun"


@pytest.fixture(autouse=True)
def no_leaks(request: pytest.FixtureRequest):  # type: ignore[no-untyped-def]
    if _why_not_runnable():
        yield
        return
    data = request.getfixturevalue("data_dir")
    before = leakcheck.snapshot([data / "state" / "crun"], match=MATCH,
                                runsc_roots=[data / "gvisor" / "runsc"])
    yield
    leakcheck.assert_no_leaks(before)


@pytest.fixture
async def gvisor(data_dir: Path, init_path: Path):  # type: ignore[no-untyped-def]
    """A GvisorRuntime of this session (skipped where runsc is not installed)."""
    from pilldrops.node.runtime.base import Handle
    from pilldrops.node.runtime.gvisor import GvisorRuntime, probe
    p = probe()
    if not p.available:
        pytest.skip(f"gVisor: {p.reason}")
    rt = GvisorRuntime(data_dir / "gvisor", name=f"{SESSION}-gv", init_path=init_path)
    try:
        yield rt
    finally:
        with anyio.CancelScope(shield=True):
            async with anyio.create_task_group() as tg:     # a gVisor destroy takes ~1.7 s: all at once
                for sid in await rt.list_ids():
                    tg.start_soon(rt.destroy, Handle(id=sid))
            await rt.close()


@pytest.fixture
async def runtime(data_dir: Path, init_path: Path):  # type: ignore[no-untyped-def]
    from pilldrops.node.runtime.base import Handle
    from pilldrops.node.runtime.crun import CrunRuntime
    rt = CrunRuntime(data_dir / "state", name=SESSION, init_path=init_path)
    try:
        yield rt
    finally:
        for sid in await rt.list_ids():
            await rt.destroy(Handle(id=sid))
        await rt.close()
