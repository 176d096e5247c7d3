"""The host end of a microVM's agent port (virtio-serial ``pd.agent``, a unix socket QEMU serves).

The wire format and the guest end are in ``pd-vmagent.c``: frames ``u8 type | u32 chan | u32 len |
payload`` multiplex command connections onto the one port, with per-channel credit (``WINDOW`` bytes in
flight each way) so that every buffer on both sides is bounded. Each channel carries pd-init's own
protocol, so a command is run by handing one end of a ``socketpair`` to ``SupervisorExec`` (the exact code
crun sandboxes use); this module relays the other end.

``AgentLink`` owns one connection and one relay thread. On connect it sends ``MAXPAY + HDR`` no-op bytes (they
complete any frame a previous, killed agent left half-written) and a sync frame with a random nonce, and
drops every byte the guest sends until the guest echoes that nonce: whatever a previous connection left
queued in QEMU or the guest never reaches a new channel. Everything the guest sends is attacker input: a
frame longer than ``MAXPAY`` or data beyond a channel's credit ends the link (or that channel).
"""

from __future__ import annotations

import os
import select
import socket
import struct
import threading
import time
from collections import deque
from collections.abc import Callable

HDR = struct.Struct("<BII")
MAXPAY = 16384
WINDOW = 65536
NCH = 64
WR_CAP = 256 * 1024          # data frames queued to the guest wait while more than this is unsent
_PAD = b"\0" * (MAXPAY + HDR.size)


class LinkError(Exception):
    pass


class _Chan:
    __slots__ = ("ack", "credit", "eof_sent", "guest_closed", "id", "opened", "out", "sock")

    def __init__(self, cid: int, sock: socket.socket) -> None:
        self.id = cid
        self.sock = sock
        self.out = bytearray()      # guest -> command (pd-init frames), not yet written to sock
        self.credit = WINDOW        # bytes we may still send to the guest
        self.ack = 0                # bytes written to sock, not yet acknowledged to the guest
        self.opened = False
        self.eof_sent = False
        self.guest_closed = False


class AgentLink:
    """One connection to the guest agent; ``open_channel`` gives a socket that speaks pd-init's protocol."""

    def __init__(self, connect: Callable[[socket.socket], None], *, idle_close: float | None = None) -> None:
        """``connect(sock)`` connects the fresh AF_UNIX socket (raising OSError when nobody listens).
        ``idle_close``: end the link after that many seconds without a channel or request (``dead`` is then
        "idle"): QEMU serves the port to one client at a time, so an idle holder must not block another
        agent instance (a restarted one) from reaching the guest."""
        self._idle_close = idle_close
        self._pending = 0
        self._idle_since: float | None = None
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            connect(self._sock)
        except OSError as e:
            self._sock.close()
            raise LinkError(f"cannot connect to the guest agent port: {e}") from e
        self._sock.setblocking(False)
        self._nonce = os.urandom(8)
        self._sync_pat = HDR.pack(ord("S"), 0, len(self._nonce)) + self._nonce
        self._wr = bytearray(_PAD + self._sync_pat)
        self._rd = bytearray()
        self._synced = threading.Event()
        self._chans: dict[int, _Chan] = {}
        self._waiting: deque[_Chan] = deque()
        self._next_id = 1
        self._cmds: deque[Callable[[], None]] = deque()
        self._lock = threading.Lock()
        self._replies: deque[bytes] = deque()
        self._expecting = False
        self._reply_cv = threading.Condition()
        self._request_lock = threading.Lock()
        self.dead: str | None = None
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._thread = threading.Thread(target=self._run, name="pd-vm-link", daemon=True)
        self._thread.start()

    # -- API (any thread) -------------------------------------------------------------------------
    def wait_synced(self, timeout: float) -> None:
        if not self._synced.wait(timeout):
            raise LinkError(self.dead or f"the guest agent did not answer within {timeout:.1f} s")
        if self.dead:
            raise LinkError(self.dead)

    def request(self, payload: bytes, timeout: float) -> str:
        """Send an identity/probe frame ('H') and return the guest's reply text."""
        with self._request_lock:
            with self._reply_cv:
                self._replies.clear()
                self._expecting = True
            self._call(lambda: self._queue(ord("H"), 0, payload))
            with self._reply_cv:
                if not self._reply_cv.wait_for(lambda: self._replies or self.dead, timeout):
                    raise LinkError(f"the guest agent did not reply within {timeout:.1f} s")
                if not self._replies:
                    raise LinkError(self.dead or "link closed")
                return self._replies.popleft().decode(errors="replace")

    def open_channel(self) -> socket.socket:
        """A connected socket whose peer is a fresh connection to pd-init in the guest."""
        a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        b.setblocking(False)

        def add() -> None:
            cid = self._next_id
            self._next_id += 1
            ch = _Chan(cid, b)
            self._chans[cid] = ch
            self._waiting.append(ch)
            with self._lock:
                self._pending -= 1
        with self._lock:            # checked and counted under the lock the idle close takes
            if self.dead:
                a.close()
                b.close()
                raise LinkError(self.dead)
            self._pending += 1
            self._cmds.append(add)
        self._wake()
        return a

    def close(self) -> None:
        self._call(lambda: self._die("closed"))
        self._thread.join(timeout=5)

    # -- relay thread -------------------------------------------------------------------------------
    def _call(self, fn: Callable[[], None]) -> None:
        with self._lock:
            self._cmds.append(fn)
        self._wake()

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except OSError:
            pass

    def _poll_timeout(self) -> float | None:
        """ms until the idle close is due (None: no timeout), after ending the link when it is due."""
        if self._idle_close is None or not self._synced.is_set():
            return None
        if self._chans or self._waiting or self._expecting or self._wr:
            self._idle_since = None
            return None
        now = time.monotonic()
        if self._idle_since is None:
            self._idle_since = now
        left = self._idle_since + self._idle_close - now
        if left <= 0:
            with self._lock:
                if not self._pending and not self._cmds:
                    self.dead = "idle"
            if self.dead:
                self._die("idle")
                return None
            return 0
        return left * 1000

    def _queue(self, typ: int, cid: int, payload: bytes = b"") -> None:
        self._wr += HDR.pack(typ, cid, len(payload)) + payload

    def _die(self, why: str) -> None:
        if self.dead is None:
            self.dead = why
        for ch in list(self._chans.values()):
            self._drop(ch)
        self._synced.set()
        with self._reply_cv:
            self._reply_cv.notify_all()

    def _drop(self, ch: _Chan) -> None:
        self._chans.pop(ch.id, None)
        try:
            self._waiting.remove(ch)
        except ValueError:
            pass
        ch.sock.close()

    def _run(self) -> None:
        try:
            while self.dead is None:
                self._step()
        except Exception as e:  # noqa: BLE001 - the link ends; every channel sees EOF
            self._die(f"agent link failed: {e!r}")
        finally:
            self._sock.close()
            os.close(self._wake_r)
            os.close(self._wake_w)

    def _step(self) -> None:
        with self._lock:
            cmds, self._cmds = self._cmds, deque()
        for fn in cmds:
            fn()
        if self.dead is not None:
            return
        opened = sum(1 for c in self._chans.values() if c.opened)
        while self._synced.is_set() and self._waiting and opened < NCH:
            ch = self._waiting.popleft()
            ch.opened = True
            opened += 1
            self._queue(ord("O"), ch.id)
        for ch in self._chans.values():
            if ch.ack:
                self._queue(ord("A"), ch.id, struct.pack("<I", ch.ack))
                ch.ack = 0
        p = select.poll()
        fds: dict[int, _Chan | None] = {self._wake_r: None}
        p.register(self._wake_r, select.POLLIN)
        p.register(self._sock, select.POLLIN | (select.POLLOUT if self._wr else 0))
        for ch in self._chans.values():
            if not ch.opened:
                continue
            ev = 0
            if ch.credit > 0 and not ch.eof_sent and not ch.guest_closed and len(self._wr) < WR_CAP:
                ev |= select.POLLIN
            if ch.out:
                ev |= select.POLLOUT
            if ev:
                p.register(ch.sock, ev)
                fds[ch.sock.fileno()] = ch
        timeout = self._poll_timeout()
        if self.dead is not None:
            return
        for fd, ev in p.poll(timeout):
            if fd == self._wake_r:
                try:
                    os.read(self._wake_r, 4096)
                except OSError:
                    pass
            elif fd == self._sock.fileno():
                if ev & (select.POLLIN | select.POLLHUP | select.POLLERR):
                    self._read_port()
                    if self.dead is not None:
                        return
                if ev & select.POLLOUT:
                    self._flush_port()
            else:
                ch = fds.get(fd)
                if ch is None or ch.id not in self._chans:
                    continue
                if ev & select.POLLOUT or (ev & (select.POLLHUP | select.POLLERR) and ch.out):
                    self._to_command(ch)
                if ch.id in self._chans and ev & (select.POLLIN | select.POLLHUP | select.POLLERR):
                    self._from_command(ch)
        if self._wr:
            self._flush_port()

    def _flush_port(self) -> None:
        try:
            n = self._sock.send(self._wr)
        except BlockingIOError:
            return
        except OSError as e:
            self._die(f"agent port closed: {e}")
            return
        del self._wr[:n]

    def _read_port(self) -> None:
        try:
            data = self._sock.recv(65536)
        except BlockingIOError:
            return
        except OSError as e:
            self._die(f"agent port closed: {e}")
            return
        if not data:
            self._die("the guest agent port closed (QEMU exited?)")
            return
        self._rd += data
        if not self._synced.is_set():
            i = self._rd.find(self._sync_pat)
            if i < 0:        # keep only what could be the start of the pattern: bounded
                del self._rd[:max(0, len(self._rd) - len(self._sync_pat) + 1)]
                return
            del self._rd[:i + len(self._sync_pat)]
            self._synced.set()
        self._parse()

    def _parse(self) -> None:
        pos = 0
        rd = self._rd
        while len(rd) - pos >= HDR.size:
            typ, cid, n = HDR.unpack_from(rd, pos)
            if n > MAXPAY:
                self._die(f"guest agent sent a {n}-byte frame (limit {MAXPAY})")
                return
            if len(rd) - pos < HDR.size + n:
                break
            payload = bytes(rd[pos + HDR.size:pos + HDR.size + n])
            pos += HDR.size + n
            self._on_frame(typ, cid, payload)
            if self.dead is not None:
                return
        del rd[:pos]

    def _on_frame(self, typ: int, cid: int, payload: bytes) -> None:
        if typ == ord("H"):
            with self._reply_cv:         # one reply per request: unasked ones are dropped (bounded)
                if self._expecting and not self._replies:
                    self._replies.append(payload[:1024])
                    self._expecting = False
                self._reply_cv.notify_all()
            return
        ch = self._chans.get(cid)
        if ch is None or not ch.opened:
            return
        if typ == ord("D"):
            if len(ch.out) + len(payload) > WINDOW:        # beyond its credit: the guest broke the rules
                self._queue(ord("C"), ch.id)
                self._drop(ch)
                return
            ch.out += payload
            self._to_command(ch)
        elif typ == ord("A") and len(payload) == 4:
            ch.credit = min(WINDOW, ch.credit + struct.unpack("<I", payload)[0])
        elif typ == ord("C"):
            ch.guest_closed = True
            if not ch.out:
                self._drop(ch)

    def _to_command(self, ch: _Chan) -> None:
        try:
            n = ch.sock.send(ch.out)
        except BlockingIOError:
            return
        except OSError:           # the command's reader is gone: tell the guest (pd-init kills it)
            self._queue(ord("C"), ch.id)
            self._drop(ch)
            return
        del ch.out[:n]
        ch.ack += n
        if not ch.out and ch.guest_closed:
            self._drop(ch)

    def _from_command(self, ch: _Chan) -> None:
        if ch.credit <= 0 or ch.eof_sent:
            return
        try:
            data = ch.sock.recv(min(ch.credit, MAXPAY))
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:               # shutdown(SHUT_WR) by SupervisorExec = kill; or closed
            ch.eof_sent = True
            self._queue(ord("E"), ch.id)
            return
        ch.credit -= len(data)
        self._queue(ord("D"), ch.id, data)
