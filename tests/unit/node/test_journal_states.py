"""The node's persisted records carry a format version (older unversioned ones read as version 1, so an
upgraded agent re-adopts what an older one started; newer ones are left alone), and a sandbox's state on
the node changes only along the transition table."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from pilldrops import errors
from pilldrops.node.agent import NodeAgent, Settings
from pilldrops.node.journal import FORMAT_VERSION, HANDLE_FORMAT_VERSION, Journal
from pilldrops.node.registry import Sandbox, Sandboxes
from pilldrops.node.runtime.base import SandboxSpec
from pilldrops.node.runtime.fake import FakeRuntime
from pilldrops.node.states import TRANSITIONS, NodeState
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


async def test_records_are_versioned_and_unversioned_ones_are_adopted_as_version_1(tmp_path: Path) -> None:
    runtime = FakeRuntime(tmp_path / "fake")
    first = agent(tmp_path, runtime)
    await first.create(spec("sb_new"))
    rec = json.loads((tmp_path / "state" / "journal" / "sb_new.json").read_text())
    assert rec["version"] == FORMAT_VERSION and rec["handle"]["version"] == HANDLE_FORMAT_VERSION
    # what an agent before format versions wrote: the same record without either version
    old = await runtime.create(SandboxSpec(id="sb_old", layers=()))
    legacy = {**rec, "id": "sb_old", "spec": spec("sb_old").model_dump(mode="json"),
              "handle": {"id": old.id, "pid": old.pid, "pid_start_time": old.pid_start_time,
                         "bundle": old.bundle, "extra": old.extra}}
    del legacy["version"]
    (tmp_path / "state" / "journal" / "sb_old.json").write_text(json.dumps(legacy))

    second = agent(tmp_path, runtime)           # the upgraded agent restarts
    await second._recover()
    assert set(second.live) == {"sb_new", "sb_old"} and second.outbox == {}
    assert second.live["sb_old"].target.handle.pid == old.pid
    assert await runtime.list_ids() == ["sb_new", "sb_old"]
    versions = {e.id: e.version for e in Journal(tmp_path / "state" / "journal").entries()}
    assert versions == {"sb_new": FORMAT_VERSION, "sb_old": 1}
    for sid in ("sb_new", "sb_old"):
        await second.kill(sid)
    await runtime.close()


async def test_a_record_of_a_newer_format_is_left_alone_with_its_sandbox(tmp_path: Path) -> None:
    runtime = FakeRuntime(tmp_path / "fake")
    first = agent(tmp_path, runtime)
    await first.create(spec("sb_future"))
    path = tmp_path / "state" / "journal" / "sb_future.json"
    rec = json.loads(path.read_text())
    path.write_text(json.dumps({**rec, "version": FORMAT_VERSION + 1, "something_new": True}))

    second = agent(tmp_path, runtime)
    await second._recover()
    assert second.live == {} and second.outbox == {}
    assert await runtime.list_ids() == ["sb_future"]      # not reaped: a newer agent may own it
    assert path.exists() and Journal(tmp_path / "state" / "journal").entries() == []
    await runtime.close()


def test_the_transition_table_is_the_only_way_between_states() -> None:
    reg = Sandboxes()
    sb = reg.add(Sandbox(spec("sb_a"), NodeState.creating))
    with pytest.raises(ValueError):
        reg.add(Sandbox(spec("sb_a"), NodeState.creating))          # one record per id
    with pytest.raises(ValueError):
        reg.add(Sandbox(spec("sb_b"), NodeState.ending))            # not a state a record starts in
    with pytest.raises(errors.InvalidState):
        reg.move(sb, NodeState.paused)                              # creating -> paused is not in the table
    assert reg.state_of("sb_a") is NodeState.creating
    reg.move(sb, NodeState.gone)
    assert reg.get("sb_a") is None and reg.state_of("sb_a") is NodeState.gone
    assert TRANSITIONS[NodeState.gone] == frozenset()
    assert all(NodeState.gone in TRANSITIONS[s] or NodeState.ending in TRANSITIONS[s]
               for s in NodeState if s is not NodeState.gone)       # every state can end


def test_a_record_that_is_not_an_object_is_dropped_like_a_torn_one(tmp_path: Path) -> None:
    """As before format versions: a record that is not a JSON object never stops the agent from starting."""
    journal = Journal(tmp_path / "journal")
    for name, text in (("sb_list", "[]"), ("sb_null", "null"), ("sb_num", "3")):
        (tmp_path / "journal" / f"{name}.json").write_text(text)
    assert journal.entries() == [] and list((tmp_path / "journal").glob("*.json")) == []
