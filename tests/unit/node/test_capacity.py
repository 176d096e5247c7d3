"""The default capacity a node offers lets the seed's 1,000-way fan-out of the default shape
(vcpu=1, memory_mb=512) run on a machine like the CI one (2 cores, 24 GiB): vcpu is a cap, not a reservation."""

from __future__ import annotations

import builtins
import io
from typing import Any

import pytest

from pilldrops.node import agent
from pilldrops.server import scheduler
from pilldrops.server.scheduler import NodeView, Request


def test_default_capacity_fits_a_thousand_default_sandboxes_on_two_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(agent.os, "cpu_count", lambda: 2)
    real_open = builtins.open

    def fake_open(path: Any, *a: Any, **k: Any) -> Any:
        if str(path) == "/proc/meminfo":
            return io.StringIO(f"MemTotal: {24 * 1024 * 1024} kB\n")
        return real_open(path, *a, **k)

    monkeypatch.setattr(builtins, "open", fake_open)
    cpu, mem = agent.default_capacity()
    node = NodeView(id="n", capacity_vcpu=cpu, capacity_memory_mb=mem, templates=frozenset({"code-interpreter"}))
    used = NodeView(id="n", capacity_vcpu=cpu, capacity_memory_mb=mem, used_vcpu=1000 + 16,  # + a pool of 16
                    used_memory_mb=(1000 + 16) * 512, templates=frozenset({"code-interpreter"}))
    req = Request("code-interpreter", 1, 512)
    assert isinstance(scheduler.place(req, [node]), scheduler.Placement)
    assert isinstance(scheduler.place(req, [used]), scheduler.Placement)     # the 1,017th still fits
