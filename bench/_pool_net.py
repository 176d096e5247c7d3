"""``bench/latency.py --egress --pool N --pool-net``: warm claims with egress, the two ways (issue 14 part 3),
in one run against a loopback-only claim, plus what a pool member with its network attached costs idle.

Two pools of the benchmark's shape, ``N`` members each: a loopback-only one and one whose policy is
``POLICY`` (members made with their veth, addresses and nft chain already there). Each iteration, in turn:

- a create without egress (a claim from the loopback pool: the baseline);
- a create with ``OTHER`` (a policy no pool keeps: a loopback member, its network attached at the claim);
- a create with ``POLICY`` (a claim from the per-policy pool: nothing to attach).

A create that missed its pool (booted cold: its container is named after the sandbox, not ``pd-…``) is not
counted in the claim times; the misses are printed. Idle cost: kernel memory (Slab + KernelStack + Percpu
from /proc/meminfo), links of the agent's prefix and rules in its nft table, measured before any pool (after
one cold egress create: the agent's table and base chains exist), with the loopback pool full and then with
the per-policy pool full too (per member: the delta over N).
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import httpx
from _harness import Up, meminfo, pct

from pilldrops import Sandbox

POLICY = {"allow_out": ["198.18.255.254"]}      # benchmark range, never contacted
OTHER = {"allow_out": ["198.18.255.253"]}
KEYS = ("claim_loopback", "claim_attach", "claim_policy")


def _api(up: Up) -> httpx.Client:
    return httpx.Client(base_url=up.url, headers={"Authorization": f"Bearer {up.key}"}, timeout=30)


def set_pool(up: Up, template: str, memory_mb: int, size: int, network: dict | None = None) -> None:  # type: ignore[type-arg]
    body = {"template": template, "vcpu": 1, "memory_mb": memory_mb, "size": size}
    with _api(up) as c:
        c.put("/v1/pools", json=body | ({"network": network} if network else {})).raise_for_status()


def pools(up: Up) -> dict[bool, dict]:  # type: ignore[type-arg]
    """The bench's pools as the nodes last reported them, by "has a network policy"."""
    with _api(up) as c:
        return {bool(p["network"]): p for p in c.get("/v1/pools").raise_for_status().json()["items"]}


def wait_full(up: Up, size: int, policy: bool, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while (pools(up).get(policy) or {}).get("ready") != size:
        if time.monotonic() > deadline:
            raise RuntimeError(f"pool never filled: {pools(up)}")
        time.sleep(0.5)
    time.sleep(2)                               # let the kernel settle (freed pages, RCU)


def _tag(up: Up) -> str:
    return (up.data / "node" / "instance").read_text().strip()[:4]


def footprint(up: Up) -> dict[str, float]:
    tag = _tag(up)
    links = len([n for n in Path("/sys/class/net").iterdir() if n.name.startswith(f"pd{tag}")])
    r = subprocess.run(["nft", "-j", "list", "table", "inet", f"pd_{tag}"], capture_output=True, check=False)
    objs = json.loads(r.stdout or b"{}").get("nftables", []) if r.returncode == 0 else []
    m = meminfo()
    return {"links": links, "rules": sum(1 for o in objs if "rule" in o),
            "elements": sum(len(o["map"].get("elem", [])) for o in objs if "map" in o),
            "kernel_kib": (m.get("Slab", 0) + m.get("KernelStack", 0) + m.get("Percpu", 0)) / 1024}


def member_memory_kib(up: Up, match: str) -> float:
    """Mean memory cgroup usage of the node's ready pool members (both kinds alike: their processes)."""
    vals = []
    for d in Path("/sys/fs/cgroup/memory").glob(f"{match}*/pd-*"):
        try:
            vals.append(int((d / "memory.usage_in_bytes").read_text()) / 1024)
        except OSError:
            continue
    return sum(vals) / len(vals) if vals else float("nan")


def claim(up: Up, template: str, memory_mb: int, network: dict | None) -> tuple[float, bool]:  # type: ignore[type-arg]
    """(create→ready ms, was it a claim) of one create; the sandbox is killed."""
    time.sleep(0.3)                             # refills run in between (2 at a time on the node)
    t = time.perf_counter()
    sb = Sandbox.create(template=template, memory_mb=memory_mb, api_url=up.url, api_key=up.key,
                        **({"network": network} if network else {}))
    dt = (time.perf_counter() - t) * 1000
    try:
        cold = (up.data / "node" / "crun" / sb.id).exists()     # a miss boots a container named after it
        assert sb.run("true").exit_code == 0
    finally:
        sb.kill()
    return dt, not cold


def run(up: Up, template: str, memory_mb: int, size: int, n: int, warmup: int, match: str,
        status: object) -> dict[str, object]:
    res: dict[str, list[float]] = {k: [] for k in KEYS}
    misses = dict.fromkeys(KEYS, 0)
    cost: dict[str, float] = {}
    claim(up, template, memory_mb, POLICY)      # cold: the agent's nft table and base chains exist from here
    f0 = footprint(up)
    set_pool(up, template, memory_mb, size)
    wait_full(up, size, policy=False)
    f1 = footprint(up)
    cost["member_cgroup_kib"] = member_memory_kib(up, match)
    set_pool(up, template, memory_mb, size, POLICY)
    wait_full(up, size, policy=True)
    f2 = footprint(up)
    for k in ("links", "rules", "elements", "kernel_kib"):
        cost[f"loopback_{k}"] = (f1[k] - f0[k]) / size
        cost[f"policy_{k}"] = (f2[k] - f1[k]) / size
    try:
        for i in range(warmup + n):
            status.update(f"pool-net iteration {i + 1}/{warmup + n}")  # type: ignore[attr-defined]
            for key, net in zip(KEYS, (None, OTHER, POLICY), strict=True):
                dt, hit = claim(up, template, memory_mb, net)
                if i < warmup:
                    continue
                if hit:
                    res[key].append(dt)
                else:
                    misses[key] += 1
        time.sleep(6)                           # one heartbeat: the node reports its hits and misses
        stats = pools(up)
    finally:
        set_pool(up, template, memory_mb, 0, POLICY)
        set_pool(up, template, memory_mb, 0)
    return {"ms": res, "misses": misses, "cost": cost, "pools": {str(k): v for k, v in stats.items()}}


def report(console: object, out: dict[str, object], size: int, n: int) -> None:
    from rich import box
    from rich.table import Table
    res, misses, cost = out["ms"], out["misses"], out["cost"]  # type: ignore[index]
    t = Table(box=box.ASCII2, title=f"warm claims with egress, pools of {size}, {n} iterations")
    for c in ("claim", "p50", "p95", "vs loopback p50", "overhead p50", "claims (cold misses)"):
        t.add_column(c, justify="left" if c == "claim" else "right")
    base = pct(res["claim_loopback"], 50) if res["claim_loopback"] else float("nan")  # type: ignore[index]
    names = {"claim_loopback": "loopback only (no egress)", "claim_attach": "egress, attached at claim",
             "claim_policy": "egress, per-policy pool member"}
    for k in KEYS:
        xs = res[k]  # type: ignore[index]
        if not xs:
            t.add_row(names[k], "-", "-", "-", "-", f"0 ({misses[k]})")  # type: ignore[index]
            continue
        p50, p95 = pct(xs, 50), pct(xs, 95)
        t.add_row(names[k], f"{p50:.1f} ms", f"{p95:.1f} ms", f"{p50 / base:.2f}×", f"{p50 - base:+.1f} ms",
                  f"{len(xs)} ({misses[k]})")  # type: ignore[index]
    console.print(t)  # type: ignore[attr-defined]
    console.print(  # type: ignore[attr-defined]
        f"Idle cost per member: loopback {cost['loopback_links']:.1f} links, {cost['loopback_rules']:.1f} nft "
        f"rules, {cost['loopback_kernel_kib']:+.0f} KiB kernel; per-policy {cost['policy_links']:.1f} links, "
        f"{cost['policy_rules']:.1f} nft rules + {cost['policy_elements']:.1f} map elements, "
        f"{cost['policy_kernel_kib']:+.0f} KiB kernel (Slab+KernelStack+Percpu deltas: noisy on a shared host); "
        f"a member's own memory cgroup: {cost['member_cgroup_kib']:.0f} KiB (both kinds). Every member has its "
        f"own netns either way (crun); a per-policy member also holds one /30 of the egress pool.")
    console.print(f"Pools as reported: {json.dumps(out['pools'])[:600]}")  # type: ignore[attr-defined]
