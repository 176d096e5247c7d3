"""Soak: many create/run/kill cycles against one node agent; its memory must stay flat and nothing may leak.

    .venv/bin/python bench/soak.py [--cycles 10000] [--concurrency 8] [--form fleet|up] [--template tiny]
                                   [--sample-s 5] [--json out.json]

Needs root and crun. Starts its own deployment (``--form fleet``: ``pilldrops serve`` on SQLite and a separate
``pilldrops node``, so the agent's RSS is its own; ``--form up``: one process), then runs ``--cycles``
cycles on ``--concurrency`` SDK threads: ``Sandbox.create`` → ``run("echo $i")`` (output checked) → ``kill``.
Every ``--sample-s`` seconds it samples the agent's (and the control plane's) RSS, open file descriptors,
threads and child processes against the cycles done. At the end, with the agent still running and after
a short settle, it checks: no container, sandbox cgroup, mount or process left; the agent's journal empty;
the node's data dir (its state: journal, sandboxes, run dirs; templates excluded) back to its size after
the warm-up; fds and children back to the warm-up's. Then it stops everything and runs the usual leak check.

RSS is judged by its slope over the cycles after the warm-up (least squares, KiB per 1,000 cycles) and the
difference between the median of the first and last tenth of the samples. Prints a table, writes ``--json``;
exits 1 on any leak or failed cycle.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from _deploy import Deployment, data_dir_usage, holdings
from _harness import PID, check_leaks, machine, pct, rss
from rich import box
from rich.console import Console
from rich.table import Table

from pilldrops import Sandbox

console = Console(width=170)
STATE_SKIP = ("templates", "bin", "crun")      # the node's data dir minus the templates and its own binaries


def fds(pid: int) -> int:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return 0


def threads(pid: int) -> int:
    try:
        return len(os.listdir(f"/proc/{pid}/task"))
    except OSError:
        return 0


def children(pid: int) -> list[str]:
    """Direct children of ``pid`` (zombies included: an unreaped child is a leak too)."""
    out = []
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            stat = (p / "stat").read_text()
        except OSError:
            continue
        rest = stat[stat.rindex(")") + 2:].split()
        if int(rest[1]) == pid:
            out.append(f"{p.name} {stat[stat.index('(') + 1:stat.rindex(')')]} {rest[0]}")
    return out


def slope(xs: list[float], ys: list[float]) -> float:
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    den = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / den if den else 0.0


def sample(dep: Deployment, done: int, t0: float) -> dict[str, float]:
    node, cp = dep.roles[dep.node_role].pid, dep.roles[dep.cp_role].pid
    return {"t": time.monotonic() - t0, "cycles": done, "node_rss": rss(node), "cp_rss": rss(cp),
            "node_fds": fds(node), "node_threads": threads(node), "node_children": len(children(node))}


def state_usage(dep: Deployment) -> tuple[int, int]:
    return data_dir_usage(dep.node_data / "node", skip=STATE_SKIP)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cycles", type=int, default=10000)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--form", default="fleet", choices=["fleet", "up"])
    ap.add_argument("--template", default="tiny")
    ap.add_argument("--memory-mb", type=int, default=64)
    ap.add_argument("--warmup", type=int, default=200, help="cycles before the baseline is taken")
    ap.add_argument("--sample-s", type=float, default=5.0)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("bench/soak.py needs root (crun, mounts, cgroups)")
    tmp = Path(tempfile.mkdtemp(prefix=f"pilldrops-bench{PID}-soak-"))
    info = machine()
    console.print(f"starting the {a.form} deployment (data in {tmp}) ...")
    dep = Deployment(tmp, a.form, a.template)
    done, failed = [0], []
    lock = threading.Lock()
    lat: list[float] = []
    samples: list[dict[str, float]] = []
    res: dict[str, object] = {}
    code = 0

    def cycle(i: int) -> None:
        t = time.perf_counter()
        try:
            sb = Sandbox.create(template=a.template, memory_mb=a.memory_mb, timeout=300, api_url=dep.url,
                                api_key=dep.key)
            try:
                r = sb.run(f"echo {i}")
                if r.exit_code or r.stdout != f"{i}\n":
                    raise RuntimeError(f"run in {sb.id}: exit {r.exit_code}, stdout {r.stdout!r}")
            finally:
                sb.kill()
        except Exception as e:  # noqa: BLE001 - counted and reported
            with lock:
                failed.append(f"{type(e).__name__}: {e}"[:300])
        with lock:
            done[0] += 1
            lat.append((time.perf_counter() - t) * 1000)

    try:
        with ThreadPoolExecutor(a.concurrency) as pool:
            list(pool.map(cycle, range(a.warmup)))
        time.sleep(3)
        base = {"state": state_usage(dep), "sample": sample(dep, 0, time.monotonic()),
                "children": children(dep.roles[dep.node_role].pid)}
        console.print(f"warm-up {a.warmup} cycles done; node RSS {base['sample']['node_rss'] / 2**20:.1f} MiB, "
                      f"{base['sample']['node_fds']} fds, state dir {base['state'][0]} files / {base['state'][1]} B")
        done[0], lat.clear()
        t0 = time.monotonic()
        stop = threading.Event()

        def sampler() -> None:
            while not stop.wait(a.sample_s):
                samples.append(sample(dep, done[0], t0))

        st_t = threading.Thread(target=sampler, daemon=True)
        st_t.start()
        with console.status("") as st, ThreadPoolExecutor(a.concurrency) as pool:
            futs = [pool.submit(cycle, i) for i in range(a.cycles)]
            while not all(f.done() for f in futs):
                s = samples[-1] if samples else base["sample"]
                st.update(f"soak: {done[0]}/{a.cycles} cycles, {len(failed)} failed, node RSS "
                          f"{s['node_rss'] / 2**20:.1f} MiB")
                time.sleep(1)
        wall = time.monotonic() - t0
        stop.set()
        st_t.join()
        samples.append(sample(dep, done[0], t0))
        time.sleep(5)                      # teardown and end reports settle
        end = {"state": state_usage(dep), "sample": sample(dep, done[0], t0),
               "children": children(dep.roles[dep.node_role].pid), "holdings": holdings(dep),
               "journal": sorted(p.name for p in (dep.node_data / "node" / "journal").glob("*"))}
        xs = [s["cycles"] for s in samples]
        ys = [s["node_rss"] / 1024 for s in samples]
        tenth = max(1, len(samples) // 10)
        res = {"cycles": a.cycles, "failed": len(failed), "errors": failed[:20], "wall_s": wall,
               "rate": a.cycles / wall, "p50_ms": pct(lat, 50), "p99_ms": pct(lat, 99),
               "rss_slope_kib_per_1000": slope(xs, ys) * 1000,
               "cp_rss_slope_kib_per_1000": slope(xs, [s["cp_rss"] / 1024 for s in samples]) * 1000,
               "rss_first_tenth_mib": statistics.median(ys[:tenth]) / 1024,
               "rss_last_tenth_mib": statistics.median(ys[-tenth:]) / 1024,
               "rss_max_mib": max(ys) / 1024, "base": base, "end": end, "samples": samples}
        leaks = {k: v for k, v in end["holdings"].items() if v}  # type: ignore[union-attr]
        if end["journal"]:
            leaks["journal entries"] = end["journal"]
        if end["state"][0] > base["state"][0]:                                       # type: ignore[index]
            leaks["state files"] = [f"{base['state'][0]} -> {end['state'][0]} files"]  # type: ignore[index]
        if end["sample"]["node_fds"] > base["sample"]["node_fds"] + 2:               # type: ignore[index]
            leaks["fds"] = [f"{base['sample']['node_fds']} -> {end['sample']['node_fds']}"]  # type: ignore[index]
        if len(end["children"]) > len(base["children"]):                             # type: ignore[arg-type]
            leaks["agent children"] = end["children"]                                 # type: ignore[assignment]
        res["leaks_running"] = leaks
    except KeyboardInterrupt:
        console.print("[yellow]interrupted[/]")
        code = 130
    finally:
        rc = dep.stop()
        left = check_leaks(tmp, [dep.crun_root], settle=10)
        res["leaks_after_stop"] = left
        res["stop_codes"] = rc
        if left:
            console.print(f"[red]left behind; {tmp} kept:[/] {left[:20]}")
            code = code or 1
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    if "wall_s" in res:
        report(a, res, info)
        if res["failed"] or res["leaks_running"]:
            code = code or 1
    if a.json:
        a.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(a).items()}, "machine": info, **res},
                                     indent=1, default=str))
    return code


def report(a: argparse.Namespace, res: dict, info: dict[str, str]) -> None:  # type: ignore[type-arg]
    console.print(f"[bold]PillDrops soak[/] — {a.cycles} create/run/kill cycles of {a.template} ({a.memory_mb} MiB), "
                  f"{a.concurrency} threads, {a.form} form; {info['cores']} cores, {info['mem']}, kernel {info['kernel']}, "
                  f"{info['crun']}, {info['date']}")
    t = Table(box=box.ASCII2, title="soak")
    for c in ("cycles", "failed", "wall", "cycles/s", "p50 / p99", "agent RSS first / last tenth / max",
              "RSS slope", "control plane RSS slope"):
        t.add_column(c, justify="right")
    t.add_row(str(res["cycles"]), str(res["failed"]), f"{res['wall_s']:.0f} s", f"{res['rate']:.1f}",
              f"{res['p50_ms']:.0f} / {res['p99_ms']:.0f} ms",
              f"{res['rss_first_tenth_mib']:.1f} / {res['rss_last_tenth_mib']:.1f} / {res['rss_max_mib']:.1f} MiB",
              f"{res['rss_slope_kib_per_1000']:+.1f} KiB/1000 cycles",
              f"{res['cp_rss_slope_kib_per_1000']:+.1f} KiB/1000 cycles")
    console.print(t)
    b, e = res["base"], res["end"]
    lt = Table(box=box.ASCII2, title="after warm-up vs at the end (agent still running)")
    for c in ("", "after warm-up", "at the end"):
        lt.add_column(c, justify="left" if not c else "right")
    lt.add_row("agent open fds", str(b["sample"]["node_fds"]), str(e["sample"]["node_fds"]))
    lt.add_row("agent threads", str(b["sample"]["node_threads"]), str(e["sample"]["node_threads"]))
    lt.add_row("agent child processes", str(len(b["children"])), str(len(e["children"])))
    lt.add_row("node state dir (files / bytes; templates excluded)", f"{b['state'][0]} / {b['state'][1]}",
               f"{e['state'][0]} / {e['state'][1]}")
    lt.add_row("journal entries", "-", str(len(e["journal"])))
    for k, v in e["holdings"].items():
        lt.add_row(f"sandbox {k} on the host", "-", str(len(v)))
    lt.add_row("left after stopping (containers, mounts, cgroups, processes)", "-", str(len(res["leaks_after_stop"])))
    console.print(lt)
    if res["errors"]:
        console.print(f"[red]{res['failed']} failed cycles[/], e.g.: " + "; ".join(res["errors"][:5]))
    console.print("leaks: " + ("none" if not res["leaks_running"] and not res["leaks_after_stop"]
                               else f"[red]{res['leaks_running']} {res['leaks_after_stop'][:10]}[/]"))


if __name__ == "__main__":
    sys.exit(main())
