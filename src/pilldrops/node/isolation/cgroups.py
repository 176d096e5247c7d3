"""cgroup v1 helpers: where a sandbox's cgroups live, its OOM counter, and removing leftovers.

crun (cgroupfs manager) creates ``/sys/fs/cgroup/<hierarchy>/<parent>/<id>`` in every v1 hierarchy and
removes them at delete; these helpers find and remove what is left (e.g. after a crash).
"""

from __future__ import annotations

import errno
import os
import time
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")


_cache: tuple[tuple[str, ...], list[Path]] | None = None


def _scan() -> list[Path]:
    out = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            parts = line.split()
            mp = parts[4]
            fstype = parts[parts.index("-") + 1]
            if fstype in ("cgroup", "cgroup2") and mp.startswith(str(CGROUP_ROOT) + "/"):
                out.append(Path(mp))
    return sorted(set(out))


def hierarchies() -> list[Path]:
    """Mounted cgroup hierarchy roots under /sys/fs/cgroup (v1 ones, plus unified).

    The mount table is read once and again only when the listing of /sys/fs/cgroup changes (a hierarchy
    mounted on a new directory) or ``forget`` is called (``host.prepare_host`` after it mounts one): with
    thousands of sandboxes the table holds 3 mounts each, and parsing it cost ~17 ms of CPU per kill at
    6,000 lines (bench/RESULTS.md, issue 15)."""
    global _cache
    try:
        names = tuple(sorted(os.listdir(CGROUP_ROOT)))
    except OSError:
        names = ()
    if _cache is None or _cache[0] != names:
        _cache = (names, _scan())
    return list(_cache[1])


def forget() -> None:
    """The next ``hierarchies`` reads the mount table again."""
    global _cache
    _cache = None


def cgroup_dirs(rel: str) -> list[Path]:
    rel = rel.strip("/")
    return [h / rel for h in hierarchies() if (h / rel).is_dir()]


def oom_kill_count(rel: str) -> int:
    """The memory cgroup's ``oom_kill`` counter (0 when the cgroup is gone)."""
    try:
        text = (CGROUP_ROOT / "memory" / rel.strip("/") / "memory.oom_control").read_text()
    except OSError:
        return 0
    for line in text.splitlines():
        k, _, v = line.partition(" ")
        if k == "oom_kill":
            return int(v)
    return 0


def remove_tree(rel: str, *, timeout: float = 10.0) -> list[Path]:
    """rmdir ``rel`` (children first) in every hierarchy; retries while busy. Returns what is left."""
    left: list[Path] = []
    for d in cgroup_dirs(rel):
        subdirs = sorted((Path(r) for r, _, _ in os.walk(d)), key=lambda p: len(p.parts), reverse=True)
        for sd in subdirs:
            deadline = time.monotonic() + timeout
            while True:
                try:
                    sd.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError as e:
                    if e.errno != errno.EBUSY or time.monotonic() > deadline:
                        left.append(sd)
                        break
                    _kill_procs(sd)
                    time.sleep(0.02)
    return left


def _kill_procs(d: Path) -> None:
    try:
        pids = [int(x) for x in (d / "cgroup.procs").read_text().split()]
    except OSError:
        return
    for pid in pids:
        try:
            os.kill(pid, 9)
        except OSError:
            pass
