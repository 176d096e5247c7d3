"""Where the host memory of N live sandboxes goes: PillDrops against raw crun, per kernel cache.

    .venv/bin/python bench/membreak.py [--n 200] [--template tiny] [--memory-mb 64] [--disk-mb 10240]
                                       [--modes pd,raw,rawdisk] [--top 25] [--json out.json]

Needs root and crun. For each mode, one after the other in this process (``live.py``'s harness: its own
``pilldrops up``, the same raw crun containers), N live at once, and a snapshot before (after a 2 s
settle) and with N live (2 s settle):

- ``pd``: N PillDrops sandboxes through the SDK (each with the node's default disk);
- ``raw``: N raw crun containers (``_harness.Raw``: same spec builder, layers and pd-init), no disk;
- ``rawdisk``: the same with the node's disk quota (``isolation.diskquota``, ``--disk-mb``) on each.

A mode may repeat under another name (``raw2``; a name with ``disk`` in it gets the disk): the order
matters, because slab pages an earlier phase freed are reused by the next one (``--shrink`` returns
them to the page allocator before each "before" snapshot).

Printed per sandbox (the delta divided by the live count): /proc/meminfo (MemAvailable, Slab,
SUnreclaim, AnonPages, Percpu, KernelStack, PageTables, Buffers), every /proc/slabinfo cache that moved
(bytes of its slabs), cgroup directories per v1 hierarchy, host mounts, and for ``pd`` the anonymous
memory of `up` (and its Python children) and of the sandboxes' own processes (smaps_rollup). The kernel
merges caches of one object size (``slab_nomerge`` is off): a line names the merged cache.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from _harness import PID, RAW_PARENT, Raw, Up, check_leaks, meminfo, python_tree
from rich import box
from rich.console import Console
from rich.table import Table

from pilldrops import Sandbox

console = Console(width=170)
MEM = ("MemAvailable", "Slab", "SReclaimable", "SUnreclaim", "AnonPages", "Percpu", "KernelStack", "PageTables",
       "Buffers", "Cached", "Shmem")
PAGE = os.sysconf("SC_PAGESIZE")


def slabinfo() -> dict[str, int]:
    """cache name -> bytes of its slabs."""
    out = {}
    with open("/proc/slabinfo") as f:
        for line in f.readlines()[2:]:
            p = line.split()
            out[p[0]] = int(p[14]) * int(p[5]) * PAGE     # num_slabs * pagesperslab
    return out


def cgroup_counts() -> dict[str, int]:
    out = {}
    for h in sorted(Path("/sys/fs/cgroup").iterdir()):
        n = 0
        for _r, dirs, _f in os.walk(h):
            n += len(dirs)
        out[h.name] = n
    return out


def mounts() -> int:
    with open("/proc/self/mountinfo") as f:
        return sum(1 for _ in f)


def shrink_slabs() -> None:
    """Give the kernel's empty slab pages back (``/sys/kernel/slab/*/shrink``): what an earlier phase's
    teardown left in partial slabs is otherwise reused by the next phase and hidden from its delta."""
    for p in Path("/sys/kernel/slab").glob("*/shrink"):
        try:
            p.write_text("1")
        except OSError:
            pass


def snap(shrink: bool = False) -> dict:  # type: ignore[type-arg]
    if shrink:
        shrink_slabs()
    time.sleep(2)
    return {"mem": meminfo(), "slab": slabinfo(), "cg": cgroup_counts(), "mounts": mounts()}


def anon_kib(pid: int) -> tuple[int, int]:
    """(Rss, Anonymous) KiB of a process from smaps_rollup."""
    rss = anon = 0
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for ln in f:
                if ln.startswith("Rss:"):
                    rss = int(ln.split()[1])
                elif ln.startswith("Anonymous:"):
                    anon = int(ln.split()[1])
    except OSError:
        pass
    return rss, anon


def procs_in(cg_match: str) -> list[int]:
    out = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                if cg_match in (p / "cgroup").read_text():
                    out.append(int(p.name))
            except OSError:
                continue
    return out


def delta(a: dict, b: dict, n: int) -> dict:  # type: ignore[type-arg]
    n = n or 1
    d = {"n": n, "mem": {k: (b["mem"].get(k, 0) - a["mem"].get(k, 0)) / n for k in MEM},
         "slab": {k: (b["slab"].get(k, 0) - a["slab"].get(k, 0)) / n for k in set(a["slab"]) | set(b["slab"])},
         "cg": {k: (b["cg"].get(k, 0) - a["cg"].get(k, 0)) / n for k in b["cg"]},
         "mounts": (b["mounts"] - a["mounts"]) / n}
    d["mem"]["used"] = -d["mem"].pop("MemAvailable")
    return d


def run_pd(a: argparse.Namespace, up: Up) -> dict:  # type: ignore[type-arg]
    kw = {"api_url": up.url, "api_key": up.key}
    for _ in range(3):
        Sandbox.create(template=a.template, memory_mb=a.memory_mb, **kw).kill()
    ups = python_tree(up.proc.pid)
    up0 = {p: anon_kib(p) for p in ups}
    s0 = snap(a.shrink)
    with ThreadPoolExecutor(8) as pool:
        live = list(pool.map(lambda i: Sandbox.create(template=a.template, memory_mb=a.memory_mb, timeout=3600,
                                                      **kw), range(a.n)))
    if a.use:
        with ThreadPoolExecutor(8) as pool:
            list(pool.map(lambda sb: sb.run("true"), live))
    s1 = snap()
    d = delta(s0, s1, len(live))
    up1 = {p: anon_kib(p) for p in python_tree(up.proc.pid)}
    d["up"] = {str(p): {"rss0": up0.get(p, (0, 0))[0], "anon0": up0.get(p, (0, 0))[1], "rss1": r, "anon1": an}
               for p, (r, an) in up1.items()}
    sp = [anon_kib(p) for p in procs_in(f"/pilldrops-bench{PID}-")]
    d["sandbox_procs"] = {"count": len(sp), "rss_kib": sum(x[0] for x in sp), "anon_kib": sum(x[1] for x in sp)}
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda sb: sb.kill(), live))
    return d


def run_raw(a: argparse.Namespace, up: Up, pre: str, disk_mb: int) -> dict:  # type: ignore[type-arg]
    raw = Raw(up.data, a.template, a.memory_mb, sub=f"bench{pre}", disk_mb=disk_mb)
    try:
        def create(i: int) -> str:
            return raw.start(f"{pre}{PID}-{i}")
        raw.warm_up(pre)
        s0 = snap(a.shrink)
        with ThreadPoolExecutor(8) as pool:
            live = list(pool.map(create, range(a.n)))
        if a.use:
            with ThreadPoolExecutor(8) as pool:
                list(pool.map(raw.exec_true, live))
        s1 = snap()
        d = delta(s0, s1, len(live))
        sp = [anon_kib(p) for p in procs_in(f"/{RAW_PARENT}/")]
        d["sandbox_procs"] = {"count": len(sp), "rss_kib": sum(x[0] for x in sp), "anon_kib": sum(x[1] for x in sp)}
        with ThreadPoolExecutor(8) as pool:
            list(pool.map(raw.cleanup, live))
        return d
    finally:
        raw.cleanup_all()


def kib(x: float) -> str:
    return f"{x / 1024:,.1f}"


def report(res: dict, top: int) -> None:  # type: ignore[type-arg]
    modes = list(res)
    t = Table(box=box.ASCII2, title="KiB per live sandbox (delta with N live / N)")
    t.add_column("figure")
    for m in modes:
        t.add_column(f"{m} (N={res[m]['n']})", justify="right")
    if "pd" in res and "raw" in res:
        t.add_column("pd − raw", justify="right")
    for k in ("used", *MEM[1:]):
        row = [kib(res[m]["mem"][k]) for m in modes]
        if "pd" in res and "raw" in res:
            row.append(kib(res["pd"]["mem"][k] - res["raw"]["mem"][k]))
        t.add_row(f"meminfo {k}", *row)
    caches = sorted({c for m in modes for c, v in res[m]["slab"].items() if abs(v) >= 512},
                    key=lambda c: -max(abs(res[m]["slab"].get(c, 0)) for m in modes))[:top]
    for c in caches:
        row = [kib(res[m]["slab"].get(c, 0)) for m in modes]
        if "pd" in res and "raw" in res:
            row.append(kib(res["pd"]["slab"].get(c, 0) - res["raw"]["slab"].get(c, 0)))
        t.add_row(f"slab {c}", *row)
    for h in sorted({h for m in modes for h in res[m]["cg"]}):
        row = [f"{res[m]['cg'].get(h, 0):.2f}" for m in modes]
        if "pd" in res and "raw" in res:
            row.append(f"{res['pd']['cg'].get(h, 0) - res['raw']['cg'].get(h, 0):+.2f}")
        t.add_row(f"cgroup dirs: {h}", *row)
    t.add_row("host mounts", *(f"{res[m]['mounts']:.2f}" for m in modes),
              *([f"{res['pd']['mounts'] - res['raw']['mounts']:+.2f}"] if "pd" in res and "raw" in res else []))
    t.add_row("sandbox processes: count", *(f"{res[m]['sandbox_procs']['count'] / res[m]['n']:.2f}" for m in modes))
    t.add_row("sandbox processes: Anonymous KiB", *(f"{res[m]['sandbox_procs']['anon_kib'] / res[m]['n']:.1f}"
                                                      for m in modes))
    t.add_row("sandbox processes: Rss KiB", *(f"{res[m]['sandbox_procs']['rss_kib'] / res[m]['n']:.1f}"
                                              for m in modes))
    console.print(t)
    if "pd" in res:
        for p, v in res["pd"]["up"].items():
            console.print(f"up process {p}: Rss {v['rss0']} → {v['rss1']} KiB, Anonymous {v['anon0']} → "
                          f"{v['anon1']} KiB ({(v['anon1'] - v['anon0']) / res['pd']['n']:.1f} KiB a sandbox)")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=200)
    ap.add_argument("--template", default="tiny")
    ap.add_argument("--memory-mb", type=int, default=64)
    ap.add_argument("--disk-mb", type=int, default=10240, help="the rawdisk mode's disk (the node's default)")
    ap.add_argument("--modes", default="pd,raw,rawdisk")
    ap.add_argument("--use", action="store_true", help="run `true` in each before the live snapshot")
    ap.add_argument("--shrink", action="store_true", help="shrink every slab cache before each 'before' snapshot")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("needs root")
    tmp = Path(tempfile.mkdtemp(prefix=f"pilldrops-bench{PID}-"))
    cap = ["--capacity-vcpu", str(max(a.n * 1.1, 128)), "--capacity-memory-mb", str(int(a.n * a.memory_mb * 1.1) + 4096),
           "--unlimited-credits"]
    res: dict = {}  # type: ignore[type-arg]
    up = Up(tmp, a.template, extra=cap)
    code = 0
    try:
        for m in a.modes.split(","):
            console.print(f"{time.strftime('%H:%M:%S')} {m} ...")
            res[m] = run_pd(a, up) if m == "pd" else run_raw(a, up, m, a.disk_mb if "disk" in m else 0)
    finally:
        up.stop(timeout=600)
        roots = [tmp / "data" / "node" / "crun", *(tmp / "data" / f"bench{m}" / "crun" for m in a.modes.split(","))]
        left = check_leaks(tmp, roots, settle=10)
        if left:
            console.print(f"[red]left behind ({len(left)}); {tmp} kept:[/]\n" + "\n".join(left[:50]))
            code = 1
        else:
            shutil.rmtree(tmp)
    report(res, a.top)
    if a.json:
        a.json.write_text(json.dumps(res, indent=1))
    return code


if __name__ == "__main__":
    sys.exit(main())
