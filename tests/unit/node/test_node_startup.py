"""The node agent's start-up settings: spare disks from the environment, and its descriptor limit."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pilldrops.node.main import spare_disks


def test_spare_disks_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PILLDROPS_DISK_SPARES", raising=False)
    assert spare_disks() == 2
    monkeypatch.setenv("PILLDROPS_DISK_SPARES", "0")
    assert spare_disks() == 0
    for bad in ("-1", "two", "1.5", ""):
        monkeypatch.setenv("PILLDROPS_DISK_SPARES", bad)
        with pytest.raises(ValueError, match="PILLDROPS_DISK_SPARES must be a whole number"):
            spare_disks()


def test_the_soft_descriptor_limit_is_raised_towards_the_hard_one() -> None:
    # in a child whose soft limit is a service manager's default of 1,024 (the hard limit stays)
    code = (
        "import resource\n"
        "soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (min(1024, hard), hard))\n"
        "from pilldrops.node.main import raise_nofile\n"
        "got = raise_nofile()\n"
        "now = resource.getrlimit(resource.RLIMIT_NOFILE)\n"
        "print(got, now[0], now[1])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    got, soft, hard = (int(x) for x in out)
    assert got == soft
    assert soft == (65536 if hard == -1 else min(hard, 65536)) and soft > 1024 or hard <= 1024
