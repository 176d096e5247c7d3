"""Pause / resume (issue 6): CRIU checkpoint and restore of sandboxes holding 64 MiB, 512 MiB and 1 GiB of
live memory, on the real crun runtime (CrunRuntime.checkpoint / restore, trixie crun 1.21 + criu 4.1.1).

    .venv/bin/python bench/pause.py [--sizes 64,512,1024] [--runs 5] [--json out.json]

Needs root, crun and the CRIU userland (scripts/install-criu). What it does:

1. Uses the ``code-interpreter`` template (Python + numpy) from the shared template cache
   (``~/.local/share/pilldrops``; built there the first time, about a minute).
2. Per size: creates a sandbox with ``memory_mb = size + 256`` and starts a Python process that fills
   ``size`` MiB with random 64-bit integers (numpy; incompressible, every page touched), records a
   checksum, then sleeps and writes a heartbeat once a second.
3. ``--runs`` times: reads the sandbox memory cgroup's ``memory.usage_in_bytes`` and the host's
   MemAvailable and AnonPages, times ``checkpoint`` (pause: dump + kill + writable layer moved into the
   image), reads them again 0.2 s later (RAM released; host-wide, so other activity adds noise), times a ``syncfs`` of the image's file system (what a durable pause
   adds: CRIU does not fsync), then times ``restore`` (resume; the image is still in the page cache) and
   deletes the image. After the last run the process recomputes its checksum: it must be unchanged.
4. Baseline in the same run: ``dd`` of 1 GiB into the image dir's file system (buffered, and with
   ``conv=fdatasync``).
5. Prints a table (median, max, per GiB, ratio to the E2B anchor: ~4 s/GiB pause, ~1 s resume; targets
   ≤ 1 s/GiB pause and ≤ 0.5 s resume of 1 GiB) and checks that nothing is left behind.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import anyio
from _harness import DEFAULT_DATA_DIR, MATCH, PID, check_leaks, machine, meminfo
from rich import box
from rich.console import Console
from rich.table import Table

from pilldrops.node.isolation import criu
from pilldrops.node.isolation.host import prepare_host
from pilldrops.node.runtime.base import Handle, SandboxSpec
from pilldrops.node.runtime.crun import CrunRuntime
from pilldrops.node.templates import TemplateStore

console = Console(width=180)
E2B_PAUSE_S_PER_GIB = 4.0
E2B_RESUME_S = 1.0
TARGET_PAUSE_S_PER_GIB = 1.0
TARGET_RESUME_S = 0.5

HOLDER = r"""
import os, signal, sys, time
import numpy as np
mib = int(sys.argv[1])
a = np.random.default_rng().integers(0, 2**63, size=mib * 131072, dtype=np.uint64)
total = int(a.sum(dtype=np.uint64))
open('/tmp/sum0', 'w').write(str(total))
def again(*_):
    open('/tmp/sum1', 'w').write(str(int(a.sum(dtype=np.uint64))))
signal.signal(signal.SIGUSR1, again)
open('/tmp/ready', 'w').write(str(os.getpid()))
n = 0
while True:
    n += 1
    open('/tmp/beat', 'w').write(str(n))
    time.sleep(1)
"""

_libc = ctypes.CDLL("libc.so.6", use_errno=True)


def syncfs(path: Path) -> float:
    fd = os.open(path, os.O_RDONLY)
    try:
        t = time.perf_counter()
        _libc.syncfs(fd)
        return time.perf_counter() - t
    finally:
        os.close(fd)


def dd_throughput(d: Path, src: Path, mib: int = 1024) -> dict[str, float]:
    """MiB/s of ``dd`` writing ``mib`` MiB of random data (from ``src``, read from the page cache) into
    ``d``: buffered (what an undurable dump sees) and with conv=fdatasync (to the disk)."""
    out = {}
    f = d / "dd.bin"
    for label, extra in (("buffered", []), ("fdatasync", ["conv=fdatasync"])):
        syncfs(d)
        t = time.perf_counter()
        subprocess.run(["dd", f"if={src}", f"of={f}", "bs=1M", f"count={mib}", *extra],
                       stdin=subprocess.DEVNULL, capture_output=True, check=True)
        out[label] = mib / (time.perf_counter() - t)
        f.unlink()
    return out


async def sh(rt: CrunRuntime, h: Handle, script: str) -> str:
    p = await rt.exec(h, ["sh", "-c", script], env={}, cwd=None, timeout=120)
    out = b""
    while (c := await p.read()) is not None:
        out += c[1]
    code = await p.wait()
    if code:
        raise RuntimeError(f"{script!r} exited {code}: {out.decode(errors='replace')}")
    return out.decode()


def mem_usage(h: Handle) -> int:
    return int((Path("/sys/fs/cgroup/memory") / h.extra["cgroup"].lstrip("/") / "memory.usage_in_bytes")
               .read_text())


async def bench_size(rt: CrunRuntime, tpl, mib: int, runs: int, work: Path) -> dict[str, list[float]]:  # type: ignore[no-untyped-def]
    spec = SandboxSpec(id=f"p{mib}", layers=tpl.layers, workdir=tpl.workdir, memory_mb=mib + 256,
                       envs=dict(tpl.env))
    h = await rt.create(spec)
    res: dict[str, list[float]] = {k: [] for k in ("pause", "sync", "resume", "image", "usage", "released",
                                                  "anon")}
    try:
        (Path(h.bundle) / "rootfs" / "tmp" / "holder.py").write_text(HOLDER)
        await sh(rt, h, f"python3 /tmp/holder.py {mib} </dev/null >/tmp/holder.log 2>&1 &")
        ready = Path(h.bundle) / "rootfs" / "tmp" / "ready"
        deadline = time.monotonic() + 120
        while not ready.exists():
            if time.monotonic() > deadline:
                raise RuntimeError("holder did not start: " + await sh(rt, h, "cat /tmp/holder.log"))
            await anyio.sleep(0.05)
        holder_pid = ready.read_text().strip()
        await anyio.sleep(0.5)
        for i in range(runs):
            img = work / f"img-{mib}-{i}"
            img.mkdir()
            usage = mem_usage(h)
            m0 = meminfo()
            t = time.perf_counter()
            size = await rt.checkpoint(h, img)
            res["pause"].append(time.perf_counter() - t)
            await anyio.sleep(0.2)
            m1 = meminfo()
            res["released"].append(m1["MemAvailable"] - m0["MemAvailable"])
            res["anon"].append(m0["AnonPages"] - m1["AnonPages"])
            res["sync"].append(syncfs(img))
            res["usage"].append(usage)
            res["image"].append(size)
            t = time.perf_counter()
            h = await rt.restore(spec, img)
            res["resume"].append(time.perf_counter() - t)
            shutil.rmtree(img)
            beat = await sh(rt, h, "cat /tmp/beat")
            console.print(f"  {mib} MiB run {i + 1}/{runs}: pause {res['pause'][-1]:.3f}s "
                          f"(+syncfs {res['sync'][-1]:.3f}s) resume {res['resume'][-1]:.3f}s "
                          f"image {size / 2**20:.1f} MiB, cgroup usage {usage / 2**20:.0f} MiB, "
                          f"MemAvailable +{res['released'][-1] / 2**20:.0f} MiB, AnonPages "
                          f"-{res['anon'][-1] / 2**20:.0f} MiB, heartbeat {beat}")
        await sh(rt, h, f"kill -USR1 {holder_pid}; sleep 0.1; i=0; while [ ! -s /tmp/sum1 ] && [ $i -lt 100 ]; "
                        "do sleep 0.1; i=$((i+1)); done")
        s0 = await sh(rt, h, "cat /tmp/sum0")
        s1 = await sh(rt, h, "cat /tmp/sum1")
        if s0 != s1:
            raise RuntimeError(f"memory changed across checkpoint/restore: {s0} != {s1}")
        console.print(f"  {mib} MiB: checksum of the live memory unchanged after {runs} pause/resume cycles")
    finally:
        await rt.destroy(h)
    return res


def fmt_s(x: float) -> str:
    return f"{x:.3f} s"


async def main_async(args: argparse.Namespace) -> dict[str, object]:
    prepare_host()
    why = criu.unavailable_reason()
    if why:
        sys.exit(f"pause.py: checkpoint/restore unavailable: {why}")
    tpl = TemplateStore(DEFAULT_DATA_DIR).ensure("code-interpreter",
                                                 progress=lambda m: print(f"  {m}", flush=True))
    tmp = Path(tempfile.mkdtemp(prefix=f"{MATCH}-"))
    rt = CrunRuntime(tmp / "state", name=f"bench{PID}")
    work = tmp / "images"
    work.mkdir()
    results: dict[str, object] = {"machine": machine(), "userland": criu.userland_root().joinpath(
        criu.READY_STAMP).read_text().splitlines()[1], "sizes": {}}
    try:
        src = work / "src.bin"
        src.write_bytes(os.urandom(1 << 30))
        results["dd_mib_s"] = dd_throughput(work, src)
        src.unlink()
        for mib in args.sizes:
            results["sizes"][str(mib)] = await bench_size(rt, tpl, mib, args.runs, work)  # type: ignore[index]
    finally:
        for sid in await rt.list_ids():
            await rt.destroy(Handle(id=sid))
        await rt.close()
    left = check_leaks(tmp, [rt.crun_root])
    shutil.rmtree(tmp, ignore_errors=True)
    if left:
        console.print(f"[red]LEFT BEHIND: {left}")
        results["leaks"] = left
    return results


def report(results: dict[str, object]) -> None:
    m = results["machine"]
    console.print(f"machine: {m}; userland: {results['userland']}")  # type: ignore[index]
    dd = results["dd_mib_s"]
    console.print(f"dd 1 GiB into the image dir's file system: {dd['buffered']:.0f} MiB/s buffered, "  # type: ignore[index]
                  f"{dd['fdatasync']:.0f} MiB/s with fdatasync")  # type: ignore[index]
    t = Table(box=box.MARKDOWN)
    for c in ("live memory", "runs", "pause p50", "pause max", "pause s/GiB", "vs E2B 4 s/GiB",
              "+syncfs p50", "resume p50", "resume max", "vs E2B 1 s", "image", "cgroup usage",
              "MemAvailable gained", "AnonPages freed"):
        t.add_column(c, justify="right")
    for mib, r in results["sizes"].items():  # type: ignore[union-attr]
        p50, pmax = statistics.median(r["pause"]), max(r["pause"])
        r50, rmax = statistics.median(r["resume"]), max(r["resume"])
        gib = int(mib) / 1024
        t.add_row(f"{mib} MiB", str(len(r["pause"])), fmt_s(p50), fmt_s(pmax), f"{p50 / gib:.2f}",
                  f"{(p50 / gib) / E2B_PAUSE_S_PER_GIB:.2f}×", fmt_s(statistics.median(r["sync"])),
                  fmt_s(r50), fmt_s(rmax), f"{r50 / E2B_RESUME_S:.2f}×",
                  f"{statistics.median(r['image']) / 2**20:.0f} MiB",
                  f"{statistics.median(r['usage']) / 2**20:.0f} MiB",
                  f"{statistics.median(r['released']) / 2**20:.0f} MiB",
                  f"{statistics.median(r['anon']) / 2**20:.0f} MiB")
    console.print(t)
    one = results["sizes"].get("1024")  # type: ignore[union-attr]
    if one:
        p = statistics.median(one["pause"])
        r = statistics.median(one["resume"])
        console.print(f"1 GiB: pause {p:.2f} s/GiB (target ≤ {TARGET_PAUSE_S_PER_GIB} s/GiB: "
                      f"{'met' if p <= TARGET_PAUSE_S_PER_GIB else f'missed by {p - TARGET_PAUSE_S_PER_GIB:.2f} s'}), "
                      f"resume {r:.2f} s (target ≤ {TARGET_RESUME_S} s: "
                      f"{'met' if r <= TARGET_RESUME_S else f'missed by {r - TARGET_RESUME_S:.2f} s'})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="64,512,1024", type=lambda s: [int(x) for x in s.split(",")])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    results = anyio.run(main_async, args)
    report(results)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    if results.get("leaks"):
        sys.exit(1)


if __name__ == "__main__":
    main()
