"""Wire shapes of the data plane's process service (``/v1/sandboxes/{id}/processes``, docs/api.md).

A process started here outlives the request that started it: it runs until it exits, its ``timeout`` fires,
it is killed, or the sandbox ends (or is paused: commands in flight end at a pause). Its output streams as
NDJSON ``ProcessEvent`` lines to every attached reader and the newest part of it is retained (bounded) for
``/output`` and later readers.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore")


class PtySize(_Model):
    rows: int = Field(24, ge=1, le=0xFFFF)
    cols: int = Field(80, ge=1, le=0xFFFF)


class ProcessStartRequest(_Model):
    cmd: str | list[str] = Field(..., description="a shell command line (run by /bin/sh -c) or an argv")
    envs: dict[str, str] = Field(default_factory=dict)
    cwd: str | None = None
    tag: str | None = Field(None, max_length=256)
    stdin: bool = False                 # keep a stdin pipe open for /stdin (a PTY always has one)
    pty: PtySize | None = None          # run the command on a new terminal of this size
    timeout: float | None = Field(None, gt=0, description="seconds, then the process tree is killed")


class ProcessInfo(_Model):
    pid: int                            # the process's pid inside the sandbox
    tag: str | None = None
    cmd: list[str]
    envs: dict[str, str] = Field(default_factory=dict)
    cwd: str | None = None
    pty: bool = False
    stdin: bool = False                 # stdin is still open
    running: bool = True
    exit_code: int | None = None        # 128+N when it was killed by signal N
    signal: int | None = None           # the signal that ended it, when one of ours did
    timed_out: bool = False
    started_at: float                   # unix time
    ended_at: float | None = None
    output_bytes: int = 0               # bytes it wrote in all
    dropped_bytes: int = 0              # of those, bytes no longer retained (the retention is bounded)


class ProcessEvent(_Model):
    """One NDJSON line of a process stream. ``data`` is base64."""

    type: Literal["start", "stdout", "stderr", "pty", "exit", "error"]
    pid: int | None = None
    tag: str | None = None
    data: str | None = None
    exit_code: int | None = None
    signal: int | None = None
    timed_out: bool | None = None
    code: str | None = None
    message: str | None = None


class ProcessOutput(_Model):
    """What a process wrote that is still retained (oldest first), for ``sandbox logs``."""

    pid: int
    events: list[ProcessEvent]
    dropped_bytes: int = 0
    running: bool = True
    exit_code: int | None = None


class SignalRequest(_Model):
    signal: int | str = Field(..., description="a number or a name: 15, 'TERM', 'SIGTERM'")


class ResizeRequest(PtySize):
    pass
