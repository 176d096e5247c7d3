"""Fixtures of the disk-quota and detach cases (tests/hostile/test_disk.py, test_detach.py): the real crun
runtime (and gVisor where runsc is installed) on the ``tiny`` template, every test leak-checked (processes,
mounts, cgroups, loop devices). Named ``pilldrops-hd<pid>`` so parallel runs never collide. Imported by
those modules only (``from tests.hostile._crun_fixtures import *``), so they need no conftest."""

from __future__ import annotations

import os
import shutil
import sys
import time
from pathlib import Path

import anyio
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import leakcheck  # tests/leakcheck.py

SESSION = f"hd{os.getpid()}"
MATCH = f"pilldrops-{SESSION}"


def why_not_runnable() -> str | None:
    if os.geteuid() != 0:
        return "needs root (mounts, cgroups, loop devices, crun)"
    if not shutil.which("crun"):
        return "crun is not installed (run scripts/install-system-deps)"
    return None


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="session")
def hd_data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    why = why_not_runnable()
    if why:
        pytest.skip(why)
    from pilldrops.node.isolation.host import prepare_host
    prepare_host()
    return tmp_path_factory.mktemp(MATCH)       # numbered: each module importing these has its own


@pytest.fixture(scope="session")
def hd_init(hd_data_dir: Path) -> Path:
    from pilldrops.node.runtime.init import build_init
    return build_init(hd_data_dir)


@pytest.fixture(scope="session")
def tiny(hd_data_dir: Path):  # type: ignore[no-untyped-def]
    from pilldrops.node.templates import TemplateStore
    return TemplateStore(hd_data_dir).ensure("tiny")


@pytest.fixture(autouse=True)
def hd_no_leaks(request: pytest.FixtureRequest):  # type: ignore[no-untyped-def]
    if why_not_runnable():
        yield
        return
    data = request.getfixturevalue("hd_data_dir")
    before = leakcheck.snapshot([data / "state" / "crun"], match=MATCH, runsc_roots=[data / "gvisor" / "runsc"])
    yield
    leakcheck.assert_no_leaks(before)


@pytest.fixture
async def crun_rt(hd_data_dir: Path, hd_init: Path, monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    from pilldrops.node.runtime.base import Handle
    from pilldrops.node.runtime.crun import CrunRuntime
    monkeypatch.setenv("PILLDROPS_EXEC", "supervisor")
    rt = CrunRuntime(hd_data_dir / "state", name=SESSION, init_path=hd_init)
    try:
        yield rt
    finally:
        with anyio.CancelScope(shield=True):
            for sid in await rt.list_ids():
                await rt.destroy(Handle(id=sid))
            await rt.close()


@pytest.fixture
async def gvisor_rt(hd_data_dir: Path, hd_init: Path, monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    from pilldrops.node.runtime.base import Handle
    from pilldrops.node.runtime.gvisor import GvisorRuntime, probe
    p = probe()
    if not p.available:
        pytest.skip(f"gVisor: {p.reason}")
    monkeypatch.setenv("PILLDROPS_EXEC", "supervisor")
    rt = GvisorRuntime(hd_data_dir / "gvisor", name=f"{SESSION}-gv", init_path=hd_init)
    try:
        yield rt
    finally:
        with anyio.CancelScope(shield=True):
            for sid in await rt.list_ids():
                await rt.destroy(Handle(id=sid))
            await rt.close()


async def collect(p):  # type: ignore[no-untyped-def]
    chunks = []
    while (c := await p.read()) is not None:
        chunks.append(c)
    code = await p.wait()
    out = b"".join(d for s, d in chunks if s == "stdout").decode(errors="replace")
    err = b"".join(d for s, d in chunks if s == "stderr").decode(errors="replace")
    return code, out, err


async def sh(rt, h, script: str, **kw):  # type: ignore[no-untyped-def]
    kw.setdefault("env", {})
    kw.setdefault("cwd", None)
    p = await rt.exec(h, ["sh", "-c", script], **kw)
    code, out, err = await collect(p)
    return code, out, err, p


def cgroup_pids(h) -> list[int]:  # type: ignore[no-untyped-def]
    """Every process in the sandbox's pids cgroup (crun: host pids)."""
    p = Path("/sys/fs/cgroup/pids") / h.extra["cgroup"].lstrip("/") / "cgroup.procs"
    return sorted(int(x) for x in p.read_text().split())


def live(pids: list[int]) -> list[int]:
    out = []
    for pid in pids:
        try:
            st = Path(f"/proc/{pid}/stat").read_bytes()
        except OSError:
            continue
        if not st[st.rindex(b")") + 2:].startswith(b"Z"):
            out.append(pid)
    return out


def wait_only_init(h, timeout: float = 5.0) -> list[int]:  # type: ignore[no-untyped-def]
    """Wait until pd-init is the sandbox's only live process; returns what is left (live, not init)."""
    deadline = time.monotonic() + timeout
    while True:
        left = [p for p in live(cgroup_pids(h)) if p != h.pid]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.05)
