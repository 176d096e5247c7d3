"""The runtime contract suite's runtimes: every test in tests/contract runs once per entry of ``RUNTIMES``.

A new runtime joins by writing one ``RuntimeCase`` subclass and adding it to ``RUNTIMES`` (one line), e.g.

    class GvisorCase(CrunCase):
        name = "gvisor"
        ...
    RUNTIMES["gvisor"] = GvisorCase

A case says whether the runtime can run on this machine (``unavailable``: the skip reason, e.g. no root),
makes runtime instances over one state directory (``make``: calling it again gives a FRESH instance over
the same host state, as a restarted agent gets), and answers the few questions the contract cannot ask the
runtime itself: how a sandbox path looks to a command, the sandbox's cgroup limits, how to kill its init
from outside, and what "nothing left behind" means for it (``snapshot`` / ``assert_no_leaks``).

Every test is leak-checked (autouse ``no_leaks``), scoped to this test session's unique names
(``pilldrops-ct<pid>``) so that parallel runs on the same machine never collide.
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any, ClassVar

import pytest

from pilldrops.node.runtime.base import Handle, Runtime, SandboxSpec

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import leakcheck  # tests/leakcheck.py

SESSION = f"ct{os.getpid()}"
MATCH = f"pilldrops-{SESSION}"


class RuntimeCase:
    """One runtime under the contract. Subclasses override what differs; see the module docstring."""

    name: ClassVar[str]
    restores_processes: ClassVar[bool] = True    # checkpoint/restore keeps processes (not only files)
    terminals: ClassVar[bool] = False            # exec(pty=(rows, cols)) runs the command on a real PTY
    signals: ClassVar[str | None] = None         # why ExecProcess.signal does not reach the command, if not
    forks_fail_at_the_limit: ClassVar[bool] = True   # past pids_limit a fork fails (else the sandbox ends)

    @staticmethod
    def unavailable() -> str | None:
        """None when the runtime can run here, else why not (the tests skip with it)."""
        return None

    def __init__(self, data: Path) -> None:
        self.data = data
        self.instances: list[Runtime] = []

    async def make(self) -> Runtime:
        """A new runtime instance over this case's state (a second call: a fresh one, same host state)."""
        raise NotImplementedError

    def spec(self, sid: str, **kw: Any) -> SandboxSpec:
        raise NotImplementedError

    def path(self, handle: Handle, path: str) -> str:
        """``path`` inside the sandbox as a command in it names it."""
        return path

    def cgroup_limits(self, handle: Handle) -> dict[str, int] | None:
        """``memory_bytes``, ``pids``, ``cpu_quota_us``, ``cpu_period_us`` as the sandbox's cgroup has them
        (and ``pids_current``, ``pids_refused``: its processes now, forks it refused at the limit so far),
        or None when the runtime puts its sandboxes in no cgroup of their own."""
        return None

    async def kill_init(self, runtime: Runtime, handle: Handle) -> None:
        """Kill the sandbox's init from outside the runtime (a fact the runtime must notice)."""
        raise NotImplementedError

    def snapshot(self) -> Any:
        raise NotImplementedError

    def assert_no_leaks(self, before: Any) -> None:
        raise NotImplementedError

    def close(self) -> None:
        pass


# ---- the fake (tests only, no isolation) ---------------------------------------------------------------

class FakeCase(RuntimeCase):
    name = "fake"
    restores_processes = False        # its checkpoint keeps the files only (documented in fake.py)

    def __init__(self, data: Path) -> None:
        super().__init__(data)
        self.root = data / "fake"

    async def make(self) -> Runtime:
        from pilldrops.node.runtime.fake import FakeRuntime
        rt = FakeRuntime(self.root)
        self.instances.append(rt)
        return rt

    def spec(self, sid: str, **kw: Any) -> SandboxSpec:
        return SandboxSpec(id=sid, layers=(), **kw)

    def path(self, handle: Handle, path: str) -> str:
        return handle.bundle + path       # no root of its own: a sandbox is a host directory

    async def kill_init(self, runtime: Runtime, handle: Handle) -> None:
        await runtime.simulate_exit(handle, 137)  # type: ignore[attr-defined]

    def _procs(self) -> set[str]:
        """Live processes whose cwd is inside the fake's root (its commands run there)."""
        out = set()
        root = str(self.root.resolve())
        for pid in os.listdir("/proc"):
            if not pid.isdigit():
                continue
            try:
                cwd = os.readlink(f"/proc/{pid}/cwd")
                stat = Path(f"/proc/{pid}/stat").read_bytes()
            except OSError:
                continue
            if cwd.startswith(root) and not stat[stat.rindex(b")") + 2:].startswith(b"Z"):
                out.add(f"proc:{pid}:{cwd}")
        return out

    def snapshot(self) -> set[str]:
        if not self.root.exists():
            return self._procs()
        files = {f"file:{p}" for p in self.root.glob("*") if p.name != ".meta"}
        meta = {f"record:{p}" for p in (self.root / ".meta").glob("*")}
        return files | meta | self._procs()

    def assert_no_leaks(self, before: set[str]) -> None:
        import time
        deadline = time.monotonic() + 2.0
        while (new := self.snapshot() - before) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not new, "leaked: " + ", ".join(sorted(new))

    def close(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


# ---- crun (root + crun) --------------------------------------------------------------------------------

class CrunCase(RuntimeCase):
    name = "crun"
    terminals = True

    @staticmethod
    def unavailable() -> str | None:
        if os.geteuid() != 0:
            return "crun sandboxes need root (mounts, cgroups, namespaces)"
        if not shutil.which("crun"):
            return "crun is not installed (run scripts/install-system-deps)"
        return None

    def __init__(self, data: Path) -> None:
        super().__init__(data)
        from pilldrops.node.isolation.host import prepare_host
        from pilldrops.node.runtime.init import build_init
        from pilldrops.node.templates import TemplateStore
        prepare_host()
        self.tiny = TemplateStore(data).ensure("tiny")
        self.init_path = build_init(data)
        self.state = data / "state"

    async def make(self) -> Runtime:
        from pilldrops.node.runtime.crun import CrunRuntime
        rt = CrunRuntime(self.state, name=SESSION, init_path=self.init_path)
        self.instances.append(rt)
        return rt

    def spec(self, sid: str, **kw: Any) -> SandboxSpec:
        kw.setdefault("workdir", self.tiny.workdir)
        return SandboxSpec(id=sid, layers=self.tiny.layers, **kw)

    def cgroup_limits(self, handle: Handle) -> dict[str, int] | None:
        return cgroup_limits(handle.extra["cgroup"])

    async def kill_init(self, runtime: Runtime, handle: Handle) -> None:
        assert handle.pid
        os.kill(handle.pid, signal.SIGKILL)

    def snapshot(self) -> dict[str, object]:
        return leakcheck.snapshot([self.state / "crun"], match=MATCH)

    def assert_no_leaks(self, before: dict[str, object]) -> None:
        leakcheck.assert_no_leaks(before)


def cgroup_limits(cgroup: str) -> dict[str, int]:
    """The limits of a cgroup path (``/<parent>/<id>``), cgroup v1 or v2; -1 for "max"."""
    base = Path("/sys/fs/cgroup")
    rel = cgroup.lstrip("/")

    def num(text: str) -> int:
        return -1 if text.strip() == "max" else int(text.strip())

    def pids(d: Path) -> dict[str, int]:
        events = dict(line.split() for line in (d / "pids.events").read_text().splitlines() if line.strip())
        return {"pids": num((d / "pids.max").read_text()), "pids_current": num((d / "pids.current").read_text()),
                "pids_refused": int(events.get("max", 0))}

    if (base / "cgroup.controllers").exists():          # v2: one hierarchy
        quota, period = (base / rel / "cpu.max").read_text().split()
        return {"memory_bytes": num((base / rel / "memory.max").read_text()), **pids(base / rel),
                "cpu_quota_us": num(quota), "cpu_period_us": int(period)}
    return {"memory_bytes": num((base / "memory" / rel / "memory.limit_in_bytes").read_text()),
            **pids(base / "pids" / rel),
            "cpu_quota_us": num((base / "cpu" / rel / "cpu.cfs_quota_us").read_text()),
            "cpu_period_us": num((base / "cpu" / rel / "cpu.cfs_period_us").read_text())}


# ---- gVisor (root + runsc) ------------------------------------------------------------------------------

class GvisorCase(CrunCase):
    """runsc on crun's bundle (``runtime/gvisor.py``). Its pids cgroup allows gVisor's own host tasks, and
    gVisor cannot fail a fork inside: past the limit the host cgroup ends the whole sandbox."""

    name = "gvisor"
    forks_fail_at_the_limit = False
    terminals = True
    signals = "a signal reaches the `runsc exec` process, not the command in the sandbox (exit 143)"

    @staticmethod
    def unavailable() -> str | None:
        why = CrunCase.unavailable()
        if why:
            return why
        from pilldrops.node.runtime.gvisor import probe
        p = probe()
        return None if p.available else p.reason

    async def make(self) -> Runtime:
        from pilldrops.node.runtime.gvisor import GvisorRuntime
        rt = GvisorRuntime(self.data / "gvisor", name=f"{SESSION}-gv", init_path=self.init_path)
        self.instances.append(rt)
        return rt

    def spec(self, sid: str, **kw: Any) -> SandboxSpec:
        return super().spec(sid, isolation="gvisor", **kw)

    def cgroup_limits(self, handle: Handle) -> dict[str, int] | None:
        from pilldrops.node.runtime.gvisor import PROCESS_TASKS, RUNTIME_PIDS
        limits = cgroup_limits(handle.extra["cgroup"])
        limits["pids"] = (limits["pids"] - RUNTIME_PIDS) // PROCESS_TASKS      # the sandbox's own processes
        return limits

    def snapshot(self) -> dict[str, object]:
        return leakcheck.snapshot([], match=MATCH, runsc_roots=[self.data / "gvisor" / "runsc"])


# ---- microVM (root + QEMU + the guest kernel; TCG where KVM is not usable) ---------------------------------

class MicrovmCase(CrunCase):
    """QEMU ``-M microvm`` guests restored from the template's snapshot (``runtime/qemu.py``). The sandbox's
    cgroup is inside the guest (pids.max, memory.max, its counters: asked of the guest agent); the CPU quota
    is the host cgroup of its QEMU. Its init is the QEMU process. Sandboxes default to 256 MiB so that every
    case shares one guest-RAM class, i.e. one template snapshot (shared with the other microVM tiers through
    the session's ``PILLDROPS_MICROVM_CACHE``)."""

    name = "microvm"
    terminals = False                     # not verified in the guest yet

    @staticmethod
    def unavailable() -> str | None:
        why = CrunCase.unavailable()
        if why:
            return why
        from pilldrops.node.runtime.qemu import probe_host
        ok, reason, _ = probe_host()
        return None if ok else f"QEMU cannot run microVMs here: {reason}"

    async def make(self) -> Runtime:
        from pilldrops.node.runtime.qemu import QemuRuntime
        rt = QemuRuntime(self.data / "microvm", name=f"{SESSION}-mv", cache_dir=self._cache())
        self.instances.append(rt)
        return rt

    def _cache(self) -> Path:
        return Path(os.environ.get("PILLDROPS_MICROVM_CACHE") or self.data / "microvm-cache")

    def spec(self, sid: str, **kw: Any) -> SandboxSpec:
        kw.setdefault("memory_mb", 256)
        return super().spec(sid, isolation="microvm", **kw)

    def cgroup_limits(self, handle: Handle) -> dict[str, int] | None:
        """The guest cgroup's values asked of the guest agent (a link of its own: the runtime's closes after
        1 s idle), the CPU quota from the QEMU's host cgroup."""
        from pilldrops.node.runtime.microvm import vm
        from pilldrops.node.runtime.microvm.channel import AgentLink
        link = AgentLink(vm.dir_connector(Path(handle.bundle), "agent.sock"))
        try:
            link.wait_synced(15)
            reply = link.request(b"", 10)
        finally:
            link.close()
        guest = dict(kv.split("=", 1) for kv in reply.split()[1:] if "=" in kv)
        host = cgroup_limits(handle.extra["cgroup"])

        def num(text: str) -> int:
            return -1 if text == "max" else int(text)
        return {"memory_bytes": num(guest["memory.max"]), "pids": num(guest["pids.max"]),
                "pids_current": num(guest["pids.current"]), "pids_refused": num(guest["pids.refused"]),
                "cpu_quota_us": host["cpu_quota_us"], "cpu_period_us": host["cpu_period_us"]}

    def snapshot(self) -> dict[str, object]:
        return leakcheck.snapshot([], match=MATCH, qemu_dirs=[self.data / "microvm", self._cache()])


# ---- the registry: one line per runtime ------------------------------------------------------------------

RUNTIMES: dict[str, type[RuntimeCase]] = {
    "fake": FakeCase,
    "crun": CrunCase,
    "gvisor": GvisorCase,
    "microvm": MicrovmCase,
}


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="session", params=list(RUNTIMES))
def case(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RuntimeCase]:
    cls = RUNTIMES[request.param]
    why = cls.unavailable()
    if why:
        pytest.skip(f"{cls.name}: {why}")
    c = cls(tmp_path_factory.mktemp(f"{MATCH}-{cls.name}", numbered=False))
    try:
        yield c
    finally:
        c.close()


@pytest.fixture(autouse=True)
def no_leaks(case: RuntimeCase) -> Iterator[None]:
    before = case.snapshot()
    yield
    case.assert_no_leaks(before)


@pytest.fixture
async def runtime(case: RuntimeCase) -> AsyncIterator[Runtime]:
    """A runtime instance; at the end every sandbox left is destroyed and every instance the test made
    (``case.make()`` again, for re-adoption) is closed."""
    rt = await case.make()
    try:
        yield rt
    finally:
        for sid in await rt.list_ids():
            await rt.destroy(Handle(id=sid))
        for inst in case.instances:
            await inst.close()  # type: ignore[attr-defined]
        case.instances.clear()
