"""The agent's spawner of its own tools (``isolation.spawn``): exit statuses, captured and bounded output,
stdio that a left-behind descendant holds, cancellation (the child is killed and reaped), and a program
that cannot be started; on both anyio backends."""

from __future__ import annotations

import errno
import os
import signal
import sys

import anyio
import pytest

from pilldrops.node.isolation import spawn

pytestmark = pytest.mark.anyio


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return request.param


def _reaped(pid: int) -> bool:
    """``pid`` is no child of ours any more (reaped: no zombie left behind)."""
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        return True
    return False


async def test_exit_status() -> None:
    assert (await spawn.run(["true"])).returncode == 0
    r = await spawn.run(["sh", "-c", "exit 3"])
    assert r.returncode == 3 and r.stdout == b"" and r.stderr == b"" and not r.truncated
    assert (await spawn.run(["sh", "-c", "kill -9 $$"])).returncode == -signal.SIGKILL


async def test_output_captured_apart() -> None:
    r = await spawn.run(["sh", "-c", "echo out; echo err >&2; exit 1"])
    assert (r.returncode, r.stdout, r.stderr) == (1, b"out\n", b"err\n")
    r = await spawn.run(["sh", "-c", "echo out; echo err >&2"], stdout=spawn.DEVNULL)
    assert (r.stdout, r.stderr) == (b"", b"err\n")


async def test_stdin_is_dev_null() -> None:
    r = await spawn.run(["cat"])          # would wait for input on anything but /dev/null
    assert (r.returncode, r.stdout) == (0, b"")


async def test_output_into_a_file(tmp_path) -> None:  # type: ignore[no-untyped-def]
    with open(tmp_path / "log", "wb") as f:  # noqa: ASYNC230 - a local file
        r = await spawn.run(["sh", "-c", "echo out; echo err >&2"], stdout=f, stderr=spawn.STDOUT)
    assert r.stdout == b"" and r.stderr == b""
    assert sorted((tmp_path / "log").read_bytes().splitlines()) == [b"err", b"out"]


async def test_output_is_bounded() -> None:
    code = "import sys; sys.stdout.write('a' * 5000 + 'b' * 5000); sys.stderr.write('c' * 5000 + 'd' * 5000)"
    r = await spawn.run([sys.executable, "-c", code], stdout_cap=5000, stderr_cap=5000)
    assert r.stdout == b"a" * 5000            # the head of stdout
    assert r.stderr == b"d" * 5000            # the tail of stderr (where an error message ends)
    assert r.truncated
    r = await spawn.run([sys.executable, "-c", code])
    assert len(r.stdout) == len(r.stderr) == 10_000 and not r.truncated


async def test_a_descendant_holding_its_stdio_does_not_hold_the_wait() -> None:
    # `crun run --detach` hands its stdio to the sandbox's init, which outlives it: the run ends with the
    # child, not with the last holder of its output
    r = await spawn.run(["sh", "-c", "sleep 60 & echo $!"])
    left = int(r.stdout)
    try:
        assert r.returncode == 0
    finally:
        os.kill(left, signal.SIGKILL)


async def test_other_fds_are_not_inherited() -> None:
    r, w = os.pipe()
    try:
        os.set_inheritable(w, True)
        assert (await spawn.run(["sh", "-c", f"test -e /proc/self/fd/{w}"])).returncode == 1
        assert (await spawn.run(["sh", "-c", "test -e /proc/self/fd/0"])).returncode == 0
    finally:
        os.close(r)
        os.close(w)


async def test_cancellation_kills_and_reaps_the_child(tmp_path) -> None:  # type: ignore[no-untyped-def]
    pid_file = tmp_path / "pid"
    async with anyio.create_task_group() as tg:
        script = f"echo $$ > {pid_file}.tmp && mv {pid_file}.tmp {pid_file} && exec sleep 60"
        tg.start_soon(spawn.run, ["sh", "-c", script])
        while not pid_file.exists():
            await anyio.sleep(0.01)
        tg.cancel_scope.cancel()
    pid = int(pid_file.read_text())
    assert _reaped(pid)
    assert not os.path.exists(f"/proc/{pid}")      # killed (sleep 60 would still run), and no zombie


async def test_a_shielded_run_is_not_cancelled() -> None:
    with anyio.CancelScope() as scope:
        scope.cancel()
        with anyio.CancelScope(shield=True):
            r = await spawn.run(["sh", "-c", "sleep 0.05; echo done"])
    assert r.stdout == b"done\n"


async def test_a_missing_program_is_a_clear_error(tmp_path) -> None:  # type: ignore[no-untyped-def]
    missing = tmp_path / "no-such-crun"
    with pytest.raises(spawn.SpawnError) as e:
        await spawn.run([str(missing), "--version"])
    assert e.value.errno == errno.ENOENT and str(missing) in str(e.value)
    not_exec = tmp_path / "not-executable"
    not_exec.write_text("#!/bin/sh\n")
    with pytest.raises(spawn.SpawnError) as e:
        await spawn.run([str(not_exec)])
    assert e.value.errno == errno.EACCES and str(not_exec) in str(e.value)


async def test_many_at_once() -> None:
    results: dict[int, spawn.Completed] = {}

    async def one(i: int) -> None:
        results[i] = await spawn.run(["sh", "-c", f"echo {i}; exit {i % 7}"])

    async with anyio.create_task_group() as tg:
        for i in range(40):
            tg.start_soon(one, i)
    assert {i: (r.returncode, r.stdout) for i, r in results.items()} == \
        {i: (i % 7, f"{i}\n".encode()) for i in range(40)}
