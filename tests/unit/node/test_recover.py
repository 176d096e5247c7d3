"""The agent's recovery after a crash, on the FakeRuntime: adopt what runs and is journaled, reap what was
half made or is unknown, report what is gone, and do it idempotently."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path

import anyio
import pytest

from pilldrops.node.agent import NodeAgent, Settings
from pilldrops.node.journal import Entry
from pilldrops.node.runtime.base import SandboxSpec
from pilldrops.node.runtime.fake import FakeRuntime
from pilldrops.schema.api import EndReason, SandboxState
from pilldrops.schema.node import NodeSandboxSpec
from tests.stack import FakeTemplates

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def spec(sid: str) -> NodeSandboxSpec:
    return NodeSandboxSpec(id=sid, template="tiny", vcpu=1, memory_mb=128, access_token="t",
                           end_at=datetime.now(UTC) + timedelta(hours=1))


def agent(tmp_path: Path, runtime: FakeRuntime) -> NodeAgent:
    return NodeAgent(Settings(name="n", public_url="http://n", capacity_vcpu=8, capacity_memory_mb=8192,
                              node_token="tok"), runtime, FakeTemplates("tiny"), tmp_path / "state")


async def test_recover_adopts_reaps_and_reports(tmp_path: Path) -> None:
    runtime = FakeRuntime(tmp_path / "fake")
    first = agent(tmp_path, runtime)
    live = await first.create(spec("sb_live"))
    gone = await first.create(spec("sb_gone"))
    first.journal.write(Entry(id="sb_half", phase="creating", spec=spec("sb_half").model_dump(mode="json")))
    await runtime.create(SandboxSpec(id="sb_stray", layers=()))           # in the runtime, never journaled
    await runtime.simulate_oom(first.live["sb_gone"].target.handle)      # its init died while we were down
    assert live.pid and gone.pid

    second = agent(tmp_path, runtime)              # the agent restarts (SIGKILL: no shutdown ran)
    await second._recover()
    assert set(second.live) == {"sb_live"}
    assert second.live["sb_live"].target.handle.pid == live.pid            # same process, adopted
    assert second.live["sb_live"].started_mono == first.live["sb_live"].started_mono   # billing clock kept
    assert await runtime.list_ids() == ["sb_live"]                          # stray and gone reaped
    ends = {sid: (st.state, st.end_reason) for sid, st in second.outbox.items()}
    assert ends == {"sb_half": (SandboxState.failed, EndReason.failed_start),
                    "sb_gone": (SandboxState.stopped, EndReason.oom)}
    assert {e.id for e in second.journal.entries()} == {"sb_live"}

    third = agent(tmp_path, runtime)               # recovering again changes nothing
    await third._recover()
    assert set(third.live) == {"sb_live"} and third.outbox == {} and await runtime.list_ids() == ["sb_live"]
    status = await third.kill("sb_live")
    assert status.end_reason == EndReason.killed and await runtime.list_ids() == []
    with anyio.fail_after(1):
        await runtime.close()
