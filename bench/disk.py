"""What a per-sandbox disk quota costs, per mechanism, measured in one run on the real crun runtime.

    .venv/bin/python bench/disk.py [--n 40] [--live 100] [--disk-mb 10240] [--json out.json]

Needs root and crun. Mechanisms (the same CrunRuntime; only where the overlay's upper/work dirs live differs):

- ``none``    upper/work in the sandbox dir on the node's disk: no quota (the baseline, as before issue 16)
- ``golden``  the chosen one (``isolation.diskquota``): a copy of a pre-formatted sparse ext4 image of the
              size (made once per size), LOOP_CONFIGURE + mount(2)
- ``mkfs``    the same, but mkfs.ext4 per sandbox (no golden image)
- ``tmpfs``   a tmpfs of that size as the upper (no device, but the writable layer is RAM)

XFS / ext4 project quotas on one shared file system are listed but cannot run on this kernel (it has
neither CONFIG_XFS_QUOTA nor CONFIG_QFMT_V2: mounting with prjquota fails), so they are not measured.

1. ``--n`` rounds, interleaved: for each mechanism create -> ``true`` -> destroy, timed (p50/p99).
2. For each mechanism ``--live`` sandboxes at once: MemAvailable and Slab per sandbox, loop devices, the
   host disk blocks the images hold; then a 64 MiB ``dd`` (fsync) in one of them.
3. Leak check (no mount, loop device, cgroup or container of this run is left), temp dirs removed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import anyio
from _harness import MATCH, check_leaks, machine, meminfo, pct, seed_templates
from rich import box
from rich.console import Console
from rich.table import Table

from pilldrops.node.isolation import diskquota
from pilldrops.node.isolation.host import prepare_host
from pilldrops.node.isolation.mounts import MS_NODEV, MS_NOSUID, mount
from pilldrops.node.runtime.base import SandboxSpec
from pilldrops.node.runtime.crun import CrunRuntime
from pilldrops.node.templates import TemplateStore

console = Console(width=150)
MECHS = ("none", "golden", "mkfs", "tmpfs")


def _mkfs_disk(self: CrunRuntime, d: Path, disk_mb: int) -> None:
    img = d / diskquota.IMAGE
    with open(img, "wb") as f:
        f.truncate(diskquota.image_mb(disk_mb) << 20)
    subprocess.run([*diskquota.MKFS, str(img)], check=True, capture_output=True)
    diskquota.mount_image(d)


def _tmpfs_disk(self: CrunRuntime, d: Path, disk_mb: int) -> None:
    (d / diskquota.MOUNT).mkdir()
    mount("tmpfs", d / diskquota.MOUNT, "tmpfs", MS_NOSUID | MS_NODEV, f"size={disk_mb}m,mode=0755")


class Bench:
    def __init__(self, tmp: Path, layers: tuple[Path, ...], disk_mb: int) -> None:
        self.rt = CrunRuntime(tmp / "state", name=f"{MATCH}-disk")
        self.layers, self.disk_mb, self.seq = layers, disk_mb, 0
        self.golden_make = CrunRuntime._make_disk

    def use(self, mech: str) -> int | None:
        CrunRuntime._make_disk = {"golden": self.golden_make, "mkfs": _mkfs_disk,  # type: ignore[method-assign]
                                  "tmpfs": _tmpfs_disk}.get(mech, self.golden_make)
        return None if mech == "none" else self.disk_mb

    async def create(self, mech: str):  # type: ignore[no-untyped-def]
        self.seq += 1
        return await self.rt.create(SandboxSpec(id=f"d{self.seq}-{mech}", layers=self.layers, memory_mb=256,
                                                disk_mb=self.use(mech)))

    async def run(self, h, script: str) -> int:  # type: ignore[no-untyped-def]
        p = await self.rt.exec(h, ["sh", "-c", script], env={}, cwd=None, timeout=120)
        while await p.read() is not None:
            pass
        return await p.wait()


async def cycles(b: Bench, n: int) -> dict[str, dict[str, list[float]]]:
    out = {m: {"create": [], "destroy": []} for m in MECHS}
    for i in range(n + 3):
        for m in MECHS:
            t = time.perf_counter()
            h = await b.create(m)
            dt_create = time.perf_counter() - t
            assert await b.run(h, "true") == 0
            t = time.perf_counter()
            await b.rt.destroy(h)
            if i >= 3:                                   # the first rounds warm caches (golden images, ...)
                out[m]["create"].append(dt_create * 1000)
                out[m]["destroy"].append((time.perf_counter() - t) * 1000)
    return out


def loops() -> int:
    return sum(1 for d in Path("/sys/block").glob("loop*") if (d / "loop" / "backing_file").exists())


async def live(b: Bench, n: int) -> dict[str, dict[str, float]]:
    res = {}
    for m in MECHS:
        before, loops0 = meminfo(), loops()
        hs = [await b.create(m) for _ in range(n)]
        await anyio.sleep(1.0)
        after = meminfo()
        blocks = sum(os.stat(Path(h.bundle) / diskquota.IMAGE).st_blocks * 512 for h in hs
                     if (Path(h.bundle) / diskquota.IMAGE).exists())
        t = time.perf_counter()
        code = await b.run(hs[0], "dd if=/dev/zero of=/root/w bs=1M count=64 conv=fsync 2>/dev/null")
        dd = time.perf_counter() - t
        res[m] = {"mem_kib": (before["MemAvailable"] - after["MemAvailable"]) / n / 1024,
                  "slab_kib": (after["Slab"] - before["Slab"]) / n / 1024, "loops": (loops() - loops0) / n,
                  "host_kib": blocks / n / 1024, "dd_mib_s": 64 / dd if code == 0 else 0.0}
        for h in hs:
            await b.rt.destroy(h)
    return res


def report(cyc: dict[str, dict[str, list[float]]], lv: dict[str, dict[str, float]], args: argparse.Namespace,
           info: dict[str, str]) -> None:
    console.print(f"[bold]PillDrops disk quota mechanisms[/] — {args.n} cycles and {args.live} live sandboxes "
                  f"per mechanism, disk_mb={args.disk_mb}; {info['cores']} cores, kernel {info['kernel']}, "
                  f"{info['crun']}, {info['date']}")
    t = Table(box=box.ASCII)
    for col in ("mechanism", "create p50", "p99", "vs none p50", "destroy p50", "vs none", "mem/sandbox",
                "slab/sandbox", "loop dev", "host disk/sb", "64 MiB dd+fsync"):
        t.add_column(col, justify="left" if col == "mechanism" else "right")
    base_c, base_d = pct(cyc["none"]["create"], 50), pct(cyc["none"]["destroy"], 50)
    for m in MECHS:
        c, d, lvm = cyc[m]["create"], cyc[m]["destroy"], lv[m]
        t.add_row(m, f"{pct(c, 50):.1f} ms", f"{pct(c, 99):.1f} ms", f"{pct(c, 50) - base_c:+.1f} ms",
                  f"{pct(d, 50):.1f} ms", f"{pct(d, 50) - base_d:+.1f} ms", f"{lvm['mem_kib']:.0f} KiB",
                  f"{lvm['slab_kib']:.0f} KiB", f"{lvm['loops']:.0f}", f"{lvm['host_kib']:.0f} KiB",
                  f"{lvm['dd_mib_s']:.0f} MiB/s")
    t.add_row("xfs/ext4 prjquota", "n/a", "", "", "", "", "", "", "", "", "kernel lacks quota formats")
    console.print(t)
    console.print("Notes: create = CrunRuntime.create (overlay + crun run) with the mechanism's writable layer; "
                  "mem = MemAvailable drop per live sandbox (page cache and kernel memory included).")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=40, help="timed create/destroy cycles per mechanism")
    ap.add_argument("--live", type=int, default=100, help="live sandboxes per mechanism")
    ap.add_argument("--disk-mb", type=int, default=10_240)
    ap.add_argument("--template", default="tiny")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    if os.geteuid() != 0 or diskquota.unavailable_reason():
        print(f"needs root and loop devices: {diskquota.unavailable_reason()}", file=sys.stderr)
        return 2
    prepare_host()
    tmp = Path(tempfile.mkdtemp(prefix=f"{MATCH}-disk-"))
    try:
        seed_templates(tmp, [args.template])
        layers = TemplateStore(tmp).get(args.template).layers
        b = Bench(tmp, layers, args.disk_mb)
        info = machine()

        async def go() -> tuple[dict, dict]:  # type: ignore[type-arg]
            try:
                return await cycles(b, args.n), await live(b, args.live)
            finally:
                await b.rt.close()
        cyc, lv = anyio.run(go)
        report(cyc, lv, args, info)
        if args.json:
            args.json.write_text(json.dumps({"machine": info, "cycles": cyc, "live": lv}, indent=1))
        left = check_leaks(tmp, [tmp / "state" / "crun"]) + [f"loop {d.name}" for d in Path("/sys/block").glob("loop*")
                                                             if str(tmp) in _backing(d)]
        if left:
            print("LEFT BEHIND:", *left, sep="\n  ", file=sys.stderr)
            return 1
        return 0
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _backing(dev: Path) -> str:
    try:
        return (dev / "loop" / "backing_file").read_text()
    except OSError:
        return ""


if __name__ == "__main__":
    sys.exit(main())
