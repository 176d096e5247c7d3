"""The node agent against what a sandbox (or a careless operator) hands it, without a runtime: a control
channel that lies about its frame sizes (item 2), trees too deep to recurse (item 4), a bad template spec
(item 10), the node's /healthz (item 9) and a batch whose client leaves (item 6, in-process)."""

from __future__ import annotations

import os
import resource
import socket
import struct
import threading
import time
from pathlib import Path

import anyio
import httpx
import pytest

from pilldrops.node.isolation.rmtree import remove_tree
from pilldrops.node.isolation.superexec import HDR, PROTO, PROTOCOL_EXIT, SupervisorExec

pytestmark = pytest.mark.anyio


def _evil_init(path: Path, frames: list[bytes], tail: int) -> threading.Thread:
    """A fake pd-init on ``path``: answers the hello, sends ``frames``, then ``tail`` bytes of zeros."""
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(str(path))
    srv.listen(1)

    def serve() -> None:
        conn, _ = srv.accept()
        try:
            conn.recv(65536)
            conn.sendall(HDR.pack(ord("V"), 4) + struct.pack("<I", PROTO))
            for f in frames:
                conn.sendall(f)
            chunk = b"\0" * 65536
            sent = 0
            while sent < tail:
                conn.sendall(chunk)
                sent += len(chunk)
        except OSError:
            pass                  # the agent hung up on us: what it should do
        finally:
            conn.close()
            srv.close()

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    return t


def _maxrss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


async def test_an_announced_768_mib_frame_is_refused_unread(tmp_path: Path) -> None:
    """Item 2: the sandbox's root replaced the socket with a server announcing a 768 MiB output frame;
    the agent must refuse the header, never buffer the body."""
    sock = tmp_path / "ctl"
    t = _evil_init(sock, [HDR.pack(ord("O"), 768 << 20)], tail=64 << 20)
    rss = _maxrss_mb()
    proc = SupervisorExec(sock, ["/bin/true"], env={}, cwd="/", stdin=None, timeout=10, output_cap=1 << 20)
    with anyio.fail_after(20):
        while await proc.read() is not None:
            pass
        code = await proc.wait()
    assert code == PROTOCOL_EXIT and proc.protocol_error and "768" in proc.protocol_error.replace(
        str(768 << 20), "768")
    assert _maxrss_mb() - rss < 48, "the agent buffered what the sandbox announced"
    t.join(10)


async def test_endless_small_frames_are_capped_not_buffered(tmp_path: Path) -> None:
    """Many well-formed frames past the output cap: the agent drops them (bounded memory) and the
    command's timeout still ends the call when the other side never sends an exit."""
    sock = tmp_path / "ctl"
    frame = HDR.pack(ord("O"), 60_000) + b"x" * 60_000
    t = _evil_init(sock, [frame] * 3000, tail=0)      # ~180 MB of output, no exit frame
    rss = _maxrss_mb()
    proc = SupervisorExec(sock, ["/bin/true"], env={}, cwd="/", stdin=None, timeout=3, output_cap=1 << 20)
    got = 0
    with anyio.fail_after(30):
        while (chunk := await proc.read()) is not None:
            got += len(chunk[1])
        await proc.wait()
    assert got <= 1 << 20 and proc.truncated
    assert _maxrss_mb() - rss < 64
    t.join(10)


def test_a_tree_deeper_than_the_recursion_limit_is_removed(tmp_path: Path) -> None:
    """Item 4: 1,100 levels (shutil.rmtree raises RecursionError at ~1,000); a symlink out is unlinked,
    never followed."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep").write_text("keep")
    top = tmp_path / "sandbox"
    top.mkdir()
    fd = os.open(top, os.O_RDONLY)
    for _ in range(1100):
        os.mkdir("d", dir_fd=fd)
        nfd = os.open("d", os.O_RDONLY, dir_fd=fd)
        os.close(fd)
        fd = nfd
    os.symlink(outside, "out", dir_fd=fd)
    os.close(fd)
    remove_tree(top)
    assert not top.exists() and (outside / "keep").read_text() == "keep"


def test_one_bad_template_spec_is_skipped_and_reported(tmp_path: Path) -> None:
    """Item 10 (first half): a spec with ``run = ""`` must not take the node's templates down."""
    from pilldrops.node import templates as T
    (tmp_path / "empty-run.toml").write_text('name = "empty"\nfrom = "busybox"\n[[steps]]\nrun = ""\n')
    store = T.TemplateStore(tmp_path / "data", spec_dirs=[T.SPEC_DIR, tmp_path])
    assert "tiny" in store.specs() and "empty" not in store.specs()
    assert list(store.spec_errors) == [str(tmp_path / "empty-run.toml")]


async def test_node_healthz_facts_need_the_node_token(tmp_path: Path) -> None:
    from tests.stack import TOKEN, stack
    async with stack(tmp_path) as st:
        node = st.transport
        async with httpx.AsyncClient(transport=node, base_url="http://node") as c:
            assert (await c.get("/healthz")).json() == {"ok": True}
            assert (await c.get("/healthz", headers={"Authorization": "Bearer nope"})).json() == {"ok": True}
            full = (await c.get("/healthz", headers={"Authorization": f"Bearer {TOKEN}"})).json()
            assert full["ok"] is True and full["node_id"] and "sandboxes" in full


async def test_a_batch_whose_client_leaves_creates_no_more(tmp_path: Path) -> None:
    """Item 6 in-process: the client is gone after the first creates; the rest are never made, and what
    was made is killed (and unbilled beyond its seconds)."""
    from pilldrops.schema.api import BatchCreateRequest
    from tests.stack import stack
    async with stack(tmp_path, capacity_memory_mb=2048) as st:
        lc = st.cp.services.sandboxes.lifecycle
        t0 = time.monotonic()

        async def gone() -> bool:
            return time.monotonic() - t0 > 0.5

        req = BatchCreateRequest(template="tiny", count=200, memory_mb=512, capacity_wait=30)
        with anyio.fail_after(20):
            out = await lc.create_batch(st.team_id, req, None, disconnected=gone)
        assert out.created <= 4 and sum(1 for it in out.items if it.error and it.error.code == "client_gone") > 150
        async with st.client() as c:
            live = (await c.get("/v1/sandboxes", params={"state": ["starting", "running"]})).json()["items"]
        assert live == []


async def test_a_signal_the_init_does_not_read_is_not_delivered_and_kills_nothing(tmp_path: Path) -> None:
    """A sandbox whose init stops reading its control connection (its socket full): a signal (or resize)
    frame none of which the socket takes is taken back and reported undelivered; the command is NOT killed
    for it (only a frame sent in part would break the framing and end the command)."""
    sock = tmp_path / "ctl"
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(str(sock))
    srv.listen(1)
    held: list[socket.socket] = []

    def serve() -> None:               # answers the hello, then never reads again
        conn, _ = srv.accept()
        conn.recv(65536)
        conn.sendall(HDR.pack(ord("V"), 4) + struct.pack("<I", PROTO))
        held.append(conn)

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    proc = SupervisorExec(sock, ["/bin/sleep", "100"], env={}, cwd="/", stdin=None, timeout=8)
    try:
        t.join(10)
        await anyio.sleep(0.2)                          # the request went out; the buffer is empty
        assert not proc._wbuf
        proc._sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        with pytest.raises(BlockingIOError):            # fill the socket the init does not read
            while True:
                proc._sock.send(b"\0" * 4096)
        with anyio.fail_after(10):
            assert await proc.signal(2) is False
        assert not proc._killed and not proc._wbuf     # taken back, nothing killed, nothing queued
    finally:
        for c in held:                                  # the init hangs up: the command ends (137)
            c.close()
        srv.close()
        with anyio.fail_after(20):
            assert await proc.wait() == 137
