"""The node's process service on real crun (node/processes.py over pd-init's control protocol v2): stdin
streaming and close, signals, background processes with later readers, PTYs (size, resize, Ctrl-C), bounded
retention under a flood, a hostile init's framing, the version hello, and nothing left behind."""

from __future__ import annotations

import base64
import os
import signal
import socket
import struct
import threading
import time
from pathlib import Path

import anyio
import pytest

from pilldrops import errors
from pilldrops.node.dataplane import Target
from pilldrops.node.isolation.execproc import PipeExec
from pilldrops.node.isolation.superexec import PROTO, SupervisorExec, probe_version
from pilldrops.node.processes import KEEP_EXITED, RETAIN_BYTES, Processes
from pilldrops.node.runtime.base import RuntimeFailure, SandboxSpec
from pilldrops.schema.processes import ProcessStartRequest, PtySize

pytestmark = [pytest.mark.integration, pytest.mark.anyio]


def rss_kib(pid: int) -> int:
    return int(next(ln.split()[1] for ln in Path(f"/proc/{pid}/status").read_text().splitlines()
                    if ln.startswith("VmRSS:")))


def cgroup_procs(h) -> list[int]:  # type: ignore[no-untyped-def]
    p = Path("/sys/fs/cgroup/pids") / h.extra["cgroup"].lstrip("/") / "cgroup.procs"
    return [int(x) for x in p.read_text().split()]


@pytest.fixture
async def env(runtime, tiny, monkeypatch):  # type: ignore[no-untyped-def]
    monkeypatch.setenv("PILLDROPS_EXEC", "supervisor")
    h = await runtime.create(SandboxSpec(id="procs", layers=tiny.layers, workdir=tiny.workdir))
    procs = Processes(runtime)
    t = Target(id="procs", handle=h, workdir=tiny.workdir)
    async with anyio.create_task_group() as tg:
        tg.start_soon(procs.run)
        while procs._tg is None:
            await anyio.sleep(0.001)
        try:
            yield procs, t
        finally:
            await runtime.destroy(h)
            with anyio.fail_after(10):           # every pump ends with its sandbox
                for m in list(procs.table(t).procs.values()):
                    await m.done.wait()
            assert not t.active
            tg.cancel_scope.cancel()


async def read_until(reader, needle: bytes, timeout: float = 10) -> bytes:  # type: ignore[no-untyped-def]
    got = b""
    with anyio.move_on_after(timeout):
        while needle not in got:
            _kind, data = await reader.receive()
            got += data
    assert needle in got, f"{needle!r} never came; got {got[-2000:]!r}"
    return got


def req(cmd, **kw) -> ProcessStartRequest:  # type: ignore[no-untyped-def]
    return ProcessStartRequest(cmd=cmd, **kw)


async def test_stdin_stream_and_close(env):  # type: ignore[no-untyped-def]
    procs, t = env
    m, reader = await procs.start(t, req(["cat"], stdin=True))
    assert m.pid > 1 and m.info().running and m.info().stdin
    await procs.write(m, b"hello\n")
    assert await read_until(reader, b"hello\n") == b"hello\n"
    await procs.write(m, b"x" * 200_000)                   # more than one frame and one pipe buffer
    assert len(await read_until(reader, b"x" * 200_000)) >= 200_000
    procs.close_stdin(m)
    with anyio.fail_after(10):
        await m.done.wait()
    assert m.exit_code == 0 and not m.info().stdin
    with pytest.raises(errors.InvalidState):
        await procs.write(m, b"late")
    # no stdin asked for: /dev/null, and writing is refused
    m2, r2 = await procs.start(t, req("cat; echo eof"))
    assert await read_until(r2, b"eof") == b"eof\n"
    with pytest.raises(errors.InvalidState):
        await procs.write(m2, b"x")


async def test_signals(env):  # type: ignore[no-untyped-def]
    procs, t = env
    script = 'trap "echo got TERM; exit 3" TERM; echo ready; while :; do sleep 0.05; done'
    m, reader = await procs.start(t, req(script))
    await read_until(reader, b"ready")
    assert await procs.signal(m, signal.SIGTERM)
    assert b"got TERM" in await read_until(reader, b"got TERM")
    with anyio.fail_after(10):
        await m.done.wait()
    assert m.exit_code == 3 and m.info().signal is None
    # a signal that ends it is reported as such; the whole process group gets it (not SIGINT here: a
    # non-interactive shell starts `&` jobs with SIGINT ignored)
    m, reader = await procs.start(t, req("sleep 100 & sleep 100; wait"))
    with anyio.fail_after(5):
        while len(cgroup_procs(t.handle)) < 5:     # init + shepherd + sh + 2 sleeps
            await anyio.sleep(0.01)
    assert await procs.signal(m, signal.SIGTERM)
    with anyio.fail_after(10):
        await m.done.wait()
    assert m.exit_code == 128 + signal.SIGTERM and m.info().signal == signal.SIGTERM
    with anyio.fail_after(5):
        while cgroup_procs(t.handle) != [t.handle.pid]:
            await anyio.sleep(0.01)
    # SIGKILL kills the tree; signalling an exited process says so
    m, _ = await procs.start(t, req("sleep 100"), attach=False)
    assert await procs.signal(m, signal.SIGKILL)
    await m.done.wait()
    assert m.exit_code == 137 and m.info().signal == 9
    assert await procs.signal(m, signal.SIGTERM) is False


async def test_background_outlives_readers_and_reconnect(env):  # type: ignore[no-untyped-def]
    procs, t = env
    m, _ = await procs.start(t, req('i=0; while [ $i -lt 40 ]; do echo "n$i"; i=$((i+1)); sleep 0.05; done',
                                    tag="counter"), attach=False)
    await anyio.sleep(0.5)
    assert procs.by_tag(t, "counter") is m
    assert [p.pid for p in procs.list(t)] == [m.pid] and procs.list(t)[0].running
    reader = procs.attach(m)                         # only new output from here
    events = [ev async for ev in procs.events(m, reader)]
    assert events[0].type == "start" and events[0].pid == m.pid and events[-1].type == "exit"
    assert events[-1].exit_code == 0
    seen = b"".join(base64.b64decode(e.data or "") for e in events if e.type == "stdout")
    assert b"n39\n" in seen and b"n0\n" not in seen
    out = procs.output(m)                            # retention has it all (small)
    assert b"".join(base64.b64decode(e.data or "") for e in out.events).startswith(b"n0\nn1\n")
    assert not out.running and out.exit_code == 0
    # a reader attached after the exit gets start + exit only
    late = [ev.type async for ev in procs.events(m, procs.attach(m))]
    assert late == ["start", "exit"]
    # a reader that leaves early does not end the process
    m, reader = await procs.start(t, req("sleep 0.5; echo later"))
    reader.close()
    with anyio.fail_after(10):
        await m.done.wait()
    assert m.exit_code == 0 and procs.output(m).events[0].data == base64.b64encode(b"later\n").decode()
    # exited processes are kept for late readers, but only the last few
    for _ in range(KEEP_EXITED + 3):
        m, _ = await procs.start(t, req("true"), attach=False)
        await m.done.wait()
    assert len(procs.list(t)) == KEEP_EXITED
    with pytest.raises(errors.NotFound):
        procs.get(t, 999_999)


async def test_pty_size_resize_and_ctrl_c(env):  # type: ignore[no-untyped-def]
    procs, t = env
    m, reader = await procs.start(t, req(["sh"], pty=PtySize(rows=30, cols=100), envs={"PS1": "$ "}))
    await procs.write(m, b"tty; stty size\n")
    got = await read_until(reader, b"30 100")
    assert b"/dev/pts/" in got
    assert await procs.resize(m, 40, 120)
    await procs.write(m, b"stty size\n")
    await read_until(reader, b"40 120")
    # Ctrl-C reaches the foreground job through the terminal, not the shell itself
    await procs.write(m, b"sleep 100\n")
    await anyio.sleep(0.5)
    await procs.write(m, b"\x03")
    await read_until(reader, b"^C")
    await procs.write(m, b"echo rc-$?\n")
    await read_until(reader, b"rc-130")
    await procs.write(m, b"exit 4\n")
    with anyio.fail_after(10):
        await m.done.wait()
    assert m.exit_code == 4
    # a non-PTY process cannot be resized
    m2, _ = await procs.start(t, req("true"), attach=False)
    with pytest.raises(errors.InvalidRequest):
        await procs.resize(m2, 10, 10)


async def test_flood_is_bounded(env):  # type: ignore[no-untyped-def]
    procs, t = env
    agent_rss = rss_kib(os.getpid())
    # nobody reads: the flood never blocks, retention stays at its cap
    m, _ = await procs.start(t, req("yes flood-flood-flood-flood-flood"), attach=False)
    with anyio.fail_after(20):
        while m.out.total < 50_000_000:
            await anyio.sleep(0.05)
    assert m.out.size <= RETAIN_BYTES and m.out.dropped >= m.out.total - RETAIN_BYTES
    # an attached reader that does not read: backpressure, nothing piles up
    reader = procs.attach(m)
    await anyio.sleep(1.0)
    total = m.out.total
    await anyio.sleep(1.0)
    assert m.out.total - total < 4_000_000, "a stalled reader must slow the writer down"
    reader.close()
    grown = rss_kib(os.getpid()) - agent_rss
    print(f"agent RSS growth during a 50 MB flood: {grown} KiB; pd-init RSS {rss_kib(t.handle.pid)} KiB")
    assert grown < 64 * 1024
    assert rss_kib(t.handle.pid) < 2048
    await procs.signal(m, signal.SIGKILL)
    await m.done.wait()


async def test_version_hello_and_old_init_fallback(env, runtime):  # type: ignore[no-untyped-def]
    procs, t = env
    h = t.handle
    fd = os.open(Path(h.bundle) / "pd" / "ctl", os.O_PATH)
    try:
        assert await anyio.to_thread.run_sync(probe_version, f"/proc/self/fd/{fd}") == PROTO
    finally:
        os.close(fd)
    p = await runtime.exec(h, ["true"], env={}, cwd=None)
    assert isinstance(p, SupervisorExec)
    await p.wait()
    # an agent that speaks only protocol 1 (no hello) still gets served by this init, as v1: no 'V' answer
    def v1_agent() -> list[tuple[int, bytes]]:
        from pilldrops.node.isolation.superexec import HDR, encode_request
        frames = []
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(10)
            s.connect(str(Path(h.bundle) / "pd" / "ctl"))
            s.sendall(encode_request(["echo", "old-agent"], {"PATH": "/bin"}, "/", stdin=False, hello=False))
            while not frames or frames[-1][0] != ord("X"):
                typ, n = HDR.unpack(s.recv(HDR.size, socket.MSG_WAITALL))
                frames.append((typ, s.recv(n, socket.MSG_WAITALL) if n else b""))
        return frames
    frames = await anyio.to_thread.run_sync(v1_agent)
    assert [chr(t) for t, _ in frames] == ["P", "O", "X"] and frames[1][1] == b"old-agent\n"
    # an init that speaks only protocol 1 (an older build): plain commands go through crun exec, PTYs refuse
    runtime._proto[h.id] = (h.pid, h.pid_start_time, 1)
    p = await runtime.exec(h, ["echo", "v1"], env={}, cwd=None)
    assert isinstance(p, PipeExec)
    assert await p.wait() == 0
    with pytest.raises(RuntimeFailure, match="older init"):
        await runtime.exec(h, ["sh"], env={}, cwd=None, pty=(24, 80))
    with pytest.raises(errors.NotSupported):
        await procs.start(t, req(["sh"], pty=PtySize()))


def _serve_once(path: Path, answer) -> threading.Thread:  # type: ignore[no-untyped-def]
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(str(path))
    srv.listen(1)

    def run() -> None:
        conn, _ = srv.accept()
        with conn, srv:
            conn.recv(65536)
            answer(conn)
    th = threading.Thread(target=run, daemon=True)
    th.start()
    return th


async def test_hostile_socket_framing_is_bounded(tmp_path):  # type: ignore[no-untyped-def]
    """A sandbox can replace its control socket: a server there announcing a 768 MiB frame gets the command
    ended as a protocol violation, with nothing buffered; one that closes on the hello is a v1 init."""
    hdr = struct.Struct("<BI")
    before = rss_kib(os.getpid())

    def huge(conn: socket.socket) -> None:
        conn.sendall(hdr.pack(ord("V"), 4) + struct.pack("<I", PROTO) + hdr.pack(ord("O"), 768 * 1024 * 1024)
                     + b"x" * 65536)
        time.sleep(1)

    path = tmp_path / "ctl"
    th = _serve_once(path, huge)
    p = SupervisorExec(path, ["true"], env={}, cwd="/", stdin=None)
    chunks = []
    while (c := await p.read()) is not None:
        chunks.append(c)
    assert await p.wait() == 126 and p.protocol_error and "frame of" in p.protocol_error
    assert b"protocol violation" in b"".join(d for _, d in chunks)
    assert rss_kib(os.getpid()) - before < 32 * 1024
    th.join(5)

    path.unlink()                                    # a socket that claims an older version mid-way
    th = _serve_once(path, lambda conn: conn.sendall(hdr.pack(ord("V"), 4) + struct.pack("<I", 1)))
    p = SupervisorExec(path, ["true"], env={}, cwd="/", stdin=None)
    while await p.read() is not None:
        pass
    assert await p.wait() == 126 and "version hello" in (p.protocol_error or "")
    th.join(5)

    path.unlink()
    th = _serve_once(path, lambda conn: None)        # closes at once, as a v1 init does on 'H'
    assert await anyio.to_thread.run_sync(probe_version, str(path)) == 1
    th.join(5)
    path.unlink()
    th = _serve_once(path, lambda conn: conn.sendall(hdr.pack(ord("P"), 4) + b"\0\0\0\0"))
    with pytest.raises(OSError):
        await anyio.to_thread.run_sync(probe_version, str(path))
    th.join(5)
