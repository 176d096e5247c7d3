"""envd PTYs through the stock ``e2b`` client: a real terminal in the sandbox, its size and resize, Ctrl-C
delivered through the terminal, the exit code."""

from __future__ import annotations

import time

import pytest

from tests.e2b.envd_fixtures import *

pytestmark = pytest.mark.integration


def test_pty_create_resize_ctrl_c_exit(e2b_debug):  # type: ignore[no-untyped-def]
    from e2b import CommandExitException
    from e2b.sandbox.commands.command_handle import PtySize
    sb = e2b_debug
    h = sb.pty.create(PtySize(rows=30, cols=100))
    assert h.pid in [p.pid for p in sb.commands.list()]
    sb.pty.send_stdin(h.pid, b"tty; stty size\n")
    time.sleep(1.0)
    sb.pty.resize(h.pid, PtySize(rows=40, cols=120))
    sb.pty.send_stdin(h.pid, b"stty size; sleep 100\n")
    time.sleep(1.0)
    sb.pty.send_stdin(h.pid, b"\x03")
    sb.pty.send_stdin(h.pid, b"echo rc-$?; exit 7\n")
    out: list[bytes] = []
    with pytest.raises(CommandExitException) as ei:
        h.wait(on_pty=lambda d: out.append(bytes(d)))
    text = b"".join(out).decode(errors="replace")
    assert ei.value.exit_code == 7
    assert "/dev/pts/" in text and "30 100" in text and "40 120" in text and "rc-130" in text


def test_pty_kill_and_connect(e2b_debug):  # type: ignore[no-untyped-def]
    from e2b.sandbox.commands.command_handle import PtySize
    sb = e2b_debug
    h = sb.pty.create(PtySize(rows=24, cols=80))
    h.disconnect()
    h2 = sb.pty.connect(h.pid)
    sb.pty.send_stdin(h.pid, b"echo again\n")
    assert sb.pty.kill(h.pid) is True
    from e2b import CommandExitException
    with pytest.raises(CommandExitException):
        h2.wait()
    assert h.pid not in [p.pid for p in sb.commands.list()]
