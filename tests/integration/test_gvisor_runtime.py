"""The gVisor runtime for real (root + runsc; tiny template): it is gVisor, same bundle and limits as crun,
fast exec path and ``runsc exec``, tree kill, re-adoption, checkpoint/restore, cleanup (leak-checked by
conftest, runsc root included). A gVisor destroy takes ~1.7 s, so the tests share few sandboxes."""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest

from pilldrops.node.isolation.superexec import SupervisorExec
from pilldrops.node.runtime.base import Handle, RuntimeFailure, SandboxSpec
from pilldrops.node.runtime.gvisor import PROCESS_TASKS, RUNTIME_PIDS, GvisorRuntime, RunscExec
from tests.integration.conftest import SESSION

pytestmark = [pytest.mark.integration, pytest.mark.anyio]


def spec(tiny, name: str, **kw) -> SandboxSpec:  # type: ignore[no-untyped-def]
    kw.setdefault("workdir", tiny.workdir)
    # runsc's control socket is named after the container id host-wide: ids unique to this session
    return SandboxSpec(id=f"{SESSION}-{name}", layers=tiny.layers, isolation="gvisor", **kw)


async def run(rt, h, argv, *, env=None, cwd=None, stdin=None, timeout=None):  # type: ignore[no-untyped-def]
    p = await rt.exec(h, argv, env=env or {}, cwd=cwd, stdin=stdin, timeout=timeout)
    chunks = []
    while (c := await p.read()) is not None:
        chunks.append(c)
    code = await p.wait()
    out = b"".join(d for s, d in chunks if s == "stdout").decode()
    err = b"".join(d for s, d in chunks if s == "stderr").decode()
    return code, out, err, p


def cg(h: Handle, controller: str, name: str) -> str:
    return (Path("/sys/fs/cgroup") / controller / h.extra["cgroup"].lstrip("/") / name).read_text().strip()


async def test_is_gvisor_with_crun_bundle_limits_and_both_exec_paths(gvisor, tiny, monkeypatch):  # type: ignore[no-untyped-def]
    h = await gvisor.create(spec(tiny, "basic", vcpu=0.5, memory_mb=256, pids_limit=100, envs={"FOO": "bar"},
                                 hostname="gv-basic"))
    try:
        with anyio.fail_after(10):      # pd-init binds its socket right after start (slower under load)
            while not (Path(h.bundle) / "pd" / "ctl").exists():
                await anyio.sleep(0.01)
        code, out, err, p = await run(gvisor, h, ["/bin/sh", "-c", "uname -r; echo $FOO; hostname; echo e >&2; exit 3"])
        assert isinstance(p, SupervisorExec)            # the fast path works under gVisor
        assert p.pid is None                            # never a host pid: the sandbox's pids are gVisor's
        # uname: gVisor's Sentry, not this host's kernel
        assert (code, out.split(), err) == (3, ["4.4.0", "bar", "gv-basic"], "e\n")
        # a terminal: this gVisor lacks TIOCGPTPEER, pd-init opens the PTY's terminal side by its number
        p = await gvisor.exec(h, ["/bin/sh", "-c", "echo hi; tty; stty size"], env={}, cwd=None, pty=(33, 101))
        chunks = []
        while (c := await p.read()) is not None:
            chunks.append(c)
        assert (await p.wait(), p.timed_out) == (0, False)
        lines = b"".join(d for _, d in chunks).decode().split("\r\n")
        assert lines[0] == "hi" and lines[1].startswith("/dev/pts/") and lines[2:] == ["33 101", ""], lines
        # ... also past pts 255 (this gVisor gives those major 136 and minor N, Linux majors 137-143: pty_peer takes both)
        hold = 'i=10; while [ $i -lt 270 ]; do eval "exec $i<>/dev/pts/ptmx" || exit 9; i=$((i+1)); done; echo held; exec sleep 60'
        holder = await gvisor.exec(h, ["/bin/sh", "-c", hold], env={}, cwd=None)
        assert (await holder.read()) == ("stdout", b"held\n")
        p = await gvisor.exec(h, ["/bin/sh", "-c", "tty"], env={}, cwd=None, pty=(24, 80))
        chunks = []
        while (c := await p.read()) is not None:
            chunks.append(c)
        out = b"".join(d for _, d in chunks).decode()
        assert await p.wait() == 0 and int(out.strip().removeprefix("/dev/pts/")) >= 256, out
        await holder.kill()
        await holder.wait()
        # same limits as crun; the pids limit leaves room for gVisor's own tasks
        assert cg(h, "cpu", "cpu.cfs_quota_us") == "50000"
        assert cg(h, "memory", "memory.limit_in_bytes") == str(256 << 20)
        assert cg(h, "pids", "pids.max") == str(PROCESS_TASKS * 100 + RUNTIME_PIDS)
        assert 2 <= int(cg(h, "pids", "pids.current")) < RUNTIME_PIDS   # Sentry + gofer, in the sandbox's cgroup
        # same seccomp profile as crun (applied inside the Sentry): no new namespaces
        code, _, _, _ = await run(gvisor, h, ["/bin/sh", "-c", "unshare -n true"])
        assert code != 0
        # the host's processes are invisible; writes land in the sandbox's own writable layer
        code, out, _, _ = await run(gvisor, h, ["/bin/sh", "-c", "ps -o pid,comm | wc -l; echo hi > /root/f"])
        assert code == 0 and int(out) <= 6        # header, init, shepherd, sh, ps, wc
        assert (Path(h.bundle) / "upper" / "root" / "f").read_text() == "hi\n"
        assert (await gvisor.state(h)).status == "running"
        assert await gvisor.list_ids() == [h.id]

        # without the fast path: runsc exec, same semantics, tree kill inside the sandbox
        monkeypatch.setenv("PILLDROPS_EXEC", "crun")
        code, out, err, p = await run(gvisor, h, ["/bin/sh", "-c", "cat; echo $FOO; exit 4"], stdin=b"in\n")
        assert isinstance(p, RunscExec) and (code, out, err) == (4, "in\nbar\n", "")
        code, _, _, _ = await run(gvisor, h, ["/bin/sh", "-c", "sleep 100 & sleep 100"], timeout=1.0)
        assert code == 137
        monkeypatch.delenv("PILLDROPS_EXEC")
        with anyio.fail_after(10):
            while True:
                _, out, _, _ = await run(gvisor, h, ["/bin/sh", "-c", "ps -o comm | grep -c sleep || true"])
                if out.strip() == "0":
                    break
                await anyio.sleep(0.1)
        # the fast path kills a tree on timeout too
        code, _, _, p = await run(gvisor, h, ["/bin/sh", "-c", "sleep 100 & sleep 100"], timeout=0.5)
        assert code == 124 or p.timed_out
        _, out, _, _ = await run(gvisor, h, ["/bin/sh", "-c", "ps -o comm | grep -c sleep || true"])
        assert out.strip() == "0"
    finally:
        await gvisor.destroy(h)
    assert (await gvisor.state(h)).status == "gone"
    assert not Path(h.bundle).exists()
    await gvisor.destroy(h)                             # idempotent


async def test_readopt_and_pause_resume(gvisor, tiny, data_dir, init_path, monkeypatch):  # type: ignore[no-untyped-def]
    h = await gvisor.create(spec(tiny, "pause", memory_mb=256))
    try:
        # state in the Sentry's memory (/tmp is gVisor's own tmpfs), on disk, and a live process
        code, _, _, _ = await run(gvisor, h, ["/bin/sh", "-c",
                                              "echo mem > /tmp/m; echo disk > /root/d; (sleep 1000 &) ; true"])
        assert code == 0
        # a restarted agent: a new runtime on the same state dir finds it from facts
        again = GvisorRuntime(data_dir / "gvisor", name=f"{SESSION}-gv", init_path=init_path)
        assert (await again.state(Handle(**vars(h)))).status == "running"
        assert await again.list_ids() == [h.id]
        code, out, _, p = await run(again, h, ["cat", "/tmp/m"])
        assert (code, out) == (0, "mem\n") and isinstance(p, SupervisorExec)
        # ``again`` stands for a restarted agent, whose predecessor's connections would be gone with its
        # process; here both live on: its spare control connection (issue 15) is ended before the pause
        await again._spares.suspend(h.id)

        image = data_dir / f"gv-image-{SESSION}"
        image.mkdir()
        try:
            # a background child of a `runsc exec` command keeps host pipes in the Sentry: the pause is refused
            # (an image with them would not restore) and the sandbox keeps running
            monkeypatch.setenv("PILLDROPS_EXEC", "crun")
            await run(gvisor, h, ["/bin/sh", "-c", "(sleep 999 &); true"])
            monkeypatch.delenv("PILLDROPS_EXEC")
            with pytest.raises(RuntimeFailure, match="cannot be paused"):
                await gvisor.checkpoint(h, image)
            assert (await gvisor.state(h)).status == "running" and not any(image.iterdir())
            kill = "for p in $(pidof sleep); do grep -q 999 /proc/$p/cmdline && kill $p; done; true"
            assert (await run(gvisor, h, ["/bin/sh", "-c", kill]))[0] == 0
            size = await gvisor.checkpoint(h, image)
            assert size > 0 and (image / "runsc").is_dir() and (await gvisor.state(h)).status == "gone"
            h = await gvisor.restore(spec(tiny, "pause", memory_mb=256), image)
        finally:
            import shutil
            shutil.rmtree(image, ignore_errors=True)
        code, out, _, p = await run(gvisor, h, ["/bin/sh", "-c", "cat /tmp/m /root/d; ps -o comm | grep -c sleep"])
        assert (code, out.split()) == (0, ["mem", "disk", "1"])
        assert isinstance(p, SupervisorExec)            # pd-init listens again after the restore
        # pd-init's cgroup per command (--cgroups) survives the restore: a timeout still ends a process that
        # left the session and lost its parent, and the earlier command's background sleep stays
        escape = "setsid sh -c '( setsid sleep 1001 & ) ; sleep 1002' & sleep 1003"
        code, _, _, p = await run(gvisor, h, ["/bin/sh", "-c", escape], timeout=2)
        assert code == 137 and p.timed_out
        with anyio.fail_after(10):
            while (await run(gvisor, h, ["/bin/sh", "-c", "ps -o comm | grep -c sleep"]))[1].strip() != "1":
                await anyio.sleep(0.1)
    finally:
        await gvisor.destroy(h)


async def test_failed_create_leaves_nothing(gvisor, tiny, tmp_path):  # type: ignore[no-untyped-def]
    bad = SandboxSpec(id=f"{SESSION}-bad", layers=(tmp_path / "no-such-layer",), isolation="gvisor")
    with pytest.raises(RuntimeFailure):
        await gvisor.create(bad)
    assert await gvisor.list_ids() == []


async def test_pids_and_memory_limits_end_the_sandbox_not_the_host(gvisor, tiny):  # type: ignore[no-untyped-def]
    """gVisor cannot fail a fork or an allocation inside: past its limits the host cgroup ends the Sentry,
    i.e. the sandbox (documented in gvisor.py and the README)."""
    forks = await gvisor.create(spec(tiny, "forks", pids_limit=20))
    hog = await gvisor.create(spec(tiny, "hog", memory_mb=64))
    try:
        p1 = await gvisor.exec(forks, ["/bin/sh", "-c", "for i in $(seq 60); do sleep 30 & done; wait"], env={},
                               cwd=None, timeout=60)
        p2 = await gvisor.exec(hog, ["/bin/sh", "-c", "head -c 300000000 /dev/zero | tail > /dev/null"], env={},
                               cwd=None, timeout=60)
        with anyio.fail_after(60):
            assert await p1.wait() != 0 and await p2.wait() != 0
            while (await gvisor.state(forks)).status == "running" or (await gvisor.state(hog)).status == "running":
                await anyio.sleep(0.1)
        assert (await gvisor.state(hog)).oom_killed
    finally:
        async with anyio.create_task_group() as tg:
            tg.start_soon(gvisor.destroy, forks)
            tg.start_soon(gvisor.destroy, hog)
