"""The crun runtime: rootful OCI sandboxes on this host (ARCHITECTURE.md §4, isolation.md §3, §10.2).

Each instance uses its own ``crun --root <state_dir>/crun`` and its own cgroup parent
``pilldrops-<name>``, so several agents or test sessions never see each other's sandboxes. Per sandbox::

    <state_dir>/pilldrops-sandboxes/<id>/{upper,work,rootfs,config.json,crun.err,exec/}

``create`` = overlay mount (ctypes) + config.json (oci_spec) + ``crun run --detach`` with stdio on
/dev/null and a file (a detached crun inherits its stdio). The sandbox init (pd-init) is re-parented
away from the agent by crun, so killing the agent leaves sandboxes running. Nothing is global: creates,
execs and destroys of different sandboxes run concurrently.
"""

from __future__ import annotations

import json
import os
import re
import resource
import shutil
import stat
import subprocess
import time
import uuid
from collections.abc import AsyncIterable
from pathlib import Path

import anyio

from pilldrops.node.isolation import cgroups, procs
from pilldrops.node.isolation.execproc import PipeExec
from pilldrops.node.isolation.host import require_crun
from pilldrops.node.isolation.mounts import MountError, mount_overlay, umount_all_under
from pilldrops.node.isolation.superexec import SupervisorExec
from pilldrops.node.runtime.base import Handle, RuntimeFailure, RuntimeState, SandboxSpec
from pilldrops.node.runtime.init import build_init
from pilldrops.node.runtime.oci_spec import NOFILE, build_spec

_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
_GONE_MARKERS = ("does not exist", "no such file", "not found")


def _nofile_limit() -> int:
    """RLIMIT_NOFILE for sandboxes: 65536, or less when our own hard limit is lower (a caller without
    CAP_SYS_RESOURCE cannot raise it; e.g. 20000 on the dev box)."""
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    return NOFILE if hard == resource.RLIM_INFINITY else min(NOFILE, hard)


def exec_mode() -> str:
    """``PILLDROPS_EXEC=supervisor`` (default: commands through pd-init's socket when the sandbox has one)
    or ``crun`` (always one ``crun exec`` per command)."""
    mode = os.environ.get("PILLDROPS_EXEC", "supervisor").strip().lower()
    return mode if mode in ("supervisor", "crun") else "supervisor"


class CrunRuntime:
    """``Runtime`` backed by crun. Needs root and a prepared host (``isolation.host.prepare_host``)."""

    name = "crun"

    def __init__(self, state_dir: Path, *, name: str = "default", init_path: Path | None = None) -> None:
        if not _NAME_RE.match(name):
            raise ValueError(f"invalid runtime instance name {name!r}")
        self.instance_name = name
        self.state_dir = Path(state_dir).resolve()
        self.crun = require_crun()
        self.crun_root = self.state_dir / "crun"
        self.sandboxes_dir = self.state_dir / "pilldrops-sandboxes"
        self.cgroup_parent = f"pilldrops-{name}"
        self.crun_root.mkdir(parents=True, exist_ok=True)
        self.sandboxes_dir.mkdir(parents=True, exist_ok=True)
        self.init_path = Path(init_path) if init_path else build_init(self.state_dir)
        # exec defaults (env, cwd) per live sandbox, so an exec does not re-read config.json
        self._defaults: dict[str, tuple[dict[str, str], str]] = {}

    # -- helpers ---------------------------------------------------------------------------------
    def _dir(self, sandbox_id: str) -> Path:
        if not _ID_RE.match(sandbox_id):
            raise RuntimeFailure(f"invalid sandbox id {sandbox_id!r}")
        return self.sandboxes_dir / sandbox_id

    def _cgroup(self, sandbox_id: str) -> str:
        return f"{self.cgroup_parent}/{sandbox_id}"

    def _cmd(self, *args: str) -> list[str]:
        return [self.crun, "--root", str(self.crun_root), *args]

    async def _crun(self, *args: str) -> subprocess.CompletedProcess[bytes]:
        return await anyio.run_process(self._cmd(*args), stdin=subprocess.DEVNULL, check=False)

    async def _crun_state(self, sandbox_id: str) -> dict | None:
        r = await self._crun("state", sandbox_id)
        if r.returncode != 0:
            err = r.stderr.decode(errors="replace").lower()
            if any(m in err for m in _GONE_MARKERS):
                return None
            raise RuntimeFailure(f"crun state {sandbox_id} failed", detail=err.strip())
        return json.loads(r.stdout)

    # -- Runtime ---------------------------------------------------------------------------------
    async def create(self, spec: SandboxSpec) -> Handle:
        d = self._dir(spec.id)
        if d.exists():
            raise RuntimeFailure(f"sandbox {spec.id} already exists", detail=str(d))
        rootfs, upper, work = d / "rootfs", d / "upper", d / "work"
        ok = False
        try:
            for p in (rootfs, upper, work, d / "exec"):
                p.mkdir(parents=True)
            (d / "pd").mkdir(mode=0o700)
            try:
                mount_overlay(rootfs, [Path(p) for p in spec.layers], upper, work)
            except (MountError, ValueError) as e:
                raise RuntimeFailure(f"overlay mount for {spec.id} failed", detail=str(e)) from e
            config = build_spec(spec, rootfs=rootfs, init_path=self.init_path,
                                cgroup_parent=self.cgroup_parent, nofile=_nofile_limit(),
                                run_dir=d / "pd")
            (d / "config.json").write_text(json.dumps(config))
            pid_file = d / "init.pid"
            with open(d / "crun.err", "wb") as err:  # noqa: ASYNC230 - local file, no wait
                r = await anyio.run_process(
                    self._cmd("run", "--detach", f"--pid-file={pid_file}", "--bundle", str(d), spec.id),
                    stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err, check=False)
            if r.returncode != 0:
                raise RuntimeFailure(f"crun run {spec.id} failed (exit {r.returncode})",
                                     detail=(d / "crun.err").read_text(errors="replace").strip())
            # The pid file crun writes saves a `crun state` round trip (~6 ms) on the create path;
            # the start time read from /proc proves the init is alive and guards against pid reuse.
            try:
                pid: int | None = int(pid_file.read_text().strip())
            except (OSError, ValueError):
                pid = None
            start = procs.start_time(pid) if pid else None
            if start is None:
                raise RuntimeFailure(f"sandbox {spec.id} init is not running after start",
                                     detail=f"pid={pid} " + (d / "crun.err").read_text(errors="replace"))
            # pd-init binds its control socket right after it starts; give it that moment so that the
            # first command already takes the fast path (if it never shows up, exec uses crun exec)
            deadline = time.monotonic() + 0.5
            while not (d / "pd" / "ctl").exists() and time.monotonic() < deadline:
                await anyio.sleep(0.001)
            self._defaults[spec.id] = self._defaults_from(config)
            ok = True
            return Handle(id=spec.id, pid=pid, pid_start_time=start, bundle=str(d),
                          extra={"cgroup": "/" + self._cgroup(spec.id), "crun_root": str(self.crun_root)})
        finally:
            if not ok:
                with anyio.CancelScope(shield=True):
                    await self._teardown(spec.id)

    async def exec(self, handle: Handle, argv: list[str], *, env: dict[str, str], cwd: str | None,
                   stdin: AsyncIterable[bytes] | bytes | None = None, timeout: float | None = None,
                   output_cap: int | None = None) -> PipeExec | SupervisorExec:
        if not argv:
            raise RuntimeFailure("exec needs a non-empty argv")
        d = self._dir(handle.id)
        if handle.pid is None or not procs.alive(handle.pid, handle.pid_start_time):
            raise RuntimeFailure(f"sandbox {handle.id} is not running")
        base_env, base_cwd = self._defaults.get(handle.id) or self._process_defaults(d)
        if exec_mode() == "supervisor":
            proc = self._supervisor_exec(d, handle, argv, env={**base_env, **env}, cwd=cwd or base_cwd,
                                         stdin=stdin, timeout=timeout, output_cap=output_cap)
            if proc is not None:
                return proc
        pid_file = d / "exec" / f"{uuid.uuid4().hex}.pid"
        args = ["exec", "--no-new-privs"]          # crun exec does not inherit noNewPrivileges
        args += [f"--env={k}={v}" for k, v in {**base_env, **env}.items()]
        args.append(f"--cwd={cwd or base_cwd}")
        args += [f"--pid-file={pid_file}", handle.id, *argv]
        try:
            return PipeExec(self._cmd(*args), stdin=stdin, pid_file=pid_file, timeout=timeout,
                            output_cap=output_cap)
        except OSError as e:
            raise RuntimeFailure(f"cannot start crun exec in {handle.id}", detail=str(e)) from e

    @staticmethod
    def _supervisor_exec(d: Path, handle: Handle, argv: list[str], *, env: dict[str, str], cwd: str,
                         stdin: AsyncIterable[bytes] | bytes | None, timeout: float | None,
                         output_cap: int | None) -> SupervisorExec | None:
        """The command through pd-init's socket, or None when there is none (sandbox made before the
        fast path, or its init does not listen): the caller falls back to ``crun exec``.

        The socket sits in a directory the sandbox can write to, so it is opened with O_NOFOLLOW and
        connected through /proc/self/fd: a symlink planted there never makes the agent connect to a
        host socket.
        """
        try:
            fd = os.open(d / "pd" / "ctl", os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            return None
        try:
            is_sock = stat.S_ISSOCK(os.fstat(fd).st_mode)
        except OSError:
            is_sock = False
        if not is_sock:
            os.close(fd)
            return None
        try:      # SupervisorExec owns fd from here on
            return SupervisorExec(Path(f"/proc/self/fd/{fd}"), argv, env=env, cwd=cwd, stdin=stdin,
                                  init_pid=handle.pid, timeout=timeout, output_cap=output_cap, path_fd=fd)
        except OSError:
            return None

    @staticmethod
    def _process_defaults(d: Path) -> tuple[dict[str, str], str]:
        """The sandbox's own env (PATH, template env, spec.envs) and cwd from its config.json.

        crun exec with ``--env`` starts from an empty environment and defaults cwd to "/", so both are
        passed explicitly; the exec's ``env``/``cwd`` override them.
        """
        try:
            return CrunRuntime._defaults_from(json.loads((d / "config.json").read_text()))
        except (OSError, ValueError, KeyError) as e:
            raise RuntimeFailure(f"sandbox {d.name} has no readable config.json", detail=str(e)) from e

    @staticmethod
    def _defaults_from(config: dict) -> tuple[dict[str, str], str]:  # type: ignore[type-arg]
        proc = config["process"]
        return dict(item.split("=", 1) for item in proc["env"]), proc.get("cwd") or "/"

    async def state(self, handle: Handle) -> RuntimeState:
        """running / stopped / gone from crun's state plus a pid + start-time check.

        ``oom_killed`` is true when the sandbox's memory cgroup has OOM-killed any process (it may still
        be running if the victim was a command, not the init). ``exit_code`` is unknown (None): the
        init is not our child.
        """
        st = await self._crun_state(handle.id)
        if st is None:
            return RuntimeState(status="gone")
        oom = cgroups.oom_kill_count(self._cgroup(handle.id)) > 0
        pid = int(st["pid"]) if st.get("pid") else None
        same = pid is not None and pid == handle.pid and procs.alive(pid, handle.pid_start_time)
        if st.get("status") in ("running", "paused", "created") and same:
            return RuntimeState(status="running", pid=pid, oom_killed=oom)
        return RuntimeState(status="stopped", pid=None, oom_killed=oom)

    async def destroy(self, handle: Handle) -> None:
        self._defaults.pop(handle.id, None)
        with anyio.CancelScope(shield=True):
            await self._teardown(handle.id)

    async def _teardown(self, sandbox_id: str) -> None:
        d = self._dir(sandbox_id)
        r = await self._crun("delete", "--force", sandbox_id)
        err = r.stderr.decode(errors="replace").strip()
        problems = []
        if r.returncode != 0 and not any(m in err.lower() for m in _GONE_MARKERS):
            problems.append(f"crun delete: {err}")
        left = await anyio.to_thread.run_sync(self._teardown_sync, sandbox_id, d)
        if left:
            problems.append(f"cgroups left: {left}")
        if problems:
            raise RuntimeFailure(f"destroy {sandbox_id} incomplete", detail="; ".join(problems))

    def _teardown_sync(self, sandbox_id: str, d: Path) -> list[str]:
        left = [str(p) for p in cgroups.remove_tree(self._cgroup(sandbox_id))]
        umount_all_under(d)
        shutil.rmtree(d, ignore_errors=True)
        if d.exists():
            umount_all_under(d)
            shutil.rmtree(d)
        return left

    async def list_ids(self) -> list[str]:
        r = await self._crun("list", "--format", "json")
        if r.returncode != 0:
            raise RuntimeFailure("crun list failed", detail=r.stderr.decode(errors="replace").strip())
        ids = {c["id"] for c in json.loads(r.stdout or b"[]") or []}
        ids |= {p.name for p in self.sandboxes_dir.iterdir() if p.is_dir()}
        return sorted(ids)

    # -- instance lifetime -----------------------------------------------------------------------
    def cleanup_parent(self) -> None:
        """rmdir this instance's cgroup parent in every hierarchy, with any sandbox cgroup a teardown could
        not remove yet (its processes were still dying), killing what is left in them first."""
        cgroups.remove_tree(self.cgroup_parent, timeout=10.0)

    async def close(self) -> None:
        await anyio.to_thread.run_sync(self.cleanup_parent)
