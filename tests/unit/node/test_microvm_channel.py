"""The host end of the microVM agent port (runtime/microvm/channel.py) against a scripted guest: the sync that
skips stale bytes, relaying a channel both ways with credits, and what a hostile guest can do (oversized
frames, data beyond its credit, unasked replies) staying bounded. No QEMU: a unix socket plays the port."""

from __future__ import annotations

import os
import socket
import struct
import threading
from pathlib import Path

import pytest

from pilldrops.node.runtime.microvm.channel import HDR, MAXPAY, WINDOW, AgentLink, LinkError


class FakeGuest:
    """Accepts the link's connection and lets a test read and write raw frames."""

    def __init__(self, tmp: Path) -> None:
        self.path = str(tmp / "agent.sock")
        self.srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.srv.bind(self.path)
        self.srv.listen(1)
        self.conn: socket.socket | None = None
        self.buf = bytearray()

    def connect(self, sock: socket.socket) -> None:
        sock.connect(self.path)
        self.conn, _ = self.srv.accept()
        self.conn.settimeout(5)

    def frame(self) -> tuple[int, int, bytes]:
        assert self.conn is not None
        while True:
            while self.buf[:1] == b"\0":              # the link's no-op padding
                del self.buf[:1]
            if len(self.buf) >= HDR.size:
                typ, cid, n = HDR.unpack_from(self.buf)
                if len(self.buf) >= HDR.size + n:
                    payload = bytes(self.buf[HDR.size:HDR.size + n])
                    del self.buf[:HDR.size + n]
                    return typ, cid, payload
            self.buf += self.conn.recv(65536)

    def send(self, typ: str, cid: int, payload: bytes = b"") -> None:
        assert self.conn is not None
        self.conn.sendall(HDR.pack(ord(typ), cid, len(payload)) + payload)

    def sync(self, stale: bytes = b"") -> None:
        typ, cid, nonce = self.frame()
        assert chr(typ) == "S"
        assert self.conn is not None
        self.conn.sendall(stale + HDR.pack(ord("S"), cid, len(nonce)) + nonce)


@pytest.fixture
def guest(tmp_path: Path) -> FakeGuest:
    return FakeGuest(tmp_path)


def test_sync_skips_stale_bytes_and_relays_a_channel(guest: FakeGuest) -> None:
    link = AgentLink(guest.connect)
    try:
        # bytes a previous connection left queued, even a well-formed frame, never reach a channel
        guest.sync(stale=HDR.pack(ord("D"), 1, 3) + b"old" + os.urandom(100))
        link.wait_synced(5)
        a = link.open_channel()
        typ, cid, _ = guest.frame()
        assert chr(typ) == "O"
        a.sendall(b"request")
        typ, cid2, data = guest.frame()
        assert (chr(typ), cid2, data) == ("D", cid, b"request")
        guest.send("D", cid, b"reply")
        a.settimeout(5)
        assert a.recv(100) == b"reply"
        typ, _, ack = guest.frame()                       # the host acknowledges what it delivered
        assert chr(typ) == "A" and struct.unpack("<I", ack)[0] == 5
        guest.send("C", cid)                              # the guest closed: the command's socket sees EOF
        assert a.recv(100) == b""
        a.close()
    finally:
        link.close()


def test_identity_request_and_unasked_replies_are_dropped(guest: FakeGuest) -> None:
    link = AgentLink(guest.connect)
    try:
        guest.sync()
        link.wait_synced(5)
        for _ in range(1000):                             # a flood of unasked replies is not kept
            guest.send("H", 0, b"x" * 1000)
        result: list[str] = []
        t = threading.Thread(target=lambda: result.append(link.request(b"hostname=a\n", 5)))
        t.start()
        while True:
            typ, _, payload = guest.frame()
            if chr(typ) == "H":
                break
        assert payload == b"hostname=a\n"
        guest.send("H", 0, b"ok")
        t.join(5)
        assert result and result[0] in ("ok", "x" * 1000)   # a flood frame may race ahead; never more than one
        assert len(link._replies) <= 1
    finally:
        link.close()


def test_oversized_frame_ends_the_link(guest: FakeGuest) -> None:
    link = AgentLink(guest.connect)
    try:
        guest.sync()
        link.wait_synced(5)
        a = link.open_channel()
        guest.frame()
        assert guest.conn is not None
        guest.conn.sendall(HDR.pack(ord("D"), 1, MAXPAY + 1))
        a.settimeout(5)
        assert a.recv(10) == b""                          # every channel sees EOF
        with pytest.raises(LinkError):
            link.open_channel()
        assert "frame" in (link.dead or "")
    finally:
        link.close()


def test_data_beyond_credit_closes_only_that_channel(guest: FakeGuest) -> None:
    link = AgentLink(guest.connect)
    try:
        guest.sync()
        link.wait_synced(5)
        a = link.open_channel()
        _, cid, _ = guest.frame()
        a.setblocking(False)                              # never read: the host keeps at most WINDOW for it
        sent = 0
        closed = False
        while sent < 32 * WINDOW and not closed:     # the socket buffer takes ~200 KiB first
            guest.send("D", cid, b"z" * MAXPAY)
            sent += MAXPAY
            guest.conn.settimeout(0.02)  # type: ignore[union-attr]
            try:
                while True:
                    typ, c, _ = guest.frame()
                    if chr(typ) == "C" and c == cid:
                        closed = True
                        break
            except TimeoutError:
                pass
        assert closed, "the host buffered past the channel's window"
        assert link.dead is None                          # the link itself lives on
        b = link.open_channel()
        guest.conn.settimeout(5)  # type: ignore[union-attr]
        typ, _, _ = guest.frame()
        assert chr(typ) == "O"
        a.close()
        b.close()
    finally:
        link.close()
