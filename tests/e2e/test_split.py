"""`pilldrops serve` and `pilldrops node` as two processes: the node registers over HTTP with the node
token, sandboxes run on it, and a node with a wrong token is refused."""

from __future__ import annotations

import re
import signal
import time
from pathlib import Path

import httpx
import pytest

from pilldrops import Sandbox
from tests import leakcheck
from tests.e2e.conftest import MATCH, NAME, _why_not_runnable, free_port
from tests.e2e.fleet import clean_env, spawn, wait_for

pytestmark = pytest.mark.integration


def test_serve_and_node_as_separate_processes(tmp_path: Path) -> None:
    why = _why_not_runnable()
    if why:
        pytest.skip(why)
    root = tmp_path / f"{MATCH}-split"
    root.mkdir()
    env = clean_env(root / "cfg")
    cp_port, node_port = free_port(), free_port()
    before = leakcheck.snapshot([root / "node-data" / "node" / "crun"], match=MATCH)
    serve = spawn(["serve", "--port", str(cp_port), "--ports-port", "0", "--data-dir", str(root / "cp-data")], root / "serve.log", env)
    node = bad = None
    try:
        out = wait_for(root / "serve.log", "control plane at", serve)
        key = re.search(r"PILLDROPS_API_KEY=(\S+)", out).group(1)   # type: ignore[union-attr]
        token = re.search(r"PILLDROPS_NODE_TOKEN=(\S+)", out).group(1)   # type: ignore[union-attr]
        url = f"http://127.0.0.1:{cp_port}"
        bad = spawn(["node", "--control-plane", url, "--node-token", "wrong", "--port", str(free_port()),
                      "--data-dir", str(root / "bad-data"), "--name", f"{NAME}-bad", "--templates", "tiny"],
                     root / "bad.log", env)
        node = spawn(["node", "--control-plane", url, "--node-token", token, "--port", str(node_port),
                       "--data-dir", str(root / "node-data"), "--name", f"{NAME}-split", "--templates", "tiny"],
                      root / "node.log", env)
        wait_for(root / "node.log", "serving at", node)
        c = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key}"})
        deadline = time.monotonic() + 30
        while not c.get("/v1/templates").json()["items"] and time.monotonic() < deadline:
            time.sleep(0.2)
        templates = c.get("/v1/templates").json()["items"]
        assert [(t["name"], t["nodes"]) for t in templates] == [("tiny", [f"{NAME}-split"])]
        with Sandbox.create(template="tiny", api_url=url, api_key=key) as sb:
            assert sb.info.envd_url == f"http://127.0.0.1:{node_port}"
            assert sb.run("echo split").stdout == "split\n"
        wait_for(root / "bad.log", "control plane unreachable", bad)   # 401: it keeps retrying, never joins
    finally:
        for p in (node, bad, serve):
            if p is not None and p.poll() is None:
                p.send_signal(signal.SIGINT)
        for p in (node, bad, serve):
            if p is not None:
                assert p.wait(timeout=60) == 0
    leakcheck.assert_no_leaks(before, settle=5)
