"""A fleet on one machine: a control plane and 4 node agents (separate processes, data dirs, ports and
cgroup parents), 1,000 sandboxes fanned out across them, then how they were placed per node.

    sudo .venv/bin/python examples/fleet_demo.py [--nodes 4] [--sandboxes 1000] [--db postgresql://...]

Everything it starts is stopped at the end (sandboxes killed, agents and control plane shut down).
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(args: list[str], log: Path, env: dict[str, str], ready: str) -> tuple[subprocess.Popen[bytes], str]:
    proc = subprocess.Popen([sys.executable, "-m", "pilldrops", *args], stdout=open(log, "ab"),
                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        text = log.read_text()
        if ready in text:
            return proc, text
        if proc.poll() is not None:
            sys.exit(f"`pilldrops {args[0]}` failed:\n{text[-2000:]}")
        time.sleep(0.1)
    sys.exit(f"`pilldrops {args[0]}` did not start; see {log}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("--sandboxes", type=int, default=1000)
    ap.add_argument("--workers", type=int, default=64, help="client threads creating sandboxes")
    ap.add_argument("--db", default=None, help="control-plane store (default: SQLite in a temp dir)")
    args = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("node agents need root (cgroups, mounts, namespaces)")

    root = Path(tempfile.mkdtemp(prefix="pilldrops-fleet-demo-"))
    env = {**os.environ, "XDG_CONFIG_HOME": str(root / "cfg")}
    procs: list[subprocess.Popen[bytes]] = []
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    try:
        serve_args = ["serve", "--port", str(port), "--ports-port", "0", "--data-dir", str(root / "cp"), "--unlimited-credits"]
        cp, out = start(serve_args + (["--db", args.db] if args.db else []), root / "serve.log", env,
                        "control plane at")
        procs.append(cp)
        key = re.search(r"PILLDROPS_API_KEY=(\S+)", out).group(1)  # type: ignore[union-attr]
        token = re.search(r"PILLDROPS_NODE_TOKEN=(\S+)", out).group(1)  # type: ignore[union-attr]
        print(f"control plane at {url} (data in {root})")
        for i in range(args.nodes):
            p, _ = start(["node", "--control-plane", url, "--node-token", token, "--port", str(free_port()),
                          "--data-dir", str(root / f"node{i}"), "--name", f"demo-node-{i}", "--templates", "tiny"],
                         root / f"node{i}.log", env, "serving at")
            procs.append(p)
        api = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=120)
        while sum(1 for n in api.get("/v1/nodes").json()["items"] if n["state"] == "ready") < args.nodes:
            time.sleep(0.2)
        print(f"{args.nodes} node agents ready; creating {args.sandboxes} sandboxes with {args.workers} threads")

        sizes = [(0.25, 64), (0.5, 128), (1, 256), (0.25, 512)]

        def create(i: int) -> dict:  # type: ignore[type-arg]
            vcpu, mem = sizes[i % len(sizes)]
            for _ in range(20):
                r = api.post("/v1/sandboxes", json={"template": "tiny", "vcpu": vcpu, "memory_mb": mem,
                                                    "metadata": {"demo": "fleet"}},
                             headers={"Idempotency-Key": f"fleet-demo-{i}"})
                if r.status_code in (200, 201):
                    return r.json()
                time.sleep(float(r.headers.get("retry-after", 1)))
            r.raise_for_status()
            return r.json()

        t0 = time.monotonic()
        with ThreadPoolExecutor(args.workers) as pool:
            made = list(pool.map(create, range(args.sandboxes)))
        took = time.monotonic() - t0
        nodes = {n["id"]: n for n in api.get("/v1/nodes").json()["items"]}
        per_node = collections.Counter(s["node_id"] for s in made)
        print(f"\n{len(made)} sandboxes running after {took:.1f} s ({len(made) / took:.0f} creates/s)\n")
        print(f"{'node':<14}{'sandboxes':>10}{'vCPU used/cap':>16}{'MiB used/cap':>20}")
        for nid, n in sorted(nodes.items(), key=lambda kv: kv[1]["name"]):
            print(f"{n['name']:<14}{per_node.get(nid, 0):>10}{n['used_vcpu']:>8g}/{n['capacity_vcpu']:<7g}"
                  f"{n['used_memory_mb']:>10}/{n['capacity_memory_mb']:<9}")
        t0 = time.monotonic()
        with ThreadPoolExecutor(args.workers) as pool:
            list(pool.map(lambda s: api.delete(f"/v1/sandboxes/{s['id']}").raise_for_status(), made))
        print(f"\nkilled all {len(made)} in {time.monotonic() - t0:.1f} s")
        return 0
    finally:
        for p in reversed(procs):
            if p.poll() is None:
                p.send_signal(signal.SIGINT)
        for p in reversed(procs):
            try:
                p.wait(timeout=120)
            except subprocess.TimeoutExpired:
                p.kill()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())
