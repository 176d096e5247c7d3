"""Node registration, heartbeats and the events nodes report; templates known across the fleet."""

from __future__ import annotations

import logging
from datetime import datetime

from pilldrops import errors
from pilldrops._internal.clock import Clock
from pilldrops._internal.ids import same_secret as same
from pilldrops.schema.api import NodeInfo, TemplateInfo
from pilldrops.schema.node import NodeHeartbeat, NodeHeartbeatReply, NodeRegister, NodeRegistered
from pilldrops.server.service.isolation import node_support
from pilldrops.server.service.pools import PoolService
from pilldrops.server.service.sandboxes import SandboxService
from pilldrops.server.store.interface import Store

HEARTBEAT_INTERVAL_S = 5.0
log = logging.getLogger("pilldrops.nodes")


class NodeService:
    def __init__(self, store: Store, sandboxes: SandboxService, clock: Clock, node_token: str,
                 heartbeat_interval: float = HEARTBEAT_INTERVAL_S, unreachable_after: float | None = None,
                 lost_after: float = 300.0, pools: PoolService | None = None) -> None:
        self.store = store
        self.sandboxes = sandboxes
        self.clock = clock
        self._token = node_token
        self.heartbeat_interval = heartbeat_interval
        self.unreachable_after = unreachable_after or 3 * heartbeat_interval
        self.lost_after = lost_after
        self._store_ok_since: datetime | None = None   # this process has reached the store since then
        self.pools = pools

    def check_token(self, presented: str | None) -> None:
        if not presented or not same(presented, self._token):
            raise errors.AuthenticationError("invalid node token")

    async def register(self, req: NodeRegister) -> NodeRegistered:
        taken = await self.store.node_by_id_or_name(req.name)
        if (taken is not None and taken.instance and req.instance and taken.instance != req.instance
                and taken.state == "ready"
                and (self.clock.now() - taken.last_heartbeat_at).total_seconds() < self.unreachable_after):
            raise errors.Conflict(f"node name {req.name!r} is in use by another live agent at {taken.url}; "
                                  "give each agent on a machine its own --name")
        node = await self.store.upsert_node(instance=req.instance or None, 
            name=req.name, url=req.url.rstrip("/"), capacity_vcpu=req.capacity_vcpu,
            capacity_memory_mb=req.capacity_memory_mb,
            templates=[t.model_dump(mode="json") for t in req.templates], now=self.clock.now(),
            isolation={m: v.model_dump(mode="json") for m, v in req.isolation.items()} or None,
            ram_mb=req.ram_mb or None)
        self.sandboxes.forget_node(node.id)          # its URL may have changed
        self.sandboxes.ctx.grants.drop_node(node.id)  # a restarted agent reaped its unclaimed members
        self.sandboxes.ctx.beats.forget(node.id)      # its next heartbeat is full
        await self._absorb(node.id, req.sandboxes)
        return NodeRegistered(node_id=node.id, heartbeat_interval=self.heartbeat_interval,
                              pools=await self.pools.specs() if self.pools else [])

    async def heartbeat(self, node_id: str, hb: NodeHeartbeat) -> NodeHeartbeatReply:
        node = await self.store.heartbeat(node_id, [t.model_dump(mode="json") for t in hb.templates],
                                          self.clock.now(),
                                          [p.model_dump(mode="json", exclude={"grants"}) for p in hb.pools])
        if node is None:
            raise errors.NotFound(f"unknown node {node_id!r}: register again")
        ctx = self.sandboxes.ctx
        ctx.grants.update(node_id, hb.pools)     # its ready members, pre-issued (claims)
        received = self.clock.now()
        pools = await self.pools.specs() if self.pools else []
        if hb.digest is None:                    # an agent from before delta heartbeats: a full report
            await self.sandboxes.absorb(node, hb.sandboxes, received)
            return NodeHeartbeatReply(pools=pools)
        want: set[str] = set()
        if hb.delta_of is None:
            want = await self.sandboxes.absorb(node, hb.sandboxes, received)
            ctx.beats.full(node_id, hb, received)
            full = False
        else:
            live = ctx.beats.delta(node_id, hb, received)
            full = live is None      # refused: not absorbed; the node sends a full beat at once (``full``)
            if live is not None:
                want = await self.sandboxes.absorb(node, hb.sandboxes, received, live=live, gone=hb.gone)
        return NodeHeartbeatReply(pools=pools, epoch=ctx.beats.epoch, full=full, want=sorted(want),
                                  usage_every_s=ctx.billing.settings.commit_every_s)

    async def _absorb(self, node_id: str, statuses: list) -> None:  # type: ignore[type-arg]
        received = self.clock.now()
        node = await self.store.get_node(node_id)
        if node is not None:
            await self.sandboxes.absorb(node, statuses, received)

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

    # ---- liveness ------------------------------------------------------------------------------------

    async def check_liveness(self) -> None:
        """Mark silent nodes ``unreachable``, and after ``lost_after`` their live sandboxes ``lost``.

        Silence only counts while this control plane has itself been reaching the store for the whole
        window: a store outage (or a restart of this process) delays every verdict instead of reaping.
        """
        now = self.clock.now()
        try:
            nodes = await self.store.list_nodes()
        except Exception:  # the store is down: no verdicts now, and the window restarts
            self._store_ok_since = None
            raise
        if self._store_ok_since is None:
            self._store_ok_since = now
        watched_since = self._store_ok_since
        for node in nodes:
            silent_since = max(node.last_heartbeat_at, watched_since)
            silence = (now - silent_since).total_seconds()
            if node.state == "ready" and silence > self.unreachable_after:
                log.warning("node %s (%s) is unreachable: no heartbeat for %.0f s", node.name, node.id, silence)
                await self.store.set_node(node.id, state="unreachable")
            if node.state in ("ready", "unreachable") and silence > self.lost_after:
                await self.sandboxes.mark_lost(node.id, node.last_heartbeat_at)

    async def run_liveness(self, every: float = 1.0) -> None:
        import anyio
        while True:
            try:
                await self.check_liveness()
            except Exception:
                log.exception("liveness pass failed (store unreachable?)")
            await anyio.sleep(every)

    # ---- admin ---------------------------------------------------------------------------------------

    async def set_draining(self, node_id: str, draining: bool) -> NodeInfo:
        node = await self.store.node_by_id_or_name(node_id)
        if node is None:
            raise errors.NotFound(f"no node {node_id!r}")
        await self.store.set_node(node.id, draining=draining)
        return next(n for n in await self.list() if n.id == node.id)

    async def list(self) -> list[NodeInfo]:
        allocs = await self.store.allocations()
        counts = await self.store.live_counts()
        return [NodeInfo(id=n.id, name=n.name, url=n.url, state=n.state, draining=n.draining,
                         capacity_vcpu=n.capacity_vcpu, capacity_memory_mb=n.capacity_memory_mb,
                         used_vcpu=allocs.get(n.id, (0.0, 0))[0], used_memory_mb=allocs.get(n.id, (0.0, 0))[1],
                         sandboxes=counts.get(n.id, 0), templates=sorted(t.get("name") for t in n.templates),
                         isolation=node_support(n.isolation), last_heartbeat_at=n.last_heartbeat_at) for n in await self.store.list_nodes()]
