"""Issue 16 part 3: a command's timeout (or kill) ends everything the command started, whatever the
command does to itself: setsid, a double fork, ignoring SIGTERM, stopping itself, closing its pipes.

pd-init runs each command under a shepherd (a child subreaper) and kills every descendant of it, found
through /proc, on a kill; under gVisor, where the subreaper does not hold, each command also has a cgroup
of its own and the kill ends everything in it. The real crun runtime (and gVisor, where runsc is
installed) are driven here.
"""

from __future__ import annotations

import time

import anyio
import pytest

from pilldrops.node.runtime.base import SandboxSpec
from pilldrops.node.runtime.gvisor import RunscExec
from tests.hostile._crun_fixtures import *
from tests.hostile._crun_fixtures import cgroup_pids, live, sh, wait_only_init

pytestmark = [pytest.mark.integration, pytest.mark.anyio]

# each script leaves something that would outlive a process-group kill, then blocks
ESCAPES = {
    "setsid": "setsid sleep 1000 & setsid sh -c 'sleep 1001' & sleep 1002",
    "double_fork": "( ( sleep 1000 & ) & ) ; sh -c 'sleep 1001 & exit 0'; sleep 1002",
    "setsid_double_fork": "setsid sh -c '( setsid sleep 1000 & ) ; sleep 1001' & sleep 1002",
    "ignores_sigterm": "trap '' TERM INT HUP; setsid sh -c \"trap '' TERM; sleep 1000\" & sleep 1001",
    "stops_itself": "setsid sleep 1000 & kill -STOP $$; sleep 1001",
    "closes_pipes": "exec >&- 2>&- <&-; setsid sleep 1000 & sleep 1001",
    "many": "for i in 1 2 3 4 5 6 7 8 9 10; do setsid sh -c 'sleep 1000 & sleep 1001' & done; sleep 1002",
    # gVisor's /proc lets a process follow pd-init's fd links: its cgroupfs must not be among them
    "moves_out_of_its_cgroup": "setsid sh -c 'for f in /proc/1/fd/*; do echo $$ > $f/cgroup.procs; "
                               "echo $$ > $f/tasks; done 2>/dev/null; exec sleep 1000' & sleep 1001",
}


def spec(tiny, sid: str) -> SandboxSpec:  # type: ignore[no-untyped-def]
    return SandboxSpec(id=sid, layers=tiny.layers, workdir=tiny.workdir)


@pytest.fixture
async def box(crun_rt, tiny):  # type: ignore[no-untyped-def]
    h = await crun_rt.create(spec(tiny, "detach"))
    yield h
    await crun_rt.destroy(h)


@pytest.mark.parametrize("case", sorted(ESCAPES))
async def test_timeout_kills_everything_the_command_started(crun_rt, box, case):  # type: ignore[no-untyped-def]
    t = time.monotonic()
    code, _, _, p = await sh(crun_rt, box, ESCAPES[case], timeout=1.5)
    took = time.monotonic() - t
    assert p.timed_out and code == 137, (code, p.timed_out)
    assert took < 10, took
    assert wait_only_init(box) == [], f"{case}: left running after the timeout"
    # the sandbox goes on working
    assert (await sh(crun_rt, box, "echo ok", timeout=10))[:2] == (0, "ok\n")


@pytest.mark.parametrize("case", ["double_fork", "setsid_double_fork"])
async def test_crun_exec_fallback_timeout_kills_everything(crun_rt, box, case, monkeypatch):  # type: ignore[no-untyped-def]
    """Without pd-init's channel (``crun exec``, e.g. PILLDROPS_EXEC=crun) the command runs under
    ``/.pd/init --shepherd`` (a subreaper): the host's kill of its tree reaches the orphans too."""
    monkeypatch.setenv("PILLDROPS_EXEC", "crun")
    code, _, _, p = await sh(crun_rt, box, ESCAPES[case], timeout=1.5)
    assert p.timed_out, (code, p.timed_out)
    assert wait_only_init(box) == [], f"{case}: left running after the timeout (crun exec)"
    code, out, _, p = await sh(crun_rt, box, "echo ok; exit 3", timeout=10)
    assert (code, out) == (3, "ok\n")
    assert (await sh(crun_rt, box, "kill -TERM $$; sleep 5", timeout=10))[0] == 128 + 15


async def test_kill_kills_detached_children(crun_rt, box):  # type: ignore[no-untyped-def]
    p = await crun_rt.exec(box, ["sh", "-c", ESCAPES["setsid_double_fork"]], env={}, cwd=None, timeout=60)
    await anyio.sleep(0.5)
    assert len(live(cgroup_pids(box))) >= 4         # init, shepherd, sh, sleeps
    await p.kill()
    assert await p.wait() == 137
    assert wait_only_init(box) == []


async def test_background_survives_a_normal_exit_and_pid_is_the_commands(crun_rt, box):  # type: ignore[no-untyped-def]
    """Only a timeout or kill ends the tree: a command that exits leaves its daemons running, as a shell
    does (servers started with `cmd &`), and $$ / the reported pid is the command's own."""
    code, out, _, p = await sh(crun_rt, box, "setsid sleep 1000 >/dev/null 2>&1 & echo $$", timeout=10)
    assert code == 0 and int(out) == p.sandbox_pid
    assert len(wait_only_init(box, timeout=0.3)) == 1                 # the daemon
    assert (await sh(crun_rt, box, "kill -9 -- -$$ 2>&1; echo unreachable", timeout=10))[0] == 137
    assert (await sh(crun_rt, box, "killall sleep; echo done", timeout=10))[:2] == (0, "done\n")
    assert wait_only_init(box) == []


async def test_signals_reach_the_commands_group_not_the_shepherd(crun_rt, box):  # type: ignore[no-untyped-def]
    p = await crun_rt.exec(box, ["sh", "-c", "trap 'echo got; exit 3' USR1; while :; do sleep 0.05; done"],
                           env={}, cwd=None, timeout=30)
    await anyio.sleep(0.3)
    assert await p.signal(10)
    chunks = []
    while (c := await p.read()) is not None:
        chunks.append(c[1])
    assert await p.wait() == 3 and b"got" in b"".join(chunks)


async def gvisor_sleeps(rt, h, timeout: float = 5.0) -> str:  # type: ignore[no-untyped-def]
    """The sandbox's ``sleep`` processes once none is left or ``timeout`` passed (inside gVisor the host sees
    only the Sentry: the sandbox itself is asked)."""
    deadline = time.monotonic() + timeout
    while True:
        _, out, _, _ = await sh(rt, h, "ps -o pid,ppid,comm | grep sleep || true", timeout=10)
        if "sleep" not in out or time.monotonic() > deadline:
            return out
        await anyio.sleep(0.1)


@pytest.mark.parametrize("case", sorted(ESCAPES))
async def test_gvisor_timeout_kills_detached(gvisor_rt, tiny, case):  # type: ignore[no-untyped-def]
    """gVisor: the timeout ends everything the command started, also a process that left the command's
    session AND lost its parent before the timeout (``setsid_double_fork``, ``double_fork``, ``many``).
    runsc re-parents such an orphan to PID 1 in spite of the shepherd's PR_SET_CHILD_SUBREAPER, so no /proc
    walk finds it; pd-init (``--cgroups``) runs each command in a cgroup of its own on gVisor's cgroupfs,
    which every descendant is born in whatever becomes of its parents, and kills what is listed there."""
    h = await gvisor_rt.create(spec(tiny, f"detach-gv-{case.replace('_', '-')}"))
    try:
        code, _, _, p = await sh(gvisor_rt, h, ESCAPES[case], timeout=2)
        assert p.timed_out and code == 137
        assert await gvisor_sleeps(gvisor_rt, h) == "", f"{case}: left running after the timeout"
        # the command saw no cgroupfs, and has no capability to mount one (pd-init dropped CAP_SYS_ADMIN)
        code, out, _, _ = await sh(gvisor_rt, h, "grep -c cgroup /proc/mounts; grep CapEff /proc/1/status; "
                                   "mount -t cgroup -o cpu pd /tmp 2>/dev/null || echo denied", timeout=10)
        lines = out.split()
        assert lines[0] == "0" and int(lines[2], 16) & (1 << 21) == 0 and lines[-1] == "denied", out
    finally:
        await gvisor_rt.destroy(h)


async def test_gvisor_kill_kills_detached_and_background_survives_a_normal_exit(gvisor_rt, tiny):  # type: ignore[no-untyped-def]
    """gVisor twins of test_kill_kills_detached_children and test_background_survives_a_normal_exit...: a
    kill (not only a timeout) ends the detached orphans; a command that exits normally leaves its daemons
    running, and $$ / the reported pid is the command's own (its cgroup changes no pid it sees)."""
    h = await gvisor_rt.create(spec(tiny, "detach-gv-kill"))
    try:
        p = await gvisor_rt.exec(h, ["sh", "-c", ESCAPES["setsid_double_fork"]], env={}, cwd=None, timeout=60)
        deadline = time.monotonic() + 10
        while (await sh(gvisor_rt, h, "ps -o comm | grep -c sleep || true", timeout=10))[1].strip() != "3":
            assert time.monotonic() < deadline, "the three sleeps never started"
            await anyio.sleep(0.1)
        await p.kill()
        assert await p.wait() == 137
        assert await gvisor_sleeps(gvisor_rt, h) == "", "left running after the kill"

        code, out, _, p = await sh(gvisor_rt, h, ESCAPES["setsid_double_fork"].replace("& sleep 1002", "& echo $$"),
                                   timeout=10)
        assert code == 0 and int(out) == p.sandbox_pid and not p.timed_out
        await anyio.sleep(0.3)
        _, out, _, _ = await sh(gvisor_rt, h, "ps -o comm | grep -c sleep || true", timeout=10)
        assert out.strip() == "2", out            # both daemons (sleep 1000 and 1001) survive the exit
        assert (await sh(gvisor_rt, h, "killall sleep; echo done", timeout=10))[:2] == (0, "done\n")
        assert await gvisor_sleeps(gvisor_rt, h) == ""
        await _assert_runsc_exec_has_no_sys_admin(gvisor_rt, h)
    finally:
        await gvisor_rt.destroy(h)


# the shell's OWN sets (builtins only: a program it execs would have had them recomputed by execve)
async def test_gvisor_cgroups_setup_failure_is_logged_and_drops_nothing_it_lacks(gvisor_rt, tiny, monkeypatch):  # type: ignore[no-untyped-def]
    """pd-init --cgroups without CAP_SYS_ADMIN (its mount fails): it says so on its stderr (the runtime's
    crun.err, which the node reports when a start fails), runs commands without per-command cgroups, and holds
    no CAP_SYS_ADMIN (a failure to drop it would end pd-init instead)."""
    config = gvisor_rt._config

    def without_sys_admin(spec, d):  # type: ignore[no-untyped-def]
        c = config(spec, d)
        caps = c["process"]["capabilities"]
        for key in ("effective", "permitted"):
            caps[key] = [x for x in caps[key] if x != "CAP_SYS_ADMIN"]
        return c

    monkeypatch.setattr(gvisor_rt, "_config", without_sys_admin)
    h = await gvisor_rt.create(spec(tiny, "detach-gv-nocg"))
    try:
        code, out, err, _ = await sh(gvisor_rt, h, "grep CapEff /proc/1/status; echo ok", timeout=10)
        assert code == 0 and out.split()[-1] == "ok" and int(out.split()[1], 16) & (1 << 21) == 0, (out, err)
        log = (gvisor_rt._dir(h.id) / "crun.err").read_text(errors="replace")
        assert "pd-init: --cgroups: mount cgroupfs" in log and "no cgroup per command" in log, log
    finally:
        await gvisor_rt.destroy(h)


CAPS_OF_SELF = "while read -r k v; do case $k in Cap*) echo $k $v;; esac; done < /proc/self/status"


async def _assert_runsc_exec_has_no_sys_admin(rt, h) -> None:  # type: ignore[no-untyped-def]
    """A command started with ``runsc exec`` (the fallback after pd-init's socket refused connections, which a
    sandbox can provoke, or PILLDROPS_EXEC=crun) has exactly the capabilities of a command pd-init runs, as
    root and as another user (none): never the CAP_SYS_ADMIN (bit 21) ``with_command_cgroups`` gives pd-init
    alone, with which it could mount a cgroupfs and leave its command's cgroup, or mount over anything
    (runsc gives a ``runsc exec`` without explicit capabilities the container's, whatever the user)."""
    for user in (None, "1000:1000"):
        code, via_init, err, _ = await sh(rt, h, CAPS_OF_SELF, timeout=10, user=user, cwd="/")
        assert code == 0, err
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("PILLDROPS_EXEC", "crun")
            code, via_exec, err, p = await sh(rt, h, CAPS_OF_SELF + "; id -u", timeout=20, user=user, cwd="/")
        assert code == 0 and isinstance(p, RunscExec), err
        *lines, uid = via_exec.splitlines()
        assert uid == (user or "0:").split(":")[0], via_exec
        caps = dict(line.split() for line in lines)
        for key in ("CapEff:", "CapPrm:", "CapBnd:"):
            assert int(caps[key], 16) & (1 << 21) == 0, f"runsc exec as {user}: {key} has CAP_SYS_ADMIN\n{via_exec}"
        assert lines == via_init.splitlines(), (user, via_init, via_exec)
