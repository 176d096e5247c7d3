"""Scheduler simulation (issue 4): a mixed-size trace placed onto simulated nodes, and what one decision
costs next to the store read every create makes anyway.

    .venv/bin/python bench/scheduler.py [--nodes 1000] [--requests N] [--churn M] [--long-lived F] [--seed S]

Two phases on the same cluster of equal nodes (16 vCPU / 64 GiB by default):

1. fill-up: N requests arrive, none departs. At the end, nodes used vs the lower bound
   ceil(max(total vCPU / node vCPU, total memory / node memory)).
2. churn: M more arrivals as a Poisson process; each sandbox departs after an exponential lifetime, except a
   long-lived share that stays to the end. Requests that do not fit are dropped (counted).

Every decision is ``scheduler.place`` (filters, then scorers) on a list of NodeViews kept up to date outside
the timed call. The baseline, measured in the same run: the read a create's placement transaction makes
(``Store.list_nodes`` + ``Store.allocations`` on a SQLite store holding the same number of nodes), and the
whole choice the create path makes from those rows (``service.placement.for_create``: views + place).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import heapq
import math
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from pilldrops.server.scheduler import NodeView, Placement, Request, place
from pilldrops.server.service import placement
from pilldrops.server.store.sql import Store, sqlite_url

VCPU = {0.5: 0.25, 1: 0.30, 2: 0.25, 4: 0.15, 8: 0.05}
MEMORY_MB = {256: 0.05, 512: 0.05, 1024: 0.10, 2048: 0.15, 4096: 0.25, 8192: 0.40}
TEMPLATE = "tiny"


def draw(rnd: random.Random) -> Request:
    vcpu = rnd.choices(list(VCPU), weights=list(VCPU.values()))[0]
    mem = rnd.choices(list(MEMORY_MB), weights=list(MEMORY_MB.values()))[0]
    return Request(TEMPLATE, vcpu, mem)


class Sim:
    def __init__(self, nodes: int, cap_c: float, cap_m: int) -> None:
        self.cap_c, self.cap_m = cap_c, cap_m
        views = [NodeView(f"node-{i:05}", cap_c, cap_m, templates=frozenset({TEMPLATE})) for i in range(nodes)]
        self.views = {v.id: v for v in views}
        self.view_list = list(self.views.values())
        self.pos = {v.id: i for i, v in enumerate(self.view_list)}
        self.place_ns: list[int] = []
        self.dropped = 0

    def decide(self, req: Request) -> str | None:
        t0 = time.perf_counter_ns()
        got = place(req, self.view_list)
        self.place_ns.append(time.perf_counter_ns() - t0)
        if not isinstance(got, Placement):
            self.dropped += 1
            return None
        self._apply(got.node_id, req.vcpu, req.memory_mb, +1)
        return got.node_id

    def depart(self, node_id: str, vcpu: float, mem: int) -> None:
        self._apply(node_id, vcpu, mem, -1)

    def _apply(self, node_id: str, vcpu: float, mem: int, sign: int) -> None:
        v = self.views[node_id]
        v = replace(v, used_vcpu=v.used_vcpu + sign * vcpu, used_memory_mb=v.used_memory_mb + sign * mem)
        self.views[node_id] = v
        self.view_list[self.pos[node_id]] = v

    def usage(self) -> tuple[int, int]:
        """(nodes used, lower bound) for what is placed now."""
        used = sum(1 for v in self.views.values() if v.used_vcpu > 1e-9 or v.used_memory_mb > 0)
        cpu = sum(v.used_vcpu for v in self.views.values())
        mem = sum(v.used_memory_mb for v in self.views.values())
        return used, max(math.ceil(cpu / self.cap_c - 1e-9), math.ceil(mem / self.cap_m))

    def take_times(self) -> list[int]:
        out, self.place_ns = self.place_ns, []
        return out


async def store_baseline(n_nodes: int, reps: int, cap_c: float, cap_m: int) -> tuple[list[int], list[int]]:
    """(store read ns, create-path choice ns) with ``n_nodes`` registered nodes, ``reps`` times each."""
    with tempfile.TemporaryDirectory(prefix="pilldrops-bench-sched") as d:
        store = await Store.open(sqlite_url(Path(d) / "db.sqlite"))
        try:
            now = dt.datetime.now(dt.UTC)
            for i in range(n_nodes):
                await store.upsert_node(name=f"node-{i:05}", url=f"http://n{i}", capacity_vcpu=cap_c,
                                        capacity_memory_mb=cap_m, templates=[{"name": TEMPLATE}], now=now)
            read_ns, choose_ns = [], []
            for _ in range(reps):
                t0 = time.perf_counter_ns()
                nodes, allocs = await store.list_nodes(), await store.allocations()
                t1 = time.perf_counter_ns()
                placement.for_create(Request(TEMPLATE, 1, 512), nodes, allocs, [], now)
                t2 = time.perf_counter_ns()
                read_ns.append(t1 - t0)
                choose_ns.append(t2 - t1)
            return read_ns, choose_ns
        finally:
            await store.close()


def pct(xs: list[int], p: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, math.ceil(p / 100 * len(s)) - 1))] / 1000


def us(x: float) -> str:
    return f"{x:,.1f} µs"


def table(rows: list[list[str]], header: list[str]) -> str:
    w = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    line = "+" + "+".join("-" * (x + 2) for x in w) + "+"

    def fmt(r: list[str]) -> str:
        return "| " + " | ".join(c.ljust(w[i]) if i == 0 else c.rjust(w[i]) for i, c in enumerate(r)) + " |"

    return "\n".join([line, fmt(header), line, *map(fmt, rows), line])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", type=int, default=1000)
    ap.add_argument("--requests", type=int, default=None,
                    help="fill-up arrivals (default: enough for ~85%% of the cluster's vCPU)")
    ap.add_argument("--churn", type=int, default=20_000, help="arrivals in the churn phase")
    ap.add_argument("--long-lived", type=float, default=0.2, help="share of churn arrivals that never depart")
    ap.add_argument("--node-vcpu", type=float, default=16)
    ap.add_argument("--node-memory-mb", type=int, default=65536)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--store-reps", type=int, default=50, help="timed store reads / create-path choices")
    a = ap.parse_args()

    rnd = random.Random(a.seed)
    mean_c = sum(k * w for k, w in VCPU.items())
    n_fill = a.requests if a.requests is not None else int(0.85 * a.nodes * a.node_vcpu / mean_c)
    sim = Sim(a.nodes, a.node_vcpu, a.node_memory_mb)

    # phase 1: fill-up, no departures
    for _ in range(n_fill):
        sim.decide(draw(rnd))
    fill_used, fill_bound = sim.usage()
    fill_dropped = sim.dropped
    fill_times = sim.take_times()

    # phase 2: churn. Start from an empty cluster; arrivals at rate 1, lifetimes sized so the cluster settles
    # near 75% of its vCPU; long-lived sandboxes stay to the end (they would fill it, so they are capped).
    sim = Sim(a.nodes, a.node_vcpu, a.node_memory_mb)
    mean_life = 0.75 * a.nodes * a.node_vcpu / mean_c / (1 + a.long_lived * 4)
    departures: list[tuple[float, int, str, float, int]] = []
    now = 0.0
    long_budget = 0.25 * a.nodes * a.node_vcpu
    for k in range(a.churn):
        now += rnd.expovariate(1.0)
        while departures and departures[0][0] <= now:
            _, _, nid, c, m = heapq.heappop(departures)
            sim.depart(nid, c, m)
        req = draw(rnd)
        nid = sim.decide(req)
        if nid is None:
            continue
        if rnd.random() < a.long_lived and long_budget >= req.vcpu:
            long_budget -= req.vcpu
        else:
            heapq.heappush(departures, (now + rnd.expovariate(1 / mean_life), k, nid, req.vcpu, req.memory_mb))
    churn_used, churn_bound = sim.usage()
    churn_times = sim.take_times()

    cpu_name = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                     if ln.startswith("model name")), platform.processor() or "?")
    print(f"PillDrops scheduler simulation — {a.nodes} nodes of {a.node_vcpu:g} vCPU / {a.node_memory_mb} MB; "
          f"seed {a.seed}; {os.cpu_count()} cores ({cpu_name}), Python {platform.python_version()}, "
          f"{dt.datetime.now(dt.UTC).isoformat(timespec='seconds')}")
    print(f"trace: vcpu {list(VCPU)} weights {list(VCPU.values())}; memory_mb {list(MEMORY_MB)} "
          f"weights {list(MEMORY_MB.values())}")
    read_ns, choose_ns = asyncio.run(store_baseline(a.nodes, a.store_reps, a.node_vcpu, a.node_memory_mb))
    base = statistics.median(read_ns)
    rows = [["store read: nodes + allocations (baseline)", str(len(read_ns)), us(pct(read_ns, 50)),
             us(pct(read_ns, 99)), us(statistics.fmean(read_ns) / 1000), "1.00×"],
            ["create path: placement.for_create on those rows", str(len(choose_ns)), us(pct(choose_ns, 50)),
             us(pct(choose_ns, 99)), us(statistics.fmean(choose_ns) / 1000),
             f"{statistics.median(choose_ns) / base:.2f}×"]]
    for phase, ns in (("fill-up", fill_times), ("churn", churn_times)):
        rows.append([f"{phase}: place (filters + scorers)", str(len(ns)), us(pct(ns, 50)), us(pct(ns, 99)),
                     us(statistics.fmean(ns) / 1000), f"{statistics.median(ns) / base:.2f}×"])
    print(table(rows, ["time per decision", "n", "p50", "p99", "mean", "vs store read"]))
    rows = [["fill-up (no departures)", str(n_fill), str(fill_dropped), str(fill_used), str(fill_bound),
             f"{fill_used / fill_bound:.3f}×"],
            ["churn (end state)", str(a.churn), str(sim.dropped), str(churn_used), str(churn_bound),
             f"{churn_used / churn_bound:.3f}×"]]
    print(table(rows, ["packing", "arrivals", "unschedulable", "nodes used", "lower bound", "ratio"]))
    p99 = pct(fill_times + churn_times, 99)
    mean = statistics.fmean(fill_times + churn_times) / 1000
    ok_p = fill_used <= 1.05 * fill_bound
    print(f"place: p99 {p99:.1f} µs, mean {mean:.1f} µs per decision, "
          f"{statistics.median(fill_times + churn_times) / base:.2f}× the store read every create makes anyway. "
          f"Target: ≤ 1.05× the lower bound after fill-up ({fill_used / fill_bound:.3f}×: "
          f"{'met' if ok_p else 'NOT met'}).")


if __name__ == "__main__":
    main()
