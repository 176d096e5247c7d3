"""The crun runtime: rootful OCI sandboxes on this host (the production runtime).

Each instance uses its own ``crun --root <state_dir>/crun`` and its own cgroup parent
``pilldrops-<name>``, so several agents or test sessions never see each other's sandboxes. Per sandbox::

    <state_dir>/pilldrops-sandboxes/<id>/{disk.img,disk/{upper,work},rootfs,config.json,crun.err,exec/}

With ``spec.disk_mb`` (issue 16) the writable layer lives on ``disk/``, a loop-mounted ext4 image of that
size of its own (``isolation.diskquota``): writes past it fail with ENOSPC inside the sandbox. Without
it (a runtime driven directly, e.g. by tests) ``upper/`` and ``work/`` sit in the sandbox dir itself.

``create`` = overlay mount (ctypes) + config.json (oci_spec) + ``crun run --detach`` with stdio on
/dev/null and a file (a detached crun inherits its stdio). The sandbox init (pd-init) is re-parented
away from the agent by crun, so killing the agent leaves sandboxes running. Nothing is global: creates,
execs and destroys of different sandboxes run concurrently.

Pause/resume (issue 6): ``checkpoint``/``restore`` run Debian trixie's crun 1.21 + criu 4.1.1 from the
userland ``scripts/install-criu`` builds (``isolation.criu``: private mount namespace, pivot_root), on the
same ``--root`` state dir (bound at its own path): crun 1.21 reads the state 1.8.1 wrote, and 1.8.1 reads
the state of a container 1.21 restored, so a restored sandbox is exec'd, inspected and destroyed by the
host's crun like any other. Image layout (``image_dir``)::

    criu/                     CRIU images + descriptors.json + dump.log (crun checkpoint --image-path)
    disk.img                  the sandbox's disk image (writable layer), renamed out of the sandbox dir
    upper/                    instead of disk.img: the writable layer of a sandbox without a disk quota
    pilldrops-checkpoint.json format, id, versions, sizes; written last (marks the image complete)

Before the dump pd-init is told (SIGUSR1) to close its control socket, and after a restore (or a failed
dump) to listen again (SIGUSR2): criu 4.1.1 cannot restore a path-bound unix socket in a process tree
that needs a session/group-leader helper, which any background command that outlived its shell creates.
"""

from __future__ import annotations

import json
import os
import re
import resource
import shutil
import signal
import stat
import subprocess
import time
import uuid
from collections.abc import AsyncIterable
from pathlib import Path
from typing import Any

import anyio

from pilldrops._internal import jsonfile
from pilldrops.node.isolation import cgroups, criu, diskquota, pdfs, procs, spawn
from pilldrops.node.isolation.diskspares import DiskSpares
from pilldrops.node.isolation.execproc import PipeExec
from pilldrops.node.isolation.fsflags import lock_dir, unlock_dir
from pilldrops.node.isolation.host import HostNotReady, require_crun
from pilldrops.node.isolation.mounts import MountError, mount_overlay, umount, umount_all_under
from pilldrops.node.isolation.rmtree import remove_tree
from pilldrops.node.isolation.superexec import PROTO, Spares, SupervisorExec, probe_version, sock_path_for
from pilldrops.node.runtime.base import Handle, RuntimeFailure, RuntimeState, SandboxSpec, shared_env
from pilldrops.node.runtime.init import build_init, source_hash
from pilldrops.node.runtime.oci_spec import INIT_PATH_IN_SANDBOX, NOFILE, build_spec
from pilldrops.node.runtime.registry import Probe

_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
_GONE_MARKERS = ("does not exist", "no such file", "not found")
CHECKPOINT_FORMAT = 1
CHECKPOINT_META = "pilldrops-checkpoint.json"
# in a sandbox dir: a checkpoint could not take its writable layer, which stays here (``restore`` uses it)
LAYER_KEPT = "layer-kept-for-restore"
_LAYER_NAMES = {diskquota.IMAGE, diskquota.MOUNT, "upper", "work", LAYER_KEPT}
# CRIU options for every dump/restore: loopback TCP connections inside the sandbox's netns and file locks
# (pip, sqlite, ...) are part of the sandbox's state
_CRIU_OPTS = ("--tcp-established", "--file-locks")


def _nofile_limit() -> int:
    """RLIMIT_NOFILE for sandboxes: 65536, or less when our own hard limit is lower (a caller without
    CAP_SYS_RESOURCE cannot raise it; e.g. 20000 on the dev box)."""
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    return NOFILE if hard == resource.RLIM_INFINITY else min(NOFILE, hard)


def _started_init(pid_file: Path, sandbox_id: str, what: str, err_file: Path | None = None) -> tuple[int, int]:
    """The init's pid from crun's pid file and its start time from /proc: proof that it runs (and a guard
    against pid reuse), without a `crun state` round trip."""
    try:
        fd = os.open(pid_file, os.O_RDONLY | os.O_CLOEXEC)     # (no buffered text file: ~15 us less)
        try:
            pid: int | None = int(os.read(fd, 64))
        finally:
            os.close(fd)
    except (OSError, ValueError):
        pid = None
    start = procs.start_time(pid) if pid else None
    if pid is None or start is None:
        detail = err_file.read_text(errors="replace") if err_file is not None and err_file.exists() else ""
        raise RuntimeFailure(f"sandbox {sandbox_id} init is not running after {what}", detail=f"pid={pid} {detail}")
    return pid, start


def probe() -> Probe:
    """The ``container`` mode (registry.py): crun installed (the host itself is prepared by the agent)."""
    try:
        require_crun()
    except HostNotReady as e:
        return Probe(False, str(e))
    return Probe(True, detail="crun")


def exec_mode() -> str:
    """``PILLDROPS_EXEC=supervisor`` (default: commands through pd-init's socket when the sandbox has one)
    or ``crun`` (always one ``crun exec`` per command)."""
    mode = os.environ.get("PILLDROPS_EXEC", "supervisor").strip().lower()
    return mode if mode in ("supervisor", "crun") else "supervisor"


def _tree_bytes(root: Path) -> int:
    """Apparent size of the regular files under ``root``."""
    total = 0
    for dirpath, _, files in os.walk(root):
        for f in files:
            try:
                st = os.lstat(os.path.join(dirpath, f))
            except OSError:
                continue
            if stat.S_ISREG(st.st_mode):
                total += st.st_size
    return total


RESOLV_CONF = "# PillDrops sandbox: no network egress, so no name server (the host's is not shown)\n"


def _write_identity_files(etc: str, hostname: str) -> None:
    """The sandbox's own machine-id, resolv.conf and hosts in the ``etc`` of its (empty) writable layer (no
    copy-up). Every sandbox gets its own machine-id (templates ship one, or none): two sandboxes, warm-pool
    members included, never share an identity. A template built on this host carries the host's resolv.conf
    and hosts (debootstrap copies them), and a sandbox without egress must not learn the host's name server
    or names (issue 16 item 9). Plain os writes (no buffered text file, no Path): ~0.1 ms less per create."""
    jsonfile.write_bytes(f"{etc}/machine-id", f"{uuid.uuid4().hex}\n".encode())
    jsonfile.write_bytes(f"{etc}/resolv.conf", RESOLV_CONF.encode())
    jsonfile.write_bytes(f"{etc}/hosts", f"127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n"
                                         f"127.0.1.1\t{hostname}\n".encode())


def _copy_tree(src: Path, dst: Path) -> None:
    """Copy an overlay layer with everything overlay needs: whiteouts (char 0/0), xattrs, owners, times."""
    subprocess.run(["cp", "-a", "--reflink=auto", str(src), str(dst)], check=True, capture_output=True)


def _move_tree(src: Path, dst: Path) -> None:
    try:
        os.rename(src, dst)
    except OSError:
        _copy_tree(src, dst)
        remove_tree(src)


def _failure_detail(err_file: Path, log: Path, lines: int = 12) -> str:
    """crun's stderr plus the error lines (else the tail) of CRIU's log."""
    try:
        err = err_file.read_text(errors="replace").strip()
    except OSError:
        err = ""
    try:
        log_lines = log.read_text(errors="replace").splitlines()
    except OSError:
        log_lines = []
    errors = [ln for ln in log_lines if "Error" in ln] or log_lines[-lines:]
    return "\n".join(x for x in [err, *errors[-lines:]] if x)[-4000:]


def _userland_versions() -> str:
    try:
        return (criu.userland_root() / criu.READY_STAMP).read_text().splitlines()[1]
    except (OSError, IndexError):
        return ""


class CrunRuntime:
    """``Runtime`` backed by crun. Needs root and a prepared host (``isolation.host.prepare_host``).

    The OCI-bundle parts (sandbox dir, overlay root, config.json, pd-init and its fast exec path, teardown,
    the checkpoint image's writable layer) are shared with ``gvisor.GvisorRuntime``, which overrides the
    hooks marked "hook" below (binary, command line, exec, signalling pd-init, dump and restore)."""

    name = "crun"
    ROOT_SUBDIR = "crun"            # hook: the OCI runtime's --root under the state dir
    IMAGE_SUBDIR = "criu"           # hook: where the process image goes inside a checkpoint image
    HOST_PIDS = True                # the sandbox's processes are host processes (their pids mean something)
    CTL_WAIT = 0.5                  # seconds create waits for pd-init's control socket
    SHEPHERD_EXEC = True            # a fallback exec runs under ``/.pd/init --shepherd`` (a subreaper)

    def __init__(self, state_dir: Path, *, name: str = "default", init_path: Path | None = None) -> None:
        if not _NAME_RE.match(name):
            raise ValueError(f"invalid runtime instance name {name!r}")
        self.instance_name = name
        self.state_dir = Path(state_dir).resolve()
        self.crun = self._binary()
        self.crun_root = self.state_dir / self.ROOT_SUBDIR
        self.sandboxes_dir = self.state_dir / "pilldrops-sandboxes"
        self.cgroup_parent = f"pilldrops-{name}"
        self.crun_root.mkdir(parents=True, exist_ok=True)
        self.sandboxes_dir.mkdir(parents=True, exist_ok=True)
        self.init_path = Path(init_path) if init_path else build_init(self.state_dir)
        # what /.pd/init is bound from: a copy on a tmpfs of its own, so that the sandbox's mountinfo names
        # no host path (isolation.pdfs)
        self.init_dir = self.state_dir / "pd-init"
        self.init_bind = self._init_copy()
        # disks made ahead, off the create path (``keep`` set by the agent's builder: node.main)
        self.disk_spares = DiskSpares(self.state_dir)
        # exec defaults (env, cwd, what /.pd/init is bound from) per live sandbox, so an exec does not
        # re-read config.json
        self._defaults: dict[str, tuple[dict[str, str], str, str]] = {}
        # control-protocol version of each sandbox's init, keyed by its (pid, start time): a sandbox this
        # instance started runs our init; an adopted or restored one may run an older build (asked once)
        self._proto: dict[str, tuple[int, int | None, int]] = {}
        self._spares = Spares()        # an idle control connection per sandbox, for its next command
        stamp = self.init_path.with_name(self.init_path.name + ".hash")
        try:
            self._init_current = stamp.read_text().strip() == source_hash()
        except OSError:
            self._init_current = False

    # -- helpers ---------------------------------------------------------------------------------
    def _init_copy(self) -> Path:
        try:
            return pdfs.init_copy(self.init_dir, self.init_path)
        except OSError as e:
            raise RuntimeFailure(f"cannot put the sandbox init on its tmpfs at {self.init_dir}", detail=str(e)) from e

    def _ensure_init(self) -> None:
        """The init's tmpfs is there (another instance on this state dir may have closed it)."""
        if not self.init_bind.exists():
            self.init_bind = self._init_copy()

    @staticmethod
    def _binary() -> str:
        """hook: the OCI runtime's path (raises ``HostNotReady`` when it is not installed)."""
        return require_crun()

    def _cid(self, sandbox_id: str) -> str:
        """hook: the OCI runtime's container id of a sandbox (``_sid`` is the inverse; None: not ours)."""
        return sandbox_id

    def _sid(self, cid: str) -> str | None:
        return cid

    def _dir(self, sandbox_id: str) -> Path:
        if not _ID_RE.match(sandbox_id):
            raise RuntimeFailure(f"invalid sandbox id {sandbox_id!r}")
        return self.sandboxes_dir / sandbox_id

    def _cgroup(self, sandbox_id: str) -> str:
        return f"{self.cgroup_parent}/{sandbox_id}"

    def _cmd(self, *args: str) -> list[str]:
        """hook: the OCI runtime's command line for ``args``."""
        return [self.crun, "--root", str(self.crun_root), *args]

    async def _run(self, argv: list[str], **kw: Any) -> spawn.Completed:
        """One run of the OCI runtime (or a tool of its userland) to its end: ``spawn.run`` (no asyncio
        subprocess transports; cancelled, it is killed and reaped); one that cannot start is a RuntimeFailure."""
        try:
            return await spawn.run(argv, **kw)
        except spawn.SpawnError as e:
            raise RuntimeFailure(f"cannot run {self.name}", detail=str(e)) from e

    async def _crun(self, *args: str) -> spawn.Completed:
        return await self._run(self._cmd(*args))

    async def _crun_state(self, sandbox_id: str) -> dict | None:
        r = await self._crun("state", self._cid(sandbox_id))
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
        ok = False
        try:
            # a spare disk (diskspares) becomes the sandbox dir, its overlay dirs made: one rename
            spare = bool(spec.disk_mb) and self.disk_spares.take(spec.disk_mb, d)
            for p in (d / "rootfs", d / "exec"):
                p.mkdir(parents=True)
            self._make_run_dir(d)
            if spec.disk_mb and not spare:
                await anyio.to_thread.run_sync(self._make_disk, d, spec.disk_mb)
            layer = diskquota.layer_dirs(d) if spare else diskquota.make_layer_dirs(d)
            _write_identity_files(f"{layer[0]}/etc", spec.hostname)
            config = self._mount_and_configure(spec, d, layer)
            pid_file = d / "init.pid"
            with open(d / "crun.err", "wb") as err:  # noqa: ASYNC230 - local file, no wait
                r = await self._run(
                    self._cmd("run", "--detach", f"--pid-file={pid_file}", "--bundle", str(d), self._cid(spec.id)),
                    stdout=spawn.DEVNULL, stderr=err)
            if r.returncode != 0:
                raise RuntimeFailure(f"{self.name} run {spec.id} failed (exit {r.returncode})",
                                     detail=(d / "crun.err").read_text(errors="replace").strip())
            # The pid file crun writes saves a `crun state` round trip (~6 ms) on the create path;
            # the start time read from /proc proves the init is alive and guards against pid reuse.
            pid, start = _started_init(pid_file, spec.id, "start", err_file=d / "crun.err")
            # pd-init binds its control socket right after it starts; give it that moment so that the
            # first command already takes the fast path (if it never shows up, exec uses crun exec)
            ctl, deadline = f"{d}/pd/ctl", time.monotonic() + self.CTL_WAIT
            while not os.path.exists(ctl) and time.monotonic() < deadline:
                await anyio.sleep(0.001)
            if os.path.exists(ctl):
                lock_dir(d / "pd")     # the sandbox cannot replace the socket (else: at the first probe)
            self._defaults[spec.id] = self._defaults_from(config)
            if self._init_current:
                self._proto[spec.id] = (pid, start, PROTO)
            ok = True
            return Handle(id=spec.id, pid=pid, pid_start_time=start, bundle=str(d),
                          extra={"cgroup": "/" + self._cgroup(spec.id), "crun_root": str(self.crun_root)})
        finally:
            if not ok:
                with anyio.CancelScope(shield=True):
                    await self._teardown(spec.id)

    def _make_run_dir(self, d: Path) -> None:
        """``d/pd`` (bound at /.pd/run) on a tmpfs of its own; the init's tmpfs is checked on the way."""
        try:
            self._ensure_init()
            pdfs.mount_run_dir(d / "pd")
        except OSError as e:
            raise RuntimeFailure(f"cannot mount the run dir of sandbox {d.name}", detail=str(e)) from e

    def _make_disk(self, d: Path, disk_mb: int) -> None:
        try:
            diskquota.make(self.state_dir, d, disk_mb)
        except OSError as e:
            raise RuntimeFailure(f"cannot make the {disk_mb} MiB disk of sandbox {d.name}", detail=str(e)) from e

    def disk_usage(self, handle: Handle, disk_mb: int | None = None) -> diskquota.Usage | None:
        """Bytes used on the sandbox's disk and its limit (None: it has no disk quota)."""
        return diskquota.usage(self._dir(handle.id), disk_mb)

    def _mount_and_configure(self, spec: SandboxSpec, d: Path,
                             layer: tuple[Path, Path] | None = None) -> dict[str, Any]:
        """Overlay ``d/rootfs`` over the template layers and the writable layer (``layer``: its upper and work
        dirs, ``diskquota.layer_dirs(d)`` unless given), and write ``d/config.json``."""
        try:
            mount_overlay(d / "rootfs", [Path(p) for p in spec.layers], *(layer or diskquota.layer_dirs(d)))
        except (MountError, ValueError) as e:
            raise RuntimeFailure(f"overlay mount for {spec.id} failed", detail=str(e)) from e
        config = self._config(spec, d)
        jsonfile.write_bytes(d / "config.json", jsonfile.dumps(config))   # orjson: ~0.35 ms less than json
        return config

    def _config(self, spec: SandboxSpec, d: Path) -> dict:  # type: ignore[type-arg]
        """hook: the sandbox's OCI config."""
        return build_spec(spec, rootfs=d / "rootfs", init_path=self.init_bind, cgroup_parent=self.cgroup_parent,
                          nofile=_nofile_limit(), run_dir=d / "pd")

    async def exec(self, handle: Handle, argv: list[str], *, env: dict[str, str], cwd: str | None,
                   stdin: AsyncIterable[bytes] | bytes | None = None, timeout: float | None = None,
                   output_cap: int | None = None,
                   pty: tuple[int, int] | None = None, user: str | None = None,
                   pid_late: bool = False) -> PipeExec | SupervisorExec:
        """``pty``: (rows, cols) of a terminal for the command (needs the supervisor path, protocol 2);
        ``user``: "uid:gid" to run it as (a template's USER), else root."""
        if not argv:
            raise RuntimeFailure("exec needs a non-empty argv")
        d = self._dir(handle.id)
        if handle.pid is None or not procs.alive(handle.pid, handle.pid_start_time):
            raise RuntimeFailure(f"sandbox {handle.id} is not running")
        base_env, base_cwd, init_src = self._defaults.get(handle.id) or self._process_defaults(d)
        if exec_mode() == "supervisor":
            proto = await self._init_proto(d, handle)
            if pty is not None and proto == 1:
                raise RuntimeFailure(f"sandbox {handle.id} runs an older init (control protocol 1) "
                                     "without terminals: start a new sandbox for a PTY")
            if proto >= 2:
                proc = None
                for attempt in range(8):
                    try:
                        proc = self._supervisor_exec(d, handle, argv, env={**base_env, **env},
                                                     cwd=cwd or base_cwd, stdin=stdin, timeout=timeout,
                                                     output_cap=output_cap, pty=pty, user=user,
                                                     pid_late=pid_late)
                        break
                    except ConnectionRefusedError:
                        # the init is between two connections (gVisor's host sockets queue none): again
                        await anyio.sleep(0.02 * (attempt + 1))
                if proc is not None:
                    return proc
        if pty is not None:
            raise RuntimeFailure(f"a PTY needs pd-init's control socket, which sandbox {handle.id} lacks "
                                 "(or PILLDROPS_EXEC=crun is set)")
        pid_file = d / "exec" / f"{uuid.uuid4().hex}.pid"
        if self.SHEPHERD_EXEC and init_src == str(self.init_bind):
            # this build's init (content-named copy): the command runs below a subreaper, so that a kill
            # of the tree from the host reaches whatever it detached (setsid, double fork; issue 16 part 3)
            argv = [INIT_PATH_IN_SANDBOX, "--shepherd", *argv]
        try:
            return self._fallback_exec(handle, self._exec_cmd(self._cid(handle.id), argv, {**base_env, **env}, cwd or base_cwd,
                                                              pid_file, user),
                                       pid_file, stdin=stdin, timeout=timeout, output_cap=output_cap)
        except OSError as e:
            raise RuntimeFailure(f"cannot start {self.name} exec in {handle.id}", detail=str(e)) from e

    def _exec_cmd(self, sandbox_id: str, argv: list[str], env: dict[str, str], cwd: str, pid_file: Path,
                  user: str | None = None) -> list[str]:
        """hook: the command line of one ``exec`` without the fast path."""
        args = ["exec", "--no-new-privs"]          # crun exec does not inherit noNewPrivileges
        if user:
            args.append(f"--user={user}")
        args += [f"--env={k}={v}" for k, v in env.items()]
        args.append(f"--cwd={cwd}")
        return self._cmd(*args, f"--pid-file={pid_file}", sandbox_id, *argv)

    def _fallback_exec(self, handle: Handle, cmd: list[str], pid_file: Path, **kw: object) -> PipeExec:
        """hook: the ``ExecProcess`` of an exec without the fast path (``cmd`` from ``_exec_cmd``)."""
        return PipeExec(cmd, pid_file=pid_file, **kw)  # type: ignore[arg-type]

    async def _init_proto(self, d: Path, handle: Handle) -> int:
        """The control-protocol version of the sandbox's init (0: no usable socket; asked once per init).

        A v1 init (an older build: an adopted sandbox, or one restored from an older node's checkpoint)
        is driven through ``crun exec``, which runs every plain command; only PTYs need v2."""
        known = self._proto.get(handle.id)
        if known is not None and known[:2] == (handle.pid, handle.pid_start_time):
            return known[2]
        for attempt in range(6):
            fd = self._open_ctl(d)
            if fd is None:
                return 0
            try:
                proto = await anyio.to_thread.run_sync(probe_version, f"/proc/self/fd/{fd}", 2.0,
                                                       handle.pid if self.HOST_PIDS else None)
                break
            except ConnectionRefusedError:
                # bound but not listening yet: the init is still starting (slow under gVisor's ptrace)
                await anyio.sleep(0.05 * (attempt + 1))
            except OSError:
                return 0                # nothing sane listens: crun exec this time, ask again next time
            finally:
                os.close(fd)
        else:
            return 0
        assert handle.pid is not None
        lock_dir(d / "pd")             # a socket that showed up after create's wait: lock it in now
        self._proto[handle.id] = (handle.pid, handle.pid_start_time, proto)
        return proto

    @staticmethod
    def _open_ctl(d: Path) -> int | None:
        """An O_PATH fd of the control socket. It sits in a directory the sandbox can write to, so it is
        opened with O_NOFOLLOW and connected through /proc/self/fd: a symlink planted there never makes the
        agent connect to a host socket."""
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
        return fd

    def _supervisor_exec(self, d: Path, handle: Handle, argv: list[str], *, env: dict[str, str], cwd: str,
                         stdin: AsyncIterable[bytes] | bytes | None, timeout: float | None,
                         output_cap: int | None, pty: tuple[int, int] | None,
                         user: str | None = None, pid_late: bool = False) -> SupervisorExec | None:
        """The command through pd-init's socket, or None when there is none (sandbox made before the
        fast path, or its init does not listen): the caller falls back to ``crun exec``.

        The socket sits in a directory the sandbox can write to, so it is opened with O_NOFOLLOW and
        connected through /proc/self/fd: a symlink planted there never makes the agent connect to a
        host socket.
        """
        key = (handle.pid, handle.pid_start_time)
        init_pid = handle.pid if self.HOST_PIDS else None

        def spare() -> None:       # the next command's connection, made once this one's request went out
            known = self._proto.get(handle.id)
            if known is not None and known[:2] == key:       # not destroyed (nor replaced) meanwhile
                self._spares.make(handle.id, key, self._open_ctl(d), init_pid)

        common: dict[str, Any] = {"env": env, "cwd": cwd, "stdin": stdin, "init_pid": init_pid, "timeout": timeout,
                                  "output_cap": output_cap, "pty": pty, "user": user, "on_sent": spare,
                                  "pid_late": pid_late}
        sock = self._spares.take(handle.id, key)
        if sock is not None:
            try:
                return SupervisorExec(sock_path_for(d), argv, sock=sock, **common)
            except BaseException:
                sock.close()            # a request it refused (a NUL in argv, say): the init's slot back now
                raise
        fd = self._open_ctl(d)
        if fd is None:
            return None
        try:      # SupervisorExec owns fd from here on
            return SupervisorExec(Path(f"/proc/self/fd/{fd}"), argv, path_fd=fd, **common)
        except ConnectionRefusedError:
            raise                       # listening, but not accepting right now: the caller retries
        except OSError:
            return None

    @staticmethod
    def _process_defaults(d: Path) -> tuple[dict[str, str], str, str]:
        """The sandbox's own env (PATH, template env, spec.envs) and cwd from its config.json.

        crun exec with ``--env`` starts from an empty environment and defaults cwd to "/", so both are
        passed explicitly; the exec's ``env``/``cwd`` override them.
        """
        try:
            return CrunRuntime._defaults_from(json.loads((d / "config.json").read_bytes()))
        except (OSError, ValueError, KeyError) as e:
            raise RuntimeFailure(f"sandbox {d.name} has no readable config.json", detail=str(e)) from e

    @staticmethod
    def _defaults_from(config: dict) -> tuple[dict[str, str], str, str]:  # type: ignore[type-arg]
        proc = config["process"]
        init_src = next((m.get("source", "") for m in config.get("mounts", [])
                         if m.get("destination") == INIT_PATH_IN_SANDBOX), "")
        env = shared_env(dict(item.split("=", 1) for item in proc["env"]))
        return env, proc.get("cwd") or "/", init_src

    async def state(self, handle: Handle) -> RuntimeState:
        """running / stopped / gone from crun's state plus a pid + start-time check.

        ``oom_killed`` is true when the sandbox's memory cgroup has OOM-killed any process (it may still
        be running if the victim was a command, not the init). ``exit_code`` is unknown (None): the
        init is not our child.
        """
        if handle.pid is not None and procs.alive(handle.pid, handle.pid_start_time):
            # its init (same pid, same start time) is alive: running, without a `crun state` process
            # (the monitor asks for every sandbox every few seconds; at 1,000 that was most of its CPU)
            return RuntimeState(status="running", pid=handle.pid,
                                oom_killed=cgroups.oom_kill_count(self._cgroup(handle.id)) > 0)
        st = await self._crun_state(handle.id)
        if st is None:
            return RuntimeState(status="gone")
        oom = cgroups.oom_kill_count(self._cgroup(handle.id)) > 0
        pid = int(st["pid"]) if st.get("pid") else None
        same = pid is not None and pid == handle.pid and procs.alive(pid, handle.pid_start_time)
        if st.get("status") in ("running", "paused", "created") and same:
            return RuntimeState(status="running", pid=pid, oom_killed=oom)
        return RuntimeState(status="stopped", pid=None, oom_killed=oom)

    def running_by_pid(self, handle: Handle) -> bool:
        """True when ``state`` would answer running from the pid alone and the init is not stopped (``T``):
        ONE /proc read, for the monitor's tick over every live sandbox (``state`` also reads the OOM
        counter, which the monitor needs only for one that is not running; issue 15). False: ask ``state``."""
        if handle.pid is None or handle.pid_start_time is None:
            return False
        f = procs.stat_fields(handle.pid)
        return bool(f) and f[0] not in ("Z", "X", "T", "t") and int(f[19]) == handle.pid_start_time

    def oom_kills(self, handle: Handle) -> int | None:
        """Processes the sandbox's memory cgroup has OOM-killed so far (one small cgroup file read)."""
        return cgroups.oom_kill_count(self._cgroup(handle.id))

    async def destroy(self, handle: Handle) -> None:
        self._defaults.pop(handle.id, None)
        self._proto.pop(handle.id, None)
        with anyio.CancelScope(shield=True):
            await self._teardown(handle.id)

    def kept_layer(self, sandbox_id: str) -> Path | None:
        """The writable layer a checkpoint kept in the sandbox dir (``_keep_layer``), or None."""
        d = self._dir(sandbox_id)
        if not (d / LAYER_KEPT).is_file():
            return None
        return d / diskquota.IMAGE if (d / diskquota.IMAGE).is_file() else d / "upper"

    async def abort_restore(self, handle: Handle, image_dir: Path) -> None:
        """A restore the agent was killed in: tear it down, the writable layer going back into ``image_dir``
        (or kept in the sandbox dir again, see ``_keep_layer``) unless the image still holds its own one
        (the restore had not moved it yet, or was copying it onto a disk it had just made)."""
        d, image_dir = self._dir(handle.id), Path(image_dir).resolve()
        in_image = (image_dir / diskquota.IMAGE).is_file() or (image_dir / "upper").is_dir()
        save = (d / LAYER_KEPT).is_file() or not in_image
        self._defaults.pop(handle.id, None)
        self._proto.pop(handle.id, None)
        with anyio.CancelScope(shield=True):
            await self._teardown(handle.id, save_to=image_dir if save and image_dir.is_dir() else None)

    async def _teardown(self, sandbox_id: str, *, save_to: Path | None = None) -> None:
        """Remove every process, cgroup, mount and file of the sandbox. With ``save_to`` (a checkpoint
        image dir), its writable layer is first moved there (``disk.img``, or ``upper/`` for a sandbox
        without a disk quota; rename, a copy across file systems) once nothing uses it."""
        self._spares.forget(sandbox_id)
        d = self._dir(sandbox_id)
        r = await self._crun("delete", "--force", self._cid(sandbox_id))
        err = r.stderr.decode(errors="replace").strip()
        problems = []
        if r.returncode != 0 and not any(m in err.lower() for m in _GONE_MARKERS):
            problems.append(f"crun delete: {err}")
        left, moved = await anyio.to_thread.run_sync(self._teardown_sync, sandbox_id, d, save_to)
        if left:
            problems.append(f"cgroups left: {left}")
        if moved:
            problems.append(moved)
        if problems:
            raise RuntimeFailure(f"destroy {sandbox_id} incomplete", detail="; ".join(problems))

    def _teardown_sync(self, sandbox_id: str, d: Path, save_to: Path | None = None) -> tuple[list[str], str]:
        left = [str(p) for p in cgroups.remove_tree(self._cgroup(sandbox_id))]
        # the one host mount of a sandbox is its rootfs overlay: unmount it directly; scanning the mount
        # table (1,000+ lines with 1,000 sandboxes) only when something is still mounted
        try:
            umount(d / "rootfs")
        except MountError:
            pass                               # not mounted (a half-made sandbox), or gone already
        if os.path.ismount(d / "rootfs") or os.path.ismount(d):
            umount_all_under(d)
        problem = ""
        try:
            # the sandbox's disk (its loop device detaches itself); a checkpoint's flushed and closed first
            diskquota.remove(d, keep_image=save_to is not None)
        except MountError as e:
            problem = f"cannot unmount the disk of {sandbox_id}: {e}"
        if save_to is not None and not problem:
            try:
                if (d / diskquota.IMAGE).is_file():
                    diskquota.move_image(d / diskquota.IMAGE, save_to / diskquota.IMAGE)
                elif (d / "upper").is_dir():
                    _move_tree(d / "upper", save_to / "upper")
            except (OSError, subprocess.CalledProcessError) as e:
                problem = f"cannot move the writable layer to {save_to}: {e}"
        unlock_dir(d / "pd")
        try:
            pdfs.umount_run_dir(d / "pd")
        except MountError:
            pass                               # umount_all_under below tries again
        if save_to is not None and problem:
            self._keep_layer(d, save_to)
            return left, problem
        try:
            remove_tree(d)             # iterative: a sandbox's tree may be any depth (issue 16 item 4)
        except OSError:
            umount_all_under(d)
            remove_tree(d)
        return left, problem

    @staticmethod
    def _keep_layer(d: Path, save_to: Path) -> None:
        """A checkpoint's writable layer could not be moved into its image: a pause never loses a sandbox's
        data, so the layer stays in the sandbox dir (the rest of it goes) and ``restore`` resumes from the
        image with it. A partial copy in the image goes."""
        if (d / diskquota.IMAGE).is_file() and (save_to / diskquota.IMAGE).is_file():
            (save_to / diskquota.IMAGE).unlink()
        if (d / "upper").is_dir() and (save_to / "upper").is_dir():
            remove_tree(save_to / "upper")
        for child in d.iterdir():
            if child.name in _LAYER_NAMES or os.path.ismount(child):
                continue
            if child.is_dir() and not child.is_symlink():
                remove_tree(child)
            else:
                child.unlink()
        (d / LAYER_KEPT).write_text(str(save_to) + "\n")

    async def list_ids(self) -> list[str]:
        r = await self._crun("list", "--format", "json")
        if r.returncode != 0:
            raise RuntimeFailure("crun list failed", detail=r.stderr.decode(errors="replace").strip())
        if r.truncated:
            raise RuntimeFailure(f"crun list printed more than {spawn.STDOUT_CAP} bytes")
        ids = {sid for c in json.loads(r.stdout or b"[]") or [] if (sid := self._sid(c["id"]))}
        ids |= {p.name for p in self.sandboxes_dir.iterdir() if p.is_dir()}
        return sorted(ids)

    # -- pause / resume (issue 6) -----------------------------------------------------------------
    def checkpoint_unsupported(self) -> str | None:
        return criu.unavailable_reason()

    async def _userland_crun(self, *args: str, binds: list[Path], err_path: Path) -> int:
        """``crun --root <ours> ARGS`` with trixie's crun 1.21 + criu 4.1.1 (``isolation.criu``);
        stderr goes to ``err_path``. Returns the exit code."""
        argv = criu.command(["crun", "--root", str(self.crun_root), *args], binds=binds)
        with open(err_path, "wb") as err:  # noqa: ASYNC230 - local file, no wait
            r = await self._run(argv, stdout=spawn.DEVNULL, stderr=err)
        return r.returncode

    async def _signal_init(self, sandbox_id: str, pid: int, sig: int) -> bool:
        """hook: send ``sig`` to the sandbox's pd-init (host pid ``pid``)."""
        try:
            os.kill(pid, sig)
        except OSError:
            return False
        return True

    async def _ctl_signal(self, d: Path, pid: int, sig: int, *, want: bool, wait: float) -> bool:
        """Ask pd-init to close (SIGUSR1) or reopen (SIGUSR2) its control socket; wait until ``pd/ctl``
        is gone / there. False if that did not happen in time (an old pd-init ignores both signals)."""
        ctl = d / "pd" / "ctl"
        unlock_dir(d / "pd")           # pd-init unlinks / binds the socket there
        try:
            if not await self._signal_init(d.name, pid, sig):
                return False
            deadline = time.monotonic() + wait
            while os.path.lexists(ctl) != want:
                if time.monotonic() > deadline:
                    return False
                await anyio.sleep(0.001)
            return True
        finally:
            # closed: lock the emptied directory, so that nothing of the sandbox (which runs on until the dump
            # freezes it) can bind a socket of its own there; reopened: lock what pd-init bound (a socket a
            # sandbox planted in the moment before is refused by the peer check, see superexec.check_peer)
            if not want or os.path.lexists(ctl):
                lock_dir(d / "pd")

    async def checkpoint(self, handle: Handle, image_dir: Path) -> int:
        why = self.checkpoint_unsupported()
        if why:
            raise RuntimeFailure("checkpoint is not supported on this host", detail=why)
        d = self._dir(handle.id)
        image_dir = Path(image_dir).resolve()
        if handle.pid is None or not procs.alive(handle.pid, handle.pid_start_time):
            raise RuntimeFailure(f"sandbox {handle.id} is not running")
        if not image_dir.is_dir() or any(image_dir.iterdir()):
            raise RuntimeFailure(f"checkpoint image dir {image_dir} must exist and be empty")
        images = image_dir / self.IMAGE_SUBDIR
        with anyio.CancelScope(shield=True):      # half a dump is worse than a late one
            images.mkdir()
            had_ctl = os.path.lexists(d / "pd" / "ctl")
            await self._spares.suspend(handle.id)     # the dump must find no connection to the socket
            if had_ctl:
                await self._ctl_signal(d, handle.pid, signal.SIGUSR1, want=False, wait=1.0)
            code, detail = await self._dump(handle, d, image_dir, images)
            if code != 0:
                alive = procs.alive(handle.pid, handle.pid_start_time)
                if alive and had_ctl:
                    await self._ctl_signal(d, handle.pid, signal.SIGUSR2, want=True, wait=1.0)
                self._spares.resume(handle.id)
                shutil.rmtree(images, ignore_errors=True)
                if not alive:      # the dump went through but crun failed after it: the sandbox is gone
                    self._defaults.pop(handle.id, None)
                    await self._teardown(handle.id)
                raise RuntimeFailure(f"checkpoint of {handle.id} failed (exit {code})"
                                     + ("" if alive else "; the sandbox is gone"), detail=detail)
            # the dump killed the process tree (crun also deleted the container, cgroup included); what is
            # left is the overlay and the sandbox dir: the writable layer moves into the image
            self._defaults.pop(handle.id, None)
            self._proto.pop(handle.id, None)     # no spare connection is made to the dumped init
            failure = None
            try:
                await self._teardown(handle.id, save_to=image_dir)
            except RuntimeFailure as e:
                if not (d / LAYER_KEPT).is_file():
                    raise
                failure = e        # the layer stays in d: the image is still complete with it (restore)
            layer = d if failure is not None else image_dir
            criu_bytes = _tree_bytes(images)
            disk = layer / diskquota.IMAGE
            upper_bytes = disk.stat().st_blocks * 512 if disk.is_file() else _tree_bytes(layer / "upper")
            meta = {"format": CHECKPOINT_FORMAT, "id": handle.id, "created": time.time(),
                    "runtime": self.name, "userland": self._versions(), "init": self.init_path.name,
                    "criu_bytes": criu_bytes, "upper_bytes": upper_bytes, "disk": disk.is_file()}
            (image_dir / (CHECKPOINT_META + ".tmp")).write_text(json.dumps(meta))
            os.replace(image_dir / (CHECKPOINT_META + ".tmp"), image_dir / CHECKPOINT_META)
            if failure is not None:
                raise RuntimeFailure(f"checkpoint of {handle.id} failed after its processes were dumped; its "
                                     f"writable layer is kept in {d} and restore resumes it from there",
                                     detail=failure.detail)
            return criu_bytes + upper_bytes

    async def _dump(self, handle: Handle, d: Path, image_dir: Path, images: Path) -> tuple[int, str]:
        """hook: write the process image of the sandbox into ``images``, ending its processes; returns the
        exit code and, on failure, what went wrong."""
        code = await self._userland_crun("checkpoint", *_CRIU_OPTS, f"--image-path={images}", handle.id,
                                         binds=[self.state_dir, image_dir], err_path=d / "criu.err")
        return code, (_failure_detail(d / "criu.err", images / "dump.log") if code else "")

    @staticmethod
    def _versions() -> str:
        """hook: the versions a checkpoint image records."""
        return _userland_versions()

    async def _restore_init(self, spec: SandboxSpec, d: Path, image_dir: Path) -> tuple[int, int]:
        """hook: start the sandbox's processes from ``image_dir`` (its bundle is ready in ``d``); returns the
        init's pid and start time."""
        (d / "criu-work").mkdir()
        pid_file = d / "init.pid"
        code = await self._userland_crun(
            "restore", "--detach", *_CRIU_OPTS, f"--bundle={d}", f"--image-path={image_dir / self.IMAGE_SUBDIR}",
            f"--work-path={d / 'criu-work'}", f"--pid-file={pid_file}", spec.id,
            binds=[self.state_dir, image_dir, self.init_bind.parent], err_path=d / "crun.err")
        if code != 0:
            raise RuntimeFailure(f"restore of {spec.id} failed (exit {code})",
                                 detail=_failure_detail(d / "crun.err", d / "criu-work" / "restore.log"))
        return _started_init(pid_file, spec.id, "restore")

    async def restore(self, spec: SandboxSpec, image_dir: Path) -> Handle:
        why = self.checkpoint_unsupported()
        if why:
            raise RuntimeFailure("restore is not supported on this host", detail=why)
        d = self._dir(spec.id)
        kept = (d / LAYER_KEPT).is_file()      # a checkpoint left its writable layer here: resume with it
        if d.exists() and not kept:
            raise RuntimeFailure(f"sandbox {spec.id} already exists", detail=str(d))
        image_dir = Path(image_dir).resolve()
        try:
            meta = json.loads((image_dir / CHECKPOINT_META).read_text())
        except (OSError, ValueError) as e:
            raise RuntimeFailure(f"{image_dir} is not a complete checkpoint image", detail=str(e)) from e
        if meta.get("format") != CHECKPOINT_FORMAT or meta.get("id") != spec.id:
            raise RuntimeFailure(f"checkpoint image {image_dir} does not fit sandbox {spec.id}",
                                 detail=f"format={meta.get('format')} id={meta.get('id')}")
        if meta.get("runtime", "crun") != self.name:
            raise RuntimeFailure(f"checkpoint image {image_dir} was written by {meta.get('runtime')}, not {self.name}")
        layer = d if kept else image_dir
        has_disk = (layer / diskquota.IMAGE).is_file()
        if not (has_disk or (layer / "upper").is_dir()) or not (image_dir / self.IMAGE_SUBDIR).is_dir():
            raise RuntimeFailure(f"checkpoint image {image_dir} is incomplete (no disk.img or upper/, or no "
                                 f"{self.IMAGE_SUBDIR}/)")
        # ``moved``: the writable layer is out of the image, so a failed restore puts it back (or keeps it
        # in ``d`` again); a kept layer is out of it from the start, and a teardown without ``save_to``
        # would delete its only copy
        moved, ok = kept, False
        try:
            for p in (d / "rootfs", d / "exec"):
                p.mkdir(parents=True, exist_ok=kept)
            self._make_run_dir(d)
            # the writable layer is renamed in (and back out on failure: the image stays retryable)
            if has_disk:
                try:
                    if not kept:
                        await anyio.to_thread.run_sync(diskquota.move_image, image_dir / diskquota.IMAGE,
                                                       d / diskquota.IMAGE)
                    moved = True
                    if not os.path.ismount(d / diskquota.MOUNT):
                        await anyio.to_thread.run_sync(diskquota.mount_image, d)
                except OSError as e:
                    raise RuntimeFailure(f"cannot mount the disk of {spec.id}", detail=str(e)) from e
            elif kept:
                moved = True
            elif spec.disk_mb:      # paused before it had a disk of its own: it gets one now
                await anyio.to_thread.run_sync(self._make_disk, d, spec.disk_mb)
            upper, work = diskquota.layer_dirs(d)
            work.mkdir(exist_ok=True)
            if not has_disk and not kept:
                try:
                    if upper.parent == d:
                        os.rename(image_dir / "upper", upper)
                        moved = True
                    else:
                        raise OSError("a copy onto the sandbox's disk")
                except OSError:
                    try:
                        await anyio.to_thread.run_sync(_copy_tree, image_dir / "upper", upper)
                    except (OSError, subprocess.CalledProcessError) as e:
                        raise RuntimeFailure(f"cannot copy the writable layer of {spec.id}", detail=str(e)) from e
            config = self._mount_and_configure(spec, d)
            pid, start = await self._restore_init(spec, d, image_dir)
            await self._ctl_signal(d, pid, signal.SIGUSR2, want=True, wait=0.5)
            self._defaults[spec.id] = self._defaults_from(config)
            (d / LAYER_KEPT).unlink(missing_ok=True)
            ok = True
            return Handle(id=spec.id, pid=pid, pid_start_time=start, bundle=str(d),
                          extra={"cgroup": "/" + self._cgroup(spec.id), "crun_root": str(self.crun_root)})
        finally:
            if not ok:
                with anyio.CancelScope(shield=True):
                    self._defaults.pop(spec.id, None)
                    await self._teardown(spec.id, save_to=image_dir if moved else None)

    # -- instance lifetime -----------------------------------------------------------------------
    def cleanup_parent(self) -> None:
        """rmdir this instance's cgroup parent in every hierarchy, with any sandbox cgroup a teardown could
        not remove yet (its processes were still dying), killing what is left in them first."""
        cgroups.remove_tree(self.cgroup_parent, timeout=10.0)

    async def close(self) -> None:
        await anyio.to_thread.run_sync(self.disk_spares.close)
        await anyio.to_thread.run_sync(self.cleanup_parent)
        # the init's tmpfs goes with the last sandbox of this state dir (running ones hold their own bind)
        if not any(p.is_dir() for p in self.sandboxes_dir.iterdir()):
            try:
                pdfs.umount_init(self.init_dir)
            except MountError:
                pass
