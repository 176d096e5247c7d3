"""/proc/<pid>/stat as the agent reads it (``isolation.procs``): the fields after the command name, whatever
that name holds, the start time that guards against pid reuse, and nothing for a pid that is gone."""

from __future__ import annotations

import os
import subprocess
import sys

from pilldrops.node.isolation import procs


def test_fields_of_a_process_whose_name_holds_parentheses_and_spaces() -> None:
    code = ("import sys, time\nopen('/proc/self/comm', 'w').write('x) (y z)')\n"
            "print('ready', flush=True)\ntime.sleep(60)")
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    try:
        assert child.stdout is not None and child.stdout.readline() == b"ready\n"
        f = procs.stat_fields(child.pid)
        assert f is not None and f[0] in ("S", "R") and int(f[1]) == os.getpid()      # state, ppid
        assert procs.ppid(child.pid) == os.getpid()
        start = procs.start_time(child.pid)
        assert start is not None and procs.alive(child.pid, start) and not procs.alive(child.pid, start + 1)
    finally:
        child.kill()
        child.wait()
        assert child.stdout is not None
        child.stdout.close()
    assert procs.stat_fields(child.pid) is None and not procs.alive(child.pid)


def test_a_zombie_is_not_alive() -> None:
    child = subprocess.Popen(["true"])
    os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)      # exited, not reaped yet: a zombie
    try:
        f = procs.stat_fields(child.pid)
        assert f is not None and f[0] == "Z" and not procs.alive(child.pid)
    finally:
        child.wait()
