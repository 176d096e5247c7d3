"""Warm-pool claim and the control plane's request floor, two source trees side by side in the same minutes.

    .venv/bin/python bench/claim_ab.py --base-src /path/to/other/checkout/src [--n 200] [--block 10]

Needs root and crun (issue 15). Starts two ``pilldrops up`` (the bench harness's ``Up``: own data dirs,
ports, node names), one running the tree at ``--base-src`` (through ``PYTHONPATH``), one this tree, each
with a warm pool of ``--pool`` members of the benchmark's shape; then alternates blocks of ``--block``
iterations between the two (in alternating order). One iteration, all on the SDK's shared kept-alive
client: a warm claim (``Sandbox.create``), then the floor's ladder on the control plane —
``GET /healthz`` (no auth, no store), ``GET /v1/rates`` (API-key auth, no store), ``GET /v1/sandboxes/{id}``
(auth + one store read + the response model) — then the kill (untimed), and a 0.1 s pause for the pool to
refill. Prints p50/p90 of each, ratios against the same side's ``GET /healthz`` and the base's figure,
the control plane's CPU (utime+stime of the ``up`` process) per iteration, with /proc/loadavg.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import httpx
from _harness import Up, pct, two_ups

from pilldrops import Sandbox

MEMORY_MB = 256
FIGURES = ("claim", "healthz", "rates", "get")


def cpu_s(pid: int) -> float:
    f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")


def iteration(up: Up, template: str, out: dict[str, list[float]] | None) -> None:
    t = time.perf_counter()
    sb = Sandbox.create(template=template, memory_mb=MEMORY_MB, api_url=up.url, api_key=up.key)
    got = {"claim": time.perf_counter() - t}
    try:
        http = sb._client._http
        auth = {"Authorization": f"Bearer {up.key}"}
        for name, path, h in (("healthz", "/healthz", {}), ("rates", "/v1/rates", auth)):
            t = time.perf_counter()
            http.get(f"{up.url}{path}", headers=h).raise_for_status()
            got[name] = time.perf_counter() - t
        t = time.perf_counter()
        sb.get_info()
        got["get"] = time.perf_counter() - t
    finally:
        sb.kill()
    if out is not None:
        for k, v in got.items():
            out[k].append(v * 1000)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--base-src", type=Path, required=True, help="the other tree's src/ directory")
    ap.add_argument("--n", type=int, default=200, help="timed iterations per side")
    ap.add_argument("--block", type=int, default=10)
    ap.add_argument("--pool", type=int, default=4)
    ap.add_argument("--template", default="tiny")
    a = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("bench/claim_ab.py needs root (crun, mounts, cgroups)")
    with two_ups(a.base_src, a.template) as ups:
        for u in ups.values():
            httpx.put(f"{u.url}/v1/pools", headers={"Authorization": f"Bearer {u.key}"}, timeout=30,
                      json={"template": a.template, "vcpu": 1, "memory_mb": MEMORY_MB, "size": a.pool}
                      ).raise_for_status()
        time.sleep(3)
        for u in ups.values():
            for _ in range(5):
                time.sleep(0.1)
                iteration(u, a.template, None)
        res = {k: {f: [] for f in FIGURES} for k in ups}
        cpu = dict.fromkeys(ups, 0.0)
        load = [Path("/proc/loadavg").read_text().split()[:3]]
        for blk in range(max(1, a.n // a.block)):
            order = list(ups.items()) if blk % 2 == 0 else list(reversed(ups.items()))
            for k, u in order:
                for _ in range(a.block):
                    time.sleep(0.1)
                    c0 = cpu_s(u.proc.pid)
                    iteration(u, a.template, res[k])
                    cpu[k] += cpu_s(u.proc.pid) - c0
        load.append(Path("/proc/loadavg").read_text().split()[:3])
        n = len(res["base"]["claim"])
        print(f"claim_ab: {n} iterations per side, blocks of {a.block}, pool {a.pool}; "
              f"loadavg {' '.join(load[0])} -> {' '.join(load[1])}")
        print(f"{'figure':<28}{'base p50':>10}{'p90':>9}{'this p50':>10}{'p90':>9}{'this/base':>11}")
        for f in FIGURES:
            b, t = res["base"][f], res["this tree"][f]
            print(f"{f:<28}{pct(b, 50):>8.2f}ms{pct(b, 90):>7.2f}ms{pct(t, 50):>8.2f}ms{pct(t, 90):>7.2f}ms"
                  f"{pct(t, 50) / pct(b, 50):>10.2f}×")
        for f in ("claim", "get", "rates"):
            b, t = res["base"], res["this tree"]
            print(f"{f + ' ÷ healthz':<28}{pct(b[f], 50) / pct(b['healthz'], 50):>9.2f}×"
                  f"{'':>9}{pct(t[f], 50) / pct(t['healthz'], 50):>9.2f}×")
        print(f"{'control-plane CPU / iter':<28}{cpu['base'] / n * 1000:>8.2f}ms{'':>9}"
              f"{cpu['this tree'] / n * 1000:>8.2f}ms{'':>9}{cpu['this tree'] / max(cpu['base'], 1e-9):>10.2f}×")
        return 0


if __name__ == "__main__":
    raise SystemExit(main())
