"""The gVisor runtime (isolation ``gvisor``, issue 11): the crun runtime's OCI bundle run by ``runsc``.

gVisor puts a user-space kernel (the Sentry) between the sandbox and the host: the sandbox's system calls are
served by the Sentry (ptrace platform here: no usable KVM), files reach the host through a separate gofer
process. Everything about the bundle is ``CrunRuntime``'s (subclassed, not copied): the sandbox dir, the
overlay root over the template layers, config.json from ``oci_spec`` (same namespaces, capabilities, seccomp
profile, CPU quota and memory limit), pd-init as PID 1, teardown, and the checkpoint image's writable layer.
What differs is in the hooks:

- every ``runsc`` call is ``runsc --root <state>/runsc --platform=ptrace --network=none --host-uds=all
  --overlay2=none --oci-seccomp``. ``--overlay2=none`` makes writes go to the host overlay (the writable
  layer, like crun; /tmp stays gVisor's own tmpfs, as runsc mounts one there), ``--oci-seccomp`` applies the
  spec's seccomp profile inside the Sentry (crun's denials hold here too), ``--host-uds=all`` lets pd-init
  bind its control socket in ``/.pd/run`` so that the host can connect to it: the fast exec path works
  under gVisor (measured: ``run("true")`` 35 ms through pd-init vs 47 ms with ``runsc exec``). That flag
  also lets the sandbox connect to host unix sockets inside its own mounts; its mounts are its rootfs and
  ``/.pd``, which hold no host sockets but its own;
- the pids limit is enforced on the host, by the sandbox's pids cgroup, set to ``PROCESS_TASKS`` × the spec's
  + ``RUNTIME_PIDS``: gVisor's own threads count there (33 idle, 64-66 once the Go runtime has grown its thread pool, measured), and on the ptrace platform each
  sandbox process costs about four host tasks (its stub process and the Sentry thread that traces it;
  measured 439 for 103 processes). This gVisor has no pids controller of its own (its cgroupfs has cpu and
  memory only) and ignores RLIMIT_NPROC, so a fork inside never fails with EAGAIN: at the limit the Sentry
  cannot make a host task and the whole sandbox ends (reported stopped), never the host. Likewise memory:
  past ``memory_mb`` the host OOM-kills the Sentry, i.e. the whole sandbox (``oom_killed``);
- ``handle.pid`` is the Sentry's host pid (the sandbox's processes are not host processes), so pd-init is
  signalled with ``runsc kill``, and an exec's pid is never a host pid;
- the Sentry re-parents an orphan to PID 1 in spite of the shepherd's PR_SET_CHILD_SUBREAPER, so pd-init
  runs with ``--cgroups`` (``with_command_cgroups``): each command in a cgroup of its own on a cgroupfs only
  pd-init can reach, and a timeout or kill ends every process listed there, also one that left the
  command's session after its parent exited (tests/hostile/test_detach.py);
- terminals (``exec(pty=...)``) go through pd-init as under crun; this runsc answers TIOCGPTPEER ENOTTY,
  so pd-init opens the terminal side by its number in the sandbox's devpts (pd-init.c, ``pty_peer``);
- without pd-init's socket (``PILLDROPS_EXEC=crun``, benchmarks) a command is ``runsc exec --process``
  (``exec_process``: the capabilities of a command pd-init runs, never pd-init's CAP_SYS_ADMIN); its kill
  kills the command's tree inside the sandbox (``runsc ps`` + ``runsc kill --pid``: an orphan that left the
  session before is not in that tree);
- pause is ``runsc checkpoint`` (pd-init closes its socket first: gVisor cannot save a bound host socket,
  and an image holding any host pipe or socket does not restore, so a pause while the Sentry holds one it
  did not start with is refused with that reason and the sandbox keeps running) and resume ``runsc restore``
  of the same bundle; the image is ``runsc/checkpoint.img`` + ``upper/``.

``destroy`` takes ~1.7 s (``runsc delete`` waits for the Sentry to be reaped; measured in
bench/RESULTS.md). runsc's container id is ``pd<hash of the root>-<sandbox id>``: it names runsc's control
socket in the host-wide abstract namespace, so the same sandbox id under two roots never collides.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import shutil
import subprocess
from pathlib import Path

import anyio

from pilldrops.node.isolation import spawn
from pilldrops.node.isolation.execproc import PipeExec
from pilldrops.node.isolation.host import HostNotReady
from pilldrops.node.isolation.superexec import parse_ids
from pilldrops.node.runtime.base import Handle, RuntimeFailure, SandboxSpec
from pilldrops.node.runtime.crun import CrunRuntime, _started_init
from pilldrops.node.runtime.registry import Probe

RUNSC_FLAGS = ("--platform=ptrace", "--network=none", "--host-uds=all", "--overlay2=none", "--oci-seccomp")
RUNTIME_PIDS = 128          # host tasks of gVisor itself (Sentry + gofer threads: 33 idle, 64-66 after a few commands), beyond the workload's
PROCESS_TASKS = 4           # host tasks per sandbox process on the ptrace platform (measured ~3.9)
CHANNELS_KEY = "sentry_channels"
MOUNT_SYSCALLS = ("mount", "umount2")   # allowed by gVisor's seccomp for pd-init's cgroupfs (CAP_SYS_ADMIN gates them)


def _channels(pid: int | None) -> set[str]:
    """The host sockets and pipes the process ``pid`` (the Sentry) holds (``socket:[N]``, ``pipe:[N]``)."""
    out = set()
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
                if link.startswith(("socket:", "pipe:")):
                    out.add(link)
    except OSError:
        pass
    return out


def require_runsc() -> str:
    path = shutil.which("runsc")
    if not path:
        raise HostNotReady("runsc not installed (scripts/install-system-deps installs Debian's runsc)")
    return path


def runsc_version() -> str:
    try:
        r = subprocess.run([require_runsc(), "--version"], capture_output=True, text=True, timeout=10, check=False)
    except (HostNotReady, OSError, subprocess.TimeoutExpired):
        return ""
    return (r.stdout.splitlines() or [""])[0].strip()


def probe() -> Probe:
    """``gvisor`` runs here when runsc is installed (the ptrace platform needs no KVM)."""
    try:
        require_runsc()
    except HostNotReady as e:
        return Probe(False, str(e))
    version = runsc_version()
    if not version:
        return Probe(False, "runsc --version failed")
    return Probe(True, detail=f"ptrace, {version.removeprefix('runsc version ')}")


class RunscExec(PipeExec):
    """``runsc exec`` of one command (no fast path). Killing the ``runsc exec`` client does not reach into the
    sandbox, so ``kill`` also kills the command's tree there: its in-sandbox pid (``--internal-pid-file``)
    and every descendant ``runsc ps`` shows."""

    def __init__(self, argv: list[str], *, cmd: list[str], sandbox_id: str, internal_pid_file: Path,
                 **kw: object) -> None:
        self._ctl = cmd                    # runsc with its global flags, no subcommand
        self._sid = sandbox_id
        self._ipid_file = internal_pid_file
        super().__init__(argv, **kw)       # type: ignore[arg-type]

    def _kill_sync(self) -> None:
        try:
            root = int(self._ipid_file.read_text().strip())
        except (OSError, ValueError):
            root = None
        if root is not None and self._popen.poll() is None:
            with contextlib.suppress(OSError, subprocess.SubprocessError, ValueError):
                r = subprocess.run([*self._ctl, "ps", self._sid], capture_output=True, timeout=10, check=False)
                children: dict[int, list[int]] = {}
                for line in r.stdout.decode(errors="replace").splitlines()[1:]:   # UID PID PPID C TTY ...
                    cols = line.split()
                    if len(cols) > 2 and cols[1].isdigit() and cols[2].isdigit():
                        children.setdefault(int(cols[2]), []).append(int(cols[1]))
                todo, tree = [root], []
                while todo:
                    pid = todo.pop()
                    tree.append(pid)
                    todo.extend(children.get(pid, []))
                for pid in tree:
                    subprocess.run([*self._ctl, "kill", f"--pid={pid}", self._sid, "KILL"],
                                   capture_output=True, timeout=10, check=False)
        super()._kill_sync()

    def _set_done(self) -> None:
        self._ipid_file.unlink(missing_ok=True)
        self._ipid_file.with_suffix(".json").unlink(missing_ok=True)   # its process.json (GvisorRuntime._exec_cmd)
        super()._set_done()


class GvisorRuntime(CrunRuntime):
    """``Runtime`` backed by gVisor's runsc (ptrace platform). Needs root."""

    name = "gvisor"
    ROOT_SUBDIR = "runsc"
    IMAGE_SUBDIR = "runsc"
    HOST_PIDS = False
    SHEPHERD_EXEC = False   # runsc re-parents orphans to PID 1 in spite of a subreaper: no use here
    CTL_WAIT = 10.0    # the Sentry starts pd-init slowly under load; the fast path keeps host pipes out of it
    COMMAND_CGROUPS = True   # pd-init --cgroups (with_command_cgroups); False only for bench/detach.py's baseline

    @staticmethod
    def _binary() -> str:
        return require_runsc()

    def _cid(self, sandbox_id: str) -> str:
        # runsc names its control socket after the container id in the host's abstract namespace: the same
        # sandbox id in two runsc roots (two agents or test sessions on one host) must not collide
        return f"{self._tag}-{sandbox_id}"

    def _sid(self, cid: str) -> str | None:
        return cid.removeprefix(f"{self._tag}-") if cid.startswith(f"{self._tag}-") else None

    @functools.cached_property
    def _tag(self) -> str:
        return "pd" + hashlib.sha256(str(self.crun_root).encode()).hexdigest()[:8]

    def _cmd(self, *args: str) -> list[str]:
        return [self.crun, "--root", str(self.crun_root), *RUNSC_FLAGS, *args]

    def _config(self, spec: SandboxSpec, d: Path) -> dict:  # type: ignore[type-arg]
        config = super()._config(spec, d)
        config["linux"]["resources"]["pids"]["limit"] = PROCESS_TASKS * int(spec.pids_limit) + RUNTIME_PIDS
        return with_command_cgroups(config) if self.COMMAND_CGROUPS else config

    def _exec_cmd(self, sandbox_id: str, argv: list[str], env: dict[str, str], cwd: str, pid_file: Path,
                  user: str | None = None) -> list[str]:
        # ``--process``, never argv + ``--env``: without explicit capabilities ``runsc exec`` gives the command
        # the container's process capabilities, i.e. pd-init's CAP_SYS_ADMIN (with_command_cgroups); and
        # ``--cap`` would also put every capability in the inheritable set, and give them to a non-root user
        d = pid_file.parent.parent                                 # <sandbox dir>/exec/<id>.pid
        try:
            config = json.loads((d / "config.json").read_bytes())
        except (OSError, ValueError) as e:
            raise RuntimeFailure(f"sandbox {d.name} has no readable config.json", detail=str(e)) from e
        try:
            process = exec_process(config, argv, env, cwd, user)
        except ValueError as e:
            raise RuntimeFailure(str(e)) from e
        process_file = pid_file.with_suffix(".json")
        process_file.write_text(json.dumps(process))
        return self._cmd("exec", f"--process={process_file}", f"--internal-pid-file={pid_file}", sandbox_id)

    def _fallback_exec(self, handle: Handle, cmd: list[str], pid_file: Path, **kw: object) -> PipeExec:
        return RunscExec(cmd, cmd=self._cmd(), sandbox_id=self._cid(handle.id), internal_pid_file=pid_file, **kw)

    async def _signal_init(self, sandbox_id: str, pid: int, sig: int) -> bool:
        r = await self._run(self._cmd("kill", self._cid(sandbox_id), str(int(sig))))
        return r.returncode == 0

    async def create(self, spec: SandboxSpec) -> Handle:
        return self._with_channels(await super().create(spec))

    async def restore(self, spec: SandboxSpec, image_dir: Path) -> Handle:
        return self._with_channels(await super().restore(spec, image_dir))

    @staticmethod
    def _with_channels(handle: Handle) -> Handle:
        """Record the Sentry's own host channels (control and gofer sockets, pd-init's listener, stdio)."""
        handle.extra[CHANNELS_KEY] = " ".join(sorted(_channels(handle.pid)))
        return handle

    # -- pause / resume -----------------------------------------------------------------------------
    def checkpoint_unsupported(self) -> str | None:
        return None        # runsc checkpoint/restore work on this kernel (tests/integration/test_gvisor_runtime.py)

    async def _dump(self, handle: Handle, d: Path, image_dir: Path, images: Path) -> tuple[int, str]:
        # A host socket or pipe held inside the Sentry makes the image unrestorable ("failed to set host FD N
        # non-blocking"): every connection pd-init accepted is one (it closes a command's connection just
        # after the command ended, and the agent ended them all), and so is the stdio of a command started
        # with `runsc exec` (a background child it left keeps it). Wait until the Sentry holds no host
        # channel it did not have at start; else refuse the pause (the sandbox keeps running).
        own = set(handle.extra.get(CHANNELS_KEY, "").split())
        deadline = anyio.current_time() + 3.0
        while (extra := _channels(handle.pid) - own) and anyio.current_time() < deadline:
            await anyio.sleep(0.005)
        if extra:
            return 1, (f"a process in the sandbox holds {len(extra)} host pipe(s)/socket(s) gVisor cannot save "
                       "(a command's connection still open, or the stdio of a command started with `runsc "
                       "exec`, e.g. kept by its background child): it cannot be paused until they are closed")
        err = d / "runsc-checkpoint.err"
        with open(err, "wb") as f:  # noqa: ASYNC230 - local file, no wait
            r = await self._run(self._cmd("checkpoint", f"--image-path={images}", self._cid(handle.id)),
                                stdout=f, stderr=spawn.STDOUT)
        return r.returncode, (_first_lines(err) if r.returncode else "")

    @staticmethod
    def _versions() -> str:
        return runsc_version()

    async def _restore_init(self, spec: SandboxSpec, d: Path, image_dir: Path) -> tuple[int, int]:
        pid_file, err = d / "init.pid", d / "crun.err"
        with open(err, "wb") as f:  # noqa: ASYNC230 - local file, no wait
            r = await self._run(
                self._cmd("restore", "--detach", f"--image-path={image_dir / self.IMAGE_SUBDIR}",
                          f"--pid-file={pid_file}", "--bundle", str(d), self._cid(spec.id)),
                stdout=spawn.DEVNULL, stderr=f)
        if r.returncode != 0:
            raise RuntimeFailure(f"runsc restore of {spec.id} failed (exit {r.returncode})", detail=_first_lines(err))
        return _started_init(pid_file, spec.id, "restore", err_file=err)


def with_command_cgroups(config: dict) -> dict:  # type: ignore[type-arg]
    """``config`` for pd-init's cgroup per command (``--cgroups``; pd-init.c, ``cg_setup``): the Sentry
    re-parents an orphan to PID 1 in spite of the shepherd's PR_SET_CHILD_SUBREAPER, so only a cgroup links
    a detached process to its command. pd-init mounts gVisor's cgroupfs once at start, detaches it and then
    drops CAP_SYS_ADMIN; for that it gets CAP_SYS_ADMIN in its permitted and effective sets but NOT in the
    bounding set (nothing it forks and execs has it; a ``runsc exec`` gets explicit capabilities without it,
    ``exec_process``, as runsc would otherwise give it the container's), and the seccomp profile lets
    ``mount``/``umount2`` through: without CAP_SYS_ADMIN gVisor answers them EPERM, as the profile did."""
    process = config["process"]
    process["args"] = [*process["args"], "--cgroups"]
    caps = process["capabilities"]
    for key in ("effective", "permitted"):
        caps[key] = [*caps[key], "CAP_SYS_ADMIN"]
    seccomp = dict(config["linux"]["seccomp"])         # the shared profile is never mutated
    seccomp["syscalls"] = [{**rule, "names": [n for n in rule["names"] if n not in MOUNT_SYSCALLS]}
                           for rule in seccomp["syscalls"]]
    seccomp["syscalls"] = [rule for rule in seccomp["syscalls"] if rule["names"]]
    config["linux"]["seccomp"] = seccomp
    return config


def exec_process(config: dict, argv: list[str], env: dict[str, str], cwd: str,  # type: ignore[type-arg]
                 user: str | None = None) -> dict:  # type: ignore[type-arg]
    """The OCI process (``runsc exec --process``) of a command in the sandbox of ``config``, with the
    capabilities a command pd-init runs has: as root, the bounding set in every set but the (empty)
    inheritable and ambient ones, as another user none but the bounding set (pd-init's setuid clears them).
    Never pd-init's own CAP_SYS_ADMIN (``with_command_cgroups`` adds it to effective and permitted only)."""
    proc = config["process"]
    bounding = list(proc["capabilities"]["bounding"])
    uid, gid = parse_ids(user) if user else (0, 0)
    held = bounding if uid == 0 else []
    return {"terminal": False, "user": {"uid": uid, "gid": gid}, "args": list(argv),
            "env": [f"{k}={v}" for k, v in env.items()], "cwd": cwd,
            "capabilities": {"bounding": bounding, "effective": held, "permitted": held,
                             "inheritable": [], "ambient": []},
            "noNewPrivileges": bool(proc.get("noNewPrivileges", True))}


def _first_lines(path: Path, n: int = 6, width: int = 600) -> str:
    """The start of runsc's error output (a Go panic's first lines say what failed; the stack does not)."""
    try:
        lines = [ln for ln in path.read_text(errors="replace").splitlines() if ln.strip() and not ln.startswith("\t")]
    except OSError:
        return ""
    return "\n".join(ln[:width] for ln in lines[:n])
