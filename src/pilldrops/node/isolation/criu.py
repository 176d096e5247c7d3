"""The CRIU userland for checkpoint/restore (issue 6) and how commands run in it.

Debian 12's crun 1.8.1 has no ``checkpoint`` command and its criu 3.17.1 fails ``criu check`` on this
kernel (``vdso: Unexpected rt vDSO area bounds``). ``scripts/install-criu`` therefore debootstraps a Debian
trixie tree (crun 1.21 with +CRIU, criu 4.1.1, libcriu2, iptables, iproute2) into ``userland_root()``
and writes ``READY_STAMP`` there once ``criu check`` passed. Nothing of it is installed on the host.

``command(argv, binds=...)`` runs ``argv`` with that tree as ``/``: this very file is executed by a bare
interpreter (``python -I -S``, standard library only), which in a private mount namespace

- rbinds the tree onto itself and mounts a fresh ``/proc``;
- rbinds the host's ``/sys`` (with the host's ``/sys/fs/cgroup``: every v1 hierarchy, incl. the
  ``hugetlb`` one ``isolation.host.prepare_host`` mounts, which CRIU's restore needs at that path),
  ``/dev``, and every path in ``binds`` at the same path (a runtime's state dir with the sandboxes'
  overlay mounts under it, image dirs, the init binary's dir; their mount points are created in the tree,
  or in the namespace's own tmpfs ``/tmp`` for paths under /tmp);
- uses the tree's ``/run``, a small tmpfs mounted once on the host (so criu keeps its kernel-features
  cache ``/run/criu.kdat`` between calls: ~25 ms saved per call);
- pivot_roots into the tree, detaches the old root and execs ``argv`` (PATH of the tree).

Mounts made inside (crun's ``criu-root`` bind, CRIU's own) never propagate back to the host, and the
namespace goes away with the command. pivot_root rather than chroot: ``criu check`` in a chroot fails with
``mnt: No parent found for mountpoint``. Overhead: ~20 ms per call (interpreter start + ~8 mounts).
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

DEFAULT_ROOT = Path("/var/lib/pilldrops/criu-trixie")
READY_STAMP = ".pilldrops-criu-ready"        # written by scripts/install-criu after `criu check` passed
USERLAND_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
_HERE = Path(__file__).resolve()

CLONE_NEWNS = 0x20000
MS_BIND = 4096
MS_REC = 16384
MS_PRIVATE = 1 << 18
MNT_DETACH = 2
SYS_PIVOT_ROOT = 155            # x86_64


def userland_root() -> Path:
    """Where the trixie tree lives (``PILLDROPS_CRIU_ROOT`` overrides, for tests or other layouts)."""
    return Path(os.environ.get("PILLDROPS_CRIU_ROOT") or DEFAULT_ROOT)


def _dedupe(binds: Sequence[str | os.PathLike[str]]) -> list[str]:
    """Absolute, resolved, without paths already inside another bind; parents first."""
    out: list[str] = []
    for p in sorted({str(Path(b).resolve()) for b in binds}, key=lambda s: (s.count("/"), s)):
        if p == "/":
            raise ValueError("cannot bind / into the CRIU userland")
        if not any(p == q or p.startswith(q + "/") for q in out):
            out.append(p)
    return out


def command(argv: Sequence[str], *, binds: Sequence[str | os.PathLike[str]] = ()) -> list[str]:
    """The argv that runs ``argv`` inside the userland with ``binds`` visible at their own paths."""
    root = userland_root()
    args = [sys.executable, "-I", "-S", str(_HERE), str(root)]
    for b in _dedupe(binds):
        if b == str(root) or b.startswith(str(root) + "/") or str(root).startswith(b + "/"):
            raise ValueError(f"bind path {b} overlaps the CRIU userland {root}")
        args += ["--bind", b]
    return [*args, "--", *argv]


def ensure_run_tmpfs(root: Path | None = None) -> None:
    """Mount a small tmpfs on ``<root>/run`` (host side, once per boot): criu's kdat cache lives there."""
    root = root or userland_root()
    run = root / "run"
    with open("/proc/self/mountinfo") as f:
        if any(line.split()[4] == str(run) for line in f):
            return
    run.mkdir(exist_ok=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m,mode=0755,nosuid,nodev", "pilldrops-criu-run",
                        str(run)], capture_output=True, text=True, check=False)
    if r.returncode != 0:
        with open("/proc/self/mountinfo") as f:       # a concurrent caller may have won the race
            if not any(line.split()[4] == str(run) for line in f):
                raise OSError(f"cannot mount tmpfs on {run}: {r.stderr.strip()}")


_reasons: dict[str, str | None] = {}


def unavailable_reason() -> str | None:
    """None when checkpoint/restore can work here, else why not (cached per userland for the process)."""
    root = userland_root()
    key = str(root)
    if key in _reasons:
        return _reasons[key]
    reason: str | None = None
    if os.geteuid() != 0:
        reason = "checkpoint/restore needs root"
    elif not (root / READY_STAMP).exists():
        reason = (f"the CRIU userland is not installed at {root}: run `scripts/install-criu` as root "
                  "(Debian 12's crun has no checkpoint command and its criu 3.17 cannot handle this kernel)")
    elif not Path("/sys/fs/cgroup/hugetlb").is_dir():
        reason = "/sys/fs/cgroup/hugetlb is missing (prepare_host mounts it); CRIU restore needs it"
    else:
        try:
            ensure_run_tmpfs(root)
            r = subprocess.run(command(["criu", "check"]), stdin=subprocess.DEVNULL, capture_output=True,
                               text=True, timeout=60, check=False)
            if r.returncode != 0:
                reason = f"`criu check` failed (exit {r.returncode}): {(r.stdout + r.stderr).strip()[-1500:]}"
        except (OSError, subprocess.TimeoutExpired) as e:
            reason = f"cannot run criu in {root}: {e}"
    _reasons[key] = reason
    return reason


def check() -> tuple[int, str]:
    """Run ``criu check`` now (uncached): exit code and output."""
    ensure_run_tmpfs()
    r = subprocess.run(command(["criu", "check"]), stdin=subprocess.DEVNULL, capture_output=True, text=True,
                       timeout=60, check=False)
    return r.returncode, (r.stdout + r.stderr).strip()


# -- the namespace entry (runs as a script under `python -I -S`, standard library only) ----------------
def _enter(root: str, binds: list[str], argv: list[str]) -> None:
    libc = ctypes.CDLL("libc.so.6", use_errno=True)      # (find_library would spawn ldconfig: slow)
    libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
    libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]

    def fail(what: str) -> None:
        e = ctypes.get_errno()
        sys.stderr.write(f"criu userland: {what}: {os.strerror(e)}\n")
        os._exit(125)

    def mount(src: str | None, dst: str, fstype: str | None, flags: int, data: str | None = None) -> None:
        if libc.mount(src and src.encode(), dst.encode(), fstype and fstype.encode(), flags,
                      data and data.encode()) != 0:
            fail(f"mount {src} on {dst}")

    if libc.unshare(CLONE_NEWNS) != 0:
        fail("unshare(CLONE_NEWNS)")
    mount(None, "/", None, MS_REC | MS_PRIVATE)
    mount(root, root, None, MS_BIND | MS_REC)
    mount("proc", root + "/proc", "proc", 0)
    mount("/sys", root + "/sys", None, MS_BIND | MS_REC)
    mount("/dev", root + "/dev", None, MS_BIND | MS_REC)
    mount("tmpfs", root + "/tmp", "tmpfs", 0, "mode=1777")   # private /tmp: mount points below go with it
    for b in binds:
        target = root + b
        os.makedirs(target, exist_ok=True)
        mount(b, target, None, MS_BIND | MS_REC)
    os.makedirs(root + "/.oldroot", exist_ok=True)
    os.chdir(root)
    if libc.syscall(SYS_PIVOT_ROOT, b".", b".oldroot") != 0:
        fail("pivot_root")
    os.chdir("/")
    if libc.umount2(b"/.oldroot", MNT_DETACH) != 0:
        fail("umount /.oldroot")
    env = {"PATH": USERLAND_PATH, "HOME": "/root", "LANG": "C.UTF-8"}
    try:
        os.execvpe(argv[0], argv, env)
    except OSError as e:
        sys.stderr.write(f"criu userland: exec {argv[0]}: {e}\n")
        os._exit(127)


def _main(args: list[str]) -> None:
    root, rest = args[0], args[1:]
    binds = []
    while rest and rest[0] == "--bind":
        binds.append(rest[1])
        rest = rest[2:]
    if not rest or rest[0] != "--" or len(rest) < 2:
        sys.stderr.write("usage: criu.py ROOT [--bind PATH]... -- COMMAND [ARG]...\n")
        os._exit(2)
    _enter(root, binds, rest[1:])


if __name__ == "__main__":
    _main(sys.argv[1:])
