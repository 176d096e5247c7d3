"""QEMU processes for microVM sandboxes: the command line, a daemonized launch, host cgroups, kill, and
the KVM probe (shared/reference isolation.md §6, §10.5 for what was measured on this machine kind).

A VM runs ``qemu-system-x86_64 -M microvm`` with the Debian kernel and the initramfs from ``guest``, one
virtio-blk disk (the sandbox's qcow2 overlay), one virtio-serial port (``pd.agent``, the agent channel: no
vhost-vsock on these hosts) and a QMP socket. QEMU is started with ``-daemonize -pidfile``: it is never a
child of the node agent (it is re-parented to init), so killing the agent leaves VMs running, and the
parent's exit status says whether QEMU initialised. Sockets are bound relative to the sandbox dir (QEMU's
cwd at start) and connected through ``/proc/self/fd/<dir fd>/``: no 108-byte ``sun_path`` limit on
state-dir paths. ``-sandbox on`` (seccomp) is on, minus ``spawn=deny``: the snapshot is written by
``migrate exec:cat``. (``elevateprivileges=deny`` makes ``-daemonize`` fail with QEMU 7.2.)

Under TCG the kernel needs ``tsc_early_khz`` (else ~2/3 of boots hang in ``calibrate_delay``); under KVM it
is left out (kvmclock knows the real frequency).
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from pilldrops.node.isolation import cgroups, procs

QEMU = "qemu-system-x86_64"
# init_on_free: freed guest pages are zeroed, so a snapshot holds only live memory (96 -> 56 MiB for tiny)
APPEND = "console=ttyS0 panic=-1 loglevel=4 quiet init_on_free=1 rdinit=/init"
TCG_APPEND = " tsc_early_khz=2000000"    # TCG only: without it ~2/3 of boots hang calibrating the TSC


def kernel_append(accel: str) -> str:
    return APPEND + (TCG_APPEND if accel != "kvm" else "")
MEMORY_OVERHEAD_MB = 192        # QEMU + TCG translation cache on top of guest RAM (host memory cgroup)
CPU_PERIOD = 100_000
SANDBOX_OPTS = "on,obsolete=deny,resourcecontrol=deny"
CGROUP_CONTROLLERS = ("cpu", "memory", "pids")


class VmError(Exception):
    def __init__(self, message: str, detail: str = "") -> None:
        super().__init__(f"{message}: {detail}" if detail else message)
        self.message = message
        self.detail = detail


@dataclass(frozen=True)
class VmConfig:
    kernel: str
    initrd: str
    memory_mb: int
    smp: int
    accel: str                  # "tcg" | "kvm"
    tag: str                    # -name (process title): pilldrops-<runtime name>-<sandbox id>

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> VmConfig:
        return cls(**json.loads(text))


def qemu_path() -> str | None:
    return shutil.which(QEMU)


@functools.cache
def qemu_version() -> str:
    r = subprocess.run([QEMU, "--version"], capture_output=True, text=True, check=False)
    return r.stdout.splitlines()[0] if r.returncode == 0 and r.stdout else "?"


def command(cfg: VmConfig, d: Path, *, disk: Path, console: Path | None, incoming: Path | None) -> list[str]:
    accel = ["-accel", "kvm", "-cpu", "host"] if cfg.accel == "kvm" else ["-accel", "tcg,tb-size=16"]
    cmd = [QEMU, "-name", cfg.tag, "-M", "microvm", *accel, "-m", str(cfg.memory_mb), "-smp", str(cfg.smp),
           "-nodefaults", "-no-user-config", "-display", "none", "-no-reboot",
           "-serial", f"file:{console}" if console else "null",
           "-kernel", cfg.kernel, "-initrd", cfg.initrd, "-append", kernel_append(cfg.accel),
           "-drive", f"id=root,file={disk},format=qcow2,if=none,discard=unmap",
           "-device", "virtio-blk-device,drive=root",
           "-device", "virtio-serial-device",
           "-chardev", "socket,id=agent,path=agent.sock,server=on,wait=off",
           "-device", "virtserialport,chardev=agent,name=pd.agent",
           "-qmp", "unix:qmp.sock,server=on,wait=off",
           "-sandbox", SANDBOX_OPTS,
           "-daemonize", "-pidfile", str(d / "qemu.pid"), "-D", str(d / "qemu.log")]
    if incoming is not None:
        cmd += ["-incoming", f"exec:cat {_sh_quote(str(incoming))}"]
    return cmd


def _sh_quote(s: str) -> str:
    return "'" + s.replace("'", "'\\''") + "'"


def log_tail(d: Path, name: str = "qemu.log", limit: int = 2000) -> str:
    try:
        with open(d / name, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - limit))
            return f.read().decode(errors="replace").strip()
    except OSError:
        return ""


def launch(cmd: list[str], d: Path, *, timeout: float = 30.0, cgroup_procs: list[Path] | None = None) -> tuple[int, int]:
    """Start QEMU daemonized with cwd ``d``; returns (pid, start time) once it initialised. With
    ``cgroup_procs`` (from ``cgroup_prepare``) it starts inside those cgroups: every byte it allocates,
    the restored guest RAM included, is charged to and limited by them from the first one."""
    if cgroup_procs:
        cmd = ["/bin/sh", "-c", 'for f in $0; do echo $$ > "$f" || exit 125; done; exec "$@"',
               " ".join(str(p) for p in cgroup_procs), *cmd]
    with open(d / "qemu.log", "ab") as log:
        try:
            r = subprocess.run(cmd, cwd=d, stdin=subprocess.DEVNULL, stdout=log, stderr=log, timeout=timeout,
                               check=False)
        except subprocess.TimeoutExpired as e:
            raise VmError(f"QEMU did not initialise within {timeout:.0f} s", log_tail(d)) from e
    pid = read_pid(d)
    if r.returncode != 0 or pid is None:
        if pid is not None:
            kill(pid, None)
        raise VmError(f"QEMU failed to start (exit {r.returncode})", log_tail(d))
    start = procs.start_time(pid)
    if start is None:
        raise VmError("QEMU exited right after it started", log_tail(d))
    return pid, start


def read_pid(d: Path) -> int | None:
    try:
        return int((d / "qemu.pid").read_text().strip())
    except (OSError, ValueError):
        return None


def is_qemu(pid: int, d: Path) -> bool:
    """``pid`` is a live QEMU of sandbox dir ``d`` (its cmdline names d's pid file): guards pid reuse when
    no start time is known."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    return str(d / "qemu.pid").encode() in cmdline.split(b"\0")


def alive(pid: int | None, start: int | None) -> bool:
    if not pid or not procs.alive(pid, start):
        return False
    try:
        st = Path(f"/proc/{pid}/stat").read_bytes()
        return not st[st.rindex(b")") + 2:].startswith(b"Z")
    except (OSError, ValueError):
        return False


def kill(pid: int, start: int | None, *, wait: float = 10.0) -> bool:
    """SIGKILL the QEMU and wait until it is gone or a zombie (it is not our child: init reaps it). False
    if it was still alive at the deadline. Its only possible child, the ``cat`` of a migration, ends on the
    closed pipe."""
    if not procs.alive(pid, start):
        return True
    try:
        os.kill(pid, signal.SIGKILL)
    except OSError:
        pass
    deadline = time.monotonic() + wait
    while alive(pid, start):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def dir_connector(d: Path, name: str) -> Callable[[socket.socket], None]:
    """A connect function for the unix socket ``d/name`` that works whatever the length of ``d``."""
    def connect(sock: socket.socket) -> None:
        fd = os.open(d, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            st = os.stat(name, dir_fd=fd, follow_symlinks=False)
            import stat as _stat
            if not _stat.S_ISSOCK(st.st_mode):
                raise OSError(f"{d / name} is not a socket")
            sock.connect(f"/proc/self/fd/{fd}/{name}")
        finally:
            os.close(fd)
    return connect


# -- host cgroups (v1): CPU quota = vcpu, memory = guest RAM + overhead ------------------------------------
def cgroup_prepare(rel: str, *, vcpu: float, memory_mb: int, pids: int = 64) -> list[Path]:
    """Make the VM's cgroups with their limits; returns their ``cgroup.procs`` files (for ``launch``).
    A controller that cannot be configured here is left out rather than stopping the VM."""
    out = []
    for ctl in CGROUP_CONTROLLERS:
        base = cgroups.CGROUP_ROOT / ctl
        if not base.is_dir():
            continue
        d = base / rel
        try:
            d.mkdir(parents=True, exist_ok=True)
            if ctl == "cpu":
                (d / "cpu.cfs_period_us").write_text(str(CPU_PERIOD))
                (d / "cpu.cfs_quota_us").write_text(str(max(1000, round(vcpu * CPU_PERIOD))))
            elif ctl == "memory":
                (d / "memory.limit_in_bytes").write_text(str((memory_mb + MEMORY_OVERHEAD_MB) * 1024 * 1024))
            elif ctl == "pids":
                (d / "pids.max").write_text(str(pids))
        except OSError:
            continue
        out.append(d / "cgroup.procs")
    return out


def cgroup_remove_parent(rel: str) -> None:
    """rmdir the runtime's cgroup parent in each controller if it has no VM cgroup left (else keep it)."""
    for ctl in CGROUP_CONTROLLERS:
        try:
            (cgroups.CGROUP_ROOT / ctl / rel).rmdir()
        except OSError:
            pass


# -- KVM probe ---------------------------------------------------------------------------------------------
def kvm_probe(kernel: Path, probe_initrd: Path, *, timeout: float = 1.5) -> tuple[bool, str]:
    """Is KVM usable for microVMs here? A real, timed boot of the guest kernel to a serial marker.

    ``/dev/kvm`` existing is not enough: on a nested paravirtual (kvm_pvm) host KVM_CREATE_VM works but a
    stock guest kernel crawls (isolation.md §6.1). Returns (usable, why not / how fast)."""
    if not os.path.exists("/dev/kvm"):
        return False, "no /dev/kvm"
    if not os.access("/dev/kvm", os.R_OK | os.W_OK):
        return False, "/dev/kvm is not accessible"
    pvm = " (/dev/kvm is kvm_pvm, nested paravirtual KVM: stock guest kernels need a PVM-enabled kernel)" \
        if Path("/sys/module/kvm_pvm").exists() else ""
    cmd = [QEMU, "-M", "microvm", "-accel", "kvm", "-cpu", "host", "-m", "128", "-smp", "1", "-nodefaults",
           "-no-user-config", "-display", "none", "-no-reboot", "-serial", "stdio", "-kernel", str(kernel),
           "-initrd", str(probe_initrd), "-append", "console=ttyS0 panic=-1 loglevel=0 quiet"]
    t0 = time.monotonic()
    p = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         start_new_session=True)
    out = b""
    try:
        out, _ = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, _ = p.communicate()
    took = time.monotonic() - t0
    if b"PD-PROBE-BOOTED" in out:
        return True, f"guest booted under KVM in {took * 1000:.0f} ms"
    if p.returncode not in (None, 0, -9) and b"PD-PROBE-BOOTED" not in out:
        msg = out.decode(errors="replace").strip().splitlines()[-1:] or [""]
        return False, f"QEMU -accel kvm failed: {msg[0][:200]}{pvm}"
    return False, f"the guest kernel did not boot under KVM within {timeout:.1f} s{pvm}"
