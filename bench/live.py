"""1,000 live sandboxes on one node: creation rate, host memory, use, teardown rate, zero leaks.

    .venv/bin/python bench/live.py [--n 1000] [--threads 8] [--template tiny] [--memory-mb 64] [--vcpu 1]
                                   [--no-baseline] [--raw-disk-mb MB] [--json out.json]

Needs root and crun. This is the documented command for "1,000 concurrent sandboxes created, used and torn
down with zero leaks". What it does:

1. Starts its own ``pilldrops up`` (see ``_harness.Up``) with ``--capacity-vcpu/--capacity-memory-mb``
   large enough for N sandboxes (the default, cores x 64 vCPU, would refuse the 129th 1-vCPU sandbox on a
   2-core machine) and ``--unlimited-credits``; 3 untimed create/kill warm-ups.
2. PillDrops: creates N sandboxes with ``--threads`` client threads through the sync SDK and keeps them
   all live; reads /proc/meminfo before (once the host settled: page cache dropped, removed cgroups freed,
   ``_harness.settle_host``; then 2 s) and with N live (2 s settle); checks that the
   control plane lists N running; uses every one (``files.write`` of a small file, then ``run`` of a
   command reading it, output checked); kills them all with the same threads.
3. Baseline, same run, same template layers and concurrency: N raw crun containers from the same spec
   builder and pd-init (``_harness.Raw``): mkdir + overlay mount + config.json + ``crun run --detach``;
   memory with N live; ``crun exec <id> true`` in each; teardown = ``crun delete --force`` + cgroup
   rmdir + umount + rm -r (what a PillDrops kill does on the node).
   With ``--raw-disk-mb MB`` the baseline runs twice, the second time with the node's disk quota on every
   container (``isolation.diskquota``: a sparse copy of a pre-formatted ext4 image, loop-mounted, holding
   upper/work; removed at teardown): what the quota costs per sandbox (memory, create, exec, teardown) as
   its own ratio. (Every PillDrops sandbox has a disk, ``--default-disk-mb``; this is the way to see it
   without one in the same run.)
4. Prints per-operation p50/p99, wall, rate and the ratio to the baseline; host memory deltas with N
   live (MemAvailable, Slab, SUnreclaim, AnonPages, PageTables, Shmem; per sandbox); CPU seconds per
   phase split into the `up` process itself (Python), its waited children (crun) and this client.
5. Stops `up` with SIGINT and checks that nothing is left: no crun containers, mounts, cgroups or live
   processes of ours. Exits 1 on any create/use/kill error or leak.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from itertools import zip_longest
from pathlib import Path

from _harness import (
    MATCH,
    PID,
    RAW_PARENT,
    Phase,
    Raw,
    Up,
    check_leaks,
    machine,
    meminfo,
    own_anon,
    pct,
    profiled,
    rss,
    run_phase,
    settle_host,
    summarize_profile,
)
from rich import box
from rich.console import Console
from rich.table import Table

from pilldrops import Sandbox

console = Console(width=170)
MEM_KEYS = ("MemAvailable", "Slab", "SUnreclaim", "AnonPages", "PageTables", "Shmem", "KernelStack", "Percpu")
def settle_mem(seconds: float = 2.0) -> dict[str, int]:
    time.sleep(seconds)
    return meminfo()


def baseline_mem(res: dict, phase: str) -> dict[str, int]:  # type: ignore[type-arg]
    """/proc/meminfo before a phase creates anything, read once the host has settled (``settle_host``: what an
    earlier benchmark or phase tore down is freed first, so both phases start from the same kind of host)."""
    res[f"{phase}_settle"] = settle_host()
    return settle_mem()


def mem_delta(before: dict[str, int], after: dict[str, int], anon: tuple[int, int] | None = None) -> dict[str, int]:
    """Deltas of /proc/meminfo; with ``anon`` (our processes' anonymous bytes before, after) also
    ``attributed``: the unreclaimable kernel memory (SUnreclaim, KernelStack, PageTables, Percpu) plus our
    own processes' anonymous memory. On a shared machine MemAvailable and AnonPages also move with every
    other engineer's processes (hundreds of MiB between two samples); this figure leaves those out."""
    d = {k: after.get(k, 0) - before.get(k, 0) for k in MEM_KEYS}
    d["used"] = -d.pop("MemAvailable")       # host memory used = MemTotal - MemAvailable
    if anon is not None:
        d["own_anon"] = anon[1] - anon[0]
        d["attributed"] = d["SUnreclaim"] + d["KernelStack"] + d["PageTables"] + d["Percpu"] + d["own_anon"]
    return d


def pd_phases(a: argparse.Namespace, up: Up, st, res: dict) -> None:  # type: ignore[no-untyped-def,type-arg]
    kw = {"api_url": up.url, "api_key": up.key}

    def prof(name: str):  # type: ignore[no-untyped-def]
        return profiled(up.proc.pid, a.profile / f"{name}.txt" if a.profile else None)

    def create(i: int) -> Sandbox:
        return Sandbox.create(template=a.template, vcpu=a.vcpu, memory_mb=a.memory_mb, timeout=3600,
                              metadata={"bench": "live"}, **kw)

    for i in range(3):                      # warm-up: the node's cgroup parent, HTTP pools, caches
        create(i).kill()
    rss0 = rss(up.proc.pid)
    mem0 = baseline_mem(res, "pd")
    anon0 = own_anon(up.proc.pid, f"/{MATCH}-")
    with prof("create"):
        ph, sbs = run_phase("create", list(range(a.n)), create, a.threads, up.proc.pid, st)
    res["pd_create"] = ph
    live = [sb for sb in sbs if sb is not None]
    mem1 = settle_mem()
    res["pd_mem"] = mem_delta(mem0, mem1, (anon0, own_anon(up.proc.pid, f"/{MATCH}-")))
    res["pd_live"] = len(live)
    res["up_rss"] = (rss0, rss(up.proc.pid))
    st.update("listing running sandboxes")
    res["pd_listed"] = len(Sandbox.list(state="running", metadata={"bench": "live"}, page_size=1000, **kw))
    with open("/proc/self/mountinfo") as f:
        res["pd_mounts"] = sum(1 for _ in f)
    if a.idle_s:                            # what N live sandboxes cost with nobody using them
        st.update(f"idle for {a.idle_s} s with {len(live)} live")
        with prof("idle"):
            res["pd_idle"], _ = run_phase(f"idle {a.idle_s:g} s", [a.idle_s], time.sleep, 1, up.proc.pid, st)

    def use(pair: tuple[int, Sandbox]) -> None:
        i, sb = pair
        sb.files.write("/tmp/token", f"sandbox-{i}\n")
        r = sb.run("cat /tmp/token && echo ok")
        if r.exit_code != 0 or r.stdout != f"sandbox-{i}\nok\n":
            raise RuntimeError(f"{sb.id}: exit {r.exit_code}, stdout {r.stdout!r}, stderr {r.stderr!r}")

    with prof("use"):
        res["pd_use"], _ = run_phase("use", list(enumerate(live)), use, a.threads, up.proc.pid, st)
    with prof("kill"):
        if a.batch_kill:        # Sandbox.kill_many: one request per batch (the node: 8 teardowns at a time)
            chunks = [live[i:i + a.batch_kill] for i in range(0, len(live), a.batch_kill)]

            def kill_chunk(chunk: list[Sandbox]) -> int:
                got = Sandbox.kill_many([sb.id for sb in chunk], **kw)
                if got.failed:
                    raise RuntimeError(f"batch kill: {got.failed} failed: {[it.error for it in got.items][:3]}")
                return len(chunk)

            ph, _ = run_phase(f"kill ({a.batch_kill} a request)", chunks, kill_chunk, min(a.threads, len(chunks)),
                              up.proc.pid, st)
            ph.lat = [x for x in ph.lat for _ in range(a.batch_kill)][:len(live)]   # per sandbox: its request's
            res["pd_kill"] = ph
        else:
            res["pd_kill"], _ = run_phase("kill", live, lambda sb: sb.kill(), a.threads, up.proc.pid, st)
    res["pd_mem_after"] = mem_delta(mem0, settle_mem())


def raw_phases(a: argparse.Namespace, up: Up, st, res: dict, disk_mb: int = 0) -> None:  # type: ignore[no-untyped-def,type-arg]
    pre = "rawdisk" if disk_mb else "raw"
    raw = Raw(up.data, a.template, a.memory_mb, sub=f"bench{pre}", disk_mb=disk_mb)
    try:
        def create(i: int) -> str:
            return raw.start(f"{pre}{PID}-{i}")

        raw.warm_up(pre)
        mem0 = baseline_mem(res, pre)
        anon0 = own_anon(up.proc.pid, f"/{RAW_PARENT}/")
        ph, cids = run_phase(f"{pre} create", list(range(a.n)), create, a.threads, up.proc.pid, st)
        res[f"{pre}_create"] = ph
        live = [c for c in cids if c is not None]
        res[f"{pre}_mem"] = mem_delta(mem0, settle_mem(), (anon0, own_anon(up.proc.pid, f"/{RAW_PARENT}/")))
        res[f"{pre}_live"] = len(live)
        res[f"{pre}_exec"], _ = run_phase(f"{pre} exec", live, raw.exec_true, a.threads, up.proc.pid, st)
        res[f"{pre}_kill"], _ = run_phase(f"{pre} teardown", live, raw.cleanup, a.threads, up.proc.pid, st)
        res[f"{pre}_mem_after"] = mem_delta(mem0, settle_mem())
    finally:
        raw.cleanup_all()


def stats(ph: Phase | None) -> list[str]:
    if ph is None or not ph.lat:
        return ["0", "-", "-", "-", "-"]
    return [str(len(ph.lat)), f"{pct(ph.lat, 50):.1f} ms", f"{pct(ph.lat, 99):.1f} ms", f"{ph.wall:.1f} s",
            f"{ph.rate:.1f}/s"]


def mib(b: float) -> str:
    return f"{b / 2**20:,.0f} MiB"


def report(a: argparse.Namespace, res: dict, info: dict[str, str], leaks: list[str]) -> None:  # type: ignore[type-arg]
    n = a.n
    console.print(f"[bold]PillDrops 1,000 live[/] — N={n} sandboxes (template {a.template}, {a.vcpu} vCPU, "
                  f"{a.memory_mb} MiB), {a.threads} client threads; {info['cores']} cores, {info['mem']}, "
                  f"kernel {info['kernel']}, {info['crun']}, Python {info['python']}, {info['date']}")
    t = Table(box=box.ASCII2, title="operations")
    for c in ("operation", "ok", "p50", "p99", "wall", "rate", "baseline (raw crun, same run)", "ok", "p50",
              "p99", "wall", "rate", "ratio (wall)"):
        t.add_column(c, justify="left" if c in ("operation", "baseline (raw crun, same run)") else "right")
    rows = [("create→ready", "pd_create", "mkdir+mount+config+crun run --detach", "raw_create"),
            ("use: files.write + run", "pd_use", "crun exec <id> true", "raw_exec"),
            ("kill", "pd_kill", "crun delete -f + rmdir cgroups + umount + rm", "raw_kill")]
    for name, pk, bname, bk in rows:
        p, b = res.get(pk), res.get(bk)
        ratio = f"{p.wall / b.wall:.2f}×" if p and b and p.wall and b.wall else "-"
        t.add_row(name, *stats(p), bname if b is not None else "(--no-baseline)", *stats(b), ratio)
    console.print(t)

    m = Table(box=box.ASCII2, title="host memory with N live (/proc/meminfo, after a 2 s settle) vs before")
    for c in ("", "live", "used (−ΔMemAvailable)", "per sandbox", "ΔSlab", "ΔSUnreclaim", "ΔAnonPages",
              "ΔPageTables", "ΔShmem", "used after teardown", "attributed", "per sandbox "):
        m.add_column(c, justify="left" if not c else "right")
    for label, mk, lk, ak in (("PillDrops", "pd_mem", "pd_live", "pd_mem_after"),
                              ("raw crun", "raw_mem", "raw_live", "raw_mem_after"),
                              (f"raw crun + {a.raw_disk_mb} MiB disk", "rawdisk_mem", "rawdisk_live",
                               "rawdisk_mem_after")):
        d = res.get(mk)
        if d is None:
            continue
        nl = res[lk] or 1
        m.add_row(label, str(res[lk]), mib(d["used"]), f"{d['used'] / nl / 1024:,.0f} KiB", mib(d["Slab"]),
                  mib(d["SUnreclaim"]), mib(d["AnonPages"]), mib(d["PageTables"]), mib(d["Shmem"]),
                  mib(res[ak]["used"]), mib(d["attributed"]) if "attributed" in d else "-",
                  f"{d['attributed'] / nl / 1024:,.0f} KiB" if "attributed" in d else "-")
    console.print(m)
    settled = [f"{ph} {v['settle_s']:g} s (memory cgroups {v['memory_cgroups_before']:,} → "
               f"{v['memory_cgroups_after']:,})" for ph in ("pd", "raw", "rawdisk") if (v := res.get(f"{ph}_settle"))]
    if settled:
        console.print("before each phase's baseline the host settled (page cache dropped, removed cgroups freed): "
                      + "; ".join(settled))
    if "attributed" in res.get("pd_mem", {}) and "attributed" in res.get("raw_mem", {}):
        p, b = res["pd_mem"], res["raw_mem"]
        console.print(f"attributed = ΔSUnreclaim + ΔKernelStack + ΔPageTables + ΔPercpu + Δ(anonymous memory of `up`'s "
                      f"processes and the sandboxes'/containers' own): PillDrops {mib(p['attributed'])} vs raw crun "
                      f"{mib(b['attributed'])} = {p['attributed'] / b['attributed']:.2f}× (used: "
                      f"{p['used'] / b['used']:.2f}×; ΔKernelStack {mib(p['KernelStack'])} vs {mib(b['KernelStack'])}, "
                      f"own anon {mib(p['own_anon'])} vs {mib(b['own_anon'])}). 'used' also moves with every other "
                      "process on the machine; 'attributed' leaves out others' anonymous memory and all reclaimable memory.")
    if "rawdisk_create" in res and "raw_create" in res:
        q = Table(box=box.ASCII2, title=f"the disk quota's cost per sandbox: raw crun with a {a.raw_disk_mb} MiB "
                  "disk (isolation.diskquota) vs without, same run")
        for c in ("operation", "without p50", "with p50", "without wall", "with wall", "ratio (wall)"):
            q.add_column(c, justify="left" if c == "operation" else "right")
        for name, k in (("create", "create"), ("exec true", "exec"), ("teardown", "kill")):
            w0, w1 = res[f"raw_{k}"], res[f"rawdisk_{k}"]
            q.add_row(name, f"{pct(w0.lat, 50):.1f} ms" if w0.lat else "-", f"{pct(w1.lat, 50):.1f} ms" if w1.lat else "-",
                      f"{w0.wall:.1f} s", f"{w1.wall:.1f} s", f"{w1.wall / w0.wall:.2f}×" if w0.wall else "-")
        n0, n1 = res["raw_live"] or 1, res["rawdisk_live"] or 1
        u0, u1 = res["raw_mem"]["used"] / n0, res["rawdisk_mem"]["used"] / n1
        q.add_row("host memory per live sandbox", "", "", f"{u0 / 1024:,.0f} KiB", f"{u1 / 1024:,.0f} KiB",
                  f"+{(u1 - u0) / 1024:,.0f} KiB")
        console.print(q)
    r0, r1 = res["up_rss"]
    console.print(f"`pilldrops up` RSS {mib(r0)} before → {mib(r1)} with {res['pd_live']} live "
                  f"(included in 'used'); control plane lists {res['pd_listed']} running; "
                  f"host mount table {res['pd_mounts']} entries with N live.")

    c = Table(box=box.ASCII2, title="CPU seconds per phase (2 cores: wall × 2 is the most there is)")
    keys = list(res["pd_create"].cpu)
    c.add_column("phase")
    c.add_column("wall", justify="right")
    for k in keys:
        c.add_column(k, justify="right")
    for k in ("pd_create", "pd_idle", "pd_use", "pd_kill", "raw_create", "raw_exec", "raw_kill",
              "rawdisk_create", "rawdisk_exec", "rawdisk_kill"):
        ph = res.get(k)
        if ph is not None:
            c.add_row(ph.name if k.startswith("raw") else f"PillDrops {ph.name}", f"{ph.wall:.1f} s",
                      *(f"{ph.cpu[x]:.1f} s" for x in keys))
    console.print(c)

    for k in ("pd_create", "pd_use", "pd_kill", "raw_create", "raw_exec", "raw_kill",
              "rawdisk_create", "rawdisk_exec", "rawdisk_kill"):
        ph = res.get(k)
        if ph is not None and ph.errors:
            uniq: dict[str, int] = {}
            for e in ph.errors:
                uniq[e[:300]] = uniq.get(e[:300], 0) + 1
            console.print(f"[red]{ph.name}: {len(ph.errors)} errors[/]")
            for e, k2 in sorted(uniq.items(), key=lambda x: -x[1])[:10]:
                console.print(f"  {k2}× {e}")
    cr, used = res["pd_create"].rate, res["pd_mem"]["used"]
    console.print(
        f"Targets: ≥ 100 creates/s (now {cr:.1f}/s, {'met' if cr >= 100 else f'NOT met, {100 / cr:.1f}× short'}); "
        f"{n} live within 2 GiB of host memory (now {mib(used)}, {'met' if used <= 2 * 2**30 else 'NOT met'}); "
        f"zero leaks ({'none left' if not leaks else f'{len(leaks)} LEFT'}).")


def print_profiles(d: Path) -> None:
    for f in sorted(d.glob("*.txt")):
        s = summarize_profile(f)
        n = s["samples"] or 1  # type: ignore[assignment]
        t = Table(box=box.ASCII2, title=f"py-spy {f.name}: {s['samples']} samples of `up` holding the GIL (100 Hz)")
        for c in ("top self frames", "self", "top PillDrops frames (total)", "total", "category", "share"):
            t.add_column(c, justify="right" if c in ("self", "total", "share") else "left")
        rows = list(zip_longest(s["self"], s["total"], s["categories"], fillvalue=("", 0)))  # type: ignore[call-overload]
        for (sf, sc), (tf, tc), (cf, cc) in rows:
            t.add_row(sf, f"{100 * sc / n:.1f}%" if sf else "", tf, f"{100 * tc / n:.1f}%" if tf else "",
                      cf, f"{100 * cc / n:.1f}%" if cf else "")
        console.print(t)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=1000, help="live sandboxes")
    ap.add_argument("--threads", type=int, default=8, help="client threads for create, use and kill")
    ap.add_argument("--template", default="tiny")
    ap.add_argument("--memory-mb", type=int, default=64)
    ap.add_argument("--vcpu", type=float, default=1.0)
    ap.add_argument("--no-baseline", action="store_true", help="skip the raw crun baseline")
    ap.add_argument("--batch-kill", type=int, default=0, metavar="K",
                    help="kill with Sandbox.kill_many, K ids a request (default: one kill per sandbox)")
    ap.add_argument("--raw-disk-mb", type=int, default=0,
                    help="also run the baseline with a disk quota of this size on each container (0: not)")
    ap.add_argument("--idle-s", type=float, default=10.0,
                    help="seconds to sit idle with N live, measuring what the agent spends on them")
    ap.add_argument("--profile", type=Path, help="py-spy record the `up` process per phase into this dir "
                    "(raw format; a summary is printed)")
    ap.add_argument("--json", type=Path, help="write raw numbers here")
    a = ap.parse_args()
    if a.profile:
        a.profile.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        sys.exit("bench/live.py needs root (crun, mounts, cgroups)")
    tmp = Path(tempfile.mkdtemp(prefix=f"pilldrops-bench{PID}-"))
    info = machine()
    res: dict = {}  # type: ignore[type-arg]
    code = 0
    up = None
    cap = ["--capacity-vcpu", str(max(a.n * a.vcpu * 1.1, 128)),
           "--capacity-memory-mb", str(int(a.n * a.memory_mb * 1.1) + 4096), "--unlimited-credits"]
    try:
        console.print(f"starting pilldrops up (data in {tmp}) ...")
        up = Up(tmp, a.template, extra=cap, seed=[a.template] if a.template != "tiny" else None)
        with console.status("") as st:
            pd_phases(a, up, st, res)
            if not a.no_baseline:
                raw_phases(a, up, st, res)
                if a.raw_disk_mb:
                    raw_phases(a, up, st, res, disk_mb=a.raw_disk_mb)
    except KeyboardInterrupt:
        console.print("[yellow]interrupted[/]: cleaning up")
        code = 130
    finally:
        if up is not None:
            t = time.perf_counter()
            rc = up.stop(timeout=600)
            res["up_stop_s"] = time.perf_counter() - t
            if rc != 0:
                console.print(f"[red]pilldrops up exited {rc}[/]:\n{up.log.read_text()[-2000:]}")
                code = code or 1
        roots = [tmp / "data" / "node" / "crun", tmp / "data" / "benchraw" / "crun",
                 tmp / "data" / "benchrawdisk" / "crun"]
        left = check_leaks(tmp, roots, settle=10)
        if left:
            console.print(f"[red]left behind ({len(left)}); {tmp} kept:[/]\n" + "\n".join(left[:50]))
            code = code or 1
        else:
            shutil.rmtree(tmp)
    if "pd_kill" in res:
        report(a, res, info, left)
        errs = sum(len(res[k].errors) for k in res if isinstance(res[k], Phase))
        if errs or res["pd_live"] != a.n or res["pd_listed"] != a.n:
            code = code or 1
        if a.profile:
            print_profiles(a.profile)
        if a.json:
            out = {k: (vars(v) if isinstance(v, Phase) else v) for k, v in res.items()}
            a.json.write_text(json.dumps({"args": vars(a) | {"json": str(a.json)}, "machine": info, **out},
                                         indent=1, default=str))
    return code


if __name__ == "__main__":
    sys.exit(main())
