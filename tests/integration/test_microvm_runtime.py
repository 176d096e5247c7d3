"""The microVM runtime for real: QEMU ``-M microvm`` guests (TCG on hosts without usable KVM, like CI).

What every runtime promises (exec semantics, files, limits, state, re-adoption, checkpoint/restore) is in
tests/contract (``MicrovmCase``); these are the microVM's own: restored identities, the agent channel's
credits, the guest memory cgroup, a SIGKILLed agent's VM adopted, failed boots/restores leaving nothing.

The template's guest is booted once per session (``snap_runtime``: ~10-20 s under TCG) and every sandbox is
restored from that snapshot (about a second under TCG). Every test checks that no QEMU process, socket,
sandbox dir or temp dir is left (``leakcheck.snapshot(qemu_dirs=...)``) on top of the usual leak check.
Skipped only where QEMU cannot run at all (no root, no QEMU, no guest kernel), saying why.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import leakcheck  # tests/leakcheck.py

SESSION = f"it{os.getpid()}"     # as tests/integration/conftest.py names this session

pytestmark = pytest.mark.anyio
MEM = 256
IDENTITY_SCRIPT = ("hostname; cat /etc/machine-id; head -c 16 /dev/urandom | od -An -tx1; date +%s; uname -r; "
                   "cat /sys/fs/cgroup/pd/pids.max /sys/fs/cgroup/pd/memory.max")


def _why_no_qemu() -> str | None:
    from pilldrops.node.runtime.qemu import probe_host
    ok, reason, _ = probe_host()
    return None if ok else reason


@pytest.fixture(scope="session")
def qemu_ready(host_ready: None) -> None:
    why = _why_no_qemu()
    if why:
        pytest.skip(f"QEMU cannot run microVMs here: {why}")


@pytest.fixture(scope="session")
def mv_dirs(data_dir: Path, qemu_ready: None, microvm_cache: Path) -> dict[str, Path]:
    return {"state": data_dir / "microvm", "cache": microvm_cache}   # the session's shared cache (tests/conftest.py)


def _runtime(mv_dirs: dict[str, Path], **kw):  # type: ignore[no-untyped-def]
    from pilldrops.node.runtime.qemu import QemuRuntime
    return QemuRuntime(kw.pop("state", mv_dirs["state"]), name=f"{SESSION}-mv", cache_dir=kw.pop("cache", mv_dirs["cache"]),
                       **kw)


def _spec(tiny, sid: str, **kw):  # type: ignore[no-untyped-def]
    from pilldrops.node.runtime.base import SandboxSpec
    return SandboxSpec(id=sid, layers=tiny.layers, memory_mb=kw.pop("memory_mb", MEM), isolation="microvm", **kw)


@pytest.fixture
def qemu_leaks(mv_dirs: dict[str, Path]):  # type: ignore[no-untyped-def]
    before = leakcheck.snapshot(match=f"pilldrops-{SESSION}", qemu_dirs=[mv_dirs["state"], mv_dirs["cache"]])
    yield mv_dirs
    leakcheck.assert_no_leaks(before, settle=5.0)


@pytest.fixture
async def mvrt(qemu_leaks: dict[str, Path], tiny):  # type: ignore[no-untyped-def]
    from pilldrops.node.runtime.base import Handle
    rt = _runtime(qemu_leaks)
    try:
        yield rt
    finally:
        for sid in await rt.list_ids():
            await rt.destroy(Handle(id=sid))
        await rt.close()


async def _run(rt, h, argv, **kw) -> tuple[int, bytes, bytes, object]:  # type: ignore[no-untyped-def]
    p = await rt.exec(h, argv, env=kw.pop("env", {}), cwd=kw.pop("cwd", None), **kw)
    out, err = bytearray(), bytearray()
    while (c := await p.read()) is not None:
        (out if c[0] == "stdout" else err).extend(c[1])
    return await p.wait(), bytes(out), bytes(err), p


async def test_create_from_snapshot_run_and_identity(mvrt, tiny) -> None:  # type: ignore[no-untyped-def]
    h1 = await mvrt.create(_spec(tiny, "id-a", hostname="alpha", envs={"FOO": "bar"}))
    h2 = await mvrt.create(_spec(tiny, "id-b", hostname="beta"))
    assert h1.extra["accel"] in ("tcg", "kvm")
    assert (await mvrt.state(h1)).status == "running"
    code, out, err, _ = await _run(mvrt, h1, ["sh", "-c", "echo out; echo err >&2; echo $FOO; exit 7"])
    assert (code, out, err) == (7, b"out\nbar\n", b"err\n")
    ids = []
    for h in (h1, h2):
        code, out, _, _ = await _run(mvrt, h, ["sh", "-c", IDENTITY_SCRIPT])
        assert code == 0, out
        host, mid, rnd, clock, kernel, pids, mem = out.decode().splitlines()
        ids.append((host, mid, rnd.strip()))
        assert abs(int(clock) - time.time()) < 30          # the clock was set after the restore
        assert kernel.endswith("cloud-amd64")              # the guest's own Debian kernel
        assert pids == "1024" and int(mem) == MEM * 2**20    # the sandbox's limits, in the guest's cgroup
    assert ids[0][0] == "alpha" and ids[1][0] == "beta"
    assert ids[0][1] != ids[1][1] and len(ids[0][1]) == 32   # own machine-id
    assert ids[0][2] != ids[1][2]                            # re-seeded: different random streams
    code, _, err, _ = await _run(mvrt, h1, ["/no/such/binary"])
    assert code == 127 and b"No such file" in err
    # QEMU is not our child: daemonized, re-parented away from this process
    assert int(Path(f"/proc/{h1.pid}/stat").read_text().rsplit(")", 1)[1].split()[1]) != os.getpid()
    await mvrt.destroy(h1)
    await mvrt.destroy(h1)                                   # idempotent
    assert (await mvrt.state(h1)).status == "gone"


async def test_credits_and_memory_limit(mvrt, tiny) -> None:  # type: ignore[no-untyped-def]
    h = await mvrt.create(_spec(tiny, "lim"))
    code, out, _, _ = await _run(mvrt, h, ["wc", "-c"], stdin=b"x" * 150_000)   # > 2 credit windows
    assert code == 0 and out.strip() == b"150000"
    # past memory_mb only the offender dies (the guest memory cgroup's OOM kill), the sandbox lives on; 16 MiB
    # is in the same guest-RAM class (256 MiB) as the other sandboxes: the same snapshot
    small = await mvrt.create(_spec(tiny, "oom", memory_mb=16))
    # one 24 MiB buffer filled by one read: charged at once, so the cgroup kills it at once (a buffer grown
    # by realloc, as `tail` does, copies its way there for minutes under TCG and hit the command's timeout)
    hog = "dd if=/dev/zero of=/dev/null bs=24M count=1"
    code, _, _, p = await _run(mvrt, small, ["sh", "-c", hog], timeout=120)
    assert code == 137 and not p.timed_out
    code, out, _, _ = await _run(mvrt, small, ["sh", "-c", "echo still-here; cat /sys/fs/cgroup/pd/memory.events"])
    assert code == 0 and out.startswith(b"still-here\n") and b"oom_kill 1" in out, out


def _alive(pid: int) -> bool:
    try:
        st = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return False
    return not st[st.rindex(b")") + 2:].startswith(b"Z")


async def test_readoption_after_the_agent_was_killed(qemu_leaks, tiny) -> None:  # type: ignore[no-untyped-def]
    """A process creates a VM and is SIGKILLed; a fresh runtime instance adopts the VM from its handle."""
    from pilldrops.node.runtime.base import Handle
    script = f"""
import anyio, json, sys
from pathlib import Path
from pilldrops.node.runtime.base import SandboxSpec
from pilldrops.node.runtime.qemu import QemuRuntime
async def main():
    rt = QemuRuntime(Path({str(qemu_leaks['state'])!r}), name={SESSION + '-mv'!r}, cache_dir=Path({str(qemu_leaks['cache'])!r}))
    h = await rt.create(SandboxSpec(id="adopt", layers=tuple(Path(p) for p in {[str(p) for p in tiny.layers]!r}),
                                    memory_mb={MEM}, isolation="microvm"))
    p = await rt.exec(h, ["sh", "-c", "sleep 1000"], env={{}}, cwd=None)   # in flight when the agent dies
    print(json.dumps({{"id": h.id, "pid": h.pid, "start": h.pid_start_time, "bundle": h.bundle, "extra": h.extra}}), flush=True)
    await anyio.sleep(1000)
anyio.run(main)
"""
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)  # noqa: ASYNC220
    try:
        line = proc.stdout.readline()  # type: ignore[union-attr]
        assert line, "the first agent did not create the VM"
        info = json.loads(line)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    rt = _runtime(qemu_leaks)
    h = Handle(id=info["id"], pid=info["pid"], pid_start_time=info["start"], bundle=info["bundle"], extra=info["extra"])
    try:
        assert _alive(h.pid)                               # the VM outlived its agent
        assert (await rt.state(h)).status == "running"
        assert await rt.list_ids() == ["adopt"]
        code, out, _, _ = await _run(rt, h, ["sh", "-c", "echo adopted; ps -o comm | grep -c '^sleep' || true"])
        assert (code, out) == (0, b"adopted\n0\n")           # the command of the dead agent was killed
    finally:
        await rt.destroy(h)
        await rt.close()
    assert not _alive(h.pid)


async def test_failed_boot_and_failed_restore_leave_nothing(qemu_leaks, tiny, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    from pilldrops.node.runtime.base import RuntimeFailure
    # a guest that cannot boot: a kernel file that is not a kernel (own cache: no snapshot to fall back on)
    qemu_leaks["state"].mkdir(parents=True, exist_ok=True)
    bad_kernel = qemu_leaks["state"] / "not-a-kernel"
    bad_kernel.write_bytes(os.urandom(4096))
    cache = qemu_leaks["state"].parent / "microvm-cache-badboot"
    rt = _runtime(qemu_leaks, kernel=bad_kernel, cache=cache, boot_timeout=5)
    try:
        with pytest.raises(RuntimeFailure) as ei:
            await rt.create(_spec(tiny, "noboot"))
        # random bytes: QEMU refuses them at once ("linux kernel too old...") or runs garbage until the boot timeout
        assert "did not boot" in str(ei.value) or "QEMU failed to start" in str(ei.value), str(ei.value)
        assert await rt.list_ids() == []
        assert not list((cache / "snapshots").glob("*")) or all(p.name.endswith(".lock") for p in (cache / "snapshots").iterdir())
    finally:
        await rt.close()
    assert not leakcheck._qemu([cache]), leakcheck._qemu([cache])
    # a snapshot that fails to restore: the session's snapshot copied and truncated
    good = _runtime(qemu_leaks)
    h = await good.create(_spec(tiny, "donor"))
    await good.destroy(h)
    await good.close()
    cache2 = qemu_leaks["state"].parent / "microvm-cache-badsnap"
    shutil.copytree(qemu_leaks["cache"], cache2, symlinks=True)
    for snap in (cache2 / "snapshots").glob("*/vm.snap"):
        with open(snap, "r+b") as f:  # noqa: ASYNC230
            f.truncate(snap.stat().st_size // 3)
    rt2 = _runtime(qemu_leaks, cache=cache2)
    try:
        with pytest.raises(RuntimeFailure) as ei:
            await rt2.create(_spec(tiny, "norestore"))
        assert "restore" in str(ei.value) or "agent" in str(ei.value), str(ei.value)
        assert await rt2.list_ids() == []
    finally:
        await rt2.close()
    assert not leakcheck._qemu([cache2, qemu_leaks["state"]])
    shutil.rmtree(cache, ignore_errors=True)
    shutil.rmtree(cache2, ignore_errors=True)
    bad_kernel.unlink()
