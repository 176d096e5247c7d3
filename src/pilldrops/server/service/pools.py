"""Warm pools, fleet-wide: the config (admin-set) and what nodes report about their pools (the capacity the
pools reserve is counted by ``service.placement`` from ``specs()``, for creates and resumes alike).

Nodes get the config with every register/heartbeat answer, and at once when it changes (best effort: a
node that misses the push catches up at its next heartbeat). Each node with the template keeps ``size``
members of the shape; members count as used capacity (at their target size, ready or not), so
neither cold creates nor resumes take the room a refill needs.
"""

from __future__ import annotations

import logging

import anyio

from pilldrops import errors
from pilldrops._internal.clock import Clock, TTLCache
from pilldrops.schema.api import PoolInfo, PoolSetRequest
from pilldrops.schema.node import NodePoolSpec, NodePoolStatus
from pilldrops.server.nodes.client import NodeClient
from pilldrops.server.store.interface import NodeRecord as Node
from pilldrops.server.store.interface import Store

log = logging.getLogger("pilldrops.pools")
CACHE_S = 2.0
Shape = tuple[str, float, int]


def shape(template: str, vcpu: float, memory_mb: int) -> Shape:
    return (template, round(float(vcpu), 3), int(memory_mb))


class PoolService:
    def __init__(self, store: Store, nodes: NodeClient, clock: Clock) -> None:
        self.store = store
        self.nodes = nodes
        self.clock = clock
        self._cache: TTLCache[str, list[NodePoolSpec]] = clock.ttl_cache(CACHE_S)

    async def specs(self) -> list[NodePoolSpec]:
        """The config, cached for ``CACHE_S`` (it is read on every create and heartbeat)."""
        specs = self._cache.get("specs")
        if specs is None:
            rows = await self.store.list_pools()
            specs = self._cache.put("specs", [NodePoolSpec(template=r.template, vcpu=r.vcpu, memory_mb=r.memory_mb,
                                                           size=r.size) for r in rows])
        return specs

    async def set(self, req: PoolSetRequest) -> PoolInfo:
        if req.size == 0:
            existing = [shape(p.template, p.vcpu, p.memory_mb) for p in await self.store.list_pools()]
            if shape(req.template, req.vcpu, req.memory_mb) not in existing:
                have = ", ".join(f"{t} {c:g} vCPU / {m} MiB" for t, c, m in existing) or "none"
                raise errors.NotFound(f"no pool {req.template} {req.vcpu:g} vCPU / {req.memory_mb} MiB to remove "
                                      f"(a pool is one template and shape; pools: {have})")
        nodes = await self.store.list_nodes()
        if (req.size and not any(req.template in {t.get("name") for t in n.templates} for n in nodes)
                and await self.store.template_version(req.template) is None):     # nor in the template store
            raise errors.TemplateNotFound(f"template {req.template!r} is not built on any node; build it first "
                                          f"(`pilldrops template build {req.template}`)")
        await self.store.set_pool(req.template, float(req.vcpu), req.memory_mb, req.size, self.clock.now())
        self._cache.clear()
        specs = await self.specs()
        async with anyio.create_task_group() as tg:            # push now; heartbeats catch up otherwise
            for n in nodes:
                if n.state == "ready":
                    tg.start_soon(self._push, n, specs)
        key = shape(req.template, req.vcpu, req.memory_mb)
        found = [p for p in await self.list() if shape(p.template, p.vcpu, p.memory_mb) == key]
        return found[0] if found else PoolInfo(template=req.template, vcpu=req.vcpu, memory_mb=req.memory_mb,
                                               size=req.size)

    async def _push(self, node: Node, specs: list[NodePoolSpec]) -> None:
        try:
            with anyio.fail_after(5):
                await self.nodes.set_pools(node.url, specs)
        except Exception as exc:  # noqa: BLE001 - the next heartbeat answer carries the config too
            log.warning("pool config not pushed to %s (it gets it with its next heartbeat): %s", node.name, exc)

    async def list(self) -> list[PoolInfo]:
        """Each configured pool with what the nodes last reported (ready, hits, misses, breaker)."""
        out: dict[Shape, PoolInfo] = {}
        for spec in await self.store.list_pools():
            out[shape(spec.template, spec.vcpu, spec.memory_mb)] = PoolInfo(
                template=spec.template, vcpu=spec.vcpu, memory_mb=spec.memory_mb, size=spec.size)
        for node in await self.store.list_nodes():
            if node.state != "ready":
                continue
            for raw in node.pool_status or []:
                st = NodePoolStatus.model_validate(raw)
                info = out.get(shape(st.template, st.vcpu, st.memory_mb))
                if info is None:
                    continue
                info.nodes += 1
                info.ready += st.ready
                info.starting += st.starting
                info.hits += st.hits
                info.misses += st.misses
                info.breaker_open = info.breaker_open or st.breaker_open
                info.last_error = info.last_error or st.last_error
        for info in out.values():
            total = info.hits + info.misses
            info.hit_rate = round(info.hits / total, 4) if total else None
        return list(out.values())

    @staticmethod
    def ready_on(node: Node, template: str, vcpu: float, memory_mb: int) -> int:
        """Ready members of this shape on the node at its last report."""
        key = shape(template, vcpu, memory_mb)
        return sum(int(raw.get("ready", 0)) for raw in node.pool_status or []
                   if shape(raw.get("template", ""), raw.get("vcpu", 0), raw.get("memory_mb", 0)) == key)
