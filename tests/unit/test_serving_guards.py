"""`up`/`serve`/`node` refuse a busy port and a data dir another process of the same role holds, in one
line and before any slow set-up."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

from pilldrops._internal.serving import DataDirInUse, PortInUse, check_port, lock_data_dir, release_data_dir


def test_a_busy_port_is_one_clear_error() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(PortInUse, match=rf"port {port} on 127.0.0.1 is already in use .*--port N"):
            check_port("127.0.0.1", port)
    check_port("127.0.0.1", port)            # free again


def test_one_process_per_role_and_data_dir(tmp_path: Path) -> None:
    holder = subprocess.Popen([sys.executable, "-c", (
        "import sys, time; from pathlib import Path; from pilldrops._internal.serving import lock_data_dir; "
        f"lock_data_dir(Path({str(tmp_path)!r}), 'node'); print('held', flush=True); time.sleep(60)")],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        with pytest.raises(DataDirInUse, match=rf"another PillDrops node \(pid {holder.pid}\) is using the data dir"):
            lock_data_dir(tmp_path, "node")
        fd = lock_data_dir(tmp_path, "control-plane")          # another role on the same dir is fine
        assert lock_data_dir(tmp_path, "control-plane") == fd  # and this process may ask again
        release_data_dir(fd)
    finally:
        holder.kill()
        holder.wait()
    release_data_dir(lock_data_dir(tmp_path, "node"))            # a killed holder releases it


def test_up_refuses_a_busy_port_before_building_anything(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        res = subprocess.run([sys.executable, "-m", "pilldrops", "up", "--port", str(port), "--data-dir",
                              str(tmp_path / "d"), "--templates", "tiny"], capture_output=True, text=True,
                             timeout=60, check=False)
    assert res.returncode == 1 and "Traceback" not in res.stderr
    assert f"port {port} on 127.0.0.1 is already in use" in res.stderr
    assert not (tmp_path / "d" / "templates").exists()


def test_up_and_serve_refuse_a_busy_or_shared_ports_port(tmp_path: Path) -> None:
    """The port-URL listener's port is checked with the others, before anything is built."""
    with socket.socket() as s, socket.socket() as free:
        s.bind(("127.0.0.1", 0))
        s.listen()
        busy = s.getsockname()[1]
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
        free.close()
        for cmd in (["up", "--templates", "tiny"], ["serve"]):
            res = subprocess.run([sys.executable, "-m", "pilldrops", *cmd, "--port", str(port), "--ports-port",
                                  str(busy), "--data-dir", str(tmp_path / cmd[0])], capture_output=True, text=True,
                                 timeout=60, check=False)
            assert res.returncode == 1 and "Traceback" not in res.stderr, res.stderr
            assert f"port {busy} on 127.0.0.1 is already in use" in res.stderr and "--ports-port" in res.stderr
        res = subprocess.run([sys.executable, "-m", "pilldrops", "serve", "--port", str(port), "--ports-port",
                              str(port), "--data-dir", str(tmp_path / "same")], capture_output=True, text=True,
                             timeout=60, check=False)
        assert res.returncode == 1 and "--ports-port" in res.stderr and "same port as --port" in res.stderr
    assert not (tmp_path / "up" / "templates").exists()


def test_one_write_sends_a_ticks_writes_together_and_holds_little() -> None:
    """``OneWrite`` (issue 15): a head and its body written in one loop tick leave as one ``send``;
    more than ``HOLD_MAX`` held goes out at once; ``close`` sends what is held first."""
    import asyncio

    from pilldrops._internal.serving import OneWrite

    class Transport:
        def __init__(self) -> None:
            self.sent: list[bytes] = []
            self.closed = False

        def write(self, data: bytes) -> None:
            self.sent.append(data)

        def is_closing(self) -> bool:
            return self.closed

        def close(self) -> None:
            self.closed = True

        def get_write_buffer_size(self) -> int:
            return 0

    async def main() -> None:
        t = Transport()
        w = OneWrite(t)
        w.write(b"HTTP/1.1 200 OK\r\n\r\n")
        w.write(b"body")
        assert t.sent == [] and w.get_write_buffer_size() == 23
        await asyncio.sleep(0)
        assert t.sent == [b"HTTP/1.1 200 OK\r\n\r\nbody"]
        w.write(b"x" * (OneWrite.HOLD_MAX + 1))
        assert len(t.sent) == 2                      # not held: the transport's flow control applies
        w.write(b"last")
        w.close()
        assert t.sent[-1] == b"last" and t.closed
        await asyncio.sleep(0)
        assert len(t.sent) == 3                      # nothing sent twice, nothing after the close

    asyncio.run(main())
