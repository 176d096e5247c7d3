"""Fan-out of RL rollouts through PillDrops vs the same episodes as bare host subprocesses, same concurrency.

    .venv/bin/python bench/fanout.py [--n 1000] [--threads 64] [--template code-interpreter] [--vcpu 1]
                                     [--memory-mb 512] [--warmup 16] [--json out.json]

Needs root and crun. What it does:

1. Starts its own ``pilldrops up`` (see ``_harness.Up``) with ``--unlimited-credits``. The
   ``code-interpreter`` template (Debian + Python 3) is taken from the default data dir
   (``~/.local/share/pilldrops``), built there first if needed (about a minute).
2. Baseline: N episodes of ``examples/env`` as bare host subprocesses with ``--threads`` threads: copy the
   env dir to a fresh temp dir (the "upload"), ``<host python> episode.py --policy P``, parse the reward,
   remove the dir. The host python is ``/usr/bin/python3`` (Debian's 3.11, the same interpreter as the
   template's) unless ``--host-python`` says otherwise.
3. PillDrops: the same N rollouts with the same threads through the sync SDK, as in the README:
   ``Sandbox.create(template, vcpu, memory_mb)`` → ``sb.upload(examples/env, "/env")`` →
   ``sb.run("python /env/episode.py --policy P")`` → ``sb.kill()``; every reward is checked against the
   episode computed in this process.
4. Prints per-rollout latency p50/p99, wall and rollouts/s of both, the ratio, a per-step breakdown and
   the CPU seconds spent by the `up` process (Python), its children (crun, tar), this client and its
   children (the host episodes).
5. Stops `up` with SIGINT and checks that nothing is left (containers, mounts, cgroups, processes).
   Exits 1 on any error, wrong reward or leak.
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

import httpx
from _harness import PID, Phase, Up, check_leaks, machine, pct, profiled, run_phase
from rich import box
from rich.console import Console
from rich.table import Table

from pilldrops import Sandbox

ROOT = Path(__file__).resolve().parent.parent
ENV = ROOT / "examples" / "env"
console = Console(width=170)
sys.path.insert(0, str(ENV))
from episode import episode  # the same code the sandboxes run: their answers are checked


def host_rollout(policy: int, py: str, scratch: Path) -> tuple[float, dict[str, float]]:
    t0 = time.perf_counter()
    d = Path(tempfile.mkdtemp(dir=scratch))
    try:
        shutil.copytree(ENV, d / "env", ignore=shutil.ignore_patterns("__pycache__"))
        t1 = time.perf_counter()
        r = subprocess.run([py, str(d / "env" / "episode.py"), "--policy", str(policy)], capture_output=True,
                           text=True, stdin=subprocess.DEVNULL, check=False)
        t2 = time.perf_counter()
        if r.returncode:
            raise RuntimeError(f"host episode {policy} exited {r.returncode}: {r.stderr[-500:]}")
    finally:
        shutil.rmtree(d, ignore_errors=True)
    return float(r.stdout), {"copy env": t1 - t0, "run episode": t2 - t1}


def sandbox_rollout(policy: int, a: argparse.Namespace, up: Up) -> tuple[float, dict[str, float]]:
    t0 = time.perf_counter()
    sb = Sandbox.create(template=a.template, vcpu=a.vcpu, memory_mb=a.memory_mb, timeout=600,
                        api_url=up.url, api_key=up.key)
    t1 = t2 = t3 = t1b = time.perf_counter()
    try:
        sb.upload(ENV, "/env")
        t2 = time.perf_counter()
        r = sb.run(f"python /env/episode.py --policy {policy}")
        t3 = time.perf_counter()
        if r.exit_code:
            raise RuntimeError(f"episode {policy} in {sb.id} exited {r.exit_code}: {r.stderr[-500:]}")
    finally:
        t1b = time.perf_counter()
        sb.kill()
    t4 = time.perf_counter()
    return float(r.stdout), {"create→ready": t1 - t0, "upload env": t2 - t1, "run episode": t3 - t2,
                             "kill": t4 - t1b}


def check(ph: Phase, out: list, policies: list[int]) -> tuple[dict[str, list[float]], int]:  # type: ignore[type-arg]
    """Per-step latencies (ms) and the number of wrong rewards."""
    steps: dict[str, list[float]] = {}
    wrong = 0
    for p, res in zip(policies, out):
        if res is None:
            continue
        reward, st = res
        if reward != episode(p):
            wrong += 1
            ph.errors.append(f"policy {p}: reward {reward} != host {episode(p)}")
        for k, v in st.items():
            steps.setdefault(k, []).append(v * 1000)
    return steps, wrong


def report(a: argparse.Namespace, res: dict, info: dict[str, str], left: list[str]) -> None:  # type: ignore[type-arg]
    pd, host = res["pd"], res["host"]
    console.print(f"[bold]PillDrops fan-out[/] — N={a.n} rollouts of examples/env, {a.threads} client threads, "
                  f"template {a.template} ({a.vcpu} vCPU, {a.memory_mb} MiB); {info['cores']} cores, {info['mem']}, "
                  f"kernel {info['kernel']}, {info['crun']}, Python {info['python']}, {info['date']}")
    t = Table(box=box.ASCII2, title="per rollout")
    for c in ("", "ok", "p50", "p99", "wall", "rollouts/s", "wall ratio", "p50 ratio"):
        t.add_column(c, justify="left" if not c else "right")
    for label, ph in ((f"host subprocess ({res['host_python']}) — baseline", host),
                      ("PillDrops: create + upload + run + kill", pd)):
        t.add_row(label, str(len(ph.lat)), f"{pct(ph.lat, 50):.1f} ms", f"{pct(ph.lat, 99):.1f} ms",
                  f"{ph.wall:.1f} s", f"{ph.rate:.1f}", f"{ph.wall / host.wall:.2f}×",
                  f"{pct(ph.lat, 50) / pct(host.lat, 50):.2f}×")
    console.print(t)
    s = Table(box=box.ASCII2, title="per step (under the same load)")
    for c in ("step", "p50", "p99", "mean"):
        s.add_column(c, justify="left" if c == "step" else "right")
    for who, steps in (("host", res["host_steps"]), ("PillDrops", res["pd_steps"])):
        for k, v in steps.items():
            s.add_row(f"{who}: {k}", f"{pct(v, 50):.1f} ms", f"{pct(v, 99):.1f} ms", f"{sum(v) / len(v):.1f} ms")
    console.print(s)
    c = Table(box=box.ASCII2, title="CPU seconds per phase (2 cores: wall × 2 is the most there is)")
    keys = list(pd.cpu)
    c.add_column("phase")
    c.add_column("wall", justify="right")
    for k in keys:
        c.add_column(k, justify="right")
    for label, ph in (("host subprocesses", host), ("PillDrops", pd)):
        c.add_row(label, f"{ph.wall:.1f} s", *(f"{ph.cpu[k]:.1f} s" for k in keys))
    console.print(c)
    for ph in (host, pd):
        if ph.errors:
            console.print(f"[red]{ph.name}: {len(ph.errors)} errors[/]")
            uniq: dict[str, int] = {}
            for e in ph.errors:
                uniq[e[:300]] = uniq.get(e[:300], 0) + 1
            for e, k in sorted(uniq.items(), key=lambda x: -x[1])[:10]:
                console.print(f"  {k}× {e}")
    if res.get("pool"):
        p = res["pool"]
        console.print(f"Warm pool: size {a.pool}, hits {p.get('hits')}, misses {p.get('misses')}, "
                      f"hit rate {p.get('hit_rate')}")
    r = pd.wall / host.wall
    console.print(f"Target: fan-out ≤ 1.5× bare subprocesses (wall; now {r:.2f}×, "
                  f"{'met' if r <= 1.5 else f'NOT met, {r / 1.5:.1f}× over'}); rewards checked against the "
                  f"host: {'all correct' if not res['wrong'] else str(res['wrong']) + ' WRONG'}; leaks: "
                  f"{'none' if not left else len(left)}.")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=1000, help="rollouts")
    ap.add_argument("--threads", type=int, default=64, help="client threads")
    ap.add_argument("--template", default="code-interpreter")
    ap.add_argument("--vcpu", type=float, default=1.0)
    ap.add_argument("--memory-mb", type=int, default=512)
    ap.add_argument("--warmup", type=int, default=16, help="untimed rollouts of each kind first")
    ap.add_argument("--host-python", default="/usr/bin/python3" if Path("/usr/bin/python3").exists()
                    else sys.executable)
    ap.add_argument("--profile", type=Path, help="py-spy record the `up` process during the PillDrops phase "
                    "into this dir (raw format; `bench/live.py --profile` prints summaries)")
    ap.add_argument("--json", type=Path, help="write raw numbers here")
    ap.add_argument("--pool", type=int, default=0,
                    help="warm pool of this size (of the rollout's shape) for the PillDrops phases (0: cold creates)")
    a = ap.parse_args()
    if a.profile:
        a.profile.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        sys.exit("bench/fanout.py needs root (crun, mounts, cgroups)")
    tmp = Path(tempfile.mkdtemp(prefix=f"pilldrops-bench{PID}-"))
    scratch = tmp / "host"
    scratch.mkdir()
    info = machine()
    res: dict = {"host_python": a.host_python}  # type: ignore[type-arg]
    code = 0
    up = None
    policies = list(range(a.n))
    try:
        console.print(f"starting pilldrops up (data in {tmp}) ...")
        up = Up(tmp, a.template, extra=["--unlimited-credits"], seed=[a.template] if a.template != "tiny" else None)
        if a.pool:
            httpx.put(f"{up.url}/v1/pools", headers={"Authorization": f"Bearer {up.key}"}, timeout=30,
                      json={"template": a.template, "vcpu": a.vcpu, "memory_mb": a.memory_mb,
                            "size": a.pool}).raise_for_status()
            time.sleep(5)
        with console.status("") as st:
            warm = list(range(a.warmup))
            run_phase("warm-up host", warm, lambda p: host_rollout(p, a.host_python, scratch), a.threads,
                      up.proc.pid, st)
            wph, _ = run_phase("warm-up PillDrops", warm, lambda p: sandbox_rollout(p, a, up), a.threads,
                               up.proc.pid, st)
            if wph.errors:
                raise RuntimeError(f"warm-up failed: {wph.errors[0]}")
            res["host"], out = run_phase("host subprocesses", policies,
                                         lambda p: host_rollout(p, a.host_python, scratch), a.threads,
                                         up.proc.pid, st)
            res["host_steps"], w1 = check(res["host"], out, policies)
            with profiled(up.proc.pid, a.profile / "fanout.txt" if a.profile else None):
                res["pd"], out = run_phase("PillDrops", policies, lambda p: sandbox_rollout(p, a, up), a.threads,
                                           up.proc.pid, st)
            res["pd_steps"], w2 = check(res["pd"], out, policies)
            if a.pool:
                time.sleep(6)              # one heartbeat: the node reports its pool's hits and misses
                items = httpx.get(f"{up.url}/v1/pools", headers={"Authorization": f"Bearer {up.key}"},
                                  timeout=30).json()["items"]
                res["pool"] = items[0] if items else {}
                httpx.put(f"{up.url}/v1/pools", headers={"Authorization": f"Bearer {up.key}"}, timeout=30,
                          json={"template": a.template, "vcpu": a.vcpu, "memory_mb": a.memory_mb, "size": 0})
            res["wrong"] = w1 + w2
    except KeyboardInterrupt:
        console.print("[yellow]interrupted[/]: cleaning up")
        code = 130
    finally:
        if up is not None:
            rc = up.stop(timeout=300)
            if rc != 0:
                console.print(f"[red]pilldrops up exited {rc}[/]:\n{up.log.read_text()[-2000:]}")
                code = code or 1
        left = check_leaks(tmp, [tmp / "data" / "node" / "crun"], settle=10)
        if left:
            console.print(f"[red]left behind ({len(left)}); {tmp} kept:[/]\n" + "\n".join(left[:50]))
            code = code or 1
        else:
            shutil.rmtree(tmp)
    if "pd" in res:
        report(a, res, info, left)
        if res["wrong"] or res["pd"].errors or res["host"].errors:
            code = code or 1
        if a.json:
            out_ = {k: (vars(v) if isinstance(v, Phase) else v) for k, v in res.items()}
            a.json.write_text(json.dumps({"args": vars(a) | {"json": str(a.json)}, "machine": info, **out_},
                                         indent=1, default=str))
    return code


if __name__ == "__main__":
    sys.exit(main())
