"""A code eval on PillDrops: 50 Python tasks, k samples each, every sample graded by running its hidden
tests inside its own disposable sandbox. See docs/evals.md for the walk-through.

    python examples/evals/run_eval.py                       # 50 tasks x 4 samples = 200 episodes
    python examples/evals/run_eval.py --tasks 10 --samples 2 --agent-episodes 2 --json out.json

Prints pass@1 and pass@k, the mean reward with a 95% confidence interval, how many episodes were
retried, and the cost per episode pulled from the usage history by the run's metadata. The first
``--agent-episodes`` failed episodes are rerun as multi-turn agents that read the grader's feedback and
pause their sandbox while they wait for the (slow) model.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import uuid
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pilldrops
from pilldrops import NotSupported, Sandbox

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from policy import solve
from scoring import mean_ci, mean_pass_at_k
from tasks import Task, all_tasks

GRADER = (HERE / "grade.py").read_text()
RUN_TIMEOUT_S = 20            # the whole grading command; a hung solution is killed and scores 0


@dataclass
class Episode:
    task: Task
    sample: int


def grade(sb: Sandbox, task: Task, solution: str) -> dict[str, Any]:
    """Put the solution and the hidden tests in the sandbox, run the grader there, read its JSON line."""
    sb.files.write("/eval/grade.py", GRADER)
    sb.files.write("/eval/tests.json", json.dumps({"entry": task.entry, "tests": task.tests}))
    sb.files.write("/eval/solution.py", solution)
    r = sb.run("python /eval/grade.py", timeout=RUN_TIMEOUT_S, max_output_bytes=64 * 1024)
    if r.timed_out:
        return {"passed": 0, "total": len(task.tests), "error": "grader timed out"}
    lines = r.stdout.strip().splitlines()
    if r.exit_code != 0 or not lines:
        raise RuntimeError(f"grader failed (exit {r.exit_code}): {r.stderr[-500:]}")   # infrastructure: retried
    return json.loads(lines[-1])


def episode(sb: Sandbox, ep: Episode) -> dict[str, Any]:
    """One sample: the model writes a solution from the prompt alone; the sandbox grades it."""
    res = grade(sb, ep.task, solve(ep.task, ep.sample))
    return {"task": ep.task.id, "sample": ep.sample, "sandbox": sb.id, "reward": res["passed"] / res["total"],
            "solved": res["passed"] == res["total"], "error": res["error"]}


def agent_episode(sb: Sandbox, ep: Episode, turns: int = 3, model_latency_s: float = 1.0) -> dict[str, Any]:
    """A multi-turn episode: attempt, read the grader's feedback, ask the model again. While the model
    thinks, the sandbox is paused (no RAM, no CPU, storage billed only, paused time off its timeout) and
    resumed exactly where it was. Where the node cannot checkpoint (no CRIU) it just keeps running."""
    feedback, paused_s, res = None, 0.0, {"passed": 0, "total": 1, "error": None}
    for turn in range(turns):
        res = grade(sb, ep.task, solve(ep.task, ep.sample, turn, feedback))
        if res["passed"] == res["total"] or turn == turns - 1:
            break
        feedback = res["error"]
        try:
            sb.pause()
        except NotSupported:
            time.sleep(model_latency_s)               # the model call, sandbox running
            continue
        t0 = time.monotonic()
        time.sleep(model_latency_s)                   # the model call, sandbox paused
        sb.resume()
        paused_s += time.monotonic() - t0
    return {"task": ep.task.id, "sample": ep.sample, "sandbox": sb.id, "reward": res["passed"] / res["total"],
            "solved": res["passed"] == res["total"], "error": res["error"], "turns": turn + 1,
            "paused_s": round(paused_s, 2)}


def run_with_retries(fn: Any, items: list[Episode], *, retries: int, **opts: Any) -> tuple[list[Any], int]:
    """pilldrops.map, then again over the items that failed (an exception: a sandbox that died, a
    grader that crashed; a wrong answer is a reward of 0, not a failure), up to ``retries`` times."""
    results: list[Any] = [None] * len(items)
    todo, retried = list(range(len(items))), 0
    for attempt in range(retries + 1):
        res = pilldrops.map(fn, [items[i] for i in todo], **opts)
        for j, i in enumerate(todo):
            results[i] = res[j]
        todo = [todo[j] for j in res.errors]
        if not todo:
            break
        if attempt < retries:
            retried += len(todo)
            print(f"retrying {len(todo)} failed episode(s): {next(iter(res.errors.values()))!r}", file=sys.stderr)
    return results, retried


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tasks", type=int, default=50, help="how many of the 50 tasks")
    ap.add_argument("--samples", type=int, default=4, help="samples per task (k of pass@k)")
    ap.add_argument("--agent-episodes", type=int, default=2, help="multi-turn episodes that pause (0: none)")
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--retries", type=int, default=2, help="re-runs of episodes that failed")
    ap.add_argument("--template", default="code-interpreter")
    ap.add_argument("--run-id", default=None, help="metadata eval=<run id> (default: a new one)")
    ap.add_argument("--json", type=Path, default=None, help="write every episode's result here")
    args = ap.parse_args(argv)

    run_id = args.run_id or f"evals-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"
    tasks = all_tasks()[: args.tasks]
    items = [Episode(t, s) for t in tasks for s in range(args.samples)]
    def tags(kind: str) -> Any:          # per-sandbox metadata: the run, and which episode it is
        return lambda ep: {"eval": run_id, "kind": kind, "task": ep.task.id, "sample": str(ep.sample)}

    opts = {"template": args.template, "vcpu": 1, "memory_mb": 256, "timeout": 300, "concurrency": args.concurrency,
                "metadata": tags("sample")}
    t0 = time.monotonic()
    results, retried = run_with_retries(episode, items, retries=args.retries, **opts)
    agents: list[Any] = []
    # multi-turn: episodes that failed in one turn get another go as an agent that reads the grader's feedback
    again = [items[i] for i, r in enumerate(results) if isinstance(r, dict) and not r["solved"]]
    if args.agent_episodes and again:
        agents, r2 = run_with_retries(agent_episode, again[: args.agent_episodes], retries=args.retries,
                                      **{**opts, "metadata": tags("agent")})
        retried += r2
    wall = time.monotonic() - t0

    done = [r for r in results if isinstance(r, dict)]
    failed = len(results) - len(done)
    solved: dict[str, list[bool]] = defaultdict(list)
    rewards: dict[str, list[float]] = defaultdict(list)
    for r in done:
        solved[r["task"]].append(r["solved"])
        rewards[r["task"]].append(r["reward"])

    # per-episode cost from the usage history, selected by this run's metadata (every attempt, retries too)
    history = {h.id: h for h in Sandbox.history(metadata={"eval": run_id})}
    costs = [history[r["sandbox"]].cost_usd for r in done if r["sandbox"] in history]
    total_cost = sum(h.cost_usd for h in history.values())

    mean, lo, hi = mean_ci(rewards)
    k = args.samples
    print(f"eval {run_id}: {len(tasks)} tasks x {k} samples = {len(items)} episodes in {wall:.1f} s "
          f"({failed} failed after {args.retries} retries; {retried} retried)")
    print(f"pass@1          {mean_pass_at_k(solved, 1):.3f}")
    if k > 1:
        print(f"pass@{k:<10} {mean_pass_at_k(solved, k):.3f}")
    print(f"mean reward     {mean:.3f} (95% CI {lo:.3f} .. {hi:.3f}, over tasks)")
    if costs:
        print(f"cost            ${total_cost:.6f} total for {len(history)} sandboxes; per episode mean "
              f"${statistics.fmean(costs):.8f}, max ${max(costs):.8f}")
    for a in agents:
        if isinstance(a, dict):
            print(f"agent episode   {a['task']} sample {a['sample']}: reward {a['reward']:.2f} after {a['turns']} turn(s), "
                  f"paused {a['paused_s']} s, cost ${history[a['sandbox']].cost_usd if a['sandbox'] in history else 0:.8f}")
    if args.json:
        out = {"run_id": run_id, "episodes": done, "agents": [a for a in agents if isinstance(a, dict)],
               "failed": failed, "retried": retried, "pass@1": mean_pass_at_k(solved, 1),
               f"pass@{k}": mean_pass_at_k(solved, k), "mean_reward": mean, "ci95": [lo, hi],
               "cost_usd": {r["sandbox"]: history[r["sandbox"]].cost_usd for r in done if r["sandbox"] in history},
               "total_cost_usd": total_cost}
        args.json.write_text(json.dumps(out, indent=1))
    return 0 if failed == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
