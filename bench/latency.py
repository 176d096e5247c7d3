"""PillDrops latency vs raw crun, measured in one run on the same machine and the same rootfs.

    .venv/bin/python bench/latency.py [--n 200] [--template tiny] [--runs 5] [--warmup 5] [--json out.json]
    .venv/bin/python bench/latency.py --egress --pool 4 --pool-net [--n 40]   # warm claims with egress only

Needs root and crun. What it does:

1. Starts its own ``pilldrops up`` (subprocess in its own session, free ports, a temp data dir named
   ``pilldrops-bench*``, its own XDG_CONFIG_HOME, ``--node-name bench<pid>``), reads the API key from the
   config file ``up`` writes, and stops it with SIGINT at the end (also on Ctrl-C or errors).
2. N times, sequentially, through the sync SDK: ``Sandbox.create(template, memory_mb=256)`` (returns only
   once the sandbox runs: "create->ready"), ``--runs`` x ``sb.run("true")``, ``sb.kill()``.
3. Interleaved with each iteration, the baselines on the same template layers: raw ``crun run --detach``
   of an equivalent bundle (``oci_spec.build_spec``, overlay over the same layers, same namespaces and
   limits, pd-init as PID 1; only the crun call is timed, stdio on /dev/null, stderr to a file — a detached
   crun inherits its stdio), raw ``crun exec <id> true``, raw ``crun delete --force``, and host fork+exec of
   ``/bin/true``. Raw containers use their own ``crun --root`` and cgroup parent ``pilldrops-benchraw<pid>``.
   With egress (``--egress``, default on; issue 14), each iteration also creates and kills a sandbox with
   ``network.allow_out`` (a veth pair, NAT and its own nft chain; nothing is ever contacted): its create
   and kill are compared with the loopback-only ones of the same run. The warm phase likewise claims
   members with egress attached at claim time, and times ``nft -f`` of one sandbox's rules alone (what a
   pool of pre-networked members per policy would still pay at claim).
   The bench's agent gets a free 10.x pool, no DNS, no uplink and an egress cap of 198.18.0.0/15.
   With ``--pool-net`` (and ``--egress --pool N``) it runs only the warm-claims-with-egress comparison of
   ``bench/_pool_net.py``: a claim from a per-policy pool (network attached before the claim) vs a loopback
   member with the network attached at the claim vs a loopback-only claim, p50/p95 in the same run, plus
   what a per-policy member costs idle (links, nft rules, kernel memory).
4. Prints a table (p50/p99, ratio and overhead vs the baseline) and optionally writes raw numbers as JSON.
5. Checks that nothing is left: no crun containers in either root, no mounts under the data dir, no
   ``pilldrops-bench*`` cgroups; then removes the temp dirs.
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

import _pool_net
import httpx
from _harness import MATCH, PID, Raw, Up, leftovers, machine, ok, pct, pd_cycle, timed
from rich import box
from rich.console import Console
from rich.table import Table

from pilldrops import Sandbox

MEMORY_MB = 256
console = Console(width=160)


def host_true() -> float:
    dt, r = timed(["/bin/true"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return ok(dt, r, "")


def iteration(i: str, up: Up, raw: Raw, template: str, runs: int, out: dict[str, list[float]] | None) -> None:
    """One PillDrops cycle, then one raw crun cycle, then host forks; records into ``out`` unless warm-up."""
    rec = (lambda k, v: out[k].append(v * 1000)) if out is not None else (lambda k, v: None)
    pd_cycle(up, template, runs, rec, MEMORY_MB)
    cid = f"raw{PID}-{i}"
    try:
        d = raw.prepare(cid)
        rec("raw_run", raw.run(cid, d))
        for _ in range(runs):
            rec("raw_exec", raw.exec_true(cid))
        rec("raw_delete", raw.delete(cid))
    finally:
        raw.cleanup(cid)
    for _ in range(runs):
        rec("host_true", host_true())


EGRESS = {"allow_out": ["198.18.255.254"]}      # benchmark range, never contacted


def egress_iteration(up: Up, template: str, out: dict[str, list[float]] | None, key: str) -> None:
    """create with egress → run("true") → kill."""
    t = time.perf_counter()
    sb = Sandbox.create(template=template, memory_mb=MEMORY_MB, api_url=up.url, api_key=up.key, network=EGRESS)
    dt = time.perf_counter() - t
    try:
        assert sb.run("true").exit_code == 0
    finally:
        t = time.perf_counter()
        sb.kill()
        dk = time.perf_counter() - t
    if out is not None:
        out[key].append(dt * 1000)
        if key == "pd_create_egress":
            out["pd_kill_egress"].append(dk * 1000)


def free_pool() -> str:
    """A 10.x /24 no host route overlaps (the bench agent's egress pool)."""
    import ipaddress
    routes = json.loads(subprocess.run(["ip", "-j", "-4", "route", "show", "table", "all"], capture_output=True,
                                       check=True).stdout or b"[]")
    taken = [ipaddress.IPv4Network(r["dst"], strict=False) for r in routes if r.get("dst") not in (None, "default")]
    for i in range(256):
        net = ipaddress.IPv4Network(f"10.211.{(PID + i) % 256}.0/24")
        if not any(net.overlaps(t) for t in taken):
            return str(net)
    raise RuntimeError("no free 10.211.x.0/24 for the egress pool")


def raw_nft(n: int) -> list[float]:
    """``nft -f`` of one sandbox chain + map element into a scratch table of our own (then removed)."""
    import ipaddress

    from pilldrops.node.egress import rules
    from pilldrops.node.egress.config import EgressConfig
    from pilldrops.schema.node import NodeNetwork
    cfg = EgressConfig(tag=f"b{PID % 100000:x}"[:6], pool=ipaddress.IPv4Network("10.211.255.0/24"))
    net = NodeNetwork(allow_out=EGRESS["allow_out"], cap=["198.18.0.0/15"])
    subprocess.run(["nft", "-f", "-"], input=rules.base(cfg).encode(), check=True)
    out = []
    try:
        for i in range(n):
            script = rules.sandbox(cfg, i % 64, net).encode()
            t = time.perf_counter()
            subprocess.run(["nft", "-f", "-"], input=script, capture_output=True, check=True)
            out.append((time.perf_counter() - t) * 1000)
            subprocess.run(["nft", "-f", "-"], input=rules.remove_sandbox(cfg, i % 64).encode(), check=True)
    finally:
        subprocess.run(["nft", "delete", "table", "inet", cfg.table], check=False)
    return out


def net_leftovers(tmp: Path) -> list[str]:
    """Egress links and the agent's nft table left after `up` stopped."""
    try:
        tag = (tmp / "data" / "node" / "instance").read_text().strip()[:4]
    except OSError:
        return []
    left = [f"link {n}" for n in os.listdir("/sys/class/net") if n.startswith(f"pd{tag}")]
    r = subprocess.run(["nft", "list", "table", "inet", f"pd_{tag}"], capture_output=True, check=False)
    return left + ([f"nft table pd_{tag}"] if r.returncode == 0 else [])


def set_pool(up: Up, template: str, size: int) -> None:
    """A warm pool of the benchmark's shape (the `up` key is the operator's admin key)."""
    r = httpx.put(f"{up.url}/v1/pools", headers={"Authorization": f"Bearer {up.key}"}, timeout=30,
                  json={"template": template, "vcpu": 1, "memory_mb": MEMORY_MB, "size": size})
    r.raise_for_status()


def pool_stats(up: Up, template: str) -> dict[str, object]:
    r = httpx.get(f"{up.url}/v1/pools", headers={"Authorization": f"Bearer {up.key}"}, timeout=30)
    items = [p for p in r.raise_for_status().json()["items"] if p["template"] == template]
    return items[0] if items else {}


def warm_iteration(up: Up, template: str, out: dict[str, list[float]] | None, egress: bool = False) -> None:
    """create (a claim from the warm pool) → run("true") → kill; the pool refills in the pause before."""
    time.sleep(0.1)
    t = time.perf_counter()
    sb = Sandbox.create(template=template, memory_mb=MEMORY_MB, api_url=up.url, api_key=up.key)
    dt = time.perf_counter() - t
    try:
        t = time.perf_counter()
        sb.get_info()           # one GET /v1/sandboxes/{id} on the same kept-alive pool: the claim's floor
        get = time.perf_counter() - t
        assert sb.run("true").exit_code == 0
    finally:
        sb.kill()
    if out is not None:
        out["pd_create_warm"].append(dt * 1000)
        out["pd_get_sb"].append(get * 1000)
    if egress:
        time.sleep(0.1)
        egress_iteration(up, template, out, "pd_create_warm_egress")


def report(res: dict[str, list[float]], n: int, runs: int, info: dict[str, str]) -> None:
    console.print(f"[bold]PillDrops latency[/] — N={n} sandboxes, {runs} runs each; {info['cores']} cores, "
                  f"kernel {info['kernel']}, {info['crun']}, Python {info['python']}, {info['date']}")
    t = Table(box=box.ASCII2)
    for c in ("operation", "PillDrops p50", "p99", "baseline", "baseline p50", "p99", "ratio p50", "overhead p50"):
        t.add_column(c, justify="left" if c in ("operation", "baseline") else "right")
    rows = [("create→ready", "pd_create", "crun run --detach", "raw_run"),
            ("create→ready, warm pool", "pd_create_warm", "crun run --detach", "raw_run"),
            ("create→ready, warm pool", "pd_create_warm", "GET /v1/sandboxes/{id}", "pd_get_sb"),
            ('run("true")', "pd_run", "crun exec <id> true", "raw_exec"),
            ('run("true")', "pd_run", "host fork+exec /bin/true", "host_true"),
            ('run("true")', "pd_run", "one GET /healthz, same server+client", "pd_get"),
            ("kill", "pd_kill", "crun delete --force", "raw_delete"),
            ("create→ready, egress", "pd_create_egress", "create→ready, loopback only", "pd_create"),
            ("kill, egress", "pd_kill_egress", "kill, loopback only", "pd_kill"),
            ("warm claim + egress attached", "pd_create_warm_egress", "warm claim, loopback only",
             "pd_create_warm"),
            ("nft -f one sandbox's rules", "raw_nft", "warm claim, loopback only", "pd_create_warm")]
    for name, pk, bname, bk in rows:
        if not res.get(pk) or not res.get(bk):
            continue
        p50, p99, b50, b99 = pct(res[pk], 50), pct(res[pk], 99), pct(res[bk], 50), pct(res[bk], 99)
        t.add_row(name, f"{p50:.1f} ms", f"{p99:.1f} ms", bname, f"{b50:.1f} ms", f"{b99:.1f} ms",
                  f"{p50 / b50:.2f}×", f"{p50 - b50:+.1f} ms")
    console.print(t)
    c, r = pct(res["pd_create"], 50) / pct(res["raw_run"], 50), pct(res["pd_run"], 50)
    console.print(f'run("true"): p50 {r:.2f} ms, p90 {pct(res["pd_run"], 90):.2f} ms; '
                  f'÷ host fork+exec {r / pct(res["host_true"], 50):.2f}×, ÷ one GET {r / pct(res["pd_get"], 50):.2f}× '
                  f'(GET p50 {pct(res["pd_get"], 50):.2f} ms, p90 {pct(res["pd_get"], 90):.2f}); '
                  f'loadavg {" ".join(Path("/proc/loadavg").read_text().split()[:3])}')
    console.print(f"Targets: cold create p50 ≤ 1.3× raw crun (now {c:.2f}×, {'met' if c <= 1.3 else 'NOT met'}); "
                  f"run p50 ≤ 3 ms (now {r:.1f} ms, {'met' if r <= 3 else 'NOT met'})"
                  + (f"; warm claim p50 ≤ 3 ms (now {pct(res['pd_create_warm'], 50):.1f} ms, "
                     f"{'met' if pct(res['pd_create_warm'], 50) <= 3 else 'NOT met'})" if res.get("pd_create_warm")
                     else "") + ".")
    if info.get("pool"):
        console.print(f"Warm pool: {info['pool']}")
    how = ("pd-init's control socket (fast exec path, PILLDROPS_EXEC=supervisor)"
           if os.environ.get("PILLDROPS_EXEC", "supervisor").strip().lower() != "crun"
           else "`crun exec --no-new-privs --env.. --cwd --pid-file` (PILLDROPS_EXEC=crun)")
    console.print(f"Notes: PillDrops run(\"true\") execs `true` directly (a plain line needs no `sh -c`: node/cmdline.py) via {how} behind HTTP;\n"
                  "       raw kill times only `crun delete --force` (PillDrops kill also unmounts, removes the cgroups and the bundle). Samples: create/kill N, run N×runs.")


class _Done(Exception):
    """The --pool-net phase is all this run measures."""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=200, help="timed sandboxes")
    ap.add_argument("--template", default="tiny")
    ap.add_argument("--runs", type=int, default=5, help='sb.run("true") / crun exec per sandbox')
    ap.add_argument("--warmup", type=int, default=5, help="untimed iterations first")
    ap.add_argument("--json", type=Path, help="write raw numbers (ms) here")
    ap.add_argument("--pool", type=int, default=4, help="warm pool size for the warm-create phase (0: skip it)")
    ap.add_argument("--egress", action=argparse.BooleanOptionalAction, default=True,
                    help="also time creates with egress (veth + NAT + rules) in the same run")
    ap.add_argument("--pool-net", action="store_true",
                    help="only warm claims with egress: per-policy pool vs attach-at-claim vs loopback claim")
    a = ap.parse_args()
    if a.pool_net and not (a.egress and a.pool):
        sys.exit("--pool-net needs --egress and --pool N (N > 0)")
    pool_net: dict[str, object] | None = None
    if os.geteuid() != 0:
        sys.exit("bench/latency.py needs root (crun, mounts, cgroups)")
    tmp = Path(tempfile.mkdtemp(prefix=f"pilldrops-bench{PID}-"))
    up = raw = None
    res: dict[str, list[float]] = {k: [] for k in ("pd_create", "pd_run", "pd_kill", "raw_run", "raw_exec",
                                                   "raw_delete", "host_true", "pd_create_warm",
                                                   "pd_get", "pd_get_sb", "pd_create_egress", "pd_kill_egress",
                                                   "pd_create_warm_egress",
                                                   "raw_nft")}
    info = machine()
    code = 0
    try:
        console.print(f"starting pilldrops up (data in {tmp}) ...")
        if a.egress:      # the bench agent's egress: its own pool, no DNS, no uplink, capped (nothing leaves)
            os.environ.update(PILLDROPS_EGRESS_POOL=free_pool(), PILLDROPS_EGRESS_DNS="none",
                              PILLDROPS_EGRESS_UPLINKS="")
        up = Up(tmp, a.template, ["--egress-allow", "198.18.0.0/15"] if a.egress else None)
        if a.pool_net:
            with console.status("") as st:
                pool_net = _pool_net.run(up, a.template, MEMORY_MB, a.pool, a.n, a.warmup, MATCH, st)
            raise _Done
        raw = Raw(up.data, a.template, MEMORY_MB)
        for i in range(a.warmup):
            iteration(f"w{i}", up, raw, a.template, a.runs, None)
        with console.status("") as st:
            for i in range(a.n):
                st.update(f"iteration {i + 1}/{a.n}")
                iteration(str(i), up, raw, a.template, a.runs, res)
                if a.egress:
                    egress_iteration(up, a.template, res, "pd_create_egress")
            if a.pool:
                set_pool(up, a.template, a.pool)
                time.sleep(3)                       # let it fill
                for i in range(a.warmup):
                    warm_iteration(up, a.template, None, a.egress)
                for i in range(a.n):
                    st.update(f"warm iteration {i + 1}/{a.n}")
                    warm_iteration(up, a.template, res, a.egress)
                time.sleep(6)                       # one heartbeat: the node reports its hits and misses
                ps = pool_stats(up, a.template)
                info["pool"] = (f"size {a.pool}, hits {ps.get('hits')}, misses {ps.get('misses')}, "
                                f"hit rate {ps.get('hit_rate')}")
                set_pool(up, a.template, 0)
            if a.egress:
                res["raw_nft"] = raw_nft(a.n)
    except _Done:
        pass
    except KeyboardInterrupt:
        console.print("[yellow]interrupted[/]: cleaning up")
        code = 130
    finally:
        if raw is not None:
            raw.cleanup_all()
        if up is not None:
            rc = up.stop()
            if rc != 0:
                console.print(f"[red]pilldrops up exited {rc}[/]:\n{up.log.read_text()[-2000:]}")
                code = code or 1
        roots = [tmp / "data" / "node" / "crun", tmp / "data" / "benchraw" / "crun"]
        for _ in range(50):                         # teardown may settle for a moment
            if not (left := leftovers(tmp, roots) + net_leftovers(tmp)):
                break
            time.sleep(0.1)
        if left:
            console.print(f"[red]left behind ({len(left)}); {tmp} kept:[/]\n" + "\n".join(left))
            code = code or 1
        else:
            shutil.rmtree(tmp)
    if code == 0 and pool_net is not None:
        console.print(f"[bold]PillDrops warm claims with egress[/] — {info['cores']} cores, kernel {info['kernel']}, "
                      f"{info['date']}, loadavg {Path('/proc/loadavg').read_text().split()[:3]}")
        _pool_net.report(console, pool_net, a.pool, a.n)
        if a.json:
            a.json.write_text(json.dumps({"n": a.n, "pool": a.pool, "machine": info, **pool_net}, indent=1))
    if code == 0 and res["pd_create"]:
        report(res, a.n, a.runs, info)
        if a.json:
            a.json.write_text(json.dumps({"n": a.n, "runs": a.runs, "template": a.template, "machine": info,
                                          "ms": res}, indent=1))
    return code


if __name__ == "__main__":
    sys.exit(main())
