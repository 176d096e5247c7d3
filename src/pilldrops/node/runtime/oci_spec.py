"""Pure builder of a sandbox's OCI runtime spec (config.json) for crun. No I/O.

What a sandbox gets: pid/mount/network(lo only)/ipc/uts/cgroup namespaces,
a cgroup under ``/<cgroup_parent>/<id>`` with cpu quota = vcpu, memory = memory_mb (no swap) and a pids
limit, Docker's default capabilities minus NET_RAW and MKNOD, ``noNewPrivileges``, a default-allow seccomp
profile denying the kernel-admin / namespace / introspection syscalls, the masked and read-only /proc and
/sys paths ``crun spec`` emits, and the init binary bind-mounted read-only at ``INIT_PATH_IN_SANDBOX``.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

from pilldrops.node.runtime.base import SandboxSpec

INIT_PATH_IN_SANDBOX = "/.pd/init"
RUN_DIR_IN_SANDBOX = "/.pd/run"      # pd-init's control socket (bind-mounted rw; immutable once bound: fsflags)
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
CPU_PERIOD = 100_000
MIN_QUOTA = 1000                     # the kernel's CFS floor (1 ms); the API refuses vcpu below 0.01
SHM_SIZE = "65536k"
NOFILE = 65536

CAPABILITIES = [
    "CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_FSETID", "CAP_FOWNER", "CAP_SETGID", "CAP_SETUID",
    "CAP_SETFCAP", "CAP_SETPCAP", "CAP_NET_BIND_SERVICE", "CAP_SYS_CHROOT", "CAP_KILL", "CAP_AUDIT_WRITE",
]

MASKED_PATHS = [
    "/proc/acpi", "/proc/kcore", "/proc/keys", "/proc/latency_stats", "/proc/timer_list",
    "/proc/timer_stats", "/proc/sched_debug", "/sys/firmware", "/proc/scsi", "/sys/devices/virtual/powercap",
]
READONLY_PATHS = ["/proc/asound", "/proc/bus", "/proc/fs", "/proc/irq", "/proc/sys", "/proc/sysrq-trigger"]

EPERM = 1
ENOSYS = 38

DENIED_SYSCALLS = [
    "keyctl", "add_key", "request_key", "bpf", "kexec_load", "kexec_file_load", "init_module",
    "finit_module", "delete_module", "mount", "umount2", "move_mount", "open_tree", "fsopen", "fsmount",
    "fspick", "pivot_root", "swapon", "swapoff", "reboot", "acct", "settimeofday", "clock_settime",
    "clock_adjtime", "adjtimex", "perf_event_open", "userfaultfd", "unshare", "setns",
    "io_uring_setup", "io_uring_enter", "io_uring_register",
    "open_by_handle_at", "name_to_handle_at", "quotactl", "iopl", "ioperm", "lookup_dcookie",
    "process_vm_readv", "process_vm_writev", "kcmp", "syslog", "vm86", "vm86old", "uselib", "nfsservctl",
]

CLONE_NS_FLAGS = {
    "CLONE_NEWNS": 0x20000,
    "CLONE_NEWCGROUP": 0x2000000,
    "CLONE_NEWUTS": 0x4000000,
    "CLONE_NEWIPC": 0x8000000,
    "CLONE_NEWUSER": 0x10000000,
    "CLONE_NEWPID": 0x20000000,
    "CLONE_NEWNET": 0x40000000,
}

# personality(2) values Docker allows; every other value is denied with EPERM.
PERSONALITY_ALLOWED = (0x0, 0x8, 0x20000, 0x20008, 0xFFFFFFFF)
_HIGH = 1 << 31


def _personality_rules() -> list[dict[str, Any]]:
    """Deny personality(x) unless x is in PERSONALITY_ALLOWED, with single-comparison rules only.

    With bit 31 clear, only bits 3 and 17 may be set: deny ``x & (b|bit31) == b`` for every other bit b.
    With bit 31 set, only 0xffffffff is allowed: deny ``x & (b|bit31) == bit31`` for every bit b < 31.
    (The kernel reads the argument as a 32-bit unsigned int.)
    """
    rules = []
    for b in range(31):
        mask = 1 << b
        values = [_HIGH] if mask & 0x20008 else [mask, _HIGH]
        for value in values:
            rules.append({
                "names": ["personality"], "action": "SCMP_ACT_ERRNO", "errnoRet": EPERM,
                "args": [{"index": 0, "value": mask | _HIGH, "valueTwo": value, "op": "SCMP_CMP_MASKED_EQ"}],
            })
    return rules


def personality_allowed(x: int) -> bool:
    """What the rules above decide for ``x`` (used by the unit test to prove the rules)."""
    for r in _personality_rules():
        a = r["args"][0]
        if x & a["value"] == a["valueTwo"]:
            return False
    return True


@functools.lru_cache(maxsize=1)
def seccomp_profile() -> dict[str, Any]:
    """The profile (built once per process and shared: callers must not mutate it)."""
    syscalls: list[dict[str, Any]] = [
        {"names": list(DENIED_SYSCALLS), "action": "SCMP_ACT_ERRNO", "errnoRet": EPERM},
        {"names": ["clone3"], "action": "SCMP_ACT_ERRNO", "errnoRet": ENOSYS},
    ]
    for flag in CLONE_NS_FLAGS.values():
        syscalls.append({
            "names": ["clone"], "action": "SCMP_ACT_ERRNO", "errnoRet": EPERM,
            "args": [{"index": 0, "value": flag, "valueTwo": flag, "op": "SCMP_CMP_MASKED_EQ"}],
        })
    syscalls.extend(_personality_rules())
    return {
        "defaultAction": "SCMP_ACT_ALLOW",
        "architectures": ["SCMP_ARCH_X86_64", "SCMP_ARCH_X86", "SCMP_ARCH_X32"],
        "syscalls": syscalls,
    }


def merged_env(base: dict[str, str] | None, extra: dict[str, str] | None) -> list[str]:
    env: dict[str, str] = {"PATH": DEFAULT_PATH, "HOME": "/root", "TERM": "xterm"}
    env.update(base or {})
    env.update(extra or {})
    return [f"{k}={v}" for k, v in env.items()]


def build_spec(spec: SandboxSpec, *, rootfs: Path, init_path: Path, cgroup_parent: str,
               template_env: dict[str, str] | None = None, nofile: int = NOFILE,
               run_dir: Path | None = None) -> dict[str, Any]:
    """The OCI config for ``spec`` with root ``rootfs`` (the overlay merged dir), as a JSON-able dict.

    ``nofile`` is RLIMIT_NOFILE (soft = hard); the caller caps it at its own hard limit when it lacks
    CAP_SYS_RESOURCE (crun's setrlimit fails with EPERM otherwise). ``run_dir`` (a host directory) is
    bind-mounted read-write at ``RUN_DIR_IN_SANDBOX``: pd-init then listens on ``ctl`` there and the agent
    runs commands through it (the fast exec path); without it pd-init is only an init. Once the socket is
    there the runtime makes the directory immutable (``isolation.fsflags``): the sandbox cannot replace it.
    """
    if spec.vcpu <= 0 or spec.memory_mb <= 0 or spec.pids_limit <= 0:
        raise ValueError(f"limits must be positive: vcpu={spec.vcpu} memory_mb={spec.memory_mb} "
                         f"pids_limit={spec.pids_limit}")
    memory = int(spec.memory_mb) * 1024 * 1024
    caps = list(CAPABILITIES)
    return {
        "ociVersion": "1.0.0",
        "process": {
            "terminal": False,
            "user": {"uid": 0, "gid": 0},
            "args": [INIT_PATH_IN_SANDBOX],
            "env": merged_env(template_env, spec.envs),
            "cwd": spec.workdir or "/",
            "capabilities": {"bounding": caps, "effective": caps, "permitted": caps,
                             "inheritable": [], "ambient": []},
            "rlimits": [{"type": "RLIMIT_NOFILE", "hard": nofile, "soft": nofile}],
            "noNewPrivileges": True,
        },
        "root": {"path": str(rootfs), "readonly": False},
        "hostname": spec.hostname,
        "mounts": [
            {"destination": "/proc", "type": "proc", "source": "proc"},
            {"destination": "/dev", "type": "tmpfs", "source": "tmpfs",
             "options": ["nosuid", "strictatime", "mode=755", "size=65536k"]},
            {"destination": "/dev/pts", "type": "devpts", "source": "devpts",
             "options": ["nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620", "gid=5"]},
            {"destination": "/dev/shm", "type": "tmpfs", "source": "shm",
             "options": ["nosuid", "noexec", "nodev", "mode=1777", f"size={SHM_SIZE}"]},
            {"destination": "/dev/mqueue", "type": "mqueue", "source": "mqueue",
             "options": ["nosuid", "noexec", "nodev"]},
            {"destination": "/sys", "type": "sysfs", "source": "sysfs",
             "options": ["nosuid", "noexec", "nodev", "ro"]},
            {"destination": "/sys/fs/cgroup", "type": "cgroup", "source": "cgroup",
             "options": ["nosuid", "noexec", "nodev", "relatime", "ro"]},
            {"destination": INIT_PATH_IN_SANDBOX, "type": "bind", "source": str(init_path),
             "options": ["bind", "ro", "nosuid", "nodev"]},
        ] + ([{"destination": RUN_DIR_IN_SANDBOX, "type": "bind", "source": str(run_dir),
               "options": ["bind", "rw", "nosuid", "nodev", "noexec"]}] if run_dir is not None else []),
        "linux": {
            "cgroupsPath": f"/{cgroup_parent.strip('/')}/{spec.id}",
            "resources": {
                "devices": [{"allow": False, "access": "rwm"}],
                "cpu": {"quota": max(MIN_QUOTA, round(spec.vcpu * CPU_PERIOD)), "period": CPU_PERIOD},
                "memory": {"limit": memory, "swap": memory},
                "pids": {"limit": int(spec.pids_limit)},
            },
            "namespaces": [{"type": t} for t in ("pid", "network", "ipc", "uts", "mount", "cgroup")],
            "maskedPaths": list(MASKED_PATHS),
            "readonlyPaths": list(READONLY_PATHS),
            "seccomp": seccomp_profile(),
        },
    }
