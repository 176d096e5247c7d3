"""Leak check for anything a runtime leaves on the host: crun containers, mounts, cgroups, processes.

``before = snapshot(crun_roots=[...])`` ... ``assert_no_leaks(before)`` fails listing every new item:
- containers in ``crun --root <r> list`` for each given root, and in ``runsc --root <r> list`` for each of
  ``runsc_roots`` (gVisor), with every live process whose command line names such a root (runsc's sandbox
  and gofer processes), and files left in the root;
- ``/proc/self/mountinfo`` mount points containing ``match``;
- cgroup dirs whose name contains ``match`` under ``/sys/fs/cgroup/*`` (depth <= 3);
- loop devices whose backing file's path contains ``match`` (a sandbox's disk image, issue 16);
- live processes whose ``/proc/<pid>/cgroup`` mentions ``match``. Zombies are ignored: a killed sandbox
  init is re-parented to the host's pid 1, and on this machine kind pid 1 (process_api) reaps only every
  few seconds; a zombie holds no memory, mount or cgroup.
- with ``net_prefix`` (sandbox egress, issue 14): network links and named netns whose name starts with it;
  with ``nft_table``: that ``inet`` table, its per-sandbox chains (``sb*``) and its verdict-map elements.
``match`` defaults to "pilldrops"; tests scope it to their session's unique name so that other
PillDrops processes on the same machine cannot make them fail.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")


def _containers(roots: list[Path]) -> set[str]:
    out = set()
    for r in roots:
        if not Path(r).exists():
            continue
        p = subprocess.run(["crun", "--root", str(r), "list", "--format", "json"], capture_output=True, check=False)
        if p.returncode == 0 and p.stdout.strip():
            out |= {f"crun:{r}:{c['id']}" for c in json.loads(p.stdout) or []}
    return out


def _runsc(roots: list[Path]) -> set[str]:
    out: set[str] = set()
    for r in roots:
        if not Path(r).exists():
            continue
        p = subprocess.run(["runsc", "--root", str(r), "list", "--format", "json"], capture_output=True, check=False)
        if p.returncode == 0 and p.stdout.strip():
            out |= {f"runsc:{r}:{c['id']}" for c in json.loads(p.stdout) or []}
        out |= {f"file:{f}" for f in Path(r).iterdir()}
    wanted = [str(Path(r)).encode() for r in roots]
    for name in os.listdir("/proc") if wanted else []:
        if not name.isdigit():
            continue
        try:
            cmd = Path(f"/proc/{name}/cmdline").read_bytes()
            stat = Path(f"/proc/{name}/stat").read_bytes()
        except OSError:
            continue
        if stat[stat.rindex(b")") + 2:].startswith(b"Z"):
            continue
        if any(w in cmd for w in wanted):
            argv0 = cmd.split(b"\0")[0].decode(errors="replace")
            out.add(f"proc:{name}:{argv0}")
    return out


def _loops(match: str) -> set[str]:
    out = set()
    for dev in Path("/sys/block").glob("loop*"):
        try:
            backing = (dev / "loop" / "backing_file").read_text().strip()
        except OSError:
            continue                    # not attached
        if match in backing:
            out.add(f"loop:{dev.name}:{backing}")
    return out


def _mounts(match: str) -> set[str]:
    with open("/proc/self/mountinfo") as f:
        return {f"mount:{line.split()[4]}" for line in f if match in line.split()[4]}


def _cgroups(match: str) -> set[str]:
    out = set()
    if not CGROUP_ROOT.is_dir():
        return out
    for h in CGROUP_ROOT.iterdir():
        if not h.is_dir():
            continue
        for root, dirs, _ in os.walk(h):
            depth = len(Path(root).relative_to(h).parts)
            for d in dirs:   # a matching dir, or anything below one (a sandbox cgroup under its parent)
                if match in d or match in str(Path(root).relative_to(h)):
                    out.add(f"cgroup:{root}/{d}")
            if depth >= 2:
                dirs[:] = []
    return out


def _procs(match: str) -> set[str]:
    out = set()
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            cg = Path(f"/proc/{name}/cgroup").read_text()
        except OSError:
            continue
        if match in cg:
            try:
                stat = Path(f"/proc/{name}/stat").read_bytes()
                if stat[stat.rindex(b")") + 2:].startswith(b"Z"):
                    continue
            except (OSError, ValueError):
                continue
            try:
                comm = Path(f"/proc/{name}/comm").read_text().strip()
            except OSError:
                comm = "?"
            out.add(f"proc:{name}:{comm}")
    return out


def _qemu(dirs: list[Path]) -> set[str]:
    """microVM leftovers under each dir (a microvm runtime's state dir or cache): live processes whose
    command line mentions the dir (QEMU, virtiofsd, a migration's cat), sockets, sandbox dirs
    (``pilldrops-vms/<id>``) and temp dirs of an unfinished boot or image build (``*.tmp``)."""
    out: set[str] = set()
    if not dirs:
        return out
    keys = [str(d).encode() for d in dirs]
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            cmdline = Path(f"/proc/{name}/cmdline").read_bytes()
            stat = Path(f"/proc/{name}/stat").read_bytes()
        except OSError:
            continue
        if any(k in cmdline for k in keys) and not stat[stat.rindex(b")") + 2:].startswith(b"Z"):
            argv0 = cmdline.split(b"\0")[0].decode(errors="replace")
            out.add(f"proc:{name}:{argv0}")
    for d in dirs:
        for root, subdirs, files in os.walk(d):
            rel = Path(root).relative_to(d)
            for f in files:
                p = Path(root) / f
                if p.is_socket() or f.endswith(".tmp"):
                    out.add(f"file:{p}")
            for sd in subdirs:
                if rel.name == "pilldrops-vms" or sd.endswith(".tmp") or sd.startswith("pilldrops-img-"):
                    out.add(f"dir:{Path(root) / sd}")
            if len(rel.parts) >= 3:
                subdirs[:] = []
    return out


def _net(prefix: str | None, table: str | None) -> set[str]:
    out: set[str] = set()
    if prefix:
        out |= {f"link:{n}" for n in os.listdir("/sys/class/net") if n.startswith(prefix)}
        netns = Path("/run/netns")
        if netns.is_dir():
            out |= {f"netns:{n}" for n in os.listdir(netns) if n.startswith(prefix)}
    if table:
        p = subprocess.run(["nft", "-j", "list", "table", "inet", table], capture_output=True, check=False)
        if p.returncode == 0:
            out.add(f"nft:{table}")
            for obj in json.loads(p.stdout or b"{}").get("nftables", []):
                if "chain" in obj and obj["chain"]["name"].startswith("sb"):
                    out.add(f"nftchain:{table}:{obj['chain']['name']}")
                if "map" in obj:
                    for elem in obj["map"].get("elem") or []:
                        out.add(f"nftelem:{table}:{json.dumps(elem[0] if isinstance(elem, list) else elem)}")
    return out


def snapshot(crun_roots: list[Path] | None = None, match: str = "pilldrops",
             runsc_roots: list[Path] | None = None, *, qemu_dirs: list[Path] | None = None,
             net_prefix: str | None = None, nft_table: str | None = None,
             ignore: tuple[str, ...] = ()) -> dict[str, object]:
    """``ignore``: items naming any of these strings are not counted (e.g. a running node's spare disks)."""
    roots = [Path(r) for r in (crun_roots or [])]
    gv = [Path(r) for r in (runsc_roots or [])]
    qdirs = [Path(d) for d in (qemu_dirs or [])]
    items = (_containers(roots) | _runsc(gv) | _mounts(match) | _loops(match) | _cgroups(match) | _procs(match)
             | _qemu(qdirs) | _net(net_prefix, nft_table))
    items = {i for i in items if not any(x in i for x in ignore)}
    return {"roots": roots, "match": match, "runsc_roots": gv, "qemu_dirs": qdirs, "net_prefix": net_prefix,
            "nft_table": nft_table, "ignore": ignore, "items": items}


def leaks(before: dict[str, object]) -> set[str]:
    now = snapshot(before["roots"], before["match"], before.get("runsc_roots"),  # type: ignore[arg-type]
                   qemu_dirs=before.get("qemu_dirs"), net_prefix=before.get("net_prefix"),  # type: ignore[arg-type]
                   nft_table=before.get("nft_table"), ignore=before.get("ignore", ()))  # type: ignore[arg-type]
    return now["items"] - before["items"]  # type: ignore[operator]


def assert_none_left(*, net_prefix: str, nft_table: str, settle: float = 5.0) -> None:
    """Fail if any link, netns or nft object of that prefix/table exists (after an agent's exit)."""
    assert_no_leaks({"roots": [], "match": "\0never", "net_prefix": net_prefix, "nft_table": nft_table,
                     "items": set()}, settle=settle)


UNMOUNTED_LOOP_GRACE_S = 30.0


def _unmounted_loop(item: str) -> bool:
    """A loop device of a deleted disk image that no mount of ours names any more: its mount was copied into
    the mount namespace of a process that was starting at that moment (another sandbox's ``crun run``,
    CRIU's or runsc's set-up copy the host's mounts before they drop them), and the kernel detaches the
    device (autoclear) when that last copy goes. Seconds under load; still a leak if it stays."""
    if not (item.startswith("loop:") and item.endswith("(deleted)")):
        return False
    dev = "/dev/" + item.split(":")[1]
    return not any(f" {dev} " in ln for ln in Path("/proc/self/mountinfo").read_text().splitlines())


def _holders(dev: str) -> list[str]:
    """The processes whose mount namespace still has ``dev`` mounted (for the failure message)."""
    out = []
    for d in Path("/proc").iterdir():
        try:
            if d.name.isdigit() and f" {dev} " in (d / "mountinfo").read_text():
                out.append(f"{d.name}:{(d / 'comm').read_text().strip()}")
        except OSError:
            continue
    return out


def assert_no_leaks(before: dict[str, object], *, settle: float = 2.0) -> None:
    """Fail if anything new is still there after up to ``settle`` seconds (processes take a moment to go;
    an unmounted loop device whose mount another namespace still holds gets ``UNMOUNTED_LOOP_GRACE_S``)."""
    start = time.monotonic()
    new = leaks(before)
    while new:
        waited = time.monotonic() - start
        if waited >= UNMOUNTED_LOOP_GRACE_S or (waited >= settle and not all(map(_unmounted_loop, new))):
            break
        time.sleep(0.05)
        new = leaks(before)
    held = {i: _holders("/dev/" + i.split(":")[1]) for i in new if i.startswith("loop:")}
    assert not new, "leaked: " + ", ".join(sorted(new)) + (f" (mounted in: {held})" if held else "")
