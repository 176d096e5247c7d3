"""Process-tree helpers over /proc: start times (pid-reuse guard) and killing a whole tree.

``kill_tree`` first SIGSTOPs the tree (so nothing forks while we look), re-walking /proc until no new
descendant appears, then SIGKILLs everything it saw plus the process group.
"""

from __future__ import annotations

import os
import signal


def stat_fields(pid: int) -> list[str] | None:
    """/proc/<pid>/stat split after the comm field: index 0 is field 3 (state). One ``os.read`` (the file is
    a few hundred bytes, read whole by one read), no buffered file object: ~10 us less per call, and the
    monitor asks this for every live sandbox on every tick."""
    try:
        fd = os.open(f"/proc/{pid}/stat", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        data = os.read(fd, 4096)
    except OSError:
        return None
    finally:
        os.close(fd)
    end = data.rfind(b")")
    return data[end + 2:].decode().split() if end >= 0 else None


def start_time(pid: int) -> int | None:
    """Field 22 of /proc/<pid>/stat (start time in clock ticks since boot)."""
    f = stat_fields(pid)
    return int(f[19]) if f else None


def ppid(pid: int) -> int | None:
    f = stat_fields(pid)
    return int(f[1]) if f else None


def alive(pid: int, start: int | None = None) -> bool:
    f = stat_fields(pid)
    if not f or f[0] == "Z":
        return False
    return start is None or int(f[19]) == start


def _children_map() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        f = stat_fields(int(name))
        if f:
            kids.setdefault(int(f[1]), []).append(int(name))
    return kids


def descendants(root: int) -> set[int]:
    kids = _children_map()
    out: set[int] = set()
    todo = [root]
    while todo:
        for c in kids.get(todo.pop(), []):
            if c not in out:
                out.add(c)
                todo.append(c)
    return out


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except OSError:
        pass


def kill_tree(root: int, *, pgid: int | None = None, include_root: bool = True) -> set[int]:
    """SIGKILL ``root`` and every descendant (and process group ``pgid``). Returns the pids signalled."""
    seen: set[int] = {root} if include_root else set()
    if include_root:
        _signal(root, signal.SIGSTOP)
    for _ in range(100):
        new = descendants(root) - seen
        if not new:
            break
        for p in new:
            _signal(p, signal.SIGSTOP)
        seen |= new
    if pgid is not None and pgid > 1:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except OSError:
            pass
    for p in seen:
        _signal(p, signal.SIGKILL)
    return seen
