"""The README's rollout example with ``isolation="microvm"`` end to end: SDK -> control plane -> node agent
-> QEMU microVMs (TCG on this machine kind), the same rewards as with containers. Small N: under TCG a
microVM costs ~1-3 s to create and ~150 MiB; the first create of the session boots the template's guest once
(the snapshot every later sandbox is restored from). Skipped only where QEMU cannot run microVMs."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from pilldrops import Sandbox
from tests.e2e.conftest import Server
from tests.e2e.test_product import make_env

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def microvm(server: Server) -> Server:
    from pilldrops.node.runtime.qemu import probe_host
    ok, reason, _ = probe_host()
    if not ok:
        pytest.skip(f"QEMU cannot run microVMs here: {reason}")
    return server


def test_readme_rollout_with_microvm_matches_containers(microvm: Server, sdk_env: Server, tmp_path: Path) -> None:
    env = make_env(tmp_path)

    def rollout(policy: int, isolation: str) -> float:
        with Sandbox.create(template="tiny", vcpu=1, memory_mb=256, timeout=600, isolation=isolation) as sb:
            sb.upload(env, "/env")                     # a whole directory, one tar stream
            r = sb.run(f"/env/episode.sh {policy}")
            assert r.exit_code == 0, r.stderr
            if isolation == "microvm":                 # its own kernel, not the host's
                assert sb.run("uname -r").stdout.strip().endswith("cloud-amd64")
            return float(r.stdout)

    policies = list(range(6))
    with ThreadPoolExecutor(max_workers=3) as pool:
        vm_rewards = list(pool.map(lambda p: rollout(p, "microvm"), policies))
        ct_rewards = list(pool.map(lambda p: rollout(p, "container"), policies))
    assert vm_rewards == ct_rewards == [p * 3 + 1 for p in policies]
    assert Sandbox.list(state="running") == []
    modes = [r.isolation for r in Sandbox.history(limit=50)]
    assert modes.count("microvm") >= len(policies), modes


def test_microvm_pause_resume_and_info(microvm: Server, sdk_env: Server) -> None:
    with Sandbox.create(template="tiny", memory_mb=256, isolation="microvm") as sb:
        assert sb.get_info().isolation == "microvm"
        sb.run("echo 41 > /root/n; sleep 1000 >/dev/null 2>&1 &")
        sb.pause()
        sb.resume()
        r = sb.run("cat /root/n; ps -o comm | grep -c '^sleep'")
        assert r.stdout.split() == ["41", "1"], r

