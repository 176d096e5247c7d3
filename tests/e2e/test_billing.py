"""Billing end to end against real crun: `pilldrops history --json` matches the formula for sandboxes of
mixed sizes run for known durations, and usage is billed exactly once when the control plane is killed
between computing and committing it (billed running seconds equal each sandbox's lifetime)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import httpx
import pytest

from pilldrops import Sandbox
from tests import leakcheck
from tests.e2e.conftest import MATCH, NAME, Server, _why_not_runnable, free_port
from tests.e2e.fleet import clean_env, spawn, wait_for

pytestmark = pytest.mark.integration
VCPU_RATE, GB_RATE = 0.0000140, 0.0000045


def cli(server: Server, *args: str) -> str:
    env = {**os.environ, "PILLDROPS_API_URL": server.api_url, "PILLDROPS_API_KEY": server.api_key}
    out = subprocess.run([sys.executable, "-m", "pilldrops", *args], capture_output=True, text=True, env=env,
                         timeout=120, check=False)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_history_json_matches_the_formula(server: Server) -> None:
    shapes = [(0.5, 128), (1, 256), (2, 512), (1.5, 1024), (4, 2048)] * 4          # 20 sandboxes
    tag = f"hist-{time.monotonic_ns()}"
    boxes = []
    for i, (vcpu, mem) in enumerate(shapes):
        sb = Sandbox.create(template="tiny", vcpu=vcpu, memory_mb=mem, metadata={"tag": tag, "i": str(i)},
                            api_url=server.api_url, api_key=server.api_key)
        boxes.append((sb, vcpu, mem, time.monotonic(), 1.0 + (i % 4) * 0.5))   # planned 1.0 .. 2.5 s
    expected: dict[str, tuple[float, float, float]] = {}
    for sb, vcpu, mem, t0, planned in sorted(boxes, key=lambda b: b[3] + b[4]):
        time.sleep(max(0.0, t0 + planned - time.monotonic()))
        info = sb.kill()
        expected[sb.id] = (vcpu, mem, time.monotonic() - t0)
        assert info.cost_usd > 0                                              # final cost on the kill answer
    records = json.loads(cli(server, "history", "--json", "--metadata", f"tag={tag}"))
    assert {r["id"] for r in records} == set(expected)
    for r in records:
        vcpu, mem, lived = expected[r["id"]]
        assert r["vcpu"] == vcpu and r["memory_mb"] == mem and r["state"] == "stopped"
        # within one second's worth of the formula
        assert abs(r["vcpu_s"] - vcpu * lived) <= vcpu * 1.0, r
        assert abs(r["gb_s"] - mem / 1024 * lived) <= mem / 1024 * 1.0, r
        formula = r["vcpu_s"] * VCPU_RATE + r["gb_s"] * GB_RATE
        assert r["cost_usd"] == pytest.approx(formula, rel=1e-6), r
        billed = r["vcpu_s"] / vcpu
        life = (datetime.fromisoformat(r["ended_at"]) - datetime.fromisoformat(r["started_at"])).total_seconds()
        assert abs(billed - life) < 1.0, r
    table = cli(server, "history", "--metadata", f"tag={tag}")
    assert "TOTAL" in table.upper()


def test_usage_is_billed_exactly_once_across_control_plane_crashes(tmp_path: Path) -> None:
    """The control plane dies (os._exit) between computing a usage commit and committing it, three times;
    each time it is started again on the same database while the node keeps its sandboxes running. At the
    end, for every sandbox, billed running seconds equal its lifetime within one second."""
    why = _why_not_runnable()
    if why:
        pytest.skip(why)
    root = tmp_path / f"{MATCH}-crash"
    root.mkdir()
    base_env = clean_env(root / "cfg")
    cp_port, node_port = free_port(), free_port()
    url = f"http://127.0.0.1:{cp_port}"
    serve_args = ["serve", "--port", str(cp_port), "--ports-port", "0", "--data-dir", str(root / "cp"), "--heartbeat-interval", "0.5",
                  "--usage-commit-interval", "0"]
    before = leakcheck.snapshot([root / "node" / "node" / "crun"], match=MATCH)
    crash_env = {**base_env, "PILLDROPS_FAULT_CRASH_BEFORE_USAGE_COMMIT": "4"}
    serve = spawn(serve_args, root / "serve.log", crash_env)
    node = None
    try:
        out = wait_for(root / "serve.log", "control plane at", serve)
        key = re.search(r"PILLDROPS_API_KEY=(\S+)", out).group(1)  # type: ignore[union-attr]
        token = re.search(r"PILLDROPS_NODE_TOKEN=(\S+)", out).group(1)  # type: ignore[union-attr]
        node = spawn(["node", "--control-plane", url, "--node-token", token, "--port", str(node_port),
                       "--data-dir", str(root / "node"), "--name", f"{NAME}-crash", "--templates", "tiny"],
                      root / "node.log", base_env)
        wait_for(root / "node.log", "serving at", node)
        api = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=30)
        state = {"serve": serve, "crashes": 0}

        def ensure_serving() -> None:
            """Each start of `serve` dies on its 4th usage commit; start it again (3 times with the fault)."""
            p = state["serve"]
            if p.poll() is None:
                return
            assert p.returncode == 137, (root / "serve.log").read_text()[-3000:]
            state["crashes"] += 1
            mark = len((root / "serve.log").read_text())
            env = crash_env if state["crashes"] < 3 else base_env
            state["serve"] = spawn(serve_args, root / "serve.log", env)
            wait_for(root / "serve.log", "control plane at", state["serve"], after=mark)

        def call(method: str, path: str, **kw: object) -> httpx.Response:
            deadline = time.monotonic() + 60
            while True:
                ensure_serving()
                try:
                    return api.request(method, path, **kw)  # type: ignore[arg-type]
                except httpx.TransportError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.2)

        deadline = time.monotonic() + 30
        while not call("GET", "/v1/templates").json()["items"] and time.monotonic() < deadline:
            time.sleep(0.2)
        ids = []
        for i in range(6):
            r = call("POST", "/v1/sandboxes", json={"template": "tiny", "vcpu": 1 + i % 2, "memory_mb": 256},
                     headers={"Idempotency-Key": f"crash-{i}"})
            ids.append(r.raise_for_status().json()["id"])
        deadline = time.monotonic() + 120
        while state["crashes"] < 3 and time.monotonic() < deadline:
            ensure_serving()
            time.sleep(0.2)
        assert state["crashes"] == 3
        time.sleep(2)                            # a few clean heartbeats
        for sid in ids[:3]:
            call("DELETE", f"/v1/sandboxes/{sid}").raise_for_status()
        for sid in ids[3:]:                      # these end on their own: a deadline reported by the node
            call("POST", f"/v1/sandboxes/{sid}/timeout", json={"timeout": 1}).raise_for_status()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            items = call("GET", "/v1/history").json()["items"]
            if all(r["state"] == "stopped" for r in items):
                break
            time.sleep(0.3)
        time.sleep(1.5)                          # the final usage of the self-ended ones rides a heartbeat
        items = {r["id"]: r for r in call("GET", "/v1/history").json()["items"]}
        assert set(items) == set(ids)
        for sid in ids:
            r = items[sid]
            assert r["state"] == "stopped", r
            life = (datetime.fromisoformat(r["ended_at"]) - datetime.fromisoformat(r["started_at"])).total_seconds()
            billed = r["vcpu_s"] / r["vcpu"]
            assert life > 2 and abs(billed - life) <= 1.0, (r, life, billed)
    finally:
        serve = state["serve"] if "state" in locals() else serve
        for p in (node, serve):
            if p is not None and p.poll() is None:
                p.send_signal(signal.SIGINT)
        for p in (node, serve):
            if p is not None:
                p.wait(timeout=60)
    leakcheck.assert_no_leaks(before, settle=5)


def test_batch_kill_through_the_sdk_ends_each_billed_and_leaves_nothing(server: Server) -> None:
    """`Sandbox.kill_many` against real crun: one request kills every sandbox (by ids, then by label),
    each answered with its final, exactly billed record; another team's id is not touched, and the
    autouse leak check finds no process, mount or cgroup left."""
    tag = f"bk-{time.monotonic_ns()}"
    opts = {"api_url": server.api_url, "api_key": server.api_key}
    boxes = Sandbox.create_many(4, template="tiny", memory_mb=128, metadata={"tag": tag}, **opts)
    extra = Sandbox.create_many(2, template="tiny", memory_mb=128, metadata={"tag": tag, "by": "label"}, **opts)
    assert boxes[0].run("echo hi").stdout == "hi\n"
    time.sleep(1.0)
    res = Sandbox.kill_many([sb.id for sb in boxes] + ["sb_doesnotexist"], **opts)
    assert (res.killed, res.failed) == (4, 1) and res.items[-1].error is not None
    assert res.items[-1].error.code == "sandbox_not_found"
    for it in res.items[:4]:
        info = it.sandbox
        assert info is not None and info.state == "stopped" and info.end_reason == "killed"
        assert info.ended_at is not None and info.started_at is not None
        life = (info.ended_at - info.started_at).total_seconds()
        assert life >= 1.0 and info.vcpu_s == pytest.approx(life, abs=0.01)          # billed = lifetime
        assert info.cost_usd == pytest.approx(life * VCPU_RATE + life * 128 / 1024 * GB_RATE, rel=1e-3)
    by_label = Sandbox.kill_many(metadata={"tag": tag, "by": "label"}, **opts)
    assert sorted(it.id for it in by_label.items) == sorted(sb.id for sb in extra) and by_label.killed == 2
    assert not [s for s in Sandbox.list(metadata={"tag": tag}, **opts)]
    records = json.loads(cli(server, "history", "--json", "--metadata", f"tag={tag}"))
    assert len(records) == 6 and all(r["state"] == "stopped" for r in records)
