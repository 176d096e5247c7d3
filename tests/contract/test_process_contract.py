"""What the data plane's process service (node/processes.py: E2B envd, `sandbox shell`) needs from a runtime,
on every runtime in ``conftest.RUNTIMES``: stdin fed from a stream that stays open across requests and then
closes, a signal other than SIGKILL reaching the command (``ExecProcess.signal``), and, where the case says
the runtime has terminals (``terminals``), a PTY of the asked size that follows a resize."""

from __future__ import annotations

import signal

import anyio
import pytest

from pilldrops.node.runtime.base import Runtime
from tests.contract.conftest import RuntimeCase
from tests.contract.test_runtime_contract import BOUND_S, collect

pytestmark = pytest.mark.anyio


async def read_until(proc, needle: bytes) -> bytes:  # type: ignore[no-untyped-def]
    got = b""
    with anyio.fail_after(BOUND_S):
        while needle not in got:
            chunk = await proc.read()
            assert chunk is not None, f"ended before {needle!r}; got {got!r}"
            got += chunk[1]
    return got


async def test_stdin_stream_stays_open_then_closes(case: RuntimeCase, runtime: Runtime) -> None:
    h = await runtime.create(case.spec("p-stdin"))
    send, recv = anyio.create_memory_object_stream[bytes](4)
    proc = await runtime.exec(h, ["/bin/sh", "-c", "while read l; do echo got-$l; done; echo eof"], env={},
                              cwd=None, stdin=recv)
    await send.send(b"a\n")
    await read_until(proc, b"got-a\n")
    await anyio.sleep(0.3)                  # a quiet stdin is not an EOF
    await send.send(b"b\n")
    await read_until(proc, b"got-b\n")
    send.close()
    assert await collect(proc) == (0, "eof\n", "")
    await runtime.destroy(h)


async def test_signal_reaches_the_command(case: RuntimeCase, runtime: Runtime) -> None:
    if case.signals:
        pytest.skip(f"{case.name}: {case.signals}")
    h = await runtime.create(case.spec("p-signal"))
    proc = await runtime.exec(h, ["/bin/sh", "-c", ('trap "echo term; exit 7" TERM; echo ready; '
                                                   "while :; do sleep 0.05; done")], env={}, cwd=None)
    await read_until(proc, b"ready")
    assert await proc.signal(signal.SIGTERM)  # type: ignore[attr-defined]
    code, out, _ = await collect(proc)
    assert (code, out) == (7, "term\n")
    assert await proc.signal(signal.SIGTERM) is False  # type: ignore[attr-defined]  (it has exited)
    await runtime.destroy(h)


async def test_pty_size_and_resize(case: RuntimeCase, runtime: Runtime) -> None:
    if not case.terminals:
        pytest.skip(f"{case.name}: its case does not claim terminals (conftest `terminals`)")
    h = await runtime.create(case.spec("p-pty"))
    send, recv = anyio.create_memory_object_stream[bytes](4)
    proc = await runtime.exec(h, ["/bin/sh"], env={"PS1": "$ "}, cwd=None, stdin=recv, pty=(33, 101))  # type: ignore[call-arg]
    await send.send(b"stty size\n")
    await read_until(proc, b"33 101")
    assert await proc.resize(44, 111)  # type: ignore[attr-defined]
    await send.send(b"stty size; exit 9\n")
    await read_until(proc, b"44 111")
    with anyio.fail_after(BOUND_S):
        while await proc.read() is not None:
            pass
        assert await proc.wait() == 9
    await runtime.destroy(h)
