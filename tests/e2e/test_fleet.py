"""Fleet end to end with real crun, on SQLite and on PostgreSQL: re-adoption after 10 SIGKILLs of a node
agent, a control plane SIGKILLed mid-batch with idempotent retries, and draining across two nodes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from pilldrops import Sandbox
from tests.e2e.conftest import MATCH, _why_not_runnable
from tests.e2e.fleet import Fleet, running_fleet

pytestmark = pytest.mark.integration


@pytest.fixture(params=["sqlite", "postgres"])
def fleet(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Fleet]:
    why = _why_not_runnable()
    if why:
        pytest.skip(why)
    db = request.getfixturevalue("postgres").new_database() if request.param == "postgres" else None
    with running_fleet(tmp_path / f"{MATCH}-fleet", f"{MATCH.split('-', 1)[1]}{request.param[:2]}", MATCH, db) as f:
        yield f


def _pid(f: Fleet, node: int, sid: str) -> int:
    entry = json.loads((f.root / f"node{node}" / "node" / "journal" / f"{sid}.json").read_text())
    return int(entry["handle"]["pid"])


def _crun_ids(f: Fleet, node: int) -> list[str]:
    out = subprocess.run(["crun", "--root", str(f.root / f"node{node}" / "node" / "crun"), "list", "--format",
                          "json"], capture_output=True, text=True, check=True)
    return sorted(c["id"] for c in json.loads(out.stdout or "[]") or [])


def test_node_agent_sigkilled_10_times_readopts_everything(fleet: Fleet, tmp_path: Path) -> None:
    fleet.start_cp()
    node = fleet.add_node()
    fleet.wait_nodes_ready(1)
    boxes = [Sandbox.create(template="tiny", memory_mb=128, api_url=fleet.url, api_key=fleet.key) for _ in range(6)]
    for i, sb in enumerate(boxes):
        sb.run(f"echo {i} > /root/id; sleep 1000 >/dev/null 2>&1 &")
    pids = {sb.id: _pid(fleet, 0, sb.id) for sb in boxes}
    payload = tmp_path / "payload.txt"
    for cycle in range(10):
        node.kill9()
        for pid in pids.values():
            os.kill(pid, 0)                      # every sandbox outlives its agent
        node.start(fleet.env, "serving at")
        fleet.wait_nodes_ready(1)
        assert _crun_ids(fleet, 0) == sorted(pids)   # none duplicated, none lost
        payload.write_text(f"cycle {cycle}")
        for i, sb in enumerate(boxes):
            again = Sandbox.connect(sb.id, api_url=fleet.url, api_key=fleet.key)
            assert _pid(fleet, 0, sb.id) == pids[sb.id]
            assert again.run("cat /root/id").stdout == f"{i}\n"
            again.upload(payload, "/root/payload.txt")
            assert again.files.read("/root/payload.txt") == f"cycle {cycle}"
    with fleet.api() as c:
        states = {s["id"]: s["state"] for s in c.get("/v1/sandboxes", params={"state": "running"}).json()["items"]}
        assert set(states) == set(pids)
    for sb in boxes:
        sb.kill()


def test_control_plane_sigkilled_mid_batch(fleet: Fleet) -> None:
    """Creates with idempotency keys run in threads while the control plane is SIGKILLed and restarted:
    every client retrying with its key gets one sandbox, the same one, and all of them run."""
    fleet.start_cp()
    fleet.add_node()
    fleet.wait_nodes_ready(1)
    results: dict[int, str] = {}
    errors: list[BaseException] = []

    def create(i: int) -> None:
        deadline = time.monotonic() + 90
        while True:
            try:
                with httpx.Client(base_url=fleet.url, headers={"Authorization": f"Bearer {fleet.key}"},
                                  timeout=30) as c:
                    r = c.post("/v1/sandboxes", json={"template": "tiny", "memory_mb": 128},
                               headers={"Idempotency-Key": f"batch-{i}"})
                if r.status_code in (200, 201):
                    results[i] = r.json()["id"]
                    return
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                errors.append(TimeoutError(f"create {i} never succeeded"))
                return
            time.sleep(0.2)

    threads = [threading.Thread(target=create, args=(i,)) for i in range(12)]
    for t in threads[:6]:
        t.start()
    time.sleep(0.3)
    assert fleet.cp is not None
    fleet.cp.kill9()                              # mid-batch
    for t in threads[6:]:
        t.start()
    time.sleep(1)
    fleet.start_cp()
    for t in threads:
        t.join()
    assert not errors and len(results) == 12
    again = {}
    for i in range(12):                           # a client retrying later still gets its own sandbox
        with fleet.api() as c:
            r = c.post("/v1/sandboxes", json={"template": "tiny", "memory_mb": 128},
                       headers={"Idempotency-Key": f"batch-{i}"})
        assert r.status_code == 200, r.text
        again[i] = r.json()["id"]
    assert again == results
    time.sleep(2)                                  # heartbeats reconcile the table with the node
    assert _crun_ids(fleet, 0) == sorted(results.values())
    with fleet.api() as c:
        running = {s["id"] for s in c.get("/v1/sandboxes", params={"state": "running"}).json()["items"]}
        assert running == set(results.values())
        for sid in results.values():
            assert c.delete(f"/v1/sandboxes/{sid}").json()["state"] == "stopped"


def test_drain_moves_new_sandboxes_to_other_nodes(fleet: Fleet) -> None:
    fleet.start_cp()
    fleet.add_node()
    fleet.add_node()
    fleet.wait_nodes_ready(2)
    env = {**fleet.env, "PILLDROPS_API_URL": fleet.url, "PILLDROPS_API_KEY": fleet.key}

    def cli(*args: str) -> str:
        out = subprocess.run([sys.executable, "-m", "pilldrops", *args], capture_output=True, text=True, env=env, check=False)
        assert out.returncode == 0, out.stderr
        return out.stdout

    nodes = json.loads(cli("nodes", "list", "--json"))
    assert sorted(n["name"] for n in nodes) == sorted(fleet.node_names)
    cli("nodes", "drain", fleet.node_names[0])
    placed = []
    for _ in range(4):
        sb = Sandbox.create(template="tiny", memory_mb=128, api_url=fleet.url, api_key=fleet.key)
        placed.append(sb)
        info = json.loads(cli("sandbox", "get", sb.id, "--json"))
        drained_id = next(n["id"] for n in nodes if n["name"] == fleet.node_names[0])
        assert info["node_id"] and info["node_id"] != drained_id
    cli("nodes", "undrain", fleet.node_names[0])
    listed = {n["name"]: n for n in json.loads(cli("nodes", "list", "--json"))}
    assert listed[fleet.node_names[0]]["draining"] is False and listed[fleet.node_names[1]]["sandboxes"] == 4
    for sb in placed:
        sb.kill()
