"""Warm pools on the real stack (`pilldrops up`, crun): claims are real sandboxes, each unique, refilled,
never reused, and a removed pool leaves nothing behind (the autouse leak check)."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import httpx

from pilldrops import Sandbox
from tests.e2e.conftest import Server, clean_env

SHAPE = {"template": "tiny", "vcpu": 0.5, "memory_mb": 64}


def _pool(api: httpx.Client) -> dict:  # type: ignore[type-arg]
    items = [p for p in api.get("/v1/pools").raise_for_status().json()["items"]
             if (p["template"], p["vcpu"], p["memory_mb"]) == tuple(SHAPE.values())]
    return items[0] if items else {}


def _wait_pool(api: httpx.Client, ready: int, hits: int = 0, timeout: float = 60) -> dict:  # type: ignore[type-arg]
    """Nodes report their pools with each heartbeat (every few seconds): poll the listing."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pool = _pool(api)
        if pool.get("ready") == ready and pool.get("hits", 0) >= hits:
            return pool
        time.sleep(0.2)
    raise AssertionError(f"pool never reached {ready} ready / {hits} hits: {_pool(api)}")


def _cli(server: Server, *args: str) -> str:
    env = clean_env(server.config_home, PILLDROPS_API_URL=server.api_url, PILLDROPS_API_KEY=server.api_key,
                    COLUMNS="160")
    out = subprocess.run([sys.executable, "-m", "pilldrops", *args], env=env, capture_output=True, text=True,
                         timeout=60, check=False)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_claimed_members_are_unique_fresh_and_refilled(server: Server, api: httpx.Client) -> None:
    out = _cli(server, "pools", "set", "tiny", "--size", "3", "--vcpu", "0.5", "--memory-mb", "64")
    assert "size 3 per node" in out
    try:
        # members report through heartbeats (every few seconds): wait until all 3 are ready
        _wait_pool(api, 3)
        seen = []
        sandboxes = [Sandbox.create(**SHAPE, api_url=server.api_url, api_key=server.api_key) for _ in range(3)]
        try:
            for sb in sandboxes:
                r = sb.run("cat /etc/hostname /etc/machine-id; hostname; head -c 16 /dev/urandom | od -An -tx1;"
                           " ls /tmp | wc -l")
                assert r.exit_code == 0, r.stderr
                seen.append(r.stdout)
                # nothing of anyone else: a fresh writable layer
                sb.run("echo secret > /tmp/tenant-data")
            identities = [tuple(s.split()[1:3]) for s in seen]      # machine-id, hostname
            assert len(set(identities)) == 3, seen
            assert len({s.split("\n")[3] for s in seen}) == 3         # urandom differs
        finally:
            for sb in sandboxes:
                sb.kill()
        pool = _wait_pool(api, 3, hits=3)                              # claimed, then refilled
        assert pool["hit_rate"] is not None and pool["nodes"] == 1
        listed = _cli(server, "pools", "list")
        assert "tiny" in listed and "HIT RATE" in listed
        data = json.loads(_cli(server, "pools", "list", "--json"))
        assert any(p["template"] == "tiny" and p["size"] == 3 for p in data)
        # a fresh claim never sees a previous tenant's files
        with Sandbox.create(**SHAPE, api_url=server.api_url, api_key=server.api_key) as sb:
            assert sb.run("test -e /tmp/tenant-data").exit_code != 0
    finally:
        _cli(server, "pools", "set", "tiny", "--size", "0", "--vcpu", "0.5", "--memory-mb", "64")
    deadline = time.monotonic() + 30                                   # members destroyed: no leaks
    while _pool(api) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _pool(api)


def test_a_claim_from_a_pre_issued_member_runs_at_once_and_keeps_its_timeout(server: Server,
                                                                             api: httpx.Client) -> None:
    """Issue 15: the create is answered from the member's grant (one store write) and the node is told right
    after; the client's first command must not notice, and the node enforces the create's timeout."""
    api.put("/v1/pools", json={**SHAPE, "size": 1}).raise_for_status()
    try:
        _wait_pool(api, 1)                   # the heartbeat that reported it ready carried its grant
        sb = Sandbox.create(**SHAPE, envs={"CLAIMED": "yes"}, metadata={"claim": "e2e"}, timeout=3,
                            api_url=server.api_url, api_key=server.api_key)
        try:
            assert sb.info.started_at == sb.info.created_at       # answered from the grant, billed from now
            r = sb.run("env")                                     # at once: the node may not know it yet
            assert r.exit_code == 0 and "CLAIMED=yes" in r.stdout, r
            deadline = time.monotonic() + 30
            while (info := sb.get_info()).state == "running" and time.monotonic() < deadline:
                time.sleep(0.2)
            assert info.state == "stopped" and info.end_reason == "timeout", info
            assert 2.5 <= (info.ended_at - info.started_at).total_seconds() <= 10, info
            assert info.cost_usd > 0
        finally:
            sb.kill()
    finally:
        api.put("/v1/pools", json={**SHAPE, "size": 0}).raise_for_status()
    deadline = time.monotonic() + 30
    while _pool(api) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _pool(api)
