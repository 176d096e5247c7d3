"""A command run by the sandbox's own init (pd-init as supervisor) over its unix socket, as an ``ExecProcess``.

The fast exec path (issue 5 part 2): instead of one ``crun exec`` per command, the agent connects to
``<sandbox dir>/pd/ctl`` (bind-mounted at ``/.pd/run/ctl`` in the sandbox; pd-init listens there), sends one
request and reads framed output. The wire format is described in ``runtime/init/pd-init.c``; every frame is
``u8 type | u32 little-endian length | payload``.

Same semantics as ``PipeExec`` (execproc.py): one reader thread pushes ``(stream, bytes)`` into one small
bounded anyio memory object stream (backpressure: a slow reader stops the thread, the socket fills, pd-init
stops reading the command's pipes, the command blocks), bytes past ``output_cap`` are read and dropped
(``truncated``), a timer thread enforces ``timeout`` whether or not anyone reads, and pd-init itself sends the
exit frame once the command has exited and its pipes went quiet for 100 ms (a background child holding the
pipes does not block the return). ``kill`` shuts down the socket's sending side: pd-init takes the EOF as
"kill the command's process group" (SIGKILL to -pgid; the command runs in its own session), which works
even while a stdin frame is stuck; it also sends a ``K`` frame when the socket is free.

``pid`` is the command's host pid, found among the init's children by their NSpid (``/proc/<pid>/status``);
``None`` if the command already exited.
"""

from __future__ import annotations

import contextlib
import os
import socket
import struct
import threading
from collections.abc import AsyncIterable, AsyncIterator
from pathlib import Path
from typing import Self

import anyio
import anyio.from_thread
import anyio.lowlevel

from pilldrops.node.isolation.execproc import OutputRelay, _next_chunk
from pilldrops.node.runtime.base import StreamName

HDR = struct.Struct("<BI")
STDIN_CHUNK = 16 * 1024          # pd-init's per-frame input limit
_STREAMS: dict[int, StreamName] = {ord("O"): "stdout", ord("e"): "stderr"}


def encode_request(argv: list[str], env: dict[str, str], cwd: str, *, stdin: bool) -> bytes:
    strs = [cwd, *argv, *(f"{k}={v}" for k, v in env.items())]
    if any("\0" in s for s in strs):
        raise ValueError("argv, env and cwd must not contain NUL bytes")
    body = struct.pack("<BII", 1 if stdin else 0, len(argv), len(env)) + b"".join(
        s.encode("utf-8", "surrogateescape") + b"\0" for s in strs)
    return HDR.pack(ord("R"), len(body)) + body


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        part = sock.recv(n - len(buf))
        if not part:
            raise EOFError
        buf += part
    return bytes(buf)


def host_pid(init_pid: int, ns_pid: int) -> int | None:
    """The host pid of the init's child whose pid in the sandbox is ``ns_pid``."""
    try:
        children = Path(f"/proc/{init_pid}/task/{init_pid}/children").read_text().split()
    except OSError:
        return None
    for c in children:
        try:
            for line in Path(f"/proc/{c}/status").read_text().splitlines():
                if line.startswith("NSpid:"):
                    if int(line.split()[-1]) == ns_pid:
                        return int(c)
                    break
        except (OSError, ValueError):
            continue
    return None


class SupervisorExec(OutputRelay):
    """``ExecProcess`` over a connection to pd-init's control socket (one command per connection)."""

    def __init__(self, sock_path: Path, argv: list[str], *, env: dict[str, str], cwd: str,
                 stdin: AsyncIterable[bytes] | bytes | None, init_pid: int | None = None,
                 timeout: float | None = None, output_cap: int | None = None,
                 path_fd: int | None = None, sock: socket.socket | None = None) -> None:
        """``path_fd``: an fd ``sock_path`` refers to (``/proc/self/fd/N``); owned from here on, closed
        once connected. ``sock``: an already connected socket to use instead of ``sock_path`` (owned from
        here on; a microVM's agent channel, runtime/microvm/channel.py)."""
        super().__init__(output_cap)
        self._init_pid = init_pid
        self._ns_pid: int | None = None
        self._pid: int | None = None
        self._code: int | None = None
        self._finished = False
        self._killed = False
        self._lock = threading.Lock()          # one writer at a time on the socket (stdin vs kill)
        self._request = encode_request(argv, env, cwd, stdin=stdin is not None)
        self._sock_path = str(sock_path)
        self._connected = False
        self._started = threading.Event()      # the request is sent: stdin frames may follow
        if sock is not None:
            self._sock = sock
            self._connected = True
        else:
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self._sock.setblocking(False)
            try:          # fails fast when nobody listens (stale socket file: the caller falls back)
                self._sock.connect(self._sock_path)
                self._connected = True
            except BlockingIOError:
                pass      # backlog full (all 64 slots busy): the reader thread connects blocking
            except OSError:
                self._sock.close()
                if path_fd is not None:
                    os.close(path_fd)
                raise
        self._path_fd = path_fd
        if self._connected:
            self._close_path_fd()
        self._sock.setblocking(True)
        # every attribute the threads touch is set before the first one starts (a command can finish
        # before this constructor returns)
        self._timer: threading.Timer | None = None
        if timeout is not None:
            self._timer = threading.Timer(timeout, self._on_timeout)
            self._timer.daemon = True
        threading.Thread(target=self._pump, daemon=True).start()
        if stdin is not None:
            src: bytes | AsyncIterator[bytes] = stdin if isinstance(stdin, bytes) else stdin.__aiter__()
            threading.Thread(target=self._feed, args=(src,), daemon=True).start()
        if self._timer is not None:
            self._timer.start()

    def _close_path_fd(self) -> None:
        if self._path_fd is not None:
            os.close(self._path_fd)
            self._path_fd = None

    # -- threads ---------------------------------------------------------------------------------
    def _pump(self) -> None:
        deliver = True
        code = 137
        try:
            if not self._connected:
                try:
                    self._sock.connect(self._sock_path)
                finally:
                    self._close_path_fd()
            self._sock.sendall(self._request)
            self._started.set()
            if self._killed:
                self._kill_sync()
            while True:
                typ, n = HDR.unpack(_recv_exact(self._sock, HDR.size))
                data = _recv_exact(self._sock, n) if n else b""
                if typ == ord("P"):
                    self._ns_pid = struct.unpack("<i", data)[0]
                    continue
                if typ == ord("X"):
                    code = struct.unpack("<i", data)[0]
                    break
                name = _STREAMS.get(typ)
                if name is None or not deliver:
                    continue
                data = self._capped(name, data)
                if not data:
                    continue              # past the cap: keep draining, drop the bytes
                try:
                    self._deliver(name, data)
                except Exception:  # noqa: BLE001 - receiver closed or loop gone: drain to the exit frame
                    deliver = False
        except (OSError, EOFError, struct.error):
            pass                  # connection lost without an exit frame: report the kill
        finally:
            self._code = code
            self._finished = True
            self._started.set()
            if self._timer is not None:
                self._timer.cancel()
            self._sock.close()
            self._end_output()
            self._set_done()

    def _feed(self, src: bytes | AsyncIterator[bytes]) -> None:
        def put(chunk: bytes) -> None:
            for i in range(0, len(chunk), STDIN_CHUNK):
                part = chunk[i:i + STDIN_CHUNK]
                with self._lock:
                    self._sock.sendall(HDR.pack(ord("I"), len(part)) + part)
        self._started.wait()
        try:
            if isinstance(src, bytes):
                put(src)
            else:
                while (chunk := anyio.from_thread.run(_next_chunk, src, token=self._token)) is not None:
                    if chunk:
                        put(chunk)
            with self._lock:
                self._sock.sendall(HDR.pack(ord("E"), 0))
        except Exception:  # noqa: BLE001, S110 - connection closed (command done or killed) or loop gone
            pass

    def _on_timeout(self) -> None:
        if not self._finished:
            self.timed_out = True
            self._kill_sync()

    def _kill_sync(self) -> None:
        self._killed = True
        if self._lock.acquire(blocking=False):
            try:
                self._sock.send(HDR.pack(ord("K"), 0), socket.MSG_DONTWAIT)
            except OSError:
                pass
            finally:
                self._lock.release()
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_WR)     # EOF = kill, even behind a stuck stdin frame

    # -- ExecProcess -----------------------------------------------------------------------------
    @property
    def pid(self) -> int | None:
        """Host pid of the command (None once it has exited or if it cannot be found)."""
        if self._pid is None and self._init_pid is not None and self._ns_pid is not None and not self._finished:
            self._pid = host_pid(self._init_pid, self._ns_pid)
        return self._pid

    @property
    def sandbox_pid(self) -> int | None:
        """The command's pid inside the sandbox's pid namespace."""
        return self._ns_pid

    async def wait(self) -> int:
        await self._done.wait()
        assert self._code is not None
        return self._code

    async def kill(self) -> None:
        """Kill the command's process group and stop reading its output (idempotent)."""
        if not self._killed and not self._finished:
            self._kill_sync()
        self._recv.close()
        await self._done.wait()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        if not self._finished:
            await self.kill()


def sock_path_for(bundle: Path) -> Path:
    return bundle / "pd" / "ctl"


