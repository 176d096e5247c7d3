"""CPU of one heartbeat with N live sandboxes: a full beat against a delta beat, in the same process and minutes.

    .venv/bin/python bench/heartbeat_cost.py [--n 250,1000] [--rounds 20]

No root, no crun: one control plane (SQLite) and one node agent in-process on the fake runtime
(``tests/stack.py``), so only the heartbeat's own Python is measured. For each N: N sandboxes are created,
then ``--rounds`` pairs of beats alternate (full, delta, full, ...), each a real ``ControlPlaneClient``
beat through the node's HTTP client to the control plane's route. A full beat is what every beat was
before delta heartbeats (the node's forced to one by dropping its ack); a delta with nothing changed is the
steady state. Prints, per kind, the control plane's CPU (process time across ``NodeService.heartbeat``,
the store's worker thread included) and the whole beat's (node + HTTP + control plane), p50 over the rounds,
and delta ÷ full.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.stack import stack


async def one(n: int, rounds: int) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {"full cp": [], "full all": [], "delta cp": [], "delta all": []}
    with tempfile.TemporaryDirectory() as tmp:
        async with stack(Path(tmp), capacity_vcpu=n * 2, capacity_memory_mb=n * 128) as st, st.client() as c:
            left = n
            while left:
                k = min(left, 50)
                r = await c.post("/v1/sandboxes/batch", json={"template": "tiny", "count": k, "memory_mb": 64})
                assert r.status_code in (200, 201), r.text
                left -= k
            nodes, client = st.cp.services.nodes, st.agent.control_plane
            real = nodes.heartbeat
            spent: list[float] = []

            async def timed(node_id: str, hb: Any) -> Any:
                t = time.process_time()
                try:
                    return await real(node_id, hb)
                finally:
                    spent.append(time.process_time() - t)

            nodes.heartbeat = timed
            for _ in range(3):
                await client.heartbeat()         # the baseline: deltas from here
            for _ in range(rounds):
                for kind in ("full", "delta"):
                    if kind == "full":
                        client._epoch = None     # no ack: the next beat is full
                    spent.clear()
                    t = time.process_time()
                    await client.heartbeat()
                    out[f"{kind} all"].append(time.process_time() - t)
                    out[f"{kind} cp"].append(sum(spent))
            nodes.heartbeat = real
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", default="250,1000", help="comma-separated numbers of live sandboxes")
    ap.add_argument("--rounds", type=int, default=20)
    args = ap.parse_args()
    print(f"{'N live':>7} {'kind':>6} {'control plane p50':>18} {'whole beat p50':>15}")
    for n in (int(x) for x in args.n.split(",")):
        got = anyio.run(one, n, args.rounds)
        med = {k: statistics.median(v) * 1000 for k, v in got.items()}
        for kind in ("full", "delta"):
            print(f"{n:>7} {kind:>6} {med[kind + ' cp']:>15.2f} ms {med[kind + ' all']:>12.2f} ms")
        print(f"{n:>7} {'ratio':>6} {med['delta cp'] / med['full cp']:>17.3f}× "
              f"{med['delta all'] / med['full all']:>13.3f}×")


if __name__ == "__main__":
    main()
