"""A host subprocess exposed as an ``ExecProcess`` (runtime/base.py): chunks, exit code, tree kill.

Used by the crun runtime (the subprocess is ``crun exec``) and by the fake runtime (the command itself).
Output is read by one OS thread (a selector over both pipes, reads of <= 64 KiB) that pushes
``(stream, bytes)`` into ONE small bounded anyio memory object stream through the event loop token, so
chunks keep arrival order and no task group has to outlive ``exec()``. Once the command itself has exited,
the thread drains what is left and stops after ``DRAIN_GRACE`` seconds of silence, even if a background
child (``server &``) still holds the pipes open: ``run`` returns when the command exits, as a shell would. The bound is backpressure: a slow reader slows the command down
instead of growing the agent's memory. Past ``output_cap`` bytes of a stream the threads keep reading and
drop the rest (``truncated``), so a command never blocks on output nobody will read. A third thread feeds
stdin (bytes, or an async iterable pulled through the loop) and a fourth waits for the exit; a timer
thread enforces ``timeout`` (kills the tree, sets ``timed_out``) whether or not anyone is reading.
"""

from __future__ import annotations

import contextlib
import os
import selectors
import signal
import subprocess
import threading
import time
from collections.abc import AsyncIterable, AsyncIterator
from pathlib import Path
from typing import Self

import anyio
import anyio.from_thread
import anyio.lowlevel

from pilldrops.node.isolation import procs
from pilldrops.node.runtime.base import StreamName

CHUNK = 64 * 1024
QUEUE_CHUNKS = 16        # at most ~1 MiB of output waits in the agent per command
DRAIN_GRACE = 0.1        # after the command exits, stop reading after this much silence


async def _next_chunk(it: AsyncIterator[bytes]) -> bytes | None:
    try:
        return await it.__anext__()
    except StopAsyncIteration:
        return None


class OutputRelay:
    """What every ``ExecProcess`` shares: one small bounded queue of ``(stream, bytes)`` chunks filled by a
    reader thread (backpressure: a slow reader slows the command, never grows the agent), a per-stream
    output cap (past it bytes are read and dropped, ``truncated``), ``timed_out``, and ``read()``."""

    def __init__(self, output_cap: int | None) -> None:
        self._token = anyio.lowlevel.current_token()
        self._send, self._recv = anyio.create_memory_object_stream[tuple[StreamName, bytes]](QUEUE_CHUNKS)
        self._done = anyio.Event()
        self._cap = output_cap
        self._used = {"stdout": 0, "stderr": 0}
        self.truncated = False
        self.timed_out = False

    def _capped(self, name: StreamName, data: bytes) -> bytes:
        """The part of ``data`` that fits under its stream's cap (``b""`` once the cap is reached)."""
        if self._cap is None:
            return data
        room = self._cap - self._used[name]
        if len(data) > room:
            self.truncated = True
            data = data[:max(room, 0)]
        self._used[name] += len(data)
        return data

    def _deliver(self, name: StreamName, data: bytes) -> None:
        """From the reader thread: blocks while the queue is full; raises once the reader closed it."""
        anyio.from_thread.run(self._send.send, (name, data), token=self._token)

    def _end_output(self) -> None:
        with contextlib.suppress(Exception):       # the event loop is gone: nobody is reading
            anyio.from_thread.run_sync(self._send.close, token=self._token)

    def _set_done(self) -> None:
        with contextlib.suppress(Exception):       # the event loop is gone: nobody is waiting
            anyio.from_thread.run_sync(self._done.set, token=self._token)

    async def read(self) -> tuple[StreamName, bytes] | None:
        try:
            return await self._recv.receive()
        except (anyio.EndOfStream, anyio.ClosedResourceError):   # ended, or killed (kill() closes it)
            return None


class PipeExec(OutputRelay):
    """``ExecProcess`` over a ``subprocess.Popen`` started in its own session (pgid == popen.pid).

    ``pid`` is the host pid of the *command*: for crun it is read from ``pid_file`` (written by
    ``crun exec --pid-file``), otherwise it is the Popen pid.
    """

    def __init__(self, argv: list[str], *, stdin: AsyncIterable[bytes] | bytes | None,
                 env: dict[str, str] | None = None, cwd: str | Path | None = None,
                 pid_file: Path | None = None, timeout: float | None = None,
                 output_cap: int | None = None) -> None:
        super().__init__(output_cap)
        self._pid_file = pid_file
        self._killed = False
        self._popen = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL if stdin is None else subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=cwd,
            start_new_session=True, close_fds=True)
        self._pid: int | None = None if pid_file is not None else self._popen.pid
        assert self._popen.stdout is not None and self._popen.stderr is not None
        self._exited = threading.Event()
        self._wake_r, self._wake_w = os.pipe()
        threading.Thread(target=self._pump, daemon=True).start()
        if stdin is not None:
            src: bytes | AsyncIterator[bytes] = stdin if isinstance(stdin, bytes) else stdin.__aiter__()
            threading.Thread(target=self._feed, args=(src,), daemon=True).start()
        self._timer: threading.Timer | None = None
        if timeout is not None:
            self._timer = threading.Timer(timeout, self._on_timeout)
            self._timer.daemon = True
            self._timer.start()
        threading.Thread(target=self._wait_exit, daemon=True).start()

    # -- threads ---------------------------------------------------------------------------------
    def _pump(self) -> None:
        assert self._popen.stdout is not None and self._popen.stderr is not None
        pipes = {self._popen.stdout.fileno(): ("stdout", self._popen.stdout),
                 self._popen.stderr.fileno(): ("stderr", self._popen.stderr)}
        sel = selectors.DefaultSelector()
        for fd in pipes:
            sel.register(fd, selectors.EVENT_READ)
        sel.register(self._wake_r, selectors.EVENT_READ)
        try:
            while pipes:
                ready = sel.select(DRAIN_GRACE if self._exited.is_set() else None)
                if not ready:
                    break                 # the command exited and its pipes stayed quiet: done
                for key, _ in ready:
                    if key.fd == self._wake_r:
                        sel.unregister(self._wake_r)     # exit noticed; from now on selects time out
                        continue
                    name, _pipe = pipes[key.fd]
                    data = os.read(key.fd, CHUNK)
                    if not data:
                        sel.unregister(key.fd)
                        del pipes[key.fd]
                        continue
                    data = self._capped(name, data)
                    if data:                  # past the cap: keep draining the pipe, drop the bytes
                        self._deliver(name, data)
        except Exception:  # noqa: BLE001 - loop gone or receiver closed: stop reading
            pass
        finally:
            sel.close()
            for stream in (self._popen.stdout, self._popen.stderr):
                stream.close()
            os.close(self._wake_r)
            self._end_output()

    def _feed(self, src: bytes | AsyncIterator[bytes]) -> None:
        pipe = self._popen.stdin
        assert pipe is not None
        try:
            if isinstance(src, bytes):
                pipe.write(src)
            else:
                while (chunk := anyio.from_thread.run(_next_chunk, src, token=self._token)) is not None:
                    pipe.write(chunk)
                    pipe.flush()
        except Exception:  # noqa: BLE001 - broken pipe (command exited) or loop gone
            pass
        finally:
            with contextlib.suppress(OSError):
                pipe.close()

    def _on_timeout(self) -> None:
        if self._popen.poll() is None:
            self.timed_out = True
            self._killed = True
            self._kill_sync()

    def _wait_exit(self) -> None:
        self._popen.wait()
        if self._timer is not None:
            self._timer.cancel()
        self._exited.set()
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"x")
            os.close(self._wake_w)
        if self._pid_file is not None:
            self._pid_file.unlink(missing_ok=True)
        self._set_done()

    # -- ExecProcess -----------------------------------------------------------------------------
    @property
    def pid(self) -> int | None:
        """Host pid of the command once known (crun writes it to the pid file right after starting it)."""
        if self._pid is None and self._pid_file is not None:
            try:
                self._pid = int(self._pid_file.read_text().strip())
            except (OSError, ValueError):
                pass
        return self._pid

    async def wait(self) -> int:
        await self._done.wait()
        rc = self._popen.returncode
        return 128 - rc if rc < 0 else rc

    def _command_pid(self, timeout: float) -> int | None:
        if self._pid_file is None:
            return self._popen.pid
        deadline = time.monotonic() + timeout
        while True:
            try:
                text = self._pid_file.read_text().strip()
                if text:
                    self._pid = int(text)
                    return self._pid
            except (OSError, ValueError):
                pass
            if self._popen.poll() is not None or time.monotonic() > deadline:
                return None
            time.sleep(0.002)

    def _kill_sync(self) -> None:
        if self._popen.poll() is None:
            pid = self._command_pid(timeout=2.0)
            if pid is not None:
                procs.kill_tree(pid, pgid=self._popen.pid)
        with contextlib.suppress(OSError):
            os.killpg(self._popen.pid, signal.SIGKILL)

    async def signal(self, signo: int) -> bool:
        """Send ``signo`` to the command (its process group when it leads one, as a fake-runtime command
        does); False once it has exited."""
        if self._popen.poll() is not None:
            return False
        pid = self._command_pid(timeout=2.0)
        try:
            if pid == self._popen.pid:
                os.killpg(pid, signo)
            elif pid is not None:
                os.kill(pid, signo)
        except OSError:
            return False
        return pid is not None

    async def kill(self) -> None:
        """Kill the command's tree and stop reading its output (idempotent)."""
        if not self._killed:
            self._killed = True
            await anyio.to_thread.run_sync(self._kill_sync, abandon_on_cancel=True)
        self._recv.close()         # unblocks reader threads waiting on a full queue
        await self._done.wait()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._popen.poll() is None:
            await self.kill()
