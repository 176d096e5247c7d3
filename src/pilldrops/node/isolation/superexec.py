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

Protocol version 2 (``PROTO``): every connection starts with ``H`` (our version), pd-init answers ``V`` (its
version) before ``P``; v2 adds PTYs (``pty=(rows, cols)``), ``signal`` and ``resize``. A v1 init closes the
connection on ``H``, before it runs anything: ``probe_version`` asks once per sandbox init (the runtime
caches the answer) so an old init is driven through ``crun exec`` instead of failing. A v1 agent talking to a
v2 init sends no ``H`` and gets v1 behaviour. Everything read from the socket is attacker input (the sandbox
can replace the socket): a frame longer than ``MAX_FRAME`` or of the wrong shape ends the command as a
protocol violation before anything is buffered.
"""

from __future__ import annotations

import contextlib
import os
import select
import socket
import struct
import threading
import time
from collections.abc import AsyncIterable, AsyncIterator
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
MAX_FRAME = 64 * 1024            # pd-init never sends more than its 32 KiB out buffer in one frame
PROTOCOL_EXIT = 126              # exit code reported when the socket broke the protocol
HELLO = HDR.pack(ord("H"), 4) + struct.pack("<I", PROTO)
_STREAMS: dict[int, StreamName] = {ord("O"): "stdout", ord("e"): "stderr"}


def encode_request(argv: list[str], env: dict[str, str], cwd: str, *, stdin: bool,
                   pty: tuple[int, int] | None = None, hello: bool = True, user: str | None = None) -> bytes:
    """``H`` + ``R`` frames; ``pty`` is (rows, cols) of a new terminal for the command; ``user`` ("uid:gid")
    the ids it runs as (a template's USER; None: the init's, root)."""
    strs = [cwd, *argv, *(f"{k}={v}" for k, v in env.items())]
    if any("\0" in s for s in strs):
        raise ValueError("argv, env and cwd must not contain NUL bytes")
    flags = (1 if stdin or pty else 0) | (2 if pty else 0) | (4 if user else 0)
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


def probe_version(sock_path: str, timeout: float = 2.0) -> int:
    """The protocol version the init behind ``sock_path`` speaks: 1 when it closes on ``H``. Blocking (run
    it in a worker thread). Raises OSError when nothing sane answers in time."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        s.connect(sock_path)
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
    """``ExecProcess`` over a connection to pd-init's control socket (one command per connection)."""

    def __init__(self, sock_path: Path, argv: list[str], *, env: dict[str, str], cwd: str,
                 stdin: AsyncIterable[bytes] | bytes | None, init_pid: int | None = None,
                 timeout: float | None = None, output_cap: int | None = None,
                 path_fd: int | None = None, sock: socket.socket | None = None,
                 pty: tuple[int, int] | None = None, user: str | None = None) -> None:
        """``path_fd``: an fd ``sock_path`` refers to (``/proc/self/fd/N``); owned from here on, closed
        once connected. ``sock``: an already connected socket to use instead of ``sock_path`` (owned from
        here on; a microVM's agent channel, runtime/microvm/channel.py). ``pty``: (rows, cols) of a terminal
        for the command (its output all comes as ``stdout``; ``stdin`` is the terminal's input)."""
        super().__init__(output_cap)
        self.pty = pty is not None
        self.protocol_error: str | None = None
        self._init_pid = init_pid
        self._ns_pid: int | None = None
        self._pid: int | None = None
        self._code: int | None = None
        self._finished = False
        self._killed = False
        self._lock = threading.Lock()          # one writer at a time on the socket (stdin vs kill)
        self._request = encode_request(argv, env, cwd, stdin=stdin is not None, pty=pty, user=user)
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
            # (EOF here is a lost connection, as anywhere: the runtime asked the init's version before)
            typ, data = _read_frame(self._sock)
            if typ != ord("V") or _i32(data) < PROTO:
                raise ProtocolError(f"the sandbox's init answered {chr(typ)!r} "
                                    f"{_i32(data) if typ == ord('V') else ''} to the version hello "
                                    f"(this agent speaks {PROTO})")
            while True:
                typ, data = _read_frame(self._sock)
                if typ == ord("P"):
                    self._ns_pid = _i32(data)
                    continue
                if typ == ord("X"):
                    code = _i32(data)
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
        except ProtocolError as e:
            self.protocol_error = str(e)
            code = PROTOCOL_EXIT
            with contextlib.suppress(OSError):
                self._sock.shutdown(socket.SHUT_RDWR)     # pd-init kills the command on the hang-up
            with contextlib.suppress(Exception):
                self._deliver("stderr", f"pilldrops: protocol violation: {e}\n".encode())
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
        except BaseException:  # noqa: BLE001 - connection closed (command done or killed), loop gone or
            pass                   # shutting down (a CancelledError from a stdin source nobody closed)

    def _send_ctl(self, frame: bytes, timeout: float = 2.0) -> bool:
        """Send one small control frame, waiting at most ``timeout`` (behind a stuck stdin frame, say); a
        frame that could only be sent in part ends the command (the framing would be broken). The
        socket's own blocking mode is left alone: the reader thread is blocked in it."""
        deadline = time.monotonic() + timeout
        if not self._started.wait(timeout) or self._finished:
            return False
        if not self._lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
            return False
        try:
            view = memoryview(frame)
            while view:
                try:
                    view = view[self._sock.send(view, socket.MSG_DONTWAIT):]
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        if len(view) < len(frame):
                            self._kill_sync()
                        return False
                    select.select([], [self._sock], [], 0.05)
                except OSError:
                    return False
            return True
        finally:
            self._lock.release()

    async def signal(self, signo: int) -> bool:
        """Send ``signo`` to the command's process group (False if it could not be delivered)."""
        if self._finished:
            return False
        return await anyio.to_thread.run_sync(self._send_ctl, HDR.pack(ord("S"), 4) + struct.pack("<i", signo))

    async def resize(self, rows: int, cols: int) -> bool:
        """New window size of the command's PTY (SIGWINCH to its foreground group)."""
        if not self.pty or self._finished:
            return False
        frame = HDR.pack(ord("W"), 4) + struct.pack("<HH", *_size(rows, cols))
        return await anyio.to_thread.run_sync(self._send_ctl, frame)

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


