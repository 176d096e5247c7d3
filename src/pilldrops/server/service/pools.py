"""Warm pools, fleet-wide: the config (admin-set) and what nodes report about their pools (the capacity the
pools reserve is counted by ``service.placement`` from ``specs()``, for creates and resumes alike).

Nodes get the config with every register/heartbeat answer, and at once when it changes (best effort: a
node that misses the push catches up at its next heartbeat). Each node with the template keeps ``size``
members of the shape; members count as used capacity (at their target size, ready or not), so
neither cold creates nor resumes take the room a refill needs.

A pool is one template, shape and egress policy (issue 14 part 3). The policy is resolved and checked like a
create's (``service.egress``: the template's ``[network]`` default when unset, ``--no-egress`` /
``--egress-allow``); the nodes make the members of a pool with egress with their network attached, so a
create with that policy claims one with nothing to set up. A pool whose policy the deployment no longer
allows (restarted with other flags) is not handed to the nodes.
"""

from __future__ import annotations

import logging

import anyio

from pilldrops import errors
from pilldrops._internal.clock import Clock, TTLCache
from pilldrops.schema.api import PoolInfo, PoolSetRequest, TemplateNetwork
from pilldrops.schema.node import NodePoolSpec, NodePoolStatus, network_key
from pilldrops.server.nodes.client import NodeClient
from pilldrops.server.service import egress
from pilldrops.server.store.interface import NodeRecord as Node
from pilldrops.server.store.interface import Store

log = logging.getLogger("pilldrops.pools")
CACHE_S = 2.0
Shape = tuple[str, float, int]
Key = tuple[str, float, int, str]      # a shape and the ``network_key`` of the members' egress ("" none)


def shape(template: str, vcpu: float, memory_mb: int) -> Shape:
    return (template, round(float(vcpu), 3), int(memory_mb))


def key(template: str, vcpu: float, memory_mb: int, network: object = None) -> Key:
    return (*shape(template, vcpu, memory_mb), network_key(network))  # type: ignore[arg-type]


def _label(template: str, vcpu: float, memory_mb: int, net: dict | None) -> str:  # type: ignore[type-arg]
    v = egress.view(net)
    policy = ("" if not network_key(net) else
              f" with {'internet' if v['allow_internet_access'] else 'no internet'}"
              + (f", allow_out {' '.join(v['network'].allow_out)}" if v["network"].allow_out else "")
              + (f", deny_out {' '.join(v['network'].deny_out)}" if v["network"].deny_out else ""))
    return f"{template} {vcpu:g} vCPU / {memory_mb} MiB{policy}"


class PoolService:
    def __init__(self, store: Store, nodes: NodeClient, clock: Clock,
                 egress_settings: egress.EgressSettings | None = None) -> None:
        self.store = store
        self.nodes = nodes
        self.clock = clock
        self.egress = egress_settings or egress.EgressSettings()
        self._cache: TTLCache[str, list[NodePoolSpec]] = clock.ttl_cache(CACHE_S)

    async def specs(self) -> list[NodePoolSpec]:
        """The config, cached for ``CACHE_S`` (it is read on every create and heartbeat)."""
        specs = self._cache.get("specs")
        if specs is None:
            rows = await self.store.list_pools()
            specs = self._cache.put("specs", [
                NodePoolSpec(template=r.template, vcpu=r.vcpu, memory_mb=r.memory_mb, size=r.size,
                             network=egress.node_network(r.network, self.egress))
                for r in rows if egress.permitted(r.network, self.egress)])
        return specs

    async def set(self, req: PoolSetRequest) -> PoolInfo:
        nodes = await self.store.list_nodes()
        # the members' policy, resolved and checked like a create's (a removal is never refused by the flags),
        # the template store's version's default first, as for a create (else a pool of a template's default
        # would get another policy than that template's plain creates, which would then never claim from it)
        version = await self.store.template_version(req.template)
        stored = TemplateNetwork.model_validate(version.network) if version is not None and version.network else None
        net = egress.resolve(req, nodes, "container", self.egress if req.size else egress.EgressSettings(), stored)
        net_id = egress.policy_id(net)
        net = net if net_id else None
        if req.size == 0:
            existing = await self.store.list_pools()
            if not any((p.template, p.vcpu, p.memory_mb, p.network_id) == (req.template, float(req.vcpu),
                                                                           req.memory_mb, net_id) for p in existing):
                have = "; ".join(_label(p.template, p.vcpu, p.memory_mb, p.network) for p in existing) or "none"
                raise errors.NotFound(f"no pool {_label(req.template, req.vcpu, req.memory_mb, net)} to remove "
                                      f"(a pool is one template, shape and network policy; pools: {have})")
        if (req.size and not any(req.template in {t.get("name") for t in n.templates} for n in nodes)
                and version is None):     # nor in the template store
            raise errors.TemplateNotFound(f"template {req.template!r} is not built on any node; build it first "
                                          f"(`pilldrops template build {req.template}`)")
        await self.store.set_pool(req.template, float(req.vcpu), req.memory_mb, req.size, self.clock.now(),
                                  network=net, network_id=net_id)
        self._cache.clear()
        specs = await self.specs()
        async with anyio.create_task_group() as tg:            # push now; heartbeats catch up otherwise
            for n in nodes:
                if n.state == "ready":
                    tg.start_soon(self._push, n, specs)
        want = key(req.template, req.vcpu, req.memory_mb, egress.node_network(net, self.egress))
        found = (await self._by_key()).get(want)
        return found if found is not None else PoolInfo(template=req.template, vcpu=req.vcpu, memory_mb=req.memory_mb,
                                               size=req.size, **egress.view(net))

    async def _push(self, node: Node, specs: list[NodePoolSpec]) -> None:
        try:
            with anyio.fail_after(5):
                await self.nodes.set_pools(node.url, specs)
        except Exception as exc:  # noqa: BLE001 - the next heartbeat answer carries the config too
            log.warning("pool config not pushed to %s (it gets it with its next heartbeat): %s", node.name, exc)

    async def list(self) -> list[PoolInfo]:
        """Each configured pool with what the nodes last reported (ready, hits, misses, breaker)."""
        return list((await self._by_key()).values())

    async def _by_key(self) -> dict[Key, PoolInfo]:
        out: dict[Key, PoolInfo] = {}
        for row in await self.store.list_pools():
            info = PoolInfo(template=row.template, vcpu=row.vcpu, memory_mb=row.memory_mb, size=row.size,
                            **egress.view(row.network))
            if not egress.permitted(row.network, self.egress):
                info.last_error = "this deployment no longer allows the pool's egress (--no-egress / --egress-allow)"
            out[key(row.template, row.vcpu, row.memory_mb, egress.node_network(row.network, self.egress))] = info
        for node in await self.store.list_nodes():
            if node.state != "ready":
                continue
            for raw in node.pool_status or []:
                st = NodePoolStatus.model_validate(raw)
                info = out.get(key(st.template, st.vcpu, st.memory_mb, st.network))
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
        return out

    @staticmethod
    def ready_on(node: Node, template: str, vcpu: float, memory_mb: int, net_key: str = "") -> int:
        """Ready members of this shape and policy (``network_key``, "" loopback only) at the node's last report."""
        want = (*shape(template, vcpu, memory_mb), net_key)
        return sum(int(raw.get("ready", 0)) for raw in node.pool_status or []
                   if key(raw.get("template", ""), raw.get("vcpu", 0), raw.get("memory_mb", 0),
                          raw.get("network")) == want)
