"""Processes that outlive the request that started them: the data plane's process service (docs/api.md).

``run`` (dataplane.py) is one request, one command: the command dies with its stream. Here a process is
started, then any number of readers attach to it and leave (``events``), its stdin is written and closed
from other requests, signals and window sizes reach it, and it is listed per sandbox. It is what the
E2B-compatible envd and ``pilldrops sandbox shell`` run on.

Bounds (everything a sandbox writes is attacker input):
- at most ``MAX_RUNNING`` running per sandbox, ``KEEP_EXITED`` exited ones kept for late readers;
- each keeps the newest ``RETAIN_BYTES`` of its output (older bytes are dropped and counted), so a process
  nobody reads never blocks and never grows the agent;
- an attached reader gets every chunk from the moment it attached, through a queue of ``READER_CHUNKS``:
  a slow reader slows the process down (backpressure, as ``run`` does), it is never buffered for;
- stdin goes through a queue of ``STDIN_CHUNKS`` chunks of at most ``STDIN_CHUNK`` bytes; a write that
  cannot get in within ``STDIN_WAIT_S`` (the process does not read its stdin) is refused.

One pump task per process (in this object's task group, started by the node agent) moves output from the
runtime's ``ExecProcess`` to the retention and the readers. The process is in the sandbox's ``active`` set
while it runs, so a pause ends it like any command in flight.
"""

from __future__ import annotations

import base64
import contextlib
import signal as signals
import time
from collections import OrderedDict, deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import anyio
import anyio.abc
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from pilldrops import errors
from pilldrops.node.dataplane import Target
from pilldrops.node.runtime.base import ExecProcess, Runtime, RuntimeFailure
from pilldrops.schema.processes import ProcessEvent, ProcessInfo, ProcessOutput, ProcessStartRequest

MAX_RUNNING = 32
KEEP_EXITED = 8
RETAIN_BYTES = 256 * 1024
READER_CHUNKS = 16
STDIN_CHUNKS = 16
STDIN_CHUNK = 64 * 1024
STDIN_WAIT_S = 10.0
PID_WAIT_S = 2.0

Chunk = tuple[str, bytes]


def parse_signal(value: int | str) -> int:
    """15, "15", "TERM", "SIGTERM", "sigterm" -> 15."""
    if isinstance(value, int) or (isinstance(value, str) and value.isdigit()):
        n = int(value)
        if 1 <= n <= 64:
            return n
        raise errors.InvalidRequest(f"signal {value} is out of range (1-64)")
    name = str(value).upper()
    name = name if name.startswith("SIG") else "SIG" + name
    try:
        return int(signals.Signals[name])
    except KeyError:
        raise errors.InvalidRequest(f"unknown signal {value!r}") from None


class Retained:
    """The newest ``cap`` bytes of a process's output, as (stream, bytes) chunks."""

    def __init__(self, cap: int = RETAIN_BYTES) -> None:
        self.cap = cap
        self.chunks: deque[Chunk] = deque()
        self.size = 0
        self.total = 0
        self.dropped = 0

    def add(self, kind: str, data: bytes) -> None:
        self.total += len(data)
        if len(data) > self.cap:
            self.dropped += len(data) - self.cap
            data = data[-self.cap:]
        self.chunks.append((kind, data))
        self.size += len(data)
        while self.size > self.cap:
            k, d = self.chunks.popleft()
            over = self.size - self.cap
            if len(d) > over:
                self.chunks.appendleft((k, d[over:]))
                self.size -= over
                self.dropped += over
            else:
                self.size -= len(d)
                self.dropped += len(d)


@dataclass(eq=False)
class Managed:
    pid: int
    req: ProcessStartRequest
    argv: list[str]
    proc: ExecProcess
    started_at: float = field(default_factory=time.time)
    out: Retained = field(default_factory=Retained)
    readers: set[MemoryObjectSendStream[Chunk]] = field(default_factory=set)
    stdin: MemoryObjectSendStream[bytes] | None = None
    done: anyio.Event = field(default_factory=anyio.Event)
    exit_code: int | None = None
    ended_at: float | None = None
    sent_signal: int | None = None

    @property
    def running(self) -> bool:
        return not self.done.is_set()

    def ended_by(self) -> int | None:
        """The signal that ended it, when it was one we sent (its exit code says 128+N)."""
        if self.sent_signal and self.exit_code == 128 + self.sent_signal:
            return self.sent_signal
        return None

    def info(self) -> ProcessInfo:
        return ProcessInfo(pid=self.pid, tag=self.req.tag, cmd=self.argv, envs=self.req.envs, cwd=self.req.cwd,
                           pty=self.req.pty is not None, stdin=self.stdin is not None, running=self.running,
                           exit_code=self.exit_code, signal=self.ended_by(),
                           timed_out=bool(getattr(self.proc, "timed_out", False)), started_at=self.started_at,
                           ended_at=self.ended_at, output_bytes=self.out.total, dropped_bytes=self.out.dropped)

    def start_event(self) -> ProcessEvent:
        return ProcessEvent(type="start", pid=self.pid, tag=self.req.tag)

    def exit_event(self) -> ProcessEvent:
        return ProcessEvent(type="exit", pid=self.pid, exit_code=self.exit_code, signal=self.ended_by(),
                            timed_out=bool(getattr(self.proc, "timed_out", False)) or None)


def data_event(kind: str, data: bytes) -> ProcessEvent:
    return ProcessEvent(type=kind, data=base64.b64encode(data).decode())  # type: ignore[arg-type]


def line(ev: ProcessEvent) -> bytes:
    return ev.model_dump_json(exclude_none=True).encode() + b"\n"


class Table:
    """The processes of one sandbox (running, then the last ``KEEP_EXITED`` exited), by pid."""

    def __init__(self) -> None:
        self.procs: OrderedDict[int, Managed] = OrderedDict()

    def running(self) -> int:
        return sum(1 for m in self.procs.values() if m.running)

    def add(self, m: Managed) -> None:
        self.procs.pop(m.pid, None)          # a reused pid replaces the exited process that had it
        self.procs[m.pid] = m

    def retire(self) -> None:
        exited = [pid for pid, m in self.procs.items() if not m.running]
        for pid in exited[:max(0, len(exited) - KEEP_EXITED)]:
            del self.procs[pid]


class Processes:
    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime
        self._tg: anyio.abc.TaskGroup | None = None
        self._fake_pid = 1 << 22               # ids for runtimes that cannot tell the in-sandbox pid

    async def run(self) -> None:
        """Hold the task group the pumps run in, until cancelled (the node agent's lifetime)."""
        async with anyio.create_task_group() as tg:
            self._tg = tg
            try:
                await anyio.sleep_forever()
            finally:
                self._tg = None

    @staticmethod
    def table(t: Target) -> Table:
        if t.processes is None:
            t.processes = Table()
        return t.processes

    def get(self, t: Target, pid: int) -> Managed:
        m = self.table(t).procs.get(pid)
        if m is None:
            raise errors.NotFound(f"process {pid} not found in sandbox {t.id}")
        return m

    def by_tag(self, t: Target, tag: str) -> Managed:
        for m in reversed(self.table(t).procs.values()):
            if m.req.tag == tag:
                return m
        raise errors.NotFound(f"process with tag {tag!r} not found in sandbox {t.id}")

    def list(self, t: Target) -> list[ProcessInfo]:
        return [m.info() for m in self.table(t).procs.values()]

    # ---- start -----------------------------------------------------------------------------------

    async def start(self, t: Target, req: ProcessStartRequest, *, attach: bool = True
                    ) -> tuple[Managed, MemoryObjectReceiveStream[Chunk] | None]:
        """Start the process; with ``attach`` also a reader that sees its output from the first byte."""
        if self._tg is None:
            raise errors.ServerError("the node's process service is not running")
        if t.pausing:
            raise errors.InvalidState(f"sandbox {t.id} is being paused", current="pausing", target="running")
        table = self.table(t)
        if table.running() >= MAX_RUNNING:
            raise errors.Conflict(f"sandbox {t.id} already runs {MAX_RUNNING} processes (the most it runs at "
                                  "once through the process service): kill some or wait for them")
        if req.cwd is not None and (not req.cwd.startswith("/") or "\0" in req.cwd):
            raise errors.InvalidRequest(f"cwd must be absolute: {req.cwd!r}")
        argv = ["/bin/sh", "-c", req.cmd] if isinstance(req.cmd, str) else list(req.cmd)
        if not argv or any("\0" in a for a in argv) or any("\0" in k + v for k, v in req.envs.items()):
            raise errors.InvalidRequest("cmd must be non-empty, and no argument or env var may hold a NUL byte")
        send: MemoryObjectSendStream[bytes] | None = None
        recv: MemoryObjectReceiveStream[bytes] | None = None
        if req.stdin or req.pty is not None:
            send, recv = anyio.create_memory_object_stream[bytes](STDIN_CHUNKS)
        extra: dict[str, Any] = {"pty": (req.pty.rows, req.pty.cols)} if req.pty is not None else {}
        if t.user:
            extra["user"] = t.user          # the template's USER, like run
        try:
            proc = await self.runtime.exec(t.handle, argv, env={**t.env, **req.envs}, cwd=req.cwd or t.workdir,
                                           stdin=recv, timeout=req.timeout, **extra)
        except RuntimeFailure as exc:
            if send is not None:
                send.close()
            if req.pty is not None and t.handle.pid is not None:
                raise errors.NotSupported(exc.message) from exc
            raise errors.InvalidState(f"sandbox {t.id} cannot run commands: {exc.message}",
                                      current="stopped", target="running") from exc
        except TypeError as exc:          # a runtime without terminals
            if send is not None:
                send.close()
            raise errors.NotSupported(f"the {self.runtime.name} runtime has no PTY support") from exc
        t.active.add(proc)
        m = Managed(pid=await self._pid_of(proc), req=req, argv=argv, proc=proc, stdin=send)
        table.add(m)
        reader = self._attach(m) if attach else None
        self._tg.start_soon(self._pump, t, table, m)
        return m, reader

    async def _pid_of(self, proc: ExecProcess) -> int:
        """The process's pid inside the sandbox (pd-init reports it right after the fork)."""
        if not hasattr(proc, "sandbox_pid"):
            if proc.pid is not None:
                return proc.pid
        else:
            with anyio.move_on_after(PID_WAIT_S):
                while (pid := proc.sandbox_pid) is None:
                    await anyio.sleep(0.0005)
                return int(pid)
        self._fake_pid += 1
        return self._fake_pid

    def _attach(self, m: Managed) -> MemoryObjectReceiveStream[Chunk]:
        send, recv = anyio.create_memory_object_stream[Chunk](READER_CHUNKS)
        if m.running:
            m.readers.add(send)
        else:
            send.close()
        return recv

    async def _pump(self, t: Target, table: Table, m: Managed) -> None:
        kind_of = (lambda _k: "pty") if m.req.pty is not None else (lambda k: k)
        try:
            while (chunk := await m.proc.read()) is not None:
                kind = kind_of(chunk[0])
                m.out.add(kind, chunk[1])
                for r in list(m.readers):
                    try:
                        await r.send((kind, chunk[1]))
                    except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                        m.readers.discard(r)
            m.exit_code = await m.proc.wait()
        except BaseException:
            with anyio.CancelScope(shield=True):
                await _kill_quietly(m.proc)
            raise
        finally:
            m.ended_at = time.time()
            if m.stdin is not None:
                m.stdin.close()
                m.stdin = None
            for r in m.readers:
                r.close()
            m.readers.clear()
            t.active.discard(m.proc)
            m.done.set()
            table.retire()

    # ---- readers ---------------------------------------------------------------------------------

    def attach(self, m: Managed) -> MemoryObjectReceiveStream[Chunk]:
        """A reader of the output written from now on (nothing older: ``output`` has that)."""
        return self._attach(m)

    async def events(self, m: Managed, reader: MemoryObjectReceiveStream[Chunk]) -> AsyncIterator[ProcessEvent]:
        """start, the output (as the reader gets it), exit. Leaving early detaches; the process goes on."""
        with reader:
            yield m.start_event()
            async for kind, data in reader:
                yield data_event(kind, data)
            await m.done.wait()
            yield m.exit_event()

    def output(self, m: Managed) -> ProcessOutput:
        return ProcessOutput(pid=m.pid, events=[data_event(k, d) for k, d in m.out.chunks],
                             dropped_bytes=m.out.dropped, running=m.running, exit_code=m.exit_code)

    # ---- input and control -----------------------------------------------------------------------

    async def write(self, m: Managed, data: bytes) -> None:
        if m.stdin is None:
            raise errors.InvalidState(f"process {m.pid} has no open stdin"
                                      + ("" if m.running else " (it has exited)"))
        try:
            with anyio.fail_after(STDIN_WAIT_S):
                for i in range(0, len(data), STDIN_CHUNK):
                    await m.stdin.send(data[i:i + STDIN_CHUNK])
        except TimeoutError:
            raise errors.Conflict(f"process {m.pid} does not read its stdin (nothing went in for "
                                  f"{STDIN_WAIT_S:.0f} s)") from None
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
            raise errors.InvalidState(f"process {m.pid} closed its stdin") from None

    def close_stdin(self, m: Managed) -> None:
        if m.stdin is not None:
            m.stdin.close()
            m.stdin = None

    async def signal(self, m: Managed, signo: int) -> bool:
        """Deliver ``signo`` (SIGKILL kills the whole tree); False when it has already exited."""
        if not m.running:
            return False
        m.sent_signal = signo
        if signo == signals.SIGKILL:
            await _kill_quietly(m.proc)
            return True
        send = getattr(m.proc, "signal", None)
        if send is None:
            raise errors.NotSupported(f"the {self.runtime.name} runtime cannot send signals other than SIGKILL")
        return bool(await send(signo))

    async def resize(self, m: Managed, rows: int, cols: int) -> bool:
        if m.req.pty is None:
            raise errors.InvalidRequest(f"process {m.pid} has no terminal")
        resize = getattr(m.proc, "resize", None)
        return bool(resize is not None and m.running and await resize(rows, cols))


async def _kill_quietly(proc: ExecProcess) -> None:
    with contextlib.suppress(Exception):
        await proc.kill()
