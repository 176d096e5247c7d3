"""Node registration, heartbeats and the events nodes report; templates known across the fleet."""

from __future__ import annotations

from pilldrops import errors
from pilldrops._internal.clock import Clock
from pilldrops.schema.api import TemplateInfo
from pilldrops.schema.node import NodeHeartbeat, NodeRegister, NodeRegistered
from pilldrops._internal.ids import same_secret as same
from pilldrops.server.service.sandboxes import SandboxService
from pilldrops.server.store.sql import Store

HEARTBEAT_INTERVAL_S = 5.0


class NodeService:
    def __init__(self, store: Store, sandboxes: SandboxService, clock: Clock, node_token: str,
                 heartbeat_interval: float = HEARTBEAT_INTERVAL_S) -> None:
        self.store = store
        self.sandboxes = sandboxes
        self.clock = clock
        self._token = node_token
        self.heartbeat_interval = heartbeat_interval

    def check_token(self, presented: str | None) -> None:
        if not presented or not same(presented, self._token):
            raise errors.AuthenticationError("invalid node token")

    async def register(self, req: NodeRegister) -> NodeRegistered:
        node = await self.store.upsert_node(
            name=req.name, url=req.url.rstrip("/"), capacity_vcpu=req.capacity_vcpu,
            capacity_memory_mb=req.capacity_memory_mb,
            templates=[t.model_dump(mode="json") for t in req.templates], now=self.clock.now())
        await self._absorb(node.id, req.sandboxes)
        return NodeRegistered(node_id=node.id, heartbeat_interval=self.heartbeat_interval)

    async def heartbeat(self, node_id: str, hb: NodeHeartbeat) -> None:
        node = await self.store.heartbeat(node_id, [t.model_dump(mode="json") for t in hb.templates],
                                          self.clock.now())
        if node is None:
            raise errors.NotFound(f"unknown node {node_id!r}: register again")
        await self._absorb(node_id, hb.sandboxes)

    async def _absorb(self, node_id: str, statuses: list) -> None:  # type: ignore[type-arg]
        for st in statuses:
            await self.sandboxes.apply_node_status(node_id, st)
        await self.sandboxes.reconcile_node(node_id, {st.id for st in statuses})

    async def templates(self) -> list[TemplateInfo]:
        merged: dict[str, TemplateInfo] = {}
        for node in await self.store.list_nodes():
            for t in node.templates:
                info = TemplateInfo.model_validate(t)
                if info.name in merged:
                    merged[info.name].nodes.append(node.name)
                else:
                    merged[info.name] = info.model_copy(update={"nodes": [node.name]})
        return sorted(merged.values(), key=lambda t: t.name)
