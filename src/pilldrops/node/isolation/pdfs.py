"""The two host places a sandbox sees at ``/.pd``, each on a tmpfs of its own (issue 16 item 9).

A bind mount's line in ``/proc/self/mountinfo`` names the path of its source inside the source's file system
(the "root" field): a bind from a directory of the data dir shows that host path to the sandbox, whatever the
mount options say. So neither bind comes from the data dir's file system:

- ``/.pd/run`` (pd-init's control socket) is bound from ``<sandbox dir>/pd``, a tiny tmpfs mounted there per
  sandbox (``mount_run_dir``): its root field is ``/``, its source ``pd``. tmpfs keeps the immutable flag
  (``isolation.fsflags``, kernel 6.0+), and the size cap bounds what the sandbox's root can write there
  before the directory is locked;
- ``/.pd/init`` is bound from ``<state dir>/pd-init/init-<hash>``, a copy of the built init on one tmpfs per runtime
  state dir (``init_copy``; root field ``/init-<hash>``), mounted when the runtime starts and kept across agent
  restarts (re-adopted and restored sandboxes find it at the same path), unmounted by the runtime's close.

Both are host mounts below the runtime's state dir: the agent and CRIU (which binds the state dir) reach the
socket at the same path as before.
"""

from __future__ import annotations

import errno
import hashlib
import os
from pathlib import Path

from pilldrops.node.isolation.mounts import MS_NODEV, MS_NOEXEC, MS_NOSUID, is_mountpoint, mount, umount

RUN_OPTS = b"mode=0700,size=64k,nr_inodes=16"
INIT_OPTS = b"mode=0755,size=16m,nr_inodes=64"
INIT_NAME = "init"


def mount_run_dir(path: Path) -> None:
    """Make ``path`` (a new directory) and mount the sandbox's run tmpfs on it."""
    path.mkdir(mode=0o700)
    mount(b"pd", path, b"tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, RUN_OPTS)


def umount_run_dir(path: Path) -> None:
    """Unmount it (not mounted / missing is fine: a sandbox of an older agent, a half-made one)."""
    umount(path)


def init_copy(directory: Path, init: Path) -> Path:
    """A copy of ``init`` on the tmpfs mounted at ``directory`` (mounted if it is not), named by its content:
    runtimes with different inits on one state dir each bind their own, and a rebuilt init never replaces
    the file a checkpointed sandbox's init came from. When the tmpfs is full, the other copies go."""
    directory.mkdir(parents=True, exist_ok=True)
    if not is_mountpoint(directory):
        mount(b"pd-init", directory, b"tmpfs", MS_NOSUID | MS_NODEV, INIT_OPTS)
    data = init.read_bytes()
    target = directory / f"{INIT_NAME}-{hashlib.sha256(data).hexdigest()[:16]}"
    if target.is_file() and target.stat().st_size == len(data):
        return target
    tmp = directory / f".{INIT_NAME}.{os.getpid()}.tmp"
    for attempt in range(2):
        try:
            tmp.write_bytes(data)
            break
        except OSError as e:
            tmp.unlink(missing_ok=True)
            if e.errno != errno.ENOSPC or attempt:
                raise
            for old in directory.glob(f"{INIT_NAME}-*"):
                old.unlink()      # a sandbox running it keeps its inode
    os.chmod(tmp, 0o755)
    os.replace(tmp, target)
    return target


def umount_init(directory: Path) -> None:
    umount(directory)
