"""`pilldrops up`'s node agent as a child process (``pilldrops node``), so the control plane and the agent
run on two interpreters (two cores) instead of sharing one GIL.

The child dies with its parent (``PR_SET_PDEATHSIG``, set by the child itself: :func:`die_with_parent`), so
a SIGKILLed ``up`` leaves what a SIGKILLed one-process ``up`` left: running sandboxes, which the next start
re-adopts. The child is in its own session, so a terminal's Ctrl-C reaches ``up`` only, which then stops
the agent (SIGTERM: it tears its sandboxes down and reports them while the control plane still listens)
before the control plane. An agent that dies on its own is restarted (it re-adopts its sandboxes), unless
it keeps dying.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import anyio
import anyio.abc

log = logging.getLogger("pilldrops.up")
PARENT_ENV = "PILLDROPS_PARENT_PID"
TOKEN_ENV = "PILLDROPS_NODE_TOKEN"
_PR_SET_PDEATHSIG = 1
REGISTER_TIMEOUT_S = 300.0      # recovery re-adopts every sandbox before the agent registers
STOP_TIMEOUT_S = 900.0          # tearing down thousands of sandboxes
RESTARTS = 5                    # deaths within RESTART_WINDOW_S after which `up` gives up
RESTART_WINDOW_S = 60.0


def die_with_parent() -> None:
    """In ``pilldrops node`` started by ``up``: be SIGKILLed when ``up`` dies (however it dies). Exits at
    once when ``up`` is already gone. No-op for a node agent started on its own."""
    want = os.environ.pop(PARENT_ENV, None)
    if not want:
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG)")
    if os.getppid() != int(want):       # it died before the prctl: follow it now
        os._exit(1)


def _aware(t: datetime) -> datetime:
    return t if t.tzinfo else t.replace(tzinfo=UTC)


class NodeChild:
    def __init__(self, argv: list[str], token: str) -> None:
        self.argv = [sys.executable, "-m", "pilldrops", "node", *argv]
        self.token = token
        self.proc: anyio.abc.Process | None = None
        self.failed: str | None = None
        self.on_lost: Callable[[], Any] = lambda: None
        self._stopping = False
        self._deaths: list[float] = []

    async def _spawn(self) -> anyio.abc.Process:
        env = {**os.environ, TOKEN_ENV: self.token, PARENT_ENV: str(os.getpid())}
        self.proc = await anyio.open_process(self.argv, stdin=subprocess.DEVNULL, stdout=None, stderr=None,
                                             env=env, start_new_session=True)
        return self.proc

    async def start_and_wait_registered(self, store: Any, name: str, url: str,
                                        tg: anyio.abc.TaskGroup) -> Any:
        """Start the agent and return its node row once it has registered with the control plane (the
        row's heartbeat is newer than the start); raises ``RuntimeError`` when it exits first."""
        t0 = datetime.now(UTC)
        proc = await self._spawn()
        with anyio.fail_after(REGISTER_TIMEOUT_S):
            while True:
                if proc.returncode is not None:
                    raise RuntimeError(f"the node agent exited with code {proc.returncode} before it registered "
                                       "(its error is above)")
                node = await store.node_by_id_or_name(name)
                if (node is not None and node.url == url and node.state == "ready"
                        and _aware(node.last_heartbeat_at) >= t0):
                    break
                await anyio.sleep(0.05)
        tg.start_soon(self._watch)
        return node

    async def _watch(self) -> None:
        while True:
            assert self.proc is not None
            code = await self.proc.wait()
            if self._stopping:
                return
            now = time.monotonic()
            self._deaths = [t for t in self._deaths if now - t < RESTART_WINDOW_S] + [now]
            if len(self._deaths) > RESTARTS:
                self.failed = (f"the node agent died {len(self._deaths)} times in {RESTART_WINDOW_S:.0f} s "
                               f"(last exit code {code}); stopping")
                log.error("%s", self.failed)
                self.on_lost()
                return
            log.warning("the node agent exited with code %s; restarting it (it re-adopts its sandboxes)", code)
            await anyio.sleep(1.0)
            if self._stopping:
                return
            await self._spawn()

    async def stop(self) -> None:
        """SIGTERM the agent and wait for its teardown (SIGKILL after ``STOP_TIMEOUT_S``)."""
        self._stopping = True
        proc = self.proc
        if proc is None or proc.returncode is not None:
            return
        proc.send_signal(signal.SIGTERM)
        with anyio.move_on_after(STOP_TIMEOUT_S):
            code = await proc.wait()
            if code != 0:
                self.failed = f"the node agent exited with code {code} while stopping"
            return
        self.failed = f"the node agent did not stop within {STOP_TIMEOUT_S:.0f} s; killed it"
        await self.kill()

    async def kill(self) -> None:
        self._stopping = True
        proc = self.proc
        if proc is not None and proc.returncode is None:
            proc.kill()
            await proc.wait()
