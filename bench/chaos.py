"""Chaos: SIGKILL the node agent or the control plane at random points of an RL fan-out, restart it, and
check that nothing was lost, orphaned or mis-billed.

    .venv/bin/python bench/chaos.py [--scenario node|cp|up|all] [--n 1000] [--kills 10] [--threads 16]
                                    [--template code-interpreter] [--seed S] [--json out.json]

Needs root, crun and (for the fleet scenarios) PostgreSQL. Scenarios:

- ``node``: fleet form, ``pilldrops serve`` on a throwaway PostgreSQL + one ``pilldrops node``; the node
  agent is SIGKILLed (its sandboxes live on) and restarted (it re-adopts them from its journal);
- ``cp``: the same fleet, the control plane SIGKILLed and restarted (PostgreSQL is the only state);
- ``up``: ``pilldrops up`` (SQLite), agent and control plane in one process, SIGKILLed together.

Each scenario runs ``--n`` rollouts of ``examples/env`` (create, upload the env, run the episode, kill) on
``--threads`` SDK threads; ``--kills`` times, when a random number of rollouts (5-95 % of N) has finished,
plus a random 0-1 s, the process is SIGKILLed, left down 0.2-3 s, then restarted. A rollout whose attempt
fails (a typed ``PillDropsError`` the client saw) is retried, up to ``--attempts`` times, as an RL harness
would. Then it checks:

1. **no rollout lost the client did not see fail**: every attempt either returned the right reward (checked
   against the episode computed here) or raised a ``PillDropsError``; nothing hung (per-attempt budget),
   nothing untyped escaped, and every rollout ended with a right reward within its attempts;
2. **no orphan**: once the fan-out is done (and a few heartbeats later), the control plane lists no live
   sandbox the client does not hold, and the node holds no container, sandbox cgroup, mount or process
   the control plane does not list; the sandboxes the client saw fail to create or kill are killed through
   the API (as their owner would) and the host is checked again, then after stopping everything;
3. **billing = lifetime ± 1 s**: for every sandbox in ``GET /v1/history``: billed running seconds
   (``vcpu_s / vcpu``) against ``ended_at - started_at``; the billed interval ``[started_at, started_at +
   billed]`` lies within the node's holding of the container (a separate process at raised priority lists
   the crun state dir every 0.1 s; the listings just before it appeared and just after it vanished bound
   it exactly, however late they came) and covers the client's holding of every rollout that went through
   (from create's answer to the kill it sent), both ± 1 s. The node's holding also includes creation
   (``crun run`` until the node has it running) and teardown (from the kill's start), neither billed; how
   many records differ from it by more than 1 s in each part is printed, not a finding. And every sandbox
   the client got is in history, ended.

Prints a table per scenario and writes ``--json``. Exits 1 when an invariant fails.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

from _deploy import CrunWatch, Deployment, Postgres, history, holdings, live_sandboxes, parse_time
from _harness import PID, check_leaks, machine, pct
from rich import box
from rich.console import Console
from rich.table import Table

from pilldrops import PillDropsError, Sandbox

ROOT = Path(__file__).resolve().parent.parent
ENV = ROOT / "examples" / "env"
console = Console(width=170)
sys.path.insert(0, str(ENV))
from episode import episode  # the code the sandboxes run: their answers are checked

TOLERANCE_S = 1.0


@dataclass
class Attempt:
    policy: int
    ok: bool = False
    step: str = "create"
    error: str = ""
    typed: bool = True
    sandbox: str | None = None
    killed: bool = False           # the client's kill answered
    seconds: float = 0.0
    t: dict[str, float] = field(default_factory=dict)  # wall times (time.time()) of the steps' starts and ends


@dataclass
class Scenario:
    name: str
    kills: list[dict] = field(default_factory=list)  # type: ignore[type-arg]
    attempts: list[Attempt] = field(default_factory=list)
    wall: float = 0.0
    findings: list[str] = field(default_factory=list)
    checks: dict[str, object] = field(default_factory=dict)
    records: list[dict] = field(default_factory=list)  # type: ignore[type-arg]  # per history record (--json)


def rollout(policy: int, dep: Deployment, a: argparse.Namespace) -> Attempt:
    at = Attempt(policy)
    t0 = time.monotonic()
    sb = None
    try:
        at.t["create"] = time.time()
        sb = Sandbox.create(template=a.template, vcpu=1, memory_mb=a.memory_mb, timeout=a.sandbox_timeout,
                            api_url=dep.url, api_key=dep.key, request_timeout=a.request_timeout)
        at.sandbox = sb.id
        at.t["created"] = time.time()
        at.step = "upload"
        sb.upload(ENV, "/env")
        at.step = "run"
        r = sb.run(f"python /env/episode.py --policy {policy}", timeout=60)
        if r.exit_code:
            raise RuntimeError(f"episode exited {r.exit_code}: {r.stderr[-300:]}")
        reward = float(r.stdout)
        if reward != episode(policy):
            at.typed = False
            raise RuntimeError(f"WRONG reward {reward} != {episode(policy)}")
        at.step = "kill"
        at.t["kill"] = time.time()
        sb.kill()
        at.t["killed"] = time.time()
        at.killed = True
        at.ok = True
    except PillDropsError as e:
        at.error = f"{type(e).__name__}: {e}"[:300]
    except Exception as e:  # noqa: BLE001 - anything not typed is a finding
        at.error, at.typed = f"{type(e).__name__}: {e}"[:300], at.typed and isinstance(e, RuntimeError) \
            and "exited" in str(e)
    if not at.ok and sb is not None and not at.killed:
        try:                       # as `with Sandbox.create(...)` would on the way out
            at.t["kill"] = time.time()
            sb.kill()
            at.t["killed"] = time.time()
            at.killed = True
        except Exception:  # noqa: BLE001 - it stays for the end-of-run check to find
            pass
    at.seconds = time.monotonic() - t0
    return at


def chaos_thread(sc: Scenario, dep: Deployment, role: str, done: list[int], n: int, kills: int,
                 rng: random.Random, stop: threading.Event) -> None:
    points = sorted(rng.sample(range(int(n * 0.05), int(n * 0.95)), kills)) if kills else []
    for p in points:
        while done[0] < p and not stop.is_set():
            time.sleep(0.05)
        if stop.is_set():
            return
        time.sleep(rng.uniform(0, 1))
        r = dep.roles[role]
        down = rng.uniform(0.2, 3.0)
        t_kill = time.time()
        r.kill9()
        time.sleep(down)
        r.start()
        ready = dep.wait_ready()
        sc.kills.append({"at_rollouts_done": done[0], "role": role, "down_s": round(down, 2),
                         "restart_to_ready_s": round(r.start_s[-1] + ready, 2), "t": t_kill})
        console.print(f"  SIGKILL {role} #{len(sc.kills)} at {done[0]} rollouts done: down {down:.1f} s, "
                      f"ready again {r.start_s[-1] + ready:.1f} s after restart")


def run_scenario(name: str, a: argparse.Namespace, rng: random.Random, pg: Postgres | None) -> Scenario:
    sc = Scenario(name)
    tmp = Path(tempfile.mkdtemp(prefix=f"pilldrops-bench{PID}-{name}-"))
    form = "up" if name == "up" else "fleet"
    role = {"node": "node", "cp": "cp", "up": "up"}[name]
    console.print(f"[bold]scenario {name}[/]: {form} form, SIGKILL {role} {a.kills}× during {a.n} rollouts "
                  f"(data in {tmp})")
    dep = Deployment(tmp, form, a.template, db=pg.new_database() if (pg and form == "fleet") else None)
    watch = CrunWatch(dep.crun_root)
    done = [0]
    stop = threading.Event()
    lock = threading.Lock()
    code_ok = True
    try:
        ct = threading.Thread(target=chaos_thread, args=(sc, dep, role, done, a.n, a.kills, rng, stop), daemon=True)

        def one(policy: int) -> list[Attempt]:
            tries = []
            for _ in range(a.attempts):
                at = rollout(policy, dep, a)
                tries.append(at)
                if at.ok:
                    break
                time.sleep(1.0)
            with lock:
                done[0] += 1
            return tries

        t0 = time.monotonic()
        ct.start()
        with console.status("") as st, ThreadPoolExecutor(a.threads) as pool:
            futs = [pool.submit(one, p) for p in range(a.n)]
            while not all(f.done() for f in futs):
                st.update(f"{name}: {done[0]}/{a.n} rollouts, {len(sc.kills)}/{a.kills} kills")
                time.sleep(0.5)
            for f in futs:
                sc.attempts += f.result()
        sc.wall = time.monotonic() - t0
        stop.set()
        ct.join()
        time.sleep(3 * 1.0 + 2)               # a few heartbeats: ends reported, orphans stopped
        code_ok = check(sc, dep, watch, a)
    finally:
        stop.set()
        watch.stop()
        rc = dep.stop()
        if any(c not in (0, None) for c in rc.values()):
            sc.findings.append(f"stopping exited {rc}")
        left = check_leaks(tmp, [dep.crun_root], settle=10)
        sc.checks["leaks after stop"] = left
        if left:
            sc.findings.append(f"left behind after stop: {left[:10]}")
            console.print(f"[red]left behind; {tmp} kept[/]")
        elif code_ok and not a.keep:
            shutil.rmtree(tmp, ignore_errors=True)
    return sc


def check(sc: Scenario, dep: Deployment, watch: CrunWatch, a: argparse.Namespace) -> bool:
    # 1. no silent loss
    by_policy: dict[int, list[Attempt]] = {}
    for at in sc.attempts:
        by_policy.setdefault(at.policy, []).append(at)
    untyped = [at for at in sc.attempts if not at.ok and not at.typed]
    slow = [at for at in sc.attempts if at.seconds > a.attempt_budget]
    never = [p for p, ats in by_policy.items() if not any(x.ok for x in ats)]
    sc.checks |= {"rollouts": len(by_policy), "attempts": len(sc.attempts),
                  "attempts failed (seen by the client)": sum(1 for x in sc.attempts if not x.ok),
                  "untyped or wrong": len(untyped), "slower than budget": len(slow), "never succeeded": len(never)}
    for at in untyped[:5]:
        sc.findings.append(f"untyped/wrong failure, policy {at.policy} at {at.step}: {at.error}")
    for at in slow[:5]:
        sc.findings.append(f"attempt took {at.seconds:.0f} s (policy {at.policy}, {at.step}): {at.error}")
    if never:
        sc.findings.append(f"{len(never)} rollouts never succeeded in {a.attempts} attempts")
    errs: dict[str, int] = {}
    for at in sc.attempts:
        if not at.ok:
            k = f"{at.step}: {at.error[:120]}"
            errs[k] = errs.get(k, 0) + 1
    sc.checks["client-seen failures"] = dict(sorted(errs.items(), key=lambda x: -x[1])[:12])

    # 2. orphans: the control plane's live list vs what the client holds, the node's containers vs both
    held = {at.sandbox for at in sc.attempts if at.sandbox and not at.killed}
    live = {s["id"]: s for s in live_sandboxes(dep)}
    hold = holdings(dep)
    unheld = sorted(set(live) - held)
    orphans = sorted(set(hold["containers"]) - set(live))
    sc.checks["live in the control plane after the fan-out"] = len(live)
    sc.checks["of them not held by the client"] = len(unheld)
    sc.checks["containers on the node the control plane does not list (orphans)"] = orphans
    if orphans:
        sc.findings.append(f"{len(orphans)} containers on the node not live in the control plane: {orphans[:5]}")
    known = {at.sandbox for at in sc.attempts if at.sandbox}
    sc.checks["unheld, never returned to the client (create seen failing)"] = len(set(unheld) - known)
    with dep.api() as c:                       # their owner cleans up, as `pilldrops sandbox kill` would
        for sid in live:
            c.delete(f"/v1/sandboxes/{sid}")
    deadline = time.monotonic() + 30
    while (hold := holdings(dep)) and any(hold.values()) and time.monotonic() < deadline:
        time.sleep(0.2)
    sc.checks["held on the host after killing those"] = {k: len(v) for k, v in hold.items()}
    if any(hold.values()):
        sc.findings.append(f"still on the host after every live sandbox was killed: "
                           f"{ {k: v[:3] for k, v in hold.items() if v} }")
    time.sleep(2)

    # 3. billing against lifetimes
    watch.stop()
    recs = history(dep)
    by_id = {r["id"]: r for r in recs}
    missing = sorted(s for s in known if s not in by_id)
    not_ended = sorted(r["id"] for r in recs if r["ended_at"] is None and r["state"] not in ("failed",))
    # the client's view: an attempt that went through held its sandbox running from create's answer to the
    # kill it sent, so the bill covers at least that; the node's: the container's state dir existed from
    # `crun run` to `crun delete`, so the bill lies within it (both ± TOLERANCE_S)
    client = {at.sandbox: at for at in sc.attempts if at.ok and at.sandbox}
    agent_kills = [k["t"] for k in sc.kills if k["role"] in ("node", "up")]
    diffs_cp, diffs_node, bad = [], [], []
    inside: list[float] = []          # how far the bill lies inside the node's view at its worse end (< 0: out)
    covers: list[float] = []          # how far the bill covers the client's view at its worse end (< 0: short)
    apart = {"create (crun run to the node's start) > 1 s": 0, "teardown after the kill's start > 1 s": 0,
             "of which the kill was cut by a SIGKILL of the agent": 0}
    for r in recs:
        st, en = parse_time(r["started_at"]), parse_time(r["ended_at"])
        billed = r["vcpu_s"] / r["vcpu"] if r["vcpu"] else 0.0
        if st is None:           # never started (failed_start): nothing may be billed
            if billed > 0:
                bad.append(f"{r['id']} never started but billed {billed:.2f} s ({r['end_reason']})")
            continue
        if en is None:
            continue
        d = billed - (en - st)
        diffs_cp.append(d)
        end = st + billed
        node_life, held = watch.lifetime(r["id"]), watch.held(r["id"])
        at = client.get(r["id"])
        sc.records.append({"id": r["id"], "billed": billed, "started_at": st, "ended_at": en,
                           "end_reason": r["end_reason"], "node_before": held[0] if held else None,
                           "node_first": watch.first.get(r["id"]), "node_last": watch.last.get(r["id"]),
                           "node_after": held[1] if held else None, "client": at.t if at else None})
        if abs(d) > TOLERANCE_S:
            bad.append(f"{r['id']}: billed {billed:.2f} s, ended_at - started_at {en - st:.2f} s ({r['end_reason']})")
        if held is None:
            if billed > TOLERANCE_S:
                bad.append(f"{r['id']}: billed {billed:.2f} s, the node's crun state never held it ({r['end_reason']})")
        else:
            diffs_node.append(billed - node_life)  # type: ignore[operator]
            margin = min(st - held[0], held[1] - end)
            inside.append(margin)
            if margin < -TOLERANCE_S:
                bad.append(f"{r['id']}: billed [{st:.2f}, {end:.2f}] outside the node's holding "
                           f"({held[0]:.2f}, {held[1]:.2f}) by {-margin:.2f} s ({r['end_reason']})")
            if watch.first[r["id"]] < st - TOLERANCE_S:
                apart["create (crun run to the node's start) > 1 s"] += 1
            if watch.last[r["id"]] > end + TOLERANCE_S:
                apart["teardown after the kill's start > 1 s"] += 1
                if any(end <= t <= watch.last[r["id"]] for t in agent_kills):
                    apart["of which the kill was cut by a SIGKILL of the agent"] += 1
        if at is not None and "created" in at.t and "kill" in at.t:
            margin = min(at.t["created"] - st, end - at.t["kill"])
            covers.append(margin)
            if margin < -TOLERANCE_S:
                bad.append(f"{r['id']}: billed [{st:.2f}, {end:.2f}] does not cover the client's holding "
                           f"[{at.t['created']:.2f}, {at.t['kill']:.2f}] by {-margin:.2f} s ({r['end_reason']})")
    sc.checks["bill inside the node's holding: worst margin, s (< 0: outside)"] = round(min(inside), 3) if inside else None
    sc.checks["bill covers the client's holding: worst margin, s (< 0: short)"] = round(min(covers), 3) if covers else None
    sc.checks["records checked against the node / the client"] = [len(inside), len(covers)]
    sc.checks["node held it more than 1 s longer than billed, by part"] = apart
    sc.checks["crun watch: longest gap between listings, s"] = round(watch.gap, 3)
    reasons: dict[str, int] = {}
    for r in recs:
        k = f"{r['state']}/{r['end_reason']}"
        reasons[k] = reasons.get(k, 0) + 1
    never_billed = [cid for cid in watch.first if cid not in by_id]
    sc.checks |= {"history records": len(recs), "end reasons": reasons,
                  "client's sandboxes missing from history": missing, "history records not ended": not_ended,
                  "containers the node ran that history does not know": never_billed,
                  "billed - (ended_at - started_at), s: min/p50/max":
                      [round(min(diffs_cp), 3), round(pct(diffs_cp, 50), 3), round(max(diffs_cp), 3)] if diffs_cp else [],
                  "billed - node lifetime (creation and teardown included), s: min/p50/max":
                      [round(min(diffs_node), 3), round(pct(diffs_node, 50), 3), round(max(diffs_node), 3)] if diffs_node else [],
                  f"billing off by more than {TOLERANCE_S:.0f} s": len(bad)}
    sc.findings += bad[:10]
    if missing:
        sc.findings.append(f"{len(missing)} sandboxes the client got are not in history: {missing[:5]}")
    if not_ended:
        sc.findings.append(f"{len(not_ended)} history records not ended after all were killed: {not_ended[:5]}")
    if never_billed:
        sc.findings.append(f"{len(never_billed)} containers ran on the node with no history record: {never_billed[:5]}")
    return not sc.findings


def report(scs: list[Scenario], a: argparse.Namespace, info: dict[str, str]) -> None:
    console.print(f"[bold]PillDrops chaos[/] — {a.n} rollouts of examples/env per scenario, {a.threads} client threads, "
                  f"{a.kills} SIGKILLs each, template {a.template}; {info['cores']} cores, {info['mem']}, kernel "
                  f"{info['kernel']}, {info['crun']}, {info['date']}")
    t = Table(box=box.ASCII2, title="per scenario")
    cols = ("scenario", "kills", "restart→ready p50/max", "wall", "rollouts ok", "attempts failed (seen)",
            "untyped/wrong", "unheld live after", "orphans", "host after kill-all", "bill − (end − start) |Δ| max",
            "bill in node's view / covers client's (worst margin)", "billed off > 1 s", "leaks after stop")
    for c in cols:
        t.add_column(c, justify="left" if c == "scenario" else "right")
    for sc in scs:
        ch = sc.checks
        rr = [k["restart_to_ready_s"] for k in sc.kills]
        dcp = ch.get("billed - (ended_at - started_at), s: min/p50/max") or [0, 0, 0]
        m_node = ch.get("bill inside the node's holding: worst margin, s (< 0: outside)")
        m_client = ch.get("bill covers the client's holding: worst margin, s (< 0: short)")
        held = ch.get("held on the host after killing those", {})
        t.add_row(sc.name, str(len(sc.kills)), f"{pct(rr, 50):.1f} / {max(rr):.1f} s" if rr else "-",
                  f"{sc.wall:.0f} s",
                  f"{ch.get('rollouts', 0) - ch.get('never succeeded', 0)}/{ch.get('rollouts', 0)}",
                  f"{ch.get('attempts failed (seen by the client)', 0)}/{ch.get('attempts', 0)}",
                  str(ch.get("untyped or wrong", 0)), str(ch.get("of them not held by the client", 0)),
                  str(len(ch.get("containers on the node the control plane does not list (orphans)", []))),  # type: ignore[arg-type]
                  str(sum(held.values())) if held else "-",  # type: ignore[union-attr]
                  f"{max(abs(dcp[0]), abs(dcp[2])):.3f} s",  # type: ignore[index]
                  f"{m_node if m_node is not None else '-'} / {m_client if m_client is not None else '-'} s",
                  str(ch.get(f"billing off by more than {TOLERANCE_S:.0f} s", 0)),
                  str(len(ch.get("leaks after stop", []))))  # type: ignore[arg-type]
    console.print(t)
    for sc in scs:
        console.print(f"[bold]{sc.name}[/]: client-seen failures by step: {sc.checks.get('client-seen failures')}")
        console.print(f"  end reasons: {sc.checks.get('end reasons')}")
        for k in ("records checked against the node / the client",
                  "billed - node lifetime (creation and teardown included), s: min/p50/max",
                  "node held it more than 1 s longer than billed, by part", "crun watch: longest gap between listings, s"):
            console.print(f"  {k}: {sc.checks.get(k)}")
        for f in sc.findings:
            console.print(f"  [red]finding[/]: {f}")
        if not sc.findings:
            console.print("  [green]all invariants held[/]")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--scenario", default="all", choices=["node", "cp", "up", "all"])
    ap.add_argument("--n", type=int, default=1000, help="rollouts per scenario")
    ap.add_argument("--kills", type=int, default=10, help="SIGKILLs per scenario")
    ap.add_argument("--threads", type=int, default=16)
    ap.add_argument("--attempts", type=int, default=5, help="attempts per rollout (an RL harness retries)")
    ap.add_argument("--attempt-budget", type=float, default=180.0, help="an attempt slower than this is a finding")
    ap.add_argument("--template", default="code-interpreter")
    ap.add_argument("--memory-mb", type=int, default=256)
    ap.add_argument("--sandbox-timeout", type=int, default=900)
    ap.add_argument("--request-timeout", type=float, default=60.0)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--keep", action="store_true", help="keep the temp dirs")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    import os
    if os.geteuid() != 0:
        sys.exit("bench/chaos.py needs root (crun, mounts, cgroups, PostgreSQL)")
    a.seed = a.seed if a.seed is not None else random.randrange(1 << 30)
    rng = random.Random(a.seed)
    console.print(f"seed {a.seed}")
    names = ["node", "cp", "up"] if a.scenario == "all" else [a.scenario]
    pg = Postgres() if any(n != "up" for n in names) else None
    info = machine()
    scs = []
    try:
        for name in names:
            scs.append(run_scenario(name, a, rng, pg))
    except KeyboardInterrupt:
        console.print("[yellow]interrupted[/]")
    finally:
        if pg is not None:
            pg.stop()
    report(scs, a, info)
    if a.json:
        a.json.write_text(json.dumps({"args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(a).items()},
                                      "machine": info,
                                      "scenarios": [asdict(sc) for sc in scs]},
                                     indent=1, default=str))
    return 1 if any(sc.findings for sc in scs) or len(scs) < len(names) else 0


if __name__ == "__main__":
    sys.exit(main())
