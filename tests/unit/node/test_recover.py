"""The agent's recovery after a crash, on the FakeRuntime: adopt what runs and is journaled, reap what was
half made or is unknown, report what is gone, and do it idempotently."""

from __future__ import annotations

import shutil
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import anyio
import pytest

from pilldrops.node.agent import NodeAgent, Settings
from pilldrops.node.journal import Entry
from pilldrops.node.runtime.base import Handle, SandboxSpec
from pilldrops.node.runtime.fake import FakeRuntime
from pilldrops.node.states import NodeState
from pilldrops.schema.api import EndReason, SandboxState
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


def cp_agent(tmp_path: Path, runtime: FakeRuntime) -> NodeAgent:
    """An agent with a control plane (that it never reaches): ends stay journaled until delivered."""
    return NodeAgent(Settings(name="n", public_url="http://n", capacity_vcpu=8, capacity_memory_mb=8192,
                              node_token="tok", control_plane_url="http://cp.invalid"), runtime,
                     FakeTemplates("tiny"), tmp_path / "state")


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


class _Killed(BaseException):
    """The agent process dies here (SIGKILL): nothing after this point runs."""


async def test_teardown_cut_short_by_a_crash_is_finished_and_billed_up_to_its_start(tmp_path: Path) -> None:
    """Found by bench/chaos.py: the agent SIGKILLed while it was killing a sandbox (the container gone, its
    journal entry not yet) came back, found the container not running and reported it ``exited`` with the
    running seconds up to its own restart (4.6 s billed for a 0.7 s sandbox). The teardown is journaled with
    its reason and start first: the restarted agent finishes it and bills up to when it began."""
    runtime = FakeRuntime(tmp_path / "fake")
    first = agent(tmp_path, runtime)
    await first.create(spec("sb_k"))
    real_destroy = runtime.destroy
    seen: dict[str, Entry] = {}

    async def destroy_then_die(handle):  # type: ignore[no-untyped-def]
        seen["entry"] = next(e for e in first.journal.entries() if e.id == "sb_k")
        await real_destroy(handle)       # the container goes; the agent does not live to drop its entry
        raise _Killed

    runtime.destroy = destroy_then_die  # type: ignore[method-assign]
    with pytest.raises(_Killed):
        await first.kill("sb_k")
    entry = seen["entry"]
    assert entry.end_reason == "killed" and entry.ended_mono is not None and entry.started_mono is not None
    billed_until = entry.ended_mono - entry.started_mono
    await anyio.sleep(0.3)                             # the agent is down for a while
    runtime.destroy = real_destroy  # type: ignore[method-assign]
    second = agent(tmp_path, runtime)
    await second._recover()
    st = second.outbox["sb_k"]
    assert (st.state, st.end_reason) == (SandboxState.stopped, EndReason.killed)
    assert st.run_s == pytest.approx(billed_until, abs=1e-6)       # not the 0.3 s of downtime on top
    assert await runtime.list_ids() == [] and not second.live
    assert [e.id for e in second.journal.entries()] == ["sb_k"]     # kept until the control plane has it
    second.journal.remove_ended("sb_k")
    assert second.journal.entries() == []
    with anyio.fail_after(1):
        await runtime.close()


async def test_a_kill_is_billed_up_to_its_start_not_through_the_runtimes_teardown(tmp_path: Path) -> None:
    """Found by bench/chaos.py (the bill against the node's crun state dir): a kill's final usage point was
    taken after the runtime had removed the sandbox (crun delete, cgroups, unmount, rm), so the bill ran
    up to 0.33 s past the container's end at load 8 and up to 7 s at load ~30, while a kill the agent's
    death cut short bills up to the kill's start. Both end at the kill's start now; so does a heartbeat
    sent during the teardown."""
    runtime = FakeRuntime(tmp_path / "fake")
    a = cp_agent(tmp_path, runtime)
    await a.create(spec("sb_t"))
    await anyio.sleep(0.2)
    real_destroy = runtime.destroy
    during: list[float] = []

    async def slow_destroy(handle):  # type: ignore[no-untyped-def]
        await anyio.sleep(0.3)
        during.extend(st.run_s for st in a.statuses() if st.id == "sb_t" and st.run_s is not None)  # a heartbeat
        await anyio.sleep(0.5)
        await real_destroy(handle)

    runtime.destroy = slow_destroy  # type: ignore[method-assign]
    started = a.live["sb_t"].started_mono
    assert started is not None
    before, ran = datetime.now(UTC), time.monotonic() - started
    final = await a.kill("sb_t")
    assert final.end_reason == EndReason.killed and final.run_s is not None and final.ended_at is not None
    assert ran <= final.run_s < ran + 0.3                 # not the 0.8 s of teardown on top
    assert final.ended_at - before < timedelta(seconds=0.3)
    assert during and max(during) <= final.run_s          # a report during the teardown bills no further
    a.journal.remove_ended("sb_t")
    with anyio.fail_after(1):
        await runtime.close()


async def test_an_end_the_control_plane_never_got_survives_an_agent_restart(tmp_path: Path) -> None:
    """Found by bench/chaos.py (``up`` SIGKILLed): the agent tore a sandbox down for the control plane's kill
    and died before the control plane recorded the answer; the end lived only in the agent's memory, so the
    retried kill got 404 and the sandbox was recorded stopped with 0 s billed of its 17 s. The journal entry
    now stays until the end is delivered: the restarted agent reports it again and answers the retried kill
    with the final usage."""
    runtime = FakeRuntime(tmp_path / "fake")
    first = cp_agent(tmp_path, runtime)
    await first.create(spec("sb_e"))
    await anyio.sleep(0.2)
    final = await first.kill("sb_e")                       # its answer never reaches the control plane
    assert final.run_s is not None and final.run_s >= 0.2 and await runtime.list_ids() == []
    second = cp_agent(tmp_path, runtime)
    await second._recover()
    again = await second.kill("sb_e")                      # the control plane's retry
    assert (again.state, again.end_reason) == (SandboxState.stopped, EndReason.killed)
    assert again.run_s == pytest.approx(final.run_s, abs=0.05)
    assert "sb_e" in second.outbox                         # and it rides on the next register/heartbeat
    second.control_plane._delivered("sb_e")                # which succeeded
    assert second.journal.entries() == []
    with anyio.fail_after(1):
        await runtime.close()


async def test_a_restarted_agent_refuses_requests_until_it_has_readopted(tmp_path: Path) -> None:
    """Found by bench/chaos.py: `pilldrops node` serves its port while recovery is still re-adopting; a kill
    arriving then got 404 (the registry was still empty), so the control plane recorded the sandbox ended
    and billed 0 s of its 8 s, while it ran on until reaped as an orphan. Until recovery is done every
    request gets 502 ``node_unavailable`` (retried by the control plane's caller and the SDK)."""
    import httpx

    from pilldrops.node.api import create_node_app

    runtime = FakeRuntime(tmp_path / "fake")
    first = agent(tmp_path, runtime)
    await first.create(spec("sb_a"))
    second = agent(tmp_path, runtime)                 # restarted: recovery blocked on the runtime
    gate = anyio.Event()
    real_state = runtime.state

    async def slow_state(handle):  # type: ignore[no-untyped-def]
        await gate.wait()
        return await real_state(handle)

    runtime.state = slow_state  # type: ignore[method-assign]
    app = create_node_app(second, "tok")
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://n",
                                 headers={"Authorization": "Bearer tok"}) as c, anyio.create_task_group() as tg:
        tg.start_soon(second._recover)
        await anyio.sleep(0.05)
        r = await c.delete("/node/v1/sandboxes/sb_a")
        assert r.status_code == 502 and r.json()["error"]["code"] == "node_unavailable", r.text
        assert await runtime.list_ids() == ["sb_a"]
        gate.set()
        with anyio.fail_after(5):
            while not second.recovered:
                await anyio.sleep(0.01)
        r = await c.delete("/node/v1/sandboxes/sb_a")
        assert r.status_code == 200 and r.json()["end_reason"] == "killed" and r.json()["run_s"] > 0
    assert await runtime.list_ids() == []
    with anyio.fail_after(1):
        await runtime.close()


async def test_a_paused_sandboxs_end_survives_an_agent_restart_until_delivered(tmp_path: Path) -> None:
    """Reviewer finding 5: the chaos-soak rule for a paused sandbox too. Its end (kill while paused) dropped
    the journal entry at once, so an agent dying before the control plane had the end forgot it: the
    retried kill got 404 and the end report (with the billed running seconds) was lost. The entry now stays
    (with the end) until the end is delivered; the restarted agent reports it again, its image gone."""
    runtime = FakeRuntime(tmp_path / "fake")
    first = cp_agent(tmp_path, runtime)
    await first.create(spec("sb_p"))
    await anyio.sleep(0.2)
    paused = await first.pause("sb_p")
    image = first.sandboxes.get("sb_p").image.path
    final = await first.kill("sb_p")                       # its answer never reaches the control plane
    assert (final.end_reason, paused.state) == (EndReason.killed, SandboxState.paused)
    assert final.run_s is not None and final.run_s >= 0.2 and not image.exists()
    assert [e.id for e in first.journal.entries()] == ["sb_p"]
    second = cp_agent(tmp_path, runtime)
    await second._recover()
    assert second.sandboxes.get("sb_p") is None or second.sandboxes.state_of("sb_p").value == "gone"
    again = await second.kill("sb_p")                      # the control plane's retry
    assert (again.state, again.end_reason) == (SandboxState.stopped, EndReason.killed)
    assert again.run_s == pytest.approx(final.run_s, abs=0.05)
    assert "sb_p" in second.outbox
    second.control_plane._delivered("sb_p")
    assert second.journal.entries() == []
    alone = agent(tmp_path / "alone", runtime)             # without a control plane the entry goes at once
    await alone.create(spec("sb_q"))
    await alone.pause("sb_q")
    await alone.kill("sb_q")
    assert alone.journal.entries() == []
    with anyio.fail_after(1):
        await runtime.close()


class _LayerMovingFake(FakeRuntime):
    """Like crun: a restore takes the writable layer (``fs/``) out of the image, so the image alone cannot
    be restored again; ``abort_restore`` puts it back, ``destroy`` deletes it."""

    async def restore(self, spec: SandboxSpec, image_dir: Path) -> Handle:
        handle = await super().restore(spec, image_dir)
        shutil.rmtree(image_dir / "fs")
        return handle

    async def abort_restore(self, handle: Handle, image_dir: Path) -> None:
        d = self.root / handle.id
        if d.is_dir() and not (image_dir / "fs").exists():
            shutil.move(str(d), image_dir / "fs")
        await self.destroy(handle)


async def test_an_agent_killed_while_resuming_keeps_the_writable_layer(tmp_path: Path) -> None:
    """Reviewer finding (fixes 2): recovery undid an interrupted resume with ``destroy``, deleting the
    writable layer the restore had taken out of the image; the sandbox came back paused with an image that
    could not be restored. It now undoes it with ``abort_restore`` (the layer goes back into the image)."""
    runtime = _LayerMovingFake(tmp_path / "fake")
    first = agent(tmp_path, runtime)
    await first.create(spec("sb_r"))
    (runtime.root / "sb_r" / "data").write_text("precious")
    await first.pause("sb_r")
    sb = first.sandboxes.get("sb_r")
    image = sb.image.path
    first.sandboxes.move(sb, NodeState.resuming)                 # resume() up to the restore, then SIGKILL
    first.journal.write(sb.journal_entry())
    await runtime.restore(first.template_cache.runtime_spec(sb.spec), image)
    assert not (image / "fs").exists()
    second = agent(tmp_path, runtime)
    await second._recover()
    assert second.sandboxes.state_of("sb_r") is NodeState.paused
    assert (image / "fs" / "data").read_text() == "precious"
    back = await second.resume("sb_r", NodeResume(spec=spec("sb_r"), timeout_s=60))
    assert back.state == SandboxState.running
    assert (runtime.root / "sb_r" / "data").read_text() == "precious"
    with anyio.fail_after(1):
        await runtime.close()
