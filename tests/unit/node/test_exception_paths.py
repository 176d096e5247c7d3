"""A sandbox never stays stuck in a transient state (``creating``, ``pausing``) and no container is left
behind when an operation fails after the runtime acted: the record goes back to a state the loops and
``kill`` handle, and what the runtime made is destroyed (review of the node split, issue 10)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import anyio
import pytest

from pilldrops.node.agent import NodeAgent, Settings
from pilldrops.node.journal import Entry
from pilldrops.node.runtime.fake import FakeRuntime
from pilldrops.node.states import NodeState
from pilldrops.schema.node import NodeResume, NodeSandboxSpec
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


def fail_target_once(a: NodeAgent) -> None:
    """The template lookup that turns a runtime handle into a data-plane target fails once (e.g. the
    template was deleted while the runtime was creating or restoring)."""
    real = a.template_cache.target
    calls = {"n": 0}

    def target(*args: Any) -> Any:
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("template gone")
        return real(*args)
    a.template_cache.target = target  # type: ignore[method-assign]


async def test_a_create_failing_after_the_runtime_made_it_leaves_no_record_and_no_container(
        tmp_path: Path) -> None:
    runtime = FakeRuntime(tmp_path / "fake")
    a = agent(tmp_path, runtime)
    fail_target_once(a)
    with pytest.raises(RuntimeError, match="template gone"):
        await a.create(spec("sb_c"))
    assert a.sandboxes.get("sb_c") is None            # not stuck in "creating" (reported starting forever)
    assert await runtime.list_ids() == []            # the container it made is gone
    assert a.journal.entries() == []
    await a.create(spec("sb_c"))                     # a retry works (no 409 for a phantom create)
    assert a.sandboxes.state_of("sb_c") is NodeState.running
    await a.kill("sb_c")
    assert await runtime.list_ids() == []
    await runtime.close()


async def test_a_pause_failing_before_the_checkpoint_leaves_it_running_and_killable(tmp_path: Path) -> None:
    runtime = FakeRuntime(tmp_path / "fake")
    a = agent(tmp_path, runtime)
    await a.create(spec("sb_p"))
    real_write = a.journal.write

    def write(entry: Entry) -> None:
        if entry.phase == "pausing":
            raise OSError(28, "No space left on device")
        real_write(entry)
    a.journal.write = write  # type: ignore[method-assign]
    with pytest.raises(OSError):
        await a.pause("sb_p")
    a.journal.write = real_write  # type: ignore[method-assign]
    assert a.sandboxes.state_of("sb_p") is NodeState.running     # not stuck in "pausing"
    assert not a.get("sb_p").target.pausing                      # commands may run again
    await a.kill("sb_p")
    assert await runtime.list_ids() == []                         # kill destroyed it
    await runtime.close()


async def test_a_cancelled_pause_leaves_it_running_and_killable(tmp_path: Path) -> None:
    runtime = FakeRuntime(tmp_path / "fake")
    a = agent(tmp_path, runtime)
    await a.create(spec("sb_x"))
    runtime.checkpoint_delay = 5.0
    with anyio.move_on_after(0.2):
        await a.pause("sb_x")
    assert a.sandboxes.state_of("sb_x") is NodeState.running
    assert not (tmp_path / "state" / "checkpoints" / "sb_x").exists()
    await a.kill("sb_x")
    assert await runtime.list_ids() == [] and a.journal.entries() == []
    await runtime.close()


async def test_a_template_removed_during_the_restore_does_not_leak_the_restored_sandbox(
        tmp_path: Path) -> None:
    """The restore consumes the image (crun moves its writable layer into the container): once it is done
    nothing may fail, or the container leaks behind a record that says paused with an unusable image."""
    runtime = FakeRuntime(tmp_path / "fake")
    a = agent(tmp_path, runtime)
    await a.create(spec("sb_r"))
    await a.pause("sb_r")
    real = runtime.restore

    async def restore(*args: Any) -> Any:       # a heartbeat re-reads the templates meanwhile: tiny is gone
        del a.templates.items["tiny"]  # type: ignore[attr-defined]
        a.refresh_templates()
        return await real(*args)
    runtime.restore = restore  # type: ignore[method-assign]
    status = await a.resume("sb_r", NodeResume(spec=spec("sb_r"), timeout_s=60))
    assert status.state.value == "running" and a.sandboxes.state_of("sb_r") is NodeState.running
    assert await runtime.list_ids() == ["sb_r"] and a.get("sb_r").target.env == {"PD_TEMPLATE": "tiny"}
    await a.kill("sb_r")
    assert await runtime.list_ids() == []
    await runtime.close()


async def test_a_resent_create_meets_the_one_in_progress_and_gets_its_answer(tmp_path: Path) -> None:
    """Reviewer finding 4: the control plane resends a create on a stale connection (``retry_stale``) while
    the node still makes the first one: the resend waits for it and answers its result (no 409), one
    sandbox is made; a resend of a create that failed gets that failure, and a later one makes it afresh."""
    runtime = FakeRuntime(tmp_path / "fake")
    runtime.create_delay = 0.3
    a = agent(tmp_path, runtime)
    got: list[Any] = []

    async def create() -> None:
        got.append(await a.create(spec("sb_r")))

    async with anyio.create_task_group() as tg:
        tg.start_soon(create)
        await anyio.sleep(0.05)
        tg.start_soon(create)                        # the resend, while the first is in the runtime
    assert [s.state.value for s in got] == ["running", "running"] and got[0].id == got[1].id == "sb_r"
    assert await runtime.list_ids() == ["sb_r"] and runtime.create_calls == 1
    await a.kill("sb_r")
    fail_target_once(a)                              # the first attempt fails: so does the resend's answer
    errs: list[BaseException] = []

    async def failing() -> None:
        try:
            await a.create(spec("sb_f"))
        except Exception as exc:  # noqa: BLE001
            errs.append(exc)

    async with anyio.create_task_group() as tg:
        tg.start_soon(failing)
        await anyio.sleep(0.05)
        tg.start_soon(failing)
    assert [str(e) for e in errs] == ["template gone", "template gone"]
    assert (await a.create(spec("sb_f"))).state.value == "running"     # a fresh attempt afterwards
    await a.kill("sb_f")
    assert await runtime.list_ids() == []
    await runtime.close()
