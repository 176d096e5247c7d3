"""The process service's bookkeeping on the fake runtime (host subprocesses): limits, retention, readers,
stdin queueing, signals. The real-crun behaviour (pd-init, PTYs) is tests/integration/test_processes.py."""

from __future__ import annotations

import signal

import anyio
import pytest

from pilldrops import errors
from pilldrops.node import processes as P
from pilldrops.node.dataplane import Target
from pilldrops.node.runtime.base import SandboxSpec
from pilldrops.node.runtime.fake import FakeRuntime
from pilldrops.schema.processes import ProcessStartRequest, PtySize

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
async def env(tmp_path):  # type: ignore[no-untyped-def]
    rt = FakeRuntime(tmp_path / "fake")
    h = await rt.create(SandboxSpec(id="sb_p", layers=()))
    procs = P.Processes(rt)
    t = Target(id="sb_p", handle=h)
    async with anyio.create_task_group() as tg:
        tg.start_soon(procs.run)
        while procs._tg is None:
            await anyio.sleep(0.001)
        yield procs, t
        for m in list(procs.table(t).procs.values()):
            if m.running:
                await procs.signal(m, signal.SIGKILL)
        await rt.destroy(h)
        tg.cancel_scope.cancel()


def test_retained_keeps_the_newest_bytes() -> None:
    r = P.Retained(cap=10)
    for chunk in (b"abcd", b"efgh", b"ijkl"):
        r.add("stdout", chunk)
    assert b"".join(d for _, d in r.chunks) == b"cdefghijkl" and r.dropped == 2 and r.total == 12
    r.add("stderr", b"x" * 25)
    assert [(k, len(d)) for k, d in r.chunks] == [("stderr", 10)] and r.size == 10 and r.dropped == 27


def test_parse_signal() -> None:
    assert P.parse_signal(15) == P.parse_signal("15") == P.parse_signal("TERM") == P.parse_signal("sigterm") == 15
    for bad in (0, 99, "NOPE"):
        with pytest.raises(errors.InvalidRequest):
            P.parse_signal(bad)


async def test_limits_stdin_and_readers(env, monkeypatch):  # type: ignore[no-untyped-def]
    procs, t = env
    monkeypatch.setattr(P, "MAX_RUNNING", 2)
    a, _ = await procs.start(t, ProcessStartRequest(cmd="sleep 30"), attach=False)
    b, reader = await procs.start(t, ProcessStartRequest(cmd=["cat"], stdin=True))
    with pytest.raises(errors.Conflict, match="already runs 2"):
        await procs.start(t, ProcessStartRequest(cmd="true"))
    await procs.write(b, b"ping\n")
    with anyio.fail_after(5):
        assert (await reader.receive()) == ("stdout", b"ping\n")
    # a second reader sees what comes after it attached, the first one too
    late = procs.attach(b)
    await procs.write(b, b"pong\n")
    with anyio.fail_after(5):
        assert (await reader.receive())[1] == b"pong\n" and (await late.receive())[1] == b"pong\n"
    procs.close_stdin(b)
    with anyio.fail_after(5):
        await b.done.wait()
    assert b.exit_code == 0 and [ev.type async for ev in procs.events(b, procs.attach(b))] == ["start", "exit"]
    assert await procs.signal(a, signal.SIGTERM)
    with anyio.fail_after(5):
        await a.done.wait()
    assert a.info().signal == signal.SIGTERM and a.exit_code == 128 + signal.SIGTERM
    with pytest.raises(errors.InvalidRequest):
        await procs.start(t, ProcessStartRequest(cmd=["a\0b"]))
    with pytest.raises(errors.InvalidRequest):
        await procs.start(t, ProcessStartRequest(cmd="true", cwd="relative"))


async def test_stdin_that_is_never_read_is_refused(env, monkeypatch):  # type: ignore[no-untyped-def]
    procs, t = env
    monkeypatch.setattr(P, "STDIN_WAIT_S", 0.5)
    m, _ = await procs.start(t, ProcessStartRequest(cmd="sleep 30", stdin=True), attach=False)
    with pytest.raises(errors.Conflict, match="does not read its stdin"):
        for _ in range(200):
            await procs.write(m, b"x" * P.STDIN_CHUNK)


async def test_no_pty_on_a_runtime_without_terminals(env):  # type: ignore[no-untyped-def]
    procs, t = env
    with pytest.raises(errors.NotSupported):
        await procs.start(t, ProcessStartRequest(cmd="sh", pty=PtySize()))


async def test_not_running_without_its_task_group(tmp_path):  # type: ignore[no-untyped-def]
    procs = P.Processes(FakeRuntime(tmp_path))
    with pytest.raises(errors.ServerError):
        await procs.start(Target(id="x", handle=None), ProcessStartRequest(cmd="true"))  # type: ignore[arg-type]
