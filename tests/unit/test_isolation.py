"""Isolation per sandbox (issue 11) without root: the registry's probing and dispatch, re-adoption through
the right runtime, placement's filter and its explanation, the mode's resolution (request > template >
deployment), validation, and the whole path through the in-process stack (FakeRuntimes per mode)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path

import pydantic
import pytest

from pilldrops.node.agent import NodeAgent, Settings
from pilldrops.node.runtime import registry
from pilldrops.node.runtime.base import Handle, RuntimeFailure, SandboxSpec
from pilldrops.node.runtime.fake import FakeRuntime
from pilldrops.node.runtime.registry import Probe, RuntimeRegistry
from pilldrops.node.templates import TemplateSpecError, parse_spec
from pilldrops.schema.api import CreateSandboxRequest, SandboxInfo
from pilldrops.schema.node import NodeSandboxSpec
from pilldrops.server import scheduler
from pilldrops.server.service import isolation
from tests.stack import FakeTemplates, fake_registry, stack

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


# -- node: the registry ---------------------------------------------------------------------------------------

def test_a_missing_driver_module_is_runtime_not_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(registry.DRIVERS, "microvm", "pilldrops.node.runtime.no_such_driver:X")
    assert registry.probe("microvm") == Probe(False, "runtime not installed")
    monkeypatch.setitem(registry.DRIVERS, "microvm", "pilldrops.node.runtime.base:Runtime")   # no probe()
    assert registry.probe("microvm") == Probe(False, "runtime has no probe()")


def test_build_probes_every_mode_and_builds_only_the_available(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(registry.DRIVERS, "container", "tests.unit.test_isolation:_DriverOk")
    monkeypatch.setitem(registry.DRIVERS, "gvisor", "tests.unit.test_isolation:_DriverBroken")
    monkeypatch.setitem(registry.DRIVERS, "microvm", "pilldrops.node.runtime.no_such_driver:X")
    reg = RuntimeRegistry.build(tmp_path, name="n1")
    assert reg.modes() == ["container"]
    assert reg.runtimes["container"].root == tmp_path          # container keeps the node's own state dir
    sup = reg.support()
    assert sup["container"].available and sup["container"].detail == "ok"
    assert not sup["gvisor"].available and sup["gvisor"].reason == "runtime failed to start: broken here"
    assert sup["microvm"].reason == "runtime not installed"
    with pytest.raises(RuntimeFailure, match="not available on this node"):
        reg.get("microvm")


class _DriverOk(FakeRuntime):
    def __init__(self, state_dir: Path, *, name: str) -> None:
        super().__init__(state_dir)


class _DriverBroken(FakeRuntime):
    def __init__(self, state_dir: Path, *, name: str) -> None:
        raise RuntimeError("broken here")


def _probe_ok() -> Probe:
    return Probe(True, detail="ok")


_DriverOk.probe = staticmethod(_probe_ok)            # type: ignore[attr-defined]
probe = _probe_ok                                     # module-level probe() of this "driver module"


async def test_dispatch_by_spec_then_by_stamped_handle(tmp_path: Path) -> None:
    reg = fake_registry(tmp_path, ("container", "gvisor"))
    c = await reg.create(SandboxSpec(id="a", layers=()))
    g = await reg.create(SandboxSpec(id="b", layers=(), isolation="gvisor"))
    assert (c.extra["isolation"], g.extra["isolation"]) == ("container", "gvisor")
    assert await reg.runtimes["container"].list_ids() == ["a"]
    assert await reg.runtimes["gvisor"].list_ids() == ["b"]
    assert await reg.list_ids() == ["a", "b"]
    # a journaled handle (a dict) goes back to its own runtime, from a fresh registry too
    fresh = RuntimeRegistry(reg.runtimes, reg.probes)
    assert (await fresh.state(Handle(**vars(g)))).status == "running"
    p = await fresh.exec(Handle(**vars(g)), ["true"], env={}, cwd=None)
    assert await p.wait() == 0
    with pytest.raises(RuntimeFailure):
        await reg.create(SandboxSpec(id="c", layers=(), isolation="microvm"))
    # an id nobody recorded is destroyed wherever it is
    await fresh.destroy(Handle(id="b"))
    assert await reg.runtimes["gvisor"].list_ids() == []
    await reg.destroy(c)
    assert await reg.list_ids() == []


async def test_a_restore_nobody_recorded_is_undone_wherever_it_is(tmp_path: Path) -> None:
    """Recovery undoes an interrupted resume (``abort_restore``) before ``list_ids`` told the registry whose
    sandbox it is: it must reach the sandbox's own runtime, not the default one."""
    reg = fake_registry(tmp_path, ("container", "gvisor"))
    await reg.create(SandboxSpec(id="b", layers=(), isolation="gvisor"))
    fresh = RuntimeRegistry(reg.runtimes, reg.probes)
    assert fresh.kept_layer("b") is None
    await fresh.abort_restore(Handle(id="b"), tmp_path / "image")
    assert await reg.list_ids() == []


def _nspec(sid: str, mode: str = "container") -> NodeSandboxSpec:
    return NodeSandboxSpec(id=sid, template="tiny", vcpu=1, memory_mb=128, access_token="t", isolation=mode,
                           end_at=datetime.now(UTC) + timedelta(hours=1))


def _agent(tmp_path: Path, runtime: object) -> NodeAgent:
    return NodeAgent(Settings(name="n", public_url="http://n", capacity_vcpu=8, capacity_memory_mb=8192,
                              node_token="tok"), runtime, FakeTemplates("tiny"), tmp_path / "state")  # type: ignore[arg-type]


async def test_restarted_agent_readopts_each_sandbox_through_its_own_runtime(tmp_path: Path) -> None:
    reg = fake_registry(tmp_path, ("container", "gvisor"))
    first = _agent(tmp_path, reg)
    await first.create(_nspec("sb_c"))
    await first.create(_nspec("sb_g", "gvisor"))
    # the agent is SIGKILLed and restarts with new runtime objects over the same sandboxes
    second = _agent(tmp_path, RuntimeRegistry(reg.runtimes, reg.probes))
    await second._recover()
    assert set(second.live) == {"sb_c", "sb_g"} and not second.outbox        # nothing reaped or ended
    assert await reg.runtimes["gvisor"].list_ids() == ["sb_g"]
    assert await reg.runtimes["container"].list_ids() == ["sb_c"]


async def test_pause_is_501_where_the_mode_cannot_checkpoint(tmp_path: Path) -> None:
    from pilldrops import errors
    reg = fake_registry(tmp_path, ("container", "gvisor"))
    reg.runtimes["gvisor"].checkpoint_supported = False
    agent = _agent(tmp_path, reg)
    await agent.create(_nspec("sb_g", "gvisor"))
    with pytest.raises(errors.NotSupported, match="cannot pause gvisor sandboxes") as ei:
        await agent.pause("sb_g")
    assert ei.value.status == 501 and ei.value.code == "not_supported"


# -- control plane ----------------------------------------------------------------------------------------

def test_unknown_mode_names_the_valid_ones() -> None:
    with pytest.raises(pydantic.ValidationError, match="valid modes: container, gvisor, microvm"):
        CreateSandboxRequest(isolation="kvm")
    assert CreateSandboxRequest().isolation is None


def _view(nid: str, modes: dict[str, tuple[bool, str]]) -> scheduler.NodeView:
    fields = isolation.view_fields({m: {"available": a, "reason": r} for m, (a, r) in modes.items()})
    return scheduler.NodeView(nid, 8, 8192, templates=frozenset({"tiny"}), **fields)


def test_placement_filters_on_the_mode_and_explains_why() -> None:
    a = _view("a", {"container": (True, ""), "gvisor": (True, ""),
                    "microvm": (False, "qemu-system-x86_64 not installed")})
    b = _view("b", {"container": (True, "")})       # an agent from before isolation modes
    req = scheduler.Request("tiny", 1, 128, "microvm")
    res = scheduler.place(req, [a])
    assert isinstance(res, scheduler.Unschedulable)
    assert res.explain() == "0/1 nodes fit: 1 no microvm (qemu-system-x86_64 not installed)"
    assert scheduler.place(scheduler.Request("tiny", 1, 128, "gvisor"), [a, b]) == scheduler.Placement("a")
    assert scheduler.place(scheduler.Request("tiny", 1, 128, "gvisor"), [b]).explain() == (  # type: ignore[union-attr]
        "0/1 nodes fit: 1 no gvisor (not reported by the node)")


def test_mode_resolution_request_then_template_then_deployment() -> None:
    class N:
        templates = [{"name": "tiny", "isolation": "gvisor"}, {"name": "base"}]  # noqa: RUF012 - read-only table
    nodes = [N()]
    assert isolation.resolve("microvm", nodes, "tiny", "container") == "microvm"
    assert isolation.resolve(None, nodes, "tiny", "container") == "gvisor"
    assert isolation.resolve(None, nodes, "base", "gvisor") == "gvisor"
    assert isolation.resolve(None, nodes, "base", "container") == "container"


def test_template_spec_isolation_key(tmp_path: Path) -> None:
    p = tmp_path / "t.toml"
    p.write_text('name = "t"\nfrom = "busybox"\nisolation = "gvisor"\n')
    assert parse_spec(p).isolation == "gvisor"
    p.write_text('name = "t"\nfrom = "busybox"\nisolation = "vm"\n')
    with pytest.raises(TemplateSpecError, match="container, gvisor, microvm"):
        parse_spec(p)


async def test_through_the_stack_mode_on_info_history_and_refusal(tmp_path: Path) -> None:
    async with stack(tmp_path, isolation=("container", "gvisor"), default_isolation="gvisor") as st, \
            st.client() as c:
        r = await c.post("/v1/sandboxes", json={"template": "tiny"})          # the deployment's default
        assert r.status_code == 201, r.text
        g = SandboxInfo.model_validate(r.json())
        assert g.isolation == "gvisor"
        r = await c.post("/v1/sandboxes", json={"template": "tiny", "isolation": "container"})
        assert SandboxInfo.model_validate(r.json()).isolation == "container"
        assert await st.agent.runtime.runtimes["gvisor"].list_ids() == [g.id]
        r = await c.post("/v1/sandboxes/batch", json={"template": "tiny", "isolation": "gvisor", "count": 2})
        assert [it["sandbox"]["isolation"] for it in r.json()["items"]] == ["gvisor", "gvisor"]
        r = await c.post("/v1/sandboxes", json={"template": "tiny", "isolation": "microvm"})
        assert r.status_code == 503
        assert r.json()["error"]["message"] == "0/1 nodes fit: 1 no microvm (not installed in this test)"
        r = await c.post("/v1/sandboxes", json={"template": "tiny", "isolation": "firecracker"})
        assert r.status_code == 400 and "container, gvisor, microvm" in r.json()["error"]["message"]
        hist = (await c.get("/v1/history")).json()["items"]
        assert sorted(h["isolation"] for h in hist) == ["container", "gvisor", "gvisor", "gvisor"]
        nodes = (await c.get("/v1/nodes")).json()["items"]
        assert {m for m, s in nodes[0]["isolation"].items() if s["available"]} == {"container", "gvisor"}
