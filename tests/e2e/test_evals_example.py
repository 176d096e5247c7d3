"""The evals guide's example (docs/evals.md, examples/evals/run_eval.py) end to end on the real stack,
with a small N: 8 tasks x 2 samples graded in their own code-interpreter sandboxes, one multi-turn episode
that pauses while it waits for the model (where CRIU works), scores and per-episode costs from the
history. The code-interpreter template is seeded from the user's template cache (see test_pause_e2e)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pilldrops import Sandbox
from tests.e2e.conftest import Server
from tests.e2e.fleet import clean_env

pytestmark = pytest.mark.integration
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "evals" / "run_eval.py"


@pytest.fixture(scope="module")
def ci_server(server: Server) -> Server:
    server.seed("code-interpreter")
    return server


def test_evals_example_small_n(ci_server: Server, tmp_path: Path) -> None:
    out = tmp_path / "eval.json"
    env = clean_env(ci_server.config_home, PILLDROPS_API_URL=ci_server.api_url, PILLDROPS_API_KEY=ci_server.api_key)
    p = subprocess.run([sys.executable, str(EXAMPLE), "--tasks", "8", "--samples", "2", "--agent-episodes", "1",
                        "--concurrency", "8", "--run-id", f"t-{time.time_ns()}", "--json", str(out)],
                       capture_output=True, text=True, env=env, timeout=240, check=False)
    assert p.returncode == 0, p.stdout + p.stderr[-3000:]
    print(p.stdout)
    res = json.loads(out.read_text())
    assert len(res["episodes"]) == 16 and res["failed"] == 0
    assert 0 <= res["pass@1"] <= res["pass@2"] <= 1
    lo, hi = res["ci95"]
    assert lo <= res["mean_reward"] <= hi
    # the toy model is right ~60% of the time, and its mistakes (syntax, hang, crash, wrong values) score 0
    assert 0 < sum(e["solved"] for e in res["episodes"]) < 16
    assert any(e["error"] and "timed out" not in e["error"] for e in res["episodes"] if not e["solved"])
    # every episode's cost came from the history, selected by the run's metadata
    hist = {h.id: h for h in Sandbox.history(metadata={"eval": res["run_id"]}, api_url=ci_server.api_url,
                                             api_key=ci_server.api_key)}
    assert set(res["cost_usd"]) == {e["sandbox"] for e in res["episodes"]} and set(res["cost_usd"]) <= set(hist)
    assert all(c > 0 and c == hist[sid].cost_usd for sid, c in res["cost_usd"].items())
    assert all(h.state == "stopped" for h in hist.values())
    (agent,) = res["agents"]
    assert agent["turns"] >= 1 and agent["sandbox"] in hist
    assert "pass@1" in p.stdout and "95% CI" in p.stdout
