"""Fan out RL rollouts: one disposable PillDrops sandbox per episode, 64 at a time.

    python examples/fanout.py --n 200

Each rollout creates a `code-interpreter` sandbox, uploads ./env, runs the episode and reads the reward
from stdout; the sandbox is always torn down (context manager). Every rollout carries the metadata
``run=<--run>, policy=<n>`` (the dashboard and `pilldrops history` select the batch by it). Prints the
mean reward (checked against the same episodes run on the host), rollouts per second and the slowest
episode.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from pilldrops import Sandbox

HERE = Path(__file__).resolve().parent
ENV = HERE / "env"


def rollout(policy: int, template: str, run: str) -> tuple[int, float, float]:
    t0 = time.monotonic()
    with Sandbox.create(template=template, vcpu=1, memory_mb=512, timeout=600,
                        metadata={"run": run, "policy": str(policy)}) as sb:
        sb.upload(ENV, "/env")
        r = sb.run(f"python /env/episode.py --policy {policy}", check=True)
        return policy, float(r.stdout), time.monotonic() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=200, help="number of rollouts")
    ap.add_argument("--workers", type=int, default=64, help="client threads")
    ap.add_argument("--template", default="code-interpreter")
    ap.add_argument("--run", default=f"fanout-{time.strftime('%Y%m%d-%H%M%S')}",
                    help="metadata run=<RUN> on every rollout (the dashboard and `history` filter by it)")
    args = ap.parse_args()

    sys.path.insert(0, str(ENV))
    from episode import episode  # the same code, run on the host, to check the sandboxed answers

    policies = list(range(args.n))
    t0 = time.monotonic()
    with ThreadPoolExecutor(max_workers=args.workers) as pool:
        results = list(pool.map(lambda p: rollout(p, args.template, args.run), policies))
    wall = time.monotonic() - t0

    rewards = [r for _, r, _ in results]
    expected = [episode(p) for p in policies]
    slowest = max(results, key=lambda x: x[2])
    mean, want = statistics.fmean(rewards), statistics.fmean(expected)
    ok = rewards == expected
    print(f"rollouts:        {len(results)} ({args.workers} client threads, template {args.template}, "
          f"metadata run={args.run})")
    print(f"mean reward:     {mean:.4f} (host check {want:.4f}: {'correct' if ok else 'MISMATCH'})")
    print(f"rollouts/s:      {len(results) / wall:.1f} ({wall:.1f} s wall)")
    print(f"slowest episode: policy {slowest[0]}, {slowest[2]:.2f} s (median "
          f"{statistics.median(x[2] for x in results):.2f} s)")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
