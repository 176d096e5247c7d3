"""The data plane: run commands and move files in and out of one sandbox, through the runtime's ``exec``.

- ``run`` streams NDJSON ``RunEvent`` lines. Output is capped per stream; past the cap it is still read
  (and dropped) so the command never blocks on a full pipe. A command timeout kills its whole process
  tree and reports exit code 124 with ``timed_out``. If the client goes away, the command is killed.
- Files move as tar streams unpacked or packed by the sandbox's own ``tar`` inside its own root, after the
  node sanitised the stream (``archive.sanitize``): nothing is ever resolved against the host's paths.
"""

from __future__ import annotations

import base64
import tempfile
import time
from collections.abc import AsyncIterable, AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import anyio

from pilldrops import errors
from pilldrops.node.archive import sanitize
from pilldrops.node.cmdline import shell_free_argv
from pilldrops.node.isolation import diskquota
from pilldrops.node.runtime.base import ExecProcess, Handle, Runtime, RuntimeFailure
from pilldrops.schema.api import FileInfo, RunEvent, RunRequest

TIMEOUT_EXIT_CODE = 124
_NOT_FOUND, _IS_DIR = 44, 45
MAX_UPLOAD_BYTES = 8 * 1024**3
MAX_READ_BYTES = 256 * 1024**2
_SPOOL = 8 * 1024**2
_CHUNK = 256 * 1024
_WHOLE = 1024**2          # a sanitised archive up to this size goes to its ``tar`` as bytes (no feed thread)


@dataclass
class Target:
    """What the data plane needs to know of a sandbox."""

    id: str
    handle: Handle
    env: dict[str, str] = field(default_factory=dict)
    workdir: str = "/"
    user: str | None = None      # "uid:gid" that run/process commands run as (a template's USER); None = root
    active: set[ExecProcess] = field(default_factory=set)   # commands in flight (ended by a pause)
    pausing: bool = False
    processes: Any = None        # processes.Table, made on first use (the process service)

    async def end_commands(self, grace_s: float = 5.0) -> None:
        """A pause is coming: kill every command in flight and wait (bounded) until their streams closed."""
        self.pausing = True
        for proc in list(self.active):
            await _kill_quietly(proc)
        with anyio.move_on_after(grace_s):
            while self.active:
                await anyio.sleep(0.01)


def _line(ev: RunEvent) -> bytes:
    return ev.model_dump_json(exclude_none=True).encode() + b"\n"


class Last(bytes):
    """The last chunk of a run stream (its exit line): the HTTP layer sends it with the end of the body,
    in one write (node/api.py ``RunStream``)."""


def _check_path(path: str) -> str:
    if not path.startswith("/") or "\0" in path or len(path) > 4096:
        raise errors.InvalidRequest(f"path must be absolute: {path!r}")
    return path


async def _kill_quietly(proc: ExecProcess) -> None:
    with anyio.CancelScope(shield=True):
        try:
            await proc.kill()
        except Exception:  # noqa: BLE001 - best effort on a path that is already failing
            pass


async def _drain(proc: ExecProcess, limit: int) -> tuple[bytes, bytes, int]:
    out, err = bytearray(), bytearray()
    while (chunk := await proc.read()) is not None:
        buf = out if chunk[0] == "stdout" else err
        if len(buf) + len(chunk[1]) > limit:
            await _kill_quietly(proc)
            raise errors.PayloadTooLarge(f"output is larger than {limit} bytes")
        buf += chunk[1]
    return bytes(out), bytes(err), await proc.wait()


def _disk_free(t: Target) -> int | None:
    """Bytes left on the sandbox's own disk (None: it has none, e.g. a microVM or the fake runtime)."""
    return diskquota.free_bytes(Path(t.handle.bundle)) if t.handle.bundle else None


def _raise_if_full(t: Target, err: bytes, what: str) -> None:
    """A write inside the sandbox failed with ENOSPC: the typed error, with what is left."""
    if b"No space left on device" in err:
        raise errors.DiskQuotaExceeded(f"{what} failed: the sandbox's disk is full",
                                       details={"free_bytes": _disk_free(t)})


async def _file_chunks(f: IO[bytes], first: bytes = b"") -> AsyncIterator[bytes]:
    if first:
        yield first
    while chunk := f.read(_CHUNK):
        yield chunk


def _whole_or_chunks(f: IO[bytes]) -> bytes | AsyncIterator[bytes]:
    """The rest of ``f`` as bytes when it is small (``_WHOLE``: a command gets bytes without a thread
    pulling a stream for it), else as chunks."""
    head = f.read(_WHOLE + 1)
    return head if len(head) <= _WHOLE else _file_chunks(f, head)


async def _next_part(it: AsyncIterator[bytes]) -> bytes | None:
    async for chunk in it:
        if chunk:
            return chunk
    return None


async def _whole_or_streamed(body: AsyncIterable[bytes]) -> bytes | AsyncIterator[bytes]:
    """``body`` as bytes when it came whole in one part (most writes: the server's first message holds it),
    which the command gets without a thread pulling the stream for it; else the stream, read on from where
    this left off (its first two parts held here meanwhile: a server's messages, not the body)."""
    it = body.__aiter__()
    first = await _next_part(it)
    if first is None:
        return b""
    second = await _next_part(it)
    if second is None:
        return first

    async def rest() -> AsyncIterator[bytes]:
        yield first
        yield second
        async for chunk in it:
            yield chunk

    return rest()


class _Feed:
    """A streamed body as a command's stdin (``write_file``'s request body). The runtime pulls it from a
    thread of its own, which can only stop feeding when the body fails (the client went away mid-body, a
    bound was passed): the command would then wait for the rest of its stdin for ever (pd-init's stdin is
    never closed) or end with what it had, as if the body were whole. So the failure is kept here, the
    command killed at once, and ``DataPlane._sh`` raises it in place of the command's result."""

    def __init__(self, body: AsyncIterable[bytes]) -> None:
        self._it = body.__aiter__()
        self.error: Exception | None = None
        self._proc: ExecProcess | None = None

    def __aiter__(self) -> _Feed:
        return self

    async def __anext__(self) -> bytes:
        try:
            return await self._it.__anext__()
        except StopAsyncIteration:
            raise
        except Exception as exc:
            self.error = exc
            if self._proc is not None:
                await _kill_quietly(self._proc)
            raise

    async def feeding(self, proc: ExecProcess) -> None:
        """The command now being fed (killed now if the body already failed while it started)."""
        self._proc = proc
        if self.error is not None:
            await _kill_quietly(proc)


class DataPlane:
    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime

    async def _exec(self, t: Target, argv: list[str], *, env: dict[str, str] | None = None,
                    cwd: str | None = None, stdin: AsyncIterable[bytes] | bytes | None = None,
                    timeout: float | None = None, output_cap: int | None = None,
                    as_user: bool = False, pid_late: bool = False) -> ExecProcess:
        """``as_user``: as the template's user (the user's own commands); file transfers stay root.
        ``pid_late``: nothing here waits for the command's pid (see ``Runtime.exec``)."""
        if t.pausing:
            raise errors.InvalidState(f"sandbox {t.id} is being paused", current="pausing", target="running")
        try:
            proc = await self.runtime.exec(t.handle, argv, env={**t.env, **(env or {})}, cwd=cwd or t.workdir,
                                           stdin=stdin, timeout=timeout, output_cap=output_cap,
                                           pid_late=pid_late, **({"user": t.user} if as_user and t.user else {}))
        except RuntimeFailure as exc:   # e.g. its init just died and the monitor has not noticed yet
            raise errors.InvalidState(f"sandbox {t.id} cannot run commands: {exc.message}",
                                      current="stopped", target="running") from exc
        t.active.add(proc)
        if t.pausing:            # a pause began while it was starting: it must not run into the checkpoint
            await _kill_quietly(proc)
            t.active.discard(proc)
            raise errors.InvalidState(f"sandbox {t.id} is being paused", current="pausing", target="running")
        return proc

    async def _sh(self, t: Target, script: str, *args: str, stdin: AsyncIterable[bytes] | bytes | None = None,
                  limit: int = MAX_READ_BYTES) -> tuple[bytes, bytes, int]:
        feed = None if stdin is None or isinstance(stdin, bytes) else _Feed(stdin)
        proc = await self._exec(t, ["/bin/sh", "-c", script, "sh", *args], stdin=feed or stdin)
        try:
            if feed is not None:
                await feed.feeding(proc)
            out = await _drain(proc, limit)
        except BaseException:
            await _kill_quietly(proc)
            raise
        finally:
            t.active.discard(proc)
        if feed is not None and feed.error is not None:
            raise feed.error             # not the result of a command that was fed part of its stdin
        if t.pausing:
            raise errors.InvalidState(f"sandbox {t.id} was paused during the transfer", current="pausing",
                                      target="running")
        return out

    # ---- run -----------------------------------------------------------------------------------------

    async def run(self, t: Target, req: RunRequest) -> AsyncIterator[bytes]:
        if isinstance(req.cmd, str):      # a plain command line runs without the shell (same semantics)
            argv = shell_free_argv(req.cmd) or ["/bin/sh", "-c", req.cmd]
        else:
            argv = list(req.cmd)
        if req.cwd is not None:
            _check_path(req.cwd)
        started = time.monotonic()
        ooms = self._oom_kills(t)
        # The runtime enforces the timeout and the output cap itself, so neither depends on how fast
        # (or whether) the client reads the stream.
        proc = await self._exec(t, argv, env=req.envs, cwd=req.cwd,
                                stdin=req.stdin.encode() if req.stdin is not None else None,
                                timeout=req.timeout, output_cap=req.max_output_bytes, as_user=True,
                                pid_late=True)
        return self._stream(t, proc, started, ooms)

    def _oom_kills(self, t: Target) -> int | None:
        fn = getattr(self.runtime, "oom_kills", None)
        return fn(t.handle) if fn is not None else None

    async def _stream(self, t: Target, proc: ExecProcess, started: float,
                      ooms: int | None = None) -> AsyncIterator[bytes]:
        finished = False
        # The start line goes out with the next one (the first output, or the exit): a command that
        # writes nothing is answered in one write, and the client wakes once for its whole body. It is made
        # then, not now: with ``pid_late`` the init sends the pid with that first output or exit.
        started_sent = False

        def start() -> bytes:
            nonlocal started_sent
            if started_sent:
                return b""
            started_sent = True
            return _line(RunEvent(type="start", pid=proc.pid))
        try:
            while (chunk := await proc.read()) is not None:
                yield start() + _line(RunEvent(type=chunk[0], data=base64.b64encode(chunk[1]).decode()))
            code = await proc.wait()
            finished = True
            t.active.discard(proc)
            # SIGKILLed while the memory cgroup's kill count grew: the limit killed it (or its child)
            oom = (code == 128 + 9 and not proc.timed_out and not t.pausing and ooms is not None
                   and (self._oom_kills(t) or 0) > ooms)
            yield Last(start() + _line(RunEvent(
                type="exit", exit_code=TIMEOUT_EXIT_CODE if proc.timed_out else code,
                duration=round(time.monotonic() - started, 6), truncated=proc.truncated, timed_out=proc.timed_out,
                paused=True if t.pausing else None, oom_killed=True if oom else None)))
        finally:
            t.active.discard(proc)
            if not finished:      # the client went away or the stream failed: never leave the command
                await _kill_quietly(proc)

    # ---- archives ------------------------------------------------------------------------------------

    async def put_archive(self, t: Target, dest: str, body: AsyncIterable[bytes], *,
                          declared: int | None = None) -> int:
        """``body`` (a tar stream, its ``declared`` length if known) unpacked under ``dest``; refused past
        ``MAX_UPLOAD_BYTES`` by its declared length before any of it is read, and as it arrives."""
        _check_path(dest)
        if declared is not None and declared > MAX_UPLOAD_BYTES:
            raise errors.PayloadTooLarge(f"upload is larger than {MAX_UPLOAD_BYTES} bytes")
        with tempfile.SpooledTemporaryFile(_SPOOL) as raw, tempfile.SpooledTemporaryFile(_SPOOL) as clean:
            size = 0
            async for chunk in body:
                size += len(chunk)
                if size > MAX_UPLOAD_BYTES:
                    raise errors.PayloadTooLarge(f"upload is larger than {MAX_UPLOAD_BYTES} bytes")
                raw.write(chunk)
            raw.seek(0)
            free = _disk_free(t)
            count = await anyio.to_thread.run_sync(lambda: sanitize(raw, clean, max_bytes=free))
            clean.seek(0)
            _, err, code = await self._sh(t, 'mkdir -p "$1" && exec tar -x -f - -C "$1"', dest,
                                          stdin=_whole_or_chunks(clean))
        if code != 0:
            _raise_if_full(t, err, f"unpacking into {dest}")
            raise errors.InvalidRequest(f"unpacking into {dest} failed: {err.decode(errors='replace').strip()}")
        return count

    async def get_archive(self, t: Target, path: str) -> AsyncIterator[bytes]:
        """Checks the path first (so a missing one is a 404 before any byte is sent), then streams."""
        _check_path(path)
        script = ('[ -e "$1" ] || [ -L "$1" ] || exit 44; d=$(dirname "$1"); b=$(basename "$1"); '
                  'case "$b" in -*) b="./$b";; esac; cd "$d" && exec tar -c -f - "$b"')
        proc = await self._exec(t, ["/bin/sh", "-c", script, "sh", path])
        first: list[bytes] = []
        while (chunk := await proc.read()) is not None:
            if chunk[0] == "stdout":
                first.append(chunk[1])
                break
        if not first:
            code = await proc.wait()
            t.active.discard(proc)
            if code == _NOT_FOUND:
                raise errors.FileNotFound(f"{path} does not exist in the sandbox")
            if code != 0:
                raise errors.ServerError(f"packing {path} failed with exit code {code}")

        async def rest() -> AsyncIterator[bytes]:
            done = False
            try:
                for b in first:
                    yield b
                while (chunk := await proc.read()) is not None:
                    if chunk[0] == "stdout":
                        yield chunk[1]
                await proc.wait()
                done = True
            finally:
                t.active.discard(proc)
                if not done:
                    await _kill_quietly(proc)

        return rest()

    # ---- single files --------------------------------------------------------------------------------

    async def read_file(self, t: Target, path: str) -> bytes:
        _check_path(path)
        out, err, code = await self._sh(t, '[ -d "$1" ] && exit 45; [ -f "$1" ] || exit 44; exec cat "$1"',
                                        path)
        if code == _NOT_FOUND:
            raise errors.FileNotFound(f"{path} does not exist in the sandbox")
        if code == _IS_DIR:
            raise errors.InvalidRequest(f"{path} is a directory")
        if code != 0:
            raise errors.ServerError(f"reading {path} failed: {err.decode(errors='replace').strip()}")
        return out

    async def write_file(self, t: Target, path: str, body: AsyncIterable[bytes]) -> FileInfo:
        _check_path(path)
        # one exec writes and stats (a second crun exec would cost ~7 ms more per write)
        out, err, code = await self._sh(t, 'mkdir -p "$(dirname "$1")" && cat > "$1" && stat -c "$2" "$1"', path,
                                        _STAT_FORMAT, stdin=await _whole_or_streamed(body))
        if code != 0:
            _raise_if_full(t, err, f"writing {path}")
            raise errors.InvalidRequest(f"writing {path} failed: {err.decode(errors='replace').strip()}")
        return _parse_stat(out)[0]

    async def list_dir(self, t: Target, path: str) -> list[FileInfo]:
        _check_path(path)
        return await self._stat(t, path, listing=True)

    async def _stat(self, t: Target, path: str, *, listing: bool) -> list[FileInfo]:
        if listing:
            script = ('[ -d "$1" ] || exit 44; for f in "$1"/* "$1"/.[!.]* "$1"/..?*; do '
                      '[ -e "$f" ] || [ -L "$f" ] || continue; stat -c "$2" "$f"; done')
        else:
            script = '[ -e "$1" ] || [ -L "$1" ] || exit 44; stat -c "$2" "$1"'
        out, err, code = await self._sh(t, script, path, _STAT_FORMAT)
        if code == _NOT_FOUND:
            raise errors.FileNotFound(f"{path} is not a directory in the sandbox" if listing
                                      else f"{path} does not exist in the sandbox")
        if code != 0:
            raise errors.ServerError(f"stat of {path} failed: {err.decode(errors='replace').strip()}")
        return _parse_stat(out)


_STAT_FORMAT = "%F|%s|%a|%Y|%n"


def _parse_stat(out: bytes) -> list[FileInfo]:
    items = []
    for line in out.decode(errors="replace").splitlines():
        parts = line.split("|", 4)
        if len(parts) != 5 or not parts[1].isdigit():
            continue          # a name with a newline in it: not representable in this listing
        kind, size, mode, mtime, name = parts
        ftype = ("file" if kind.startswith("regular") else "dir" if kind == "directory"
                 else "symlink" if kind == "symbolic link" else "other")
        full = name.replace("//", "/")
        items.append(FileInfo(name=full.rsplit("/", 1)[-1], path=full, type=ftype, size=int(size),
                              mode=int(mode, 8), mtime=float(mtime)))
    return items

