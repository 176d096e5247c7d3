"""Isolation per sandbox end to end (issue 11): the rollout gives the same rewards in a gVisor sandbox as in
a container, the mode is on SandboxInfo and in `pilldrops history --json`, pause/resume works on gVisor,
the node reports its modes, and a mode no node runs is refused with the node's reason (leak-checked,
runsc's processes and files included)."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from pilldrops import CapacityUnavailable, InvalidRequest, Sandbox
from tests.e2e.conftest import Server
from tests.e2e.test_billing import cli
from tests.e2e.test_product import make_env

pytestmark = pytest.mark.integration


def _modes(api: httpx.Client) -> dict[str, dict]:  # type: ignore[type-arg]
    (node,) = api.get("/v1/nodes").raise_for_status().json()["items"]
    return node["isolation"]


def test_rollout_same_rewards_in_gvisor_and_container(sdk_env: Server, api: httpx.Client, tmp_path: Path) -> None:
    if not _modes(api)["gvisor"]["available"]:
        pytest.skip(f"this node runs no gvisor: {_modes(api)['gvisor']['reason']}")
    env = make_env(tmp_path)
    tag = tmp_path.name

    def rollout(arg: tuple[str, int]) -> tuple[float, str]:
        mode, policy = arg
        with Sandbox.create(template="tiny", memory_mb=128, isolation=mode, metadata={"t": tag}) as sb:
            assert sb.info.isolation == mode
            sb.upload(env, "/env")
            r = sb.run(f"/env/episode.sh {policy}")
            assert r.exit_code == 0, r.stderr
            return float(r.stdout), sb.run("uname -r").stdout.strip()

    jobs = [(m, p) for m in ("container", "gvisor") for p in range(4)]
    with ThreadPoolExecutor(max_workers=4) as pool:
        results = list(pool.map(rollout, jobs))
    rewards = {m: [r for (mm, _), (r, _) in zip(jobs, results) if mm == m] for m in ("container", "gvisor")}
    assert rewards["gvisor"] == rewards["container"] == [p * 3 + 1 for p in range(4)]
    kernels = {m: {k for (mm, _), (_, k) in zip(jobs, results) if mm == m} for m in ("container", "gvisor")}
    assert kernels["gvisor"] == {"4.4.0"} and kernels["container"] == {Path("/proc/sys/kernel/osrelease").read_text().strip()}
    # the mode is in the usage history; billing is the same formula whatever the mode
    records = json.loads(cli(sdk_env, "history", "--json", "--metadata", f"t={tag}"))
    assert sorted(r["isolation"] for r in records) == ["container"] * 4 + ["gvisor"] * 4
    for r in records:
        assert r["vcpu_s"] == pytest.approx(r["gb_s"] * 1024 / 128, abs=1e-4)   # both rounded to 1e-6


def test_gvisor_pause_resume_keeps_memory_and_files(sdk_env: Server, api: httpx.Client) -> None:
    if not _modes(api)["gvisor"]["available"]:
        pytest.skip("this node runs no gvisor")
    with Sandbox.create(template="tiny", memory_mb=128, isolation="gvisor") as sb:
        sb.run("echo mem > /tmp/m; echo disk > /root/d; (sleep 1000 &); true")
        sb.pause()
        assert Sandbox.get_info_by_id(sb.id).state.value == "paused"
        sb.resume()
        r = sb.run("cat /tmp/m /root/d; ps -o comm | grep -c sleep")
        assert r.stdout.split() == ["mem", "disk", "1"]
        assert sb.get_info().isolation == "gvisor"


def test_modes_reported_and_unknown_or_missing_mode_refused(sdk_env: Server, api: httpx.Client) -> None:
    modes = _modes(api)
    assert set(modes) == {"container", "gvisor", "microvm"} and modes["container"]["available"]
    r = api.post("/v1/sandboxes", json={"template": "tiny", "isolation": "kvm"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_request"
    assert "container, gvisor, microvm" in r.json()["error"]["message"]
    with pytest.raises(InvalidRequest):
        Sandbox.create(template="tiny", isolation="vm")
    missing = [m for m, s in modes.items() if not s["available"]]
    if not missing:
        pytest.skip("this node runs every mode: nothing to refuse")
    mode = missing[0]
    r = api.post("/v1/sandboxes", json={"template": "tiny", "isolation": mode})
    assert r.status_code == 503, r.text
    assert r.json()["error"]["message"] == f"0/1 nodes fit: 1 no {mode} ({modes[mode]['reason']})"
    with pytest.raises(CapacityUnavailable):
        Sandbox.create(template="tiny", isolation=mode, capacity_wait=0)
