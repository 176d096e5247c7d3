"""Disk quota end to end (issue 16 part 2) on a real `pilldrops up`: the SDK's and the CLI's `disk_mb`, ENOSPC
inside, a typed 413 for a write that does not fit, `disk_used_bytes` reported by the node's heartbeat, and
a typed 400 past the deployment's maximum (leak-checked: the sandbox's loop device and mount go with it)."""

from __future__ import annotations

import json
import time

import pytest

from pilldrops import DiskQuotaExceeded, InvalidRequest, Sandbox
from tests.e2e.conftest import Server
from tests.e2e.test_billing import cli

pytestmark = pytest.mark.integration
MiB = 1 << 20


def test_disk_mb_end_to_end(sdk_env: Server) -> None:
    with Sandbox.create("tiny", disk_mb=64) as sb:
        assert sb.info.disk_mb == 64
        r = sb.run("dd if=/dev/zero of=/root/big bs=1M count=200")
        assert r.exit_code != 0 and "No space left on device" in r.stderr
        with pytest.raises(DiskQuotaExceeded) as e:
            sb.files.write("/root/more", bytes(8 * MiB))
        assert e.value.code == "disk_quota_exceeded" and e.value.status == 413
        deadline = time.monotonic() + 30            # a heartbeat after the writes carries their usage (one
        while ((used := sb.get_info().disk_used_bytes) is None or used < 60 * MiB) \
                and time.monotonic() < deadline:    # from before them says the empty disk's ~56 KiB)
            time.sleep(0.5)
        assert used is not None and 60 * MiB <= used <= 70 * MiB, used
        got = json.loads(cli(sdk_env, "sandbox", "get", sb.id, "--json"))
        assert got["disk_mb"] == 64
        assert "MiB of 64 MiB" in cli(sdk_env, "sandbox", "get", sb.id)
    sid = cli(sdk_env, "sandbox", "create", "--template", "tiny", "--disk-mb", "128").strip()
    assert json.loads(cli(sdk_env, "sandbox", "get", sid, "--json"))["disk_mb"] == 128
    cli(sdk_env, "sandbox", "kill", sid)
    with pytest.raises(InvalidRequest) as e2:
        Sandbox.create("tiny", disk_mb=10_000_000)
    assert "disk_mb" in str(e2.value)
    with pytest.raises(InvalidRequest) as e3:
        Sandbox.create("tiny", disk_mb=200_000)        # past the deployment's default maximum (102400)
    assert e3.value.details["max_disk_mb"] == 102_400
