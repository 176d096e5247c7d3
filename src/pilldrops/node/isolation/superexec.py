"""A command run by the sandbox's own init (pd-init as supervisor) over its unix socket, as an ``ExecProcess``.

The fast exec path (issue 5 part 2): instead of one ``crun exec`` per command, the agent connects to
``<sandbox dir>/pd/ctl`` (bind-mounted at ``/.pd/run/ctl`` in the sandbox; pd-init listens there), sends one
request and reads framed output. The wire format is described in ``runtime/init/pd-init.c``; every frame is
``u8 type | u32 little-endian length | payload``.

Same semantics as ``PipeExec`` (execproc.py), without its threads (issue 15): the socket is read and
written on the event loop (``add_reader``/``add_writer``), chunks go into one small bounded anyio memory
object stream (backpressure: while it is full the socket is not read, it fills, pd-init stops reading the
command's pipes, the command blocks), bytes past ``output_cap`` are read and dropped (``truncated``), a loop
timer enforces ``timeout`` whether or not anyone reads, and pd-init itself sends the exit frame once the
command has exited and its pipes went quiet for 100 ms (a background child holding the pipes does not block
the return). ``kill`` shuts down the socket's sending side: pd-init takes the EOF as "kill the command's
process group" (SIGKILL to -pgid; the command runs in its own session), which works even while a stdin
frame is stuck; it also sends a ``K`` frame when nothing else waits to be sent.

``pid`` is the command's host pid, found among the init's children by their NSpid (``/proc/<pid>/status``);
``None`` if the command already exited.

Protocol version 2 (``PROTO``): every connection starts with ``H`` (our version), pd-init answers ``V`` (its
version) before ``P``; v2 adds PTYs (``pty=(rows, cols)``), ``signal`` and ``resize``. A v1 init closes the
connection on ``H``, before it runs anything: ``probe_version`` asks once per sandbox init (the runtime
caches the answer) so an old init is driven through ``crun exec`` instead of failing. A v1 agent talking to a
v2 init sends no ``H`` and gets v1 behaviour. Everything read from the socket is attacker input (the sandbox
can replace the socket): a frame longer than ``MAX_FRAME`` or of the wrong shape ends the command as a
protocol violation before anything is buffered.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import struct
import threading
import time
from collections.abc import AsyncIterable, AsyncIterator, Callable
from pathlib import Path
from typing import Self

import anyio
import anyio.from_thread
import anyio.lowlevel

from pilldrops.node.isolation.execproc import OutputRelay, _next_chunk
from pilldrops.node.runtime.base import StreamName

HDR = struct.Struct("<BI")
PROTO = 2
STDIN_CHUNK = 16 * 1024          # pd-init's per-frame input limit
ABANDON_AFTER_S = 2.0            # after a timeout: how long the init has to end the command before the host does
MAX_FRAME = 64 * 1024            # pd-init never sends more than its 32 KiB out buffer in one frame
PROTOCOL_EXIT = 126              # exit code reported when the socket broke the protocol
HELLO = HDR.pack(ord("H"), 4) + struct.pack("<I", PROTO)
_STREAMS: dict[int, StreamName] = {ord("O"): "stdout", ord("e"): "stderr"}


def encode_request(argv: list[str], env: dict[str, str], cwd: str, *, stdin: bool,
                   pty: tuple[int, int] | None = None, hello: bool = True, user: str | None = None,
                   pid_late: bool = False) -> bytes:
    """``H`` + ``R`` frames; ``pty`` is (rows, cols) of a new terminal for the command; ``user`` ("uid:gid")
    the ids it runs as (a template's USER; None: the init's, root); ``pid_late``: the init may send ``P``
    with the first output or the exit (at most its HOLD_MS after the fork; not with stdin or a PTY)."""
    strs = [cwd, *argv, *(f"{k}={v}" for k, v in env.items())]
    if any("\0" in s for s in strs):
        raise ValueError("argv, env and cwd must not contain NUL bytes")
    flags = (1 if stdin or pty else 0) | (2 if pty else 0) | (4 if user else 0) | (8 if pid_late else 0)
    head = struct.pack("<BII", flags, len(argv), len(env))
    if pty:
        head += struct.pack("<HH", *_size(*pty))
    if user:
        head += struct.pack("<II", *parse_ids(user))
    body = head + b"".join(s.encode("utf-8", "surrogateescape") + b"\0" for s in strs)
    return (HELLO if hello else b"") + HDR.pack(ord("R"), len(body)) + body


def parse_ids(user: str) -> tuple[int, int]:
    """``"uid:gid"`` as two ints (ValueError otherwise)."""
    uid, sep, gid = user.partition(":")
    if not (sep and uid.isdigit() and gid.isdigit()) or int(uid) >= 2**32 or int(gid) >= 2**32:
        raise ValueError(f"user must be uid:gid, got {user!r}")
    return int(uid), int(gid)


def _size(rows: int, cols: int) -> tuple[int, int]:
    return max(0, min(int(rows), 0xFFFF)), max(0, min(int(cols), 0xFFFF))


class ProtocolError(Exception):
    """The socket broke the framing (too long, wrong shape, wrong version)."""


def _read_frame(sock: socket.socket) -> tuple[int, bytes]:
    typ, n = HDR.unpack(_recv_exact(sock, HDR.size))
    if n > MAX_FRAME:
        raise ProtocolError(f"frame of {n} bytes from the sandbox's init (at most {MAX_FRAME})")
    return typ, _recv_exact(sock, n) if n else b""


def _i32(data: bytes) -> int:
    if len(data) != 4:
        raise ProtocolError(f"a 4-byte frame had {len(data)} bytes")
    return struct.unpack("<i", data)[0]


def check_peer(sock: socket.socket, init_pid: int | None) -> None:
    """Raise OSError unless the process listening on ``sock``'s other end is the sandbox's init (host pid
    ``init_pid``; None: the runtime's pids are not host pids, no check). The socket sits where the sandbox
    could have bound one of its own (in a moment the directory is not locked): never talk to that one."""
    if init_pid is None:
        return
    pid, _uid, _gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                          struct.calcsize("3i")))
    if pid != init_pid:
        raise OSError(f"the control socket is not the sandbox init's (its listener is pid {pid}, not {init_pid})")


def probe_version(sock_path: str, timeout: float = 2.0, init_pid: int | None = None) -> int:
    """The protocol version the init behind ``sock_path`` speaks: 1 when it closes on ``H``. Blocking (run
    it in a worker thread). Raises OSError when nothing sane answers in time, or when the listener is not
    the init (``init_pid``, see :func:`check_peer`)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        s.connect(sock_path)
        check_peer(s, init_pid)
        s.sendall(HELLO)
        try:
            typ, data = _read_frame(s)
        except EOFError:
            return 1
        except (ProtocolError, struct.error) as e:
            raise OSError(str(e)) from e
        if typ != ord("V"):
            raise OSError(f"unexpected first frame {typ!r} from the sandbox's init")
        return _i32(data)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        part = sock.recv(n - len(buf))
        if not part:
            raise EOFError
        buf += part
    return bytes(buf)


def _children(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        return []


def _ns_pid(pid: str) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("NSpid:"):
                return int(line.split()[-1])
    except (OSError, ValueError):
        pass
    return None


def host_pid(init_pid: int, ns_pid: int) -> int | None:
    """The host pid of the command whose pid in the sandbox is ``ns_pid``: a child of one of the init's
    children (its shepherd, pd-init >= issue 16), or of the init itself (an older pd-init)."""
    for shepherd in _children(init_pid):
        if _ns_pid(shepherd) == ns_pid:
            return int(shepherd)
        for c in _children(int(shepherd)):
            if _ns_pid(c) == ns_pid:
                return int(c)
    return None


class SupervisorExec(OutputRelay):
    """``ExecProcess`` over a connection to pd-init's control socket (one command per connection).

    Read and written on the event loop itself (issue 15): the socket is non-blocking and registered with
    the loop (``add_reader``/``add_writer``), frames are parsed in the reader callback and chunks go
    straight into the bounded queue, so a command costs no thread and no thread-to-loop hand-off. When
    the queue is full the reader is taken off the loop (``remove_reader``) until ``read`` makes room:
    the socket fills, pd-init stops reading the command's pipes, the command blocks (backpressure).
    Everything written (request, stdin, control frames) goes through one buffer of whole frames, sent
    in order. Only an async-iterable ``stdin`` uses a thread (it pulls the iterator through the loop).
    """

    def __init__(self, sock_path: Path, argv: list[str], *, env: dict[str, str], cwd: str,
                 stdin: AsyncIterable[bytes] | bytes | None, init_pid: int | None = None,
                 timeout: float | None = None, output_cap: int | None = None,
                 path_fd: int | None = None, sock: socket.socket | None = None,
                 pty: tuple[int, int] | None = None, user: str | None = None,
                 on_sent: Callable[[], None] | None = None, pid_late: bool = False) -> None:
        """``on_sent``: called (soon, on the loop) once the request went out, while the command runs (the
        runtime makes the sandbox's next connection then: off the path of this command's answer). ``path_fd``: an fd
        ``sock_path`` refers to (``/proc/self/fd/N``); owned from here on, closed once connected. ``sock``: an already connected socket to use instead of ``sock_path`` (owned from
        here on; a microVM's agent channel, runtime/microvm/channel.py). ``pty``: (rows, cols) of a terminal
        for the command (its output all comes as ``stdout``; ``stdin`` is the terminal's input). ``pid_late``:
        see ``encode_request`` (``pid``/``sandbox_pid`` may stay None for the first few ms)."""
        super().__init__(output_cap)
        self.pty = pty is not None
        self.protocol_error: str | None = None
        self.init_unresponsive = False         # the init never ended it after its timeout (see _abandon)
        self._loop = asyncio.get_running_loop()
        self._init_pid = init_pid
        self._ns_pid: int | None = None
        self._pid: int | None = None
        self._pid_late = pid_late              # a run: its start event wants the pid, which comes late
        self._code: int | None = None
        self._finished = False
        self._killed = False
        self._hello = False                    # the init's 'V' frame was read
        self._deliver_ok = True                # False once the reader is gone: drain to the exit frame
        self._pending: tuple[StreamName, bytes] | None = None    # a chunk waiting for room in the queue
        self._reading = False
        self._writing = False
        self._rbuf = bytearray()
        self._wbuf = bytearray(encode_request(argv, env, cwd, stdin=stdin is not None, pty=pty, user=user,
                                                   pid_late=pid_late))
        self._drained: list[asyncio.Future[None]] = []
        self._timers: list[asyncio.TimerHandle] = []
        self._retry: asyncio.TimerHandle | None = None      # the one pending connect retry (backlog full)
        self._sent = 0                                      # bytes written to the socket so far
        self._sock_path = str(sock_path)
        self._on_sent = on_sent
        self._connected = False
        if sock is not None:
            self._sock = sock
            self._connected = True
        else:
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self._sock.setblocking(False)
            try:          # fails fast when nobody listens (stale socket file: the caller falls back)
                self._sock.connect(self._sock_path)
                self._connected = True
                check_peer(self._sock, init_pid)
            except BlockingIOError:
                pass      # backlog full (all 64 slots busy): connect again in a moment (_retry_connect)
            except OSError:
                self._sock.close()
                if path_fd is not None:
                    os.close(path_fd)
                raise
        self._path_fd = path_fd
        self._sock.setblocking(False)
        if isinstance(stdin, bytes):
            self._queue_stdin(stdin)
            self._wbuf += HDR.pack(ord("E"), 0)
        if timeout is not None:
            self._timers.append(self._loop.call_later(timeout, self._on_timeout))
        if self._connected:
            self._on_connected()
        else:
            self._retry = self._loop.call_later(0.005, self._retry_connect)
        if stdin is not None and not isinstance(stdin, bytes):
            threading.Thread(target=self._feed, args=(stdin.__aiter__(),), daemon=True).start()

    # -- connection ------------------------------------------------------------------------------
    def _close_path_fd(self) -> None:
        if self._path_fd is not None:
            os.close(self._path_fd)
            self._path_fd = None

    def _retry_connect(self) -> None:
        if self._finished:
            return
        if self._killed:                 # killed before it ever reached the init: nothing ran
            self._finish(137)
            return
        try:
            self._sock.connect(self._sock_path)
            check_peer(self._sock, self._init_pid)
        except BlockingIOError:
            self._retry = self._loop.call_later(0.005, self._retry_connect)
            return
        except OSError:
            self._finish(137)
            return
        self._connected = True
        self._on_connected()

    def _on_connected(self) -> None:
        self._close_path_fd()
        self._resume_reading()
        self._flush()
        if self._on_sent is not None:
            self._loop.call_soon(self._on_sent)
            self._on_sent = None

    # -- writing ---------------------------------------------------------------------------------
    def _queue_stdin(self, data: bytes) -> None:
        for i in range(0, len(data), STDIN_CHUNK):
            part = data[i:i + STDIN_CHUNK]
            self._wbuf += HDR.pack(ord("I"), len(part)) + part

    def _flush(self) -> None:
        """Send what the buffer holds, as far as the socket takes it; the rest when it is writable."""
        if not self._connected or self._finished:
            return
        while self._wbuf:
            try:
                n = self._sock.send(self._wbuf)
            except (BlockingIOError, InterruptedError):
                break
            except OSError:                 # the init hung up: the reader sees it (EOF or reset)
                self._wbuf.clear()
                break
            del self._wbuf[:n]
            self._sent += n
        if self._wbuf and not self._writing:
            self._loop.add_writer(self._sock.fileno(), self._flush)
            self._writing = True
        elif not self._wbuf:
            if self._writing:
                self._loop.remove_writer(self._sock.fileno())
                self._writing = False
            self._wake_drained()

    def _wake_drained(self) -> None:
        for f in self._drained:
            if not f.done():
                f.set_result(None)
        self._drained.clear()

    async def _wait_drained(self, limit: int = 0, timeout: float | None = None) -> bool:
        """Wait until at most ``limit`` bytes wait to be sent (False: finished first, or ``timeout``)."""
        with anyio.move_on_after(timeout):
            while len(self._wbuf) > limit or not self._connected:
                if self._finished:
                    return False
                f = self._loop.create_future()
                self._drained.append(f)
                await f
            return not self._finished
        return False

    async def _put_stdin(self, chunk: bytes | None) -> None:
        """From the feed thread: queue one stdin chunk (None: EOF); waits while much is unsent."""
        if self._finished or self._killed:
            raise anyio.ClosedResourceError
        if chunk is None:
            self._wbuf += HDR.pack(ord("E"), 0)
        else:
            self._queue_stdin(chunk)
        self._flush()
        if not await self._wait_drained(limit=4 * STDIN_CHUNK):
            raise anyio.ClosedResourceError

    def _feed(self, src: AsyncIterator[bytes]) -> None:
        try:
            while (chunk := anyio.from_thread.run(_next_chunk, src, token=self._token)) is not None:
                if chunk:
                    anyio.from_thread.run(self._put_stdin, chunk, token=self._token)
            anyio.from_thread.run(self._put_stdin, None, token=self._token)
        except BaseException:  # noqa: BLE001 - connection closed (command done or killed), loop gone or
            pass                   # shutting down (a CancelledError from a stdin source nobody closed)

    # -- reading ---------------------------------------------------------------------------------
    def _resume_reading(self) -> None:
        if not self._reading and not self._finished and self._connected:
            self._loop.add_reader(self._sock.fileno(), self._on_readable)
            self._reading = True

    def _pause_reading(self) -> None:
        if self._reading:
            self._loop.remove_reader(self._sock.fileno())
            self._reading = False

    def _on_readable(self) -> None:
        try:
            data = self._sock.recv(MAX_FRAME + HDR.size)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:                # connection lost without an exit frame: report the kill
            self._finish(137)
            return
        self._rbuf += data
        try:
            self._parse()
        except Exception:  # noqa: BLE001 - a loop callback must never leave the command hanging
            self._pending = None
            self._finish(137)

    def _parse(self) -> None:
        """Act on the whole frames in the read buffer (it never holds more than one frame and one recv)."""
        buf = self._rbuf
        try:
            while len(buf) >= HDR.size and not self._finished:
                typ, n = HDR.unpack_from(buf)
                if n > MAX_FRAME:
                    raise ProtocolError(f"frame of {n} bytes from the sandbox's init (at most {MAX_FRAME})")
                if len(buf) < HDR.size + n:
                    return
                data = bytes(buf[HDR.size:HDR.size + n])
                del buf[:HDR.size + n]
                if not self._hello:
                    if typ != ord("V") or _i32(data) < PROTO:
                        raise ProtocolError(f"the sandbox's init answered {chr(typ)!r} "
                                            f"{_i32(data) if typ == ord('V') else ''} to the version hello "
                                            f"(this agent speaks {PROTO})")
                    self._hello = True
                elif typ == ord("P"):
                    self._ns_pid = _i32(data)
                    if self._pid_late:          # the run's start event is made after this read: the command
                        _ = self.pid            # may have exited by then (its pid no longer found)
                elif typ == ord("X"):
                    self._finish(_i32(data))
                elif (name := _STREAMS.get(typ)) is not None and self._deliver_ok:
                    data = self._capped(name, data)
                    if data and not self._offer(name, data):
                        self._pending = (name, data)
                        self._pause_reading()
                        return
        except ProtocolError as e:
            self.protocol_error = str(e)
            with contextlib.suppress(OSError):
                self._sock.shutdown(socket.SHUT_RDWR)     # pd-init kills the command on the hang-up
            self._pending = None
            self._offer("stderr", f"pilldrops: protocol violation: {e}\n".encode())
            self._finish(PROTOCOL_EXIT)

    def _offer(self, name: StreamName, data: bytes) -> bool:
        """Into the queue now; False when it is full (the caller holds the chunk and pauses)."""
        try:
            self._send.send_nowait((name, data))
        except anyio.WouldBlock:
            return False
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
            self._deliver_ok = False     # nobody reads any more: drain to the exit frame, drop the bytes
        return True

    def _unblock(self) -> None:
        """Room in the queue (or nobody reads any more): hand over the held chunk, go on reading."""
        if self._pending is not None:
            name, data = self._pending
            if self._deliver_ok and not self._offer(name, data):
                return
            self._pending = None
        if not self._finished:
            self._parse()
            if self._pending is None:
                self._resume_reading()

    async def read(self) -> tuple[StreamName, bytes] | None:
        chunk = await super().read()
        if self._pending is not None:
            self._unblock()
        return chunk

    def _finish(self, code: int) -> None:
        if self._finished:
            return
        self._code = code
        self._finished = True
        for t in self._timers:
            t.cancel()
        self._timers.clear()
        if self._retry is not None:
            self._retry.cancel()
        self._pause_reading()
        if self._writing:
            self._loop.remove_writer(self._sock.fileno())
            self._writing = False
        self._wbuf.clear()
        self._sock.close()
        self._close_path_fd()
        self._wake_drained()
        self._send.close()
        self._done.set()

    # -- control ---------------------------------------------------------------------------------
    async def _send_ctl(self, frame: bytes, timeout: float = 2.0) -> bool:
        """Send one small control frame, waiting at most ``timeout`` (behind a stuck stdin frame, say); a
        frame none of which the socket took is taken back (False: not delivered); one that could only be
        sent in part ends the command (the framing would be broken)."""
        deadline = time.monotonic() + timeout
        if not await self._wait_drained(timeout=timeout) or self._killed:
            return False
        sent_before = self._sent            # the buffer is empty here: the frame goes out first
        self._wbuf += frame
        self._flush()
        if not self._wbuf:
            return True
        if await self._wait_drained(timeout=max(0.0, deadline - time.monotonic())):
            return True
        if self._finished:
            return False
        if self._sent == sent_before:       # not a byte of it went out (pd-init is not reading): take it back
            del self._wbuf[:len(frame)]
            if not self._wbuf and self._writing:
                self._loop.remove_writer(self._sock.fileno())
                self._writing = False
            return False
        self._kill_sync()
        return False

    async def signal(self, signo: int) -> bool:
        """Send ``signo`` to the command's process group (False if it could not be delivered)."""
        if self._finished:
            return False
        return await self._send_ctl(HDR.pack(ord("S"), 4) + struct.pack("<i", signo))

    async def resize(self, rows: int, cols: int) -> bool:
        """New window size of the command's PTY (SIGWINCH to its foreground group)."""
        if not self.pty or self._finished:
            return False
        return await self._send_ctl(HDR.pack(ord("W"), 4) + struct.pack("<HH", *_size(rows, cols)))

    def _on_timeout(self) -> None:
        if not self._finished:
            self.timed_out = True
            self._kill_sync()
            self._timers.append(self._loop.call_later(ABANDON_AFTER_S, self._abandon))

    def _abandon(self) -> None:
        """The init did not end the command within ``ABANDON_AFTER_S`` of its timeout (it is stopped, say:
        SIGSTOP from the host): kill the command from the host when its pid is known, and hang up, so the
        run ends now with its timeout, whatever the init does (issue 16 item 7)."""
        if self._finished:
            return
        self.init_unresponsive = True
        pid = self.pid
        if pid is not None:
            with contextlib.suppress(OSError):
                os.killpg(pid, signal.SIGKILL)
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._finish(137)                                # exit 137, timed out

    def _kill_sync(self) -> None:
        """'K' when nothing else waits to be sent, then EOF: pd-init kills on either, even behind a
        half-sent stdin frame (the rest of which is dropped)."""
        self._killed = True
        if not self._connected or self._finished:
            return                   # never connected: _retry_connect ends it without running anything
        if self._wbuf:
            self._wbuf.clear()
        else:
            with contextlib.suppress(OSError):
                self._sock.send(HDR.pack(ord("K"), 0), socket.MSG_DONTWAIT)
        if self._writing:
            self._loop.remove_writer(self._sock.fileno())
            self._writing = False
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_WR)     # EOF = kill
        self._wake_drained()

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
        self._deliver_ok = False
        if self._pending is not None:
            self._unblock()
        await self._done.wait()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        if not self._finished:
            await self.kill()


class Spares:
    """One idle connection per sandbox to its init's control socket, made once a command's request went out
    (while it runs), so the next command's request goes out on it at once: no connect, no accept and no
    wake-up of the init for them on that command's path (issue 15). pd-init holds it as any connection
    waiting for its request
    (one of its slots). Each is keyed by the init it was made to (pid and start time: a restarted or
    restored init never gets one of its predecessor's) and checked before use (a connection the init
    closed, or one with anything to read, is thrown away and the command connects as before). ``suspend``
    closes a sandbox's spare and makes none until ``resume`` (a checkpoint: CRIU must find no connection).
    """

    def __init__(self) -> None:
        self._socks: dict[str, tuple[object, socket.socket]] = {}
        self._off: set[str] = set()

    def take(self, sid: str, key: object) -> socket.socket | None:
        held = self._socks.pop(sid, None)
        if held is None:
            return None
        if held[0] != key:
            held[1].close()
            return None
        sock = held[1]
        try:
            sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
        except (BlockingIOError, InterruptedError):
            return sock          # idle and open: the init is waiting for a request on it
        except OSError:
            pass
        sock.close()             # EOF (the init let it go) or bytes nobody asked for: not usable
        return None

    def make(self, sid: str, key: object, path_fd: int | None, init_pid: int | None) -> None:
        """Connect a spare through ``path_fd`` (an O_PATH fd of the socket; closed here), unless the sandbox
        has one, is suspended, or the init does not take it at once."""
        try:
            if path_fd is None or sid in self._socks or sid in self._off:
                return
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.setblocking(False)
                sock.connect(f"/proc/self/fd/{path_fd}")
                check_peer(sock, init_pid)
            except OSError:          # incl. BlockingIOError: backlog full, the init is busy; no spare now
                sock.close()
                return
            self._socks[sid] = (key, sock)
        finally:
            if path_fd is not None:
                os.close(path_fd)

    def close(self, sid: str) -> None:
        held = self._socks.pop(sid, None)
        if held is not None:
            held[1].close()

    async def suspend(self, sid: str, wait: float = 2.0) -> None:
        """Make no spare for ``sid`` until ``resume``, and end the one it has: hang up and wait (at most
        ``wait`` seconds) until the init has closed its end too, so that no connection is left in the
        sandbox when this returns (a checkpoint follows; gVisor refuses to save an open host socket)."""
        self._off.add(sid)
        held = self._socks.pop(sid, None)
        if held is None:
            return
        sock = held[1]
        try:
            sock.shutdown(socket.SHUT_WR)            # EOF before a request: the init releases the slot
            deadline = time.monotonic() + wait
            while time.monotonic() < deadline:
                try:
                    if not sock.recv(64, socket.MSG_DONTWAIT):
                        break                        # the init's end is closed
                except (BlockingIOError, InterruptedError):
                    await anyio.sleep(0.002)
        except OSError:
            pass
        finally:
            sock.close()

    def resume(self, sid: str) -> None:
        self._off.discard(sid)

    def forget(self, sid: str) -> None:
        self._off.discard(sid)
        self.close(sid)


def sock_path_for(bundle: Path) -> Path:
    return bundle / "pd" / "ctl"


