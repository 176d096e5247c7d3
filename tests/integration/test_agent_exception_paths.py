"""The node agent on real crun + CRIU when an operation fails after the runtime acted: a pause cancelled
mid-checkpoint leaves the sandbox running and killable (not stuck in ``pausing``), and a resume failing
after the restore leaves no container behind its paused record (leak-checked like every integration test).
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import anyio
import pytest

from pilldrops.node.agent import NodeAgent, Settings
from pilldrops.node.isolation import criu
from pilldrops.node.runtime.crun import CrunRuntime
from pilldrops.node.states import NodeState
from pilldrops.schema.node import NodeResume, NodeSandboxSpec

pytestmark = [pytest.mark.integration, pytest.mark.anyio]


@pytest.fixture
def agent(runtime: CrunRuntime, template_store, tiny, data_dir: Path, tmp_path: Path) -> NodeAgent:  # type: ignore[no-untyped-def]
    why = criu.unavailable_reason()
    if why:
        pytest.skip(f"CRIU checkpoint/restore unavailable: {why}")
    return NodeAgent(Settings(name="n", public_url="http://n", capacity_vcpu=8, capacity_memory_mb=8192,
                              node_token="tok"), runtime, template_store, tmp_path / "agent")


def spec(sid: str) -> NodeSandboxSpec:
    return NodeSandboxSpec(id=sid, template="tiny", vcpu=1, memory_mb=128, access_token="t",
                           end_at=datetime.now(UTC) + timedelta(hours=1))


async def test_a_template_removed_during_the_restore_leaves_no_stray_container(
        agent: NodeAgent, runtime: CrunRuntime, template_store) -> None:  # type: ignore[no-untyped-def]
    """crun's restore moves the image's writable layer into the container: once it returned, the agent must
    adopt what it restored (nothing may fail after it), else a running container leaks behind a record
    that says paused with an image that can no longer be restored."""
    sid = "aep-resume"
    await agent.create(spec(sid))
    await agent.pause(sid)
    assert await runtime.list_ids() == []
    real = runtime.restore

    async def restore(*args: Any) -> Any:       # a heartbeat re-reads the templates meanwhile: tiny is gone
        agent.template_cache.templates = _Without(template_store, "tiny")
        agent.refresh_templates()
        return await real(*args)
    runtime.restore = restore  # type: ignore[method-assign]
    await agent.resume(sid, NodeResume(spec=spec(sid), timeout_s=60))
    assert agent.sandboxes.state_of(sid) is NodeState.running
    h = agent.get(sid).target.handle
    assert (await runtime.state(h)).status == "running" and await runtime.list_ids() == [sid]
    await agent.kill(sid)
    assert await runtime.list_ids() == [] and agent.journal.entries() == []


class _Without:
    """A template store in which one template was deleted."""

    def __init__(self, store: Any, name: str) -> None:
        self.store, self.name = store, name

    def list(self) -> list[Any]:
        return [t for t in self.store.list() if t.name != self.name]

    def get(self, name: str) -> Any:
        if name == self.name:
            raise LookupError(name)
        return self.store.get(name)


async def test_a_cancelled_pause_leaves_it_running_and_killable(agent: NodeAgent, runtime: CrunRuntime) -> None:
    sid = "aep-pause"
    await agent.create(spec(sid))
    real = runtime.checkpoint

    async def slow_checkpoint(*args: Any) -> int:   # the pause's caller goes away before the dump starts
        await anyio.sleep(30)
        return await real(*args)
    runtime.checkpoint = slow_checkpoint  # type: ignore[method-assign]
    with anyio.move_on_after(0.5):
        await agent.pause(sid)
    assert agent.sandboxes.state_of(sid) is NodeState.running
    assert (await runtime.state(agent.get(sid).target.handle)).status == "running"
    await agent.kill(sid)                          # really destroys it (not a "stopped" answer for a live one)
    assert await runtime.list_ids() == [] and agent.journal.entries() == []
