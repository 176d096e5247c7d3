"""The runtime seam: what the node agent needs from an isolation backend (crun, fake, later qemu).

The agent never knows which driver it holds. A driver owns everything about *how* a sandbox is isolated
(rootfs, cgroups, namespaces, seccomp); the agent owns *what* runs and when (deadlines, caps, journal).

Contract every driver keeps (``tests/contract/`` runs it on each runtime in its ``RUNTIMES`` registry):
- ``create`` returns only once the sandbox's init is running; on any failure it leaves nothing behind
  and raises ``RuntimeFailure``.
- Sandbox processes are never children of the agent: killing the agent leaves them running.
- ``exec`` runs a command inside the sandbox with all of its restrictions; output arrives in chunks;
  ``ExecProcess.kill`` kills the command's whole process tree.
- ``destroy`` is idempotent and removes every process, mount, cgroup and state file of the sandbox.
- ``state`` derives the truth from facts (runtime state, pid + start time), never from memory alone.
"""

from __future__ import annotations

import weakref
from collections.abc import AsyncIterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Protocol


class RuntimeFailure(Exception):
    """A runtime operation failed; ``detail`` carries the runtime's own words (stderr, log)."""

    def __init__(self, message: str, *, detail: str = "") -> None:
        super().__init__(f"{message}: {detail}" if detail else message)
        self.message = message
        self.detail = detail


@dataclass(frozen=True)
class SandboxSpec:
    id: str
    layers: tuple[Path, ...]           # read-only template layers, top first (overlay lowerdir order)
    vcpu: float = 1.0
    memory_mb: int = 512
    pids_limit: int = 1024
    envs: dict[str, str] = field(default_factory=dict)
    workdir: str = "/"
    hostname: str = "sandbox"
    isolation: str = "container"       # which runtime of the node's registry runs it (registry.py)
    disk_mb: int | None = None         # writable layer limit in MiB (None: none; the agent always sets one)
    user: str | None = None            # "uid:gid" its commands run as (a template's USER); None = root


@dataclass
class Handle:
    """What the agent persists per sandbox so that it (or a restarted agent) can find it again."""

    id: str
    pid: int | None = None
    pid_start_time: int | None = None   # /proc/<pid>/stat field 22, guards against pid reuse
    bundle: str = ""
    extra: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class RuntimeState:
    status: Literal["running", "stopped", "gone"]
    pid: int | None = None
    oom_killed: bool = False
    exit_code: int | None = None


StreamName = Literal["stdout", "stderr"]


class ExecProcess(Protocol):
    pid: int | None
    timed_out: bool     # the exec's timeout fired and killed the tree
    truncated: bool     # output past output_cap was dropped

    async def read(self) -> tuple[StreamName, bytes] | None:
        """Next output chunk from either stream, or None once both are at EOF."""

    async def wait(self) -> int:
        """Exit code; 128+N when killed by signal N."""

    async def kill(self) -> None:
        """Kill the command's whole process tree (idempotent)."""


class Runtime(Protocol):
    name: str

    async def create(self, spec: SandboxSpec) -> Handle: ...

    async def exec(self, handle: Handle, argv: list[str], *, env: dict[str, str], cwd: str | None,
                   stdin: AsyncIterable[bytes] | bytes | None = None, timeout: float | None = None,
                   output_cap: int | None = None, user: str | None = None,
                   pid_late: bool = False) -> ExecProcess:
        """``timeout`` kills the tree after that many seconds even if nobody reads; ``output_cap`` bounds
        each stream (the rest is read and dropped); ``user`` ("uid:gid") is who runs it (default root);
        ``pid_late``: nothing waits for the command's pid (a run), so the driver may learn it with the
        first output or the exit, at most a few ms late (pd-init's flag 8: one wake-up fewer)."""

    async def state(self, handle: Handle) -> RuntimeState: ...

    def running_by_pid(self, handle: Handle) -> bool:
        """A cheap check for the monitor's tick over every live sandbox: True when ``state`` would answer
        running; False means "ask ``state``" (a runtime without a cheaper way always answers False)."""

    async def destroy(self, handle: Handle) -> None: ...

    async def list_ids(self) -> list[str]:
        """Ids of every sandbox this runtime instance currently holds (for reaping and leak checks)."""

    # optional: ``oom_kills(handle) -> int | None``, how many processes the sandbox's memory limit has killed
    # so far (None: this runtime cannot tell cheaply); a run that exits 137 while it grew was OOM-killed

    # -- pause / resume (issue 6) ---------------------------------------------------------------------
    def checkpoint_unsupported(self) -> str | None:
        """None when ``checkpoint``/``restore`` work on this host, else why not (shown to users)."""

    async def checkpoint(self, handle: Handle, image_dir: Path) -> int:
        """Write the sandbox's whole process tree with its memory, and its writable layer, into
        ``image_dir`` (created by the caller, empty), then remove its processes, cgroup and mounts exactly
        as ``destroy`` would: a checkpointed sandbox holds no RAM. Returns the image's size in bytes.

        The caller guarantees no ``exec`` is in flight (the agent ends them first). On failure the sandbox
        keeps running untouched and ``RuntimeFailure`` is raised.
        """

    async def restore(self, spec: SandboxSpec, image_dir: Path) -> Handle:
        """Bring a checkpointed sandbox back from ``image_dir`` (possibly written on another node with the
        same template layers): processes with their memory, open files, cwd and in-sandbox pids, and the
        writable layer. ``spec`` is the sandbox's original spec (same id). Returns the new handle; the
        image may be deleted afterwards. On failure nothing of the sandbox is left running and the image
        is intact, so restore can be retried."""

    # optional: ``abort_restore(handle, image_dir)``, undo a ``restore`` the agent did not see to its end (it
    # was killed while resuming): like ``destroy``, but a writable layer the restore had taken out of
    # ``image_dir`` (or one a checkpoint kept in the sandbox dir) goes back into it, so the image can be
    # restored again. A runtime whose restore leaves the image intact needs none (see ``abort_restore``).

    # optional: ``kept_layer(sandbox_id) -> Path | None``, the writable layer (a file or a directory) that a
    # checkpoint of ``sandbox_id`` could not move into its image and kept outside it (``restore`` resumes
    # with it; ``destroy`` of the id removes it); None when the image holds the whole sandbox


def kept_layer(runtime: Runtime, sandbox_id: str) -> Path | None:
    """``runtime.kept_layer`` where the runtime has one, else None (its images are whole)."""
    fn = getattr(runtime, "kept_layer", None)
    return fn(sandbox_id) if fn is not None else None


async def abort_restore(runtime: Runtime, handle: Handle, image_dir: Path) -> None:
    """``runtime.abort_restore`` where the runtime has one, else ``destroy`` (its image is intact)."""
    fn = getattr(runtime, "abort_restore", None)
    if fn is None:
        await runtime.destroy(handle)
    else:
        await fn(handle, image_dir)


class _Env(dict):   # type: ignore[type-arg]
    """A shared environment (a dict that a weak table can hold)."""
    __slots__ = ("__weakref__",)


_ENVS: weakref.WeakValueDictionary[tuple[tuple[str, str], ...], _Env] = weakref.WeakValueDictionary()


def shared_env(env: dict[str, str]) -> dict[str, str]:
    """One dict for every live sandbox with the same environment (most of a template's sandboxes): the
    node keeps a sandbox's env for each command it runs, ~0.4 KiB a copy (bench/RESULTS.md, issue 15
    session 7). Callers only read it (a command's env is a new ``{**env, **extra}``). The table holds them
    weakly: an environment (its secrets included) is gone with the last sandbox that had it."""
    key = tuple(env.items())
    got = _ENVS.get(key)
    if got is None:
        got = _ENVS[key] = _Env(env)
    return got
