"""Running the agent's own tools (crun, runsc, the CRIU userland) as child processes, cheaply (issue 15).

``anyio.run_process`` goes through asyncio's subprocess machinery: a transport with a protocol per pipe and a
child-watcher thread per process. Measured on the dev box (asyncio, ``/bin/true``): ~1.2 ms of the agent's
CPU per run with pipes, ~0.8 ms with /dev/null; ``run`` here takes ~0.3 ms. It starts the child with
``subprocess.Popen`` (vfork + exec, every other fd closed, signal dispositions restored, no pipes), waits
until the child's pidfd (``os.pidfd_open``) becomes readable with ``anyio.wait_readable`` (any anyio backend;
no thread, no SIGCHLD handler) and then reaps it.

- Captured output (``CAPTURE``) goes to a memfd, not a pipe: a descendant that keeps the child's stdio (``crun
  run --detach`` hands its own to the sandbox's init) never holds the wait open, and the child never blocks
  on a full pipe. What is read back is bounded: the first ``stdout_cap`` bytes of stdout, the last
  ``stderr_cap`` bytes of stderr (an error message ends there), ``truncated`` when something was dropped.
  The programs run here are the agent's own tools, not sandbox input; the bound holds all the same.
- Cancellation SIGKILLs the child and reaps it (that wait is shielded) before the cancellation goes on: no
  zombie, no child left running. A caller whose tool must not be interrupted shields the call itself.
- A program that cannot be started raises ``SpawnError`` (an ``OSError`` with its errno) naming it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from typing import IO

import anyio
import anyio.to_thread

CAPTURE = subprocess.PIPE        # read back from a memfd after the child ended (never a pipe)
DEVNULL = subprocess.DEVNULL
STDOUT = subprocess.STDOUT       # stderr only: into the same place as stdout
STDOUT_CAP = 16 << 20            # bytes of stdout kept (``crun list`` of thousands of sandboxes fits)
STDERR_CAP = 64 << 10            # bytes of stderr kept (its end)

Target = int | IO[bytes] | IO[str] | None
_null_fd: int | None = None


class SpawnError(OSError):
    """The program could not be started (not found, not executable, ...) or watched."""


@dataclass(frozen=True, slots=True)
class Completed:
    args: list[str]
    returncode: int          # negative: killed by that signal (``subprocess``'s convention)
    stdout: bytes = b""
    stderr: bytes = b""
    truncated: bool = False  # captured output past its cap was dropped


def _null() -> int:
    """One /dev/null fd for every child's stdin (and DEVNULL outputs), opened once."""
    global _null_fd
    if _null_fd is None:
        _null_fd = os.open(os.devnull, os.O_RDWR | os.O_CLOEXEC)
    return _null_fd


def _read_back(fd: int, cap: int, *, tail: bool) -> tuple[bytes, bool]:
    """At most ``cap`` bytes of what the child wrote into the memfd ``fd`` (its end when ``tail``)."""
    size = os.fstat(fd).st_size
    want = min(size, cap)
    offset = size - want if tail else 0
    chunks, got = [], 0
    while got < want:
        chunk = os.pread(fd, want - got, offset + got)
        if not chunk:
            break
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks), size > cap


async def run(argv: Sequence[str], *, stdout: Target = CAPTURE, stderr: Target = CAPTURE,
              stdout_cap: int = STDOUT_CAP, stderr_cap: int = STDERR_CAP) -> Completed:
    """Run ``argv`` (stdin /dev/null) to its end. ``stdout``/``stderr``: ``CAPTURE`` (the default),
    ``DEVNULL``, a file (object or fd) the caller owns, or for ``stderr`` also ``STDOUT``."""
    args = [os.fspath(a) for a in argv]
    out_fd = os.memfd_create("pd-stdout", os.MFD_CLOEXEC) if stdout == CAPTURE else None
    try:
        err_fd = os.memfd_create("pd-stderr", os.MFD_CLOEXEC) if stderr == CAPTURE else None
        try:
            try:
                proc = subprocess.Popen(  # noqa: ASYNC220 - vfork + exec: returns once the child runs
                    args, stdin=_null(), close_fds=True,
                    stdout=out_fd if out_fd is not None else _null() if stdout == DEVNULL else stdout,
                    stderr=err_fd if err_fd is not None else _null() if stderr == DEVNULL else stderr)
            except OSError as e:
                raise SpawnError(e.errno, f"cannot run {args[0]}: {e.strerror or e}") from e
            code = await _wait(proc)
            out, cut_out = _read_back(out_fd, stdout_cap, tail=False) if out_fd is not None else (b"", False)
            err, cut_err = _read_back(err_fd, stderr_cap, tail=True) if err_fd is not None else (b"", False)
        finally:
            if err_fd is not None:
                os.close(err_fd)
    finally:
        if out_fd is not None:
            os.close(out_fd)
    return Completed(args, code, out, err, cut_out or cut_err)


async def _wait(proc: subprocess.Popen[bytes]) -> int:
    """The exit status of ``proc``, reaped; cancelled: ``proc`` is killed and reaped first."""
    try:
        pidfd = os.pidfd_open(proc.pid)
    except OSError as e:            # no fd left for it: the child cannot be watched, so it goes
        proc.kill()
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(proc.wait)
        raise SpawnError(e.errno, f"cannot watch {proc.args!r}: {e.strerror or e}") from e
    try:
        try:
            await anyio.wait_readable(pidfd)
        except BaseException:
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(pidfd, signal.SIGKILL)
            with anyio.CancelScope(shield=True):
                await anyio.wait_readable(pidfd)
            proc.wait()
            raise
    finally:
        os.close(pidfd)
    return proc.wait()             # it has exited: waitpid returns at once
