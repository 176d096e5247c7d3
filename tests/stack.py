"""An in-process PillDrops for unit tests: control plane (real SQLite store) + node agent on the
FakeRuntime, wired through ASGI transports (no sockets, no root)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import httpx

from pilldrops._internal.clock import Clock
from pilldrops.node.agent import NodeAgent, Settings
from pilldrops.node.api import create_node_app
from pilldrops.node.runtime.fake import FakeRuntime
from pilldrops.schema.node import NodeNetwork
from pilldrops.server.main import ControlPlane, build_control_plane
from pilldrops.server.service.billing import BillingSettings
from pilldrops.server.store.sql import sqlite_url

TOKEN = "test-node-token"


@dataclass(frozen=True)
class FakeTemplate:
    name: str
    layers: tuple[Path, ...] = ()
    env: dict[str, str] | None = None
    workdir: str = "/"
    size: int = 0
    built_at: float = 0.0
    built: bool = True
    description: str = ""
    isolation: str | None = None
    disk_mb: int | None = None
    network: dict[str, Any] | None = None     # a template's [network] default (issue 14)

    def __post_init__(self) -> None:
        object.__setattr__(self, "env", self.env or {"PD_TEMPLATE": self.name})


class FakeTemplates:
    def __init__(self, *names: str) -> None:
        self.items = {n: FakeTemplate(n) for n in names}

    def get(self, name: str) -> FakeTemplate:
        from pilldrops.errors import TemplateNotFound
        if name not in self.items:
            raise TemplateNotFound(name)
        return self.items[name]

    def list(self) -> list[FakeTemplate]:
        return list(self.items.values())


@dataclass
class Stack:
    cp: ControlPlane
    agent: NodeAgent
    runtime: FakeRuntime
    key: str
    team_id: str
    others: list[tuple[NodeAgent, FakeRuntime]] = field(default_factory=list)   # extra nodes (nodes=N)
    # routes by host to the control plane (http://cp) and the nodes: what an SDK client is given
    transport: httpx.AsyncBaseTransport | None = None

    def client(self, key: str | None = None, **kw: Any) -> httpx.AsyncClient:
        headers = {"Authorization": f"Bearer {key if key is not None else self.key}"} if (key or self.key) else {}
        return httpx.AsyncClient(transport=httpx.ASGITransport(app=self.cp.app), base_url="http://cp",
                                 headers=headers, **kw)

    def ports_client(self, **kw: Any) -> httpx.AsyncClient:
        """A client of the port-URL listener (its own origin: ``http://cp:82``, the API's port + 2)."""
        return httpx.AsyncClient(transport=httpx.ASGITransport(app=self.cp.ports_app), base_url="http://cp:82", **kw)

    async def new_team_key(self, name: str) -> str:
        team = await self.cp.services.auth.create_team(name)
        return (await self.cp.services.auth.create_key(team.id, "k")).secret


@asynccontextmanager
async def stack(tmp_path: Path, *, capacity_vcpu: float = 64, capacity_memory_mb: int = 65536,
                templates: tuple[str, ...] = ("tiny",), billing: BillingSettings | None = None,
                clock: Clock | None = None, db_url: str | None = None, nodes: int = 1,
                isolation: tuple[str, ...] = (), node_ram_mb: int | None = None,
                **cp_options: Any) -> AsyncIterator[Stack]:
    """One control plane and ``nodes`` agents (``node-a`` at http://node, then ``node-b`` at
    http://node-b, ...), all in-process; every HTTP call is routed by host to the right ASGI app.
    ``isolation``: the first node's runtime is a ``RuntimeRegistry`` of FakeRuntimes for these modes (the
    others reported unavailable); ``Stack.runtime`` is then its container fake. ``node_ram_mb``: the RAM
    the nodes report (default: this machine's)."""
    holder: dict[str, Any] = {}
    transport = httpx.ASGITransport(app=_Lazy(holder))
    cp = await build_control_plane(db_url or sqlite_url(tmp_path / "db.sqlite"), TOKEN, clock,
                                   node_transport=transport, billing=billing, **cp_options)
    holder["cp"] = cp.app
    agents: list[tuple[NodeAgent, FakeRuntime]] = []
    for i in range(nodes):
        suffix = "" if i == 0 else f"-{chr(ord('a') + i)}"
        runtime = FakeRuntime(tmp_path / f"fake{suffix}")
        node_runtime: Any = runtime
        if isolation and i == 0:
            node_runtime = fake_registry(tmp_path, isolation, runtime)
        settings = Settings(name=f"node-{chr(ord('a') + i)}", public_url=f"http://node{suffix}",
                            capacity_vcpu=capacity_vcpu, capacity_memory_mb=capacity_memory_mb,
                            control_plane_url="http://cp", node_token=TOKEN, ram_mb=node_ram_mb)
        agent = NodeAgent(settings, node_runtime, FakeTemplates(*templates), tmp_path / f"node{suffix}",
                          http=httpx.AsyncClient(transport=transport, headers={"Authorization": f"Bearer {TOKEN}"}))
        holder[f"node{suffix}"] = create_node_app(agent, TOKEN)
        agents.append((agent, runtime))
    team_id, secret = await cp.services.auth.bootstrap(None)
    assert secret
    try:
        async with anyio.create_task_group() as tg:
            for agent, _ in agents:
                await tg.start(agent.run)
            tg.start_soon(cp.run)
            with anyio.fail_after(10):
                for agent, _ in agents:
                    await agent.wait_registered()
            yield Stack(cp, agents[0][0], agents[0][1], secret, team_id, agents[1:], transport=transport)
            for agent, _ in agents:
                await agent.shutdown()
            tg.cancel_scope.cancel()
    finally:
        await cp.aclose()
        for _, runtime in agents:
            await runtime.close()


def fake_registry(tmp_path: Path, modes: tuple[str, ...], container: FakeRuntime | None = None) -> Any:
    """A ``RuntimeRegistry`` with one FakeRuntime per mode in ``modes`` (container always); the other modes
    are reported unavailable ("not installed in this test")."""
    from pilldrops.node.runtime.registry import Probe, RuntimeRegistry
    from pilldrops.schema.api import ISOLATION_MODES
    runtimes: dict[str, Any] = {"container": container or FakeRuntime(tmp_path / "fake")}
    for m in modes:
        if m != "container":
            runtimes[m] = FakeRuntime(tmp_path / f"fake-{m}")
    probes = {m: Probe(True, detail="fake") if m in runtimes else Probe(False, "not installed in this test")
              for m in ISOLATION_MODES}
    return RuntimeRegistry(runtimes, probes)


class _Lazy:
    """ASGI apps resolved at call time by the request's host (node apps are built after the control plane)."""

    def __init__(self, holder: dict[str, Any]) -> None:
        self.holder = holder

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        host = dict(scope.get("headers") or []).get(b"host", b"node").decode().split(":")[0]
        await self.holder[host](scope, receive, send)


class FakeEgress:
    """The node's egress, recording what it was asked (attach, release)."""

    def __init__(self) -> None:
        self.attached: dict[str, NodeNetwork] = {}
        self.released: list[str] = []
        self.rekeyed: list[tuple[str, str]] = []
        self.attaches = 0                       # attach calls (a claim of a per-policy member makes none)

    def unavailable(self) -> str | None:
        return None

    async def attach(self, sandbox_id: str, pid: int, rootfs: Path | None, net: NodeNetwork) -> int:
        self.attached[sandbox_id] = net
        self.attaches += 1
        return 0

    def rekey(self, old_id: str, new_id: str) -> None:
        self.attached[new_id] = self.attached.pop(old_id)
        self.rekeyed.append((old_id, new_id))

    async def release(self, sandbox_id: str) -> None:
        self.released.append(sandbox_id)

    async def detach(self, sandbox_id: str) -> None: ...

    def forget(self, sandbox_id: str) -> None: ...

    async def recover(self, *a: Any) -> None: ...

    async def close(self) -> None: ...


def fake_egress(st: Any) -> FakeEgress:
    """Replace the first node's egress with a recording fake (the fake runtime has no netns)."""
    fake = FakeEgress()
    st.agent.egress = fake
    st.agent.transfer.egress = fake
    return fake


async def until(pred: Any, timeout: float = 10.0) -> None:
    """Poll ``pred`` every 20 ms until it holds; TimeoutError after ``timeout`` seconds."""
    with anyio.fail_after(timeout):
        while not pred():
            await anyio.sleep(0.02)
