"""Host preparation for rootful crun on this machine kind (cgroup v1 with a stray hugetlb on the v2 mount).

``prepare_host()`` is idempotent and needs root:
- crun refuses hybrid cgroups while ``/sys/fs/cgroup/unified/cgroup.controllers`` is non-empty (a stray
  ``hugetlb``); mounting a v1 ``hugetlb`` hierarchy at ``/sys/fs/cgroup/hugetlb`` empties it;
- raises ``fs.inotify.max_user_instances`` and ``kernel.pid_max`` (never lowers them);
- checks that ``crun`` is installed.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from pilldrops.node.isolation import cgroups
from pilldrops.node.isolation.mounts import MountError, is_mountpoint, mount

CGROUP_ROOT = Path("/sys/fs/cgroup")
SYSCTL_MINIMUMS: dict[str, int] = {
    "fs/inotify/max_user_instances": 8192,
    "kernel/pid_max": 4194304,
}


class HostNotReady(RuntimeError):
    """The host cannot run sandboxes; the message says what to do."""


def require_crun() -> str:
    path = shutil.which("crun")
    if not path:
        raise HostNotReady("crun is not installed: run `scripts/install-system-deps` (as root) first")
    return path


def _fix_hybrid_cgroups() -> None:
    controllers = CGROUP_ROOT / "unified" / "cgroup.controllers"
    if not controllers.exists() or not controllers.read_text().split():
        return
    stray = controllers.read_text().split()
    for ctrl in stray:
        target = CGROUP_ROOT / ctrl
        if is_mountpoint(target):
            continue
        target.mkdir(exist_ok=True)
        try:
            mount(b"cgroup", str(target).encode(), b"cgroup", 0, ctrl.encode())
        except MountError as e:
            raise HostNotReady(f"cannot mount v1 cgroup hierarchy {ctrl} at {target}: {e}") from e
        cgroups.forget()
    left = controllers.read_text().split()
    if left:
        raise HostNotReady(f"cgroup v2 still lists controllers {left}; crun refuses hybrid mode")


def _raise_sysctls() -> dict[str, int]:
    out = {}
    for key, minimum in SYSCTL_MINIMUMS.items():
        p = Path("/proc/sys") / key
        current = int(p.read_text().split()[0])
        if current < minimum:
            p.write_text(f"{minimum}\n")
            current = minimum
        out[key.replace("/", ".")] = current
    return out


def prepare_host() -> dict[str, object]:
    """Make this host able to run crun sandboxes. Idempotent. Returns what it found/set."""
    if os.geteuid() != 0:
        raise HostNotReady("prepare_host needs root")
    crun = require_crun()
    _fix_hybrid_cgroups()
    sysctls = _raise_sysctls()
    return {"crun": crun, "sysctls": sysctls}
