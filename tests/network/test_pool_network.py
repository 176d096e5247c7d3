"""Warm pools per egress policy (issue 14 part 3) on the real stack: a pool's members have their veth and
rules before any claim; a create with that policy takes one without a new attach (its slot record moves
to the sandbox), reaches what the policy allows and nothing else, keeps it across pause/resume and an agent
SIGKILL + restart; shrinking the pool leaves no link, chain, netns or process (the autouse leak check)."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import httpx
import pytest

from pilldrops import Sandbox
from tests.network.conftest import Server
from tests.network.test_egress import fetch

pytestmark = pytest.mark.usefixtures("sdk_env")


def _records(server: Server) -> dict[str, int]:
    """The agent's egress slot records: id (sandbox or pool member) -> slot."""
    out = {}
    for p in (server.data_dir / "node" / "egress").glob("*.json"):
        try:
            out[p.stem] = int(json.loads(p.read_text())["slot"])
        except (OSError, ValueError, KeyError):
            continue
    return out


def _link(server: Server, slot: int) -> bool:
    return Path(f"/sys/class/net/pd{server.tag}{slot:x}").exists()


def _wait(pred, timeout: float = 30) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_policy_pool_member_is_claimed_attached_and_keeps_its_policy(server: Server, api: httpx.Client) -> None:
    policy = {"network": {"allow_out": [server.outside.ip]}}
    pool = {"template": "tiny", "vcpu": 0.5, "memory_mb": 64}
    r = api.put("/v1/pools", json={**pool, "size": 1, **policy})
    assert r.status_code == 200, r.text
    sb = None
    try:
        _wait(lambda: any(k.startswith("pd-") and _link(server, v) for k, v in _records(server).items()))
        member, slot = next((k, v) for k, v in _records(server).items() if k.startswith("pd-"))   # attached
        # ready, not only attaching (its link exists before it is): a create before that is a miss, cold
        _wait(lambda: any(p["ready"] >= 1 for p in api.get("/v1/pools").json()["items"]))
        sb = Sandbox.create("tiny", vcpu=0.5, memory_mb=64, **policy)
        assert _records(server).get(sb.id) == slot and member not in _records(server)   # moved, not re-made
        assert fetch(sb, f"http://{server.outside.ip}:8080/") == f"ok {server.outside.ip}"
        assert fetch(sb, f"http://{server.outside.ip2}:8080/", timeout=1) is None
        plain = Sandbox.create("tiny", vcpu=0.5, memory_mb=64)      # no egress: never a member with a network
        try:
            assert plain.id not in _records(server)
            assert fetch(plain, f"http://{server.outside.ip}:8080/", timeout=1) is None
        finally:
            plain.kill()
        sb.pause()
        sb.resume()
        assert fetch(sb, f"http://{server.outside.ip}:8080/") == f"ok {server.outside.ip}"
        _wait(lambda: any(k.startswith("pd-") for k in _records(server)))      # refilled
        assert server.stop(signal.SIGKILL) != 0
        server.start()
        sb = Sandbox.connect(sb.id)
        assert fetch(sb, f"http://{server.outside.ip}:8080/") == f"ok {server.outside.ip}"   # re-adopted
        assert fetch(sb, f"http://{server.outside.ip2}:8080/", timeout=1) is None
    finally:
        if sb is not None:
            Sandbox.kill_by_id(sb.id)
        assert api.put("/v1/pools", json={**pool, "size": 0, **policy}).status_code == 200
    _wait(lambda: not _records(server))              # members destroyed: their links and chains go too
