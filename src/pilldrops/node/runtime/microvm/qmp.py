"""A minimal blocking QMP client (QEMU's JSON control socket): greeting, ``qmp_capabilities``, commands.

Lines are bounded (``MAX_LINE``); events are skipped. Used from worker threads (``anyio.to_thread``).
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Callable
from typing import Any

MAX_LINE = 1024 * 1024


class QmpError(Exception):
    pass


class Qmp:
    def __init__(self, connect: Callable[[socket.socket], None], *, timeout: float = 5.0) -> None:
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        self._sock.settimeout(timeout)
        self._buf = bytearray()
        self._id = 0
        try:
            connect(self._sock)
            greeting = self._read()
            if "QMP" not in greeting:
                raise QmpError(f"not a QMP greeting: {str(greeting)[:200]}")
            self.cmd("qmp_capabilities")
        except (OSError, QmpError, ValueError) as e:
            self._sock.close()
            raise QmpError(f"QMP connect failed: {e}") from e

    def _read(self) -> dict[str, Any]:
        while b"\n" not in self._buf:
            if len(self._buf) > MAX_LINE:
                raise QmpError("QMP line too long")
            part = self._sock.recv(65536)
            if not part:
                raise QmpError("QMP connection closed")
            self._buf += part
        i = self._buf.index(b"\n")
        line = bytes(self._buf[:i])
        del self._buf[:i + 1]
        return json.loads(line)

    def cmd(self, name: str, args: dict[str, Any] | None = None, *, timeout: float | None = None) -> Any:
        self._id += 1
        msg: dict[str, Any] = {"execute": name, "id": self._id}
        if args:
            msg["arguments"] = args
        if timeout is not None:
            self._sock.settimeout(timeout)
        try:
            self._sock.sendall(json.dumps(msg).encode() + b"\n")
            while True:
                r = self._read()
                if r.get("id") != self._id:
                    continue                      # an event, or a late reply
                if "error" in r:
                    raise QmpError(f"{name}: {r['error'].get('desc', r['error'])}")
                return r.get("return")
        except (OSError, ValueError) as e:
            raise QmpError(f"{name}: {e}") from e

    def wait_status(self, want: set[str], timeout: float, *, fail: set[str] | None = None) -> str:
        deadline = time.monotonic() + timeout
        while True:
            st = self.cmd("query-status")["status"]
            if st in want:
                return st
            if fail and st in fail:
                raise QmpError(f"VM status {st}")
            if time.monotonic() > deadline:
                raise QmpError(f"VM status still {st} after {timeout:.1f} s")
            time.sleep(0.01)

    def migrate_to(self, command: str, timeout: float) -> None:
        """Stop the VM and write its state with ``migrate exec:<command>``; returns once completed."""
        self.cmd("stop")
        self.cmd("migrate", {"uri": f"exec:{command}"})
        deadline = time.monotonic() + timeout
        while True:
            info = self.cmd("query-migrate")
            st = info.get("status")
            if st == "completed":
                return
            if st in ("failed", "cancelled"):
                raise QmpError(f"migrate {st}: {info.get('error-desc', '')}")
            if time.monotonic() > deadline:
                raise QmpError(f"migrate still {st} after {timeout:.1f} s")
            time.sleep(0.01)

    def close(self) -> None:
        self._sock.close()
