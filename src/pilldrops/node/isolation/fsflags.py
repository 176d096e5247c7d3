"""The immutable inode flag (``chattr +i``) on host directories a sandbox sees (issue 16 item 2).

A sandbox's ``/.pd/run`` is a host directory bind-mounted read-write (pd-init must bind its control socket
there, and gVisor's gofer reaches host sockets only that way). Once the socket is there the agent sets
``FS_IMMUTABLE_FL`` on the directory: no entry can then be created, removed or renamed in it by anyone
without ``CAP_LINUX_IMMUTABLE``, which no sandbox has, so its root cannot replace the socket with a server
of its own. The agent clears the flag before it asks pd-init to close the socket (a pause) and before it
removes the sandbox's directory. A filesystem without the flag (``ENOTTY``/``EOPNOTSUPP``) leaves the
directory as it was: the agent's side of the channel bounds every frame either way.
"""

from __future__ import annotations

import array
import contextlib
import fcntl
import os
from pathlib import Path

FS_IOC_GETFLAGS = 0x80086601
FS_IOC_SETFLAGS = 0x40086602
FS_IMMUTABLE_FL = 0x00000010


def _set(path: Path, on: bool) -> bool:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        buf = array.array("i", [0])
        fcntl.ioctl(fd, FS_IOC_GETFLAGS, buf, True)
        flags = buf[0] | FS_IMMUTABLE_FL if on else buf[0] & ~FS_IMMUTABLE_FL
        if flags != buf[0]:
            fcntl.ioctl(fd, FS_IOC_SETFLAGS, array.array("i", [flags]))
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def lock_dir(path: str | Path) -> bool:
    """Make ``path`` immutable; False when the filesystem (or a missing dir) does not allow it."""
    return _set(Path(path), True)


def unlock_dir(path: str | Path) -> bool:
    return _set(Path(path), False)


def is_locked(path: str | Path) -> bool:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            buf = array.array("i", [0])
            fcntl.ioctl(fd, FS_IOC_GETFLAGS, buf, True)
            return bool(buf[0] & FS_IMMUTABLE_FL)
        finally:
            os.close(fd)
    return False
