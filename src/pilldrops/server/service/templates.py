"""The template store (issue 19): build a template once, on one node the scheduler picks, keep its layers
content-addressed (``server.artifacts``), and hand every create the version it runs so that any node can
fetch what it lacks.

- A build is keyed by ``schema.templates.build_key`` (spec document, parent's key, context digest): when
  the current version already has that key nothing is built. Otherwise the builder node gets the spec,
  the parent's layer refs and the context digest, streams its build log back (relayed to the client as
  NDJSON) and uploads the new layer, which the store verifies by digest before the version is recorded.
- A rebuild is the next version; creates take the current one, sandboxes keep theirs (the version is on
  the sandbox row, and in the node spec). ``gc`` drops versions neither current nor used by a sandbox
  that has not ended, then the blobs no remaining version names.
- ``list`` is what ``template list`` shows: per template its size, digest, build time and the nodes that
  hold it (as their heartbeats report), next to templates nodes built on their own.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import AsyncIterator
from datetime import datetime, timedelta
from typing import Any

import httpx

from pilldrops import errors
from pilldrops._internal.clock import Clock
from pilldrops.schema.api import DISK_MB_CAP, MIN_DISK_MB, TemplateBuildRequest, TemplateInfo, TemplateNetwork
from pilldrops.schema.node import NodeBuildRequest, NodeLayerRef, NodeTemplateRef
from pilldrops.schema.templates import build_key
from pilldrops.server import scheduler
from pilldrops.server.artifacts import BlobStore
from pilldrops.server.nodes.client import NodeClient
from pilldrops.server.store.interface import Store, TemplateVersionRecord

log = logging.getLogger("pilldrops.templates")
NAME_RE = re.compile(r"^[a-z0-9][a-z0-9_.-]{0,62}$")
MAX_LAYER_BYTES = 16 << 30
DEFAULT_MAX_CONTEXT_BYTES = 256 << 20
BUILD_SHAPE = (1.0, 1024)      # what a build asks of its node (vCPU, MiB)
READY_WINDOW = timedelta(seconds=30)
# a build is not a sandbox: it holds no reservation, so a full node may build; the least loaded one does
BUILD_FILTERS = (scheduler.READY, scheduler.NOT_DRAINING)
LEAST_LOADED = scheduler.Scorer("least loaded", lambda r, n: -((n.capacity_vcpu - n.used_vcpu) / n.capacity_vcpu
                                                               + (n.capacity_memory_mb - n.used_memory_mb)
                                                               / n.capacity_memory_mb))


def ref_of(row: TemplateVersionRecord) -> NodeTemplateRef:
    return NodeTemplateRef(name=row.name, version=row.version, key=row.key,
                           layers=[NodeLayerRef(**layer) for layer in row.layers], env=dict(row.env or {}),
                           workdir=row.workdir or "/", user=getattr(row, "user", None),
                           home=getattr(row, "home", None), isolation=row.isolation, built_at=row.built_at,
                           size_bytes=row.size_bytes, disk_mb=row.disk_mb,
                           network=TemplateNetwork.model_validate(row.network) if row.network else None)


def _defaults(spec: dict[str, Any]) -> tuple[int | None, dict[str, Any] | None]:
    """The spec's sandbox defaults (``disk_mb``, ``[network]``), checked like a create's fields."""
    disk_mb, network = spec.get("disk_mb"), spec.get("network")
    if disk_mb is not None and (isinstance(disk_mb, bool) or not isinstance(disk_mb, int)
                                or not MIN_DISK_MB <= disk_mb <= DISK_MB_CAP):
        raise errors.InvalidRequest(f"spec 'disk_mb' must be an integer from {MIN_DISK_MB} to {DISK_MB_CAP}",
                                    details={"field": "disk_mb"})
    try:
        net = TemplateNetwork.model_validate(network).model_dump() if network is not None else None
    except ValueError as e:
        raise errors.InvalidRequest(f"spec [network]: {e}", details={"field": "network"}) from None
    return disk_mb, net


def _opt_str(v: Any) -> str | None:
    return str(v)[:1024] if v else None


def _event(kind: str, **fields: Any) -> bytes:
    return (json.dumps({"type": kind, **fields}, default=str) + "\n").encode()


class TemplateService:
    def __init__(self, store: Store, blobs: BlobStore, nodes: NodeClient, clock: Clock, *,
                 max_context_bytes: int = DEFAULT_MAX_CONTEXT_BYTES) -> None:
        self.store = store
        self.blobs = blobs
        self.nodes = nodes
        self.clock = clock
        self.max_context_bytes = max_context_bytes
        self._current = clock.ttl_cache(1.0)          # name -> current ref (or False): one read per second
        self._versions: dict[tuple[str, int], NodeTemplateRef] = {}     # immutable once built

    # ---- what creates run ------------------------------------------------------------------------------

    async def current(self, name: str) -> NodeTemplateRef | None:
        hit = self._current.get(name)
        if hit is None:
            row = await self.store.template_version(name)
            hit = self._current.put(name, ref_of(row) if row is not None else False)
        return hit or None

    async def version(self, name: str, version: int) -> NodeTemplateRef | None:
        ref = self._versions.get((name, version))
        if ref is None:
            row = await self.store.template_version(name, version)
            if row is None:
                return None
            ref = self._versions[(name, version)] = ref_of(row)
        return ref

    # ---- uploads and serving blobs --------------------------------------------------------------------

    async def put_context(self, digest: str, body: AsyncIterator[bytes]) -> int:
        if self.blobs.has("contexts", digest):
            async for _ in body:      # drain it: the client sent it anyway
                pass
            return self.blobs.size("contexts", digest)
        return await self.blobs.put("contexts", digest, body, self.max_context_bytes)

    async def put_layer(self, digest: str, body: AsyncIterator[bytes]) -> int:
        return await self.blobs.put("layers", digest, body, MAX_LAYER_BYTES)

    async def read(self, kind: str, digest: str) -> AsyncIterator[bytes]:
        return await self.blobs.read(kind, digest)

    # ---- builds ---------------------------------------------------------------------------------------

    async def build(self, req: TemplateBuildRequest) -> AsyncIterator[bytes]:
        """Check the request (errors raise before the stream starts), then stream the build's events."""
        spec = req.spec
        name = spec.get("name")
        if not isinstance(name, str) or not NAME_RE.match(name):
            raise errors.InvalidRequest(f"spec 'name' must match {NAME_RE.pattern}")
        base = spec.get("from")
        if not isinstance(base, str) or not base or base == name:
            raise errors.InvalidRequest("spec 'from' must name a parent template or a builder")
        _defaults(spec)
        if req.context and not self.blobs.has("contexts", req.context):
            raise errors.InvalidRequest(f"build context {req.context} was not uploaded (PUT "
                                        f"/v1/templates/contexts/{req.context} first)")
        parent = await self.current(base)
        key = build_key(spec, parent.key if parent else None, req.context)
        current = await self.current(name)
        if current is not None and current.key == key and not req.force:
            async def cached() -> AsyncIterator[bytes]:
                yield _event("status", message=f"template {name} v{current.version} is up to date (cached)")
                yield _event("done", cached=True, template=self._info(current, []).model_dump(mode="json"))
            return cached()
        node = await self._builder()
        body = NodeBuildRequest(spec=spec, key=key, context=req.context, parent=parent,
                                context_size=self.blobs.size("contexts", req.context) if req.context else 0)
        return self._run(name, spec, parent, key, node, body)

    async def _builder(self) -> Any:
        """The node a build runs on: ready, not draining, the least loaded."""
        nodes = await self.store.list_nodes()
        allocs = await self.store.allocations()
        now = self.clock.now()
        views = [scheduler.NodeView(
            id=n.id, capacity_vcpu=n.capacity_vcpu, capacity_memory_mb=n.capacity_memory_mb,
            used_vcpu=allocs.get(n.id, (0.0, 0))[0], used_memory_mb=allocs.get(n.id, (0.0, 0))[1],
            ready=n.state == "ready" and now - n.last_heartbeat_at < READY_WINDOW, draining=n.draining)
            for n in nodes]
        result = scheduler.place(scheduler.Request("", *BUILD_SHAPE), views, [LEAST_LOADED], filters=BUILD_FILTERS)
        if isinstance(result, scheduler.Unschedulable):
            raise errors.CapacityUnavailable(f"no node can build templates now: {result.explain()}",
                                             details={"reasons": result.reasons})
        return next(n for n in nodes if n.id == result.node_id)

    async def _run(self, name: str, spec: dict[str, Any], parent: NodeTemplateRef | None, key: str,
                   node: Any, body: NodeBuildRequest) -> AsyncIterator[bytes]:
        yield _event("status", message=f"building template {name} on node {node.name}")
        done: dict[str, Any] | None = None
        try:
            async with self.nodes.stream_build(node.url, body) as lines:
                async for line in lines:
                    try:
                        ev = json.loads(line)
                    except ValueError:
                        continue
                    if not isinstance(ev, dict):
                        continue
                    if ev.get("type") == "done":
                        done = ev
                    elif ev.get("type") == "error":
                        yield _event("error", error=ev.get("error"))
                        return
                    else:
                        yield (json.dumps(ev) + "\n").encode()
        except (errors.PillDropsError, httpx.HTTPError) as exc:
            err = exc if isinstance(exc, errors.PillDropsError) else errors.NodeUnavailable(
                f"the build on node {node.name} broke off: {exc!r}")
            yield _event("error", error=err.to_body()["error"])
            return
        if done is None:
            yield _event("error", error=errors.NodeUnavailable(
                f"the build on node {node.name} ended without a result").to_body()["error"])
            return
        try:
            row = await self._record(name, spec, parent, key, node, done)
        except errors.PillDropsError as exc:
            yield _event("error", error=exc.to_body()["error"])
            return
        ref = ref_of(row)
        self._current.put(name, ref)
        try:                 # the builder holds the layer already: now it knows the version, and reports it
            await self.nodes.hold_template(node.url, ref)
        except errors.PillDropsError as exc:
            log.warning("builder %s did not take template %s v%d: %s", node.name, name, row.version, exc)
        yield _event("status", message=f"stored template {name} v{row.version} "
                                       f"({row.size_bytes / 2**20:.1f} MiB, layer {ref.layers[0].digest[:19]})")
        try:
            await self.gc()
        except Exception:
            log.exception("template store gc failed")
        yield _event("done", cached=False, template=self._info(ref, [node.name], row).model_dump(mode="json"))

    async def _record(self, name: str, spec: dict[str, Any], parent: NodeTemplateRef | None, key: str,
                      node: Any, done: dict[str, Any]) -> TemplateVersionRecord:
        layer = NodeLayerRef.model_validate(done.get("layer"))
        if not self.blobs.has("layers", layer.digest) or self.blobs.size("layers", layer.digest) != layer.size:
            raise errors.TemplateBuildFailed(f"node {node.name} reported layer {layer.digest} but the "
                                             "template store does not hold it (upload failed?)")
        layers = [layer.model_dump(), *([x.model_dump() for x in parent.layers] if parent else [])]
        own = int(done.get("size_bytes") or layer.size)
        disk_mb, network = _defaults(spec)
        return await self.store.add_template_version(
            name=name, key=key, layers=layers, env=dict(done.get("env") or {}),
            workdir=str(done.get("workdir") or "/"), user=_opt_str(done.get("user")),
            home=_opt_str(done.get("home")), size_bytes=own + (parent.size_bytes if parent else 0),
            description=str(spec.get("description") or ""), isolation=spec.get("isolation"),
            disk_mb=disk_mb, network=network, parent=parent.name if parent else None, builder=node.name,
            build_seconds=float(done.get("build_seconds") or 0.0), built_at=self.clock.now())

    # ---- listing and garbage collection --------------------------------------------------------------

    def _info(self, ref: NodeTemplateRef, nodes: list[str], row: Any = None) -> TemplateInfo:
        return TemplateInfo(name=ref.name, description=getattr(row, "description", "") or "",
                            layers=[x.digest for x in ref.layers], size_bytes=ref.size_bytes,
                            built_at=ref.built_at, nodes=nodes, workdir=ref.workdir, isolation=ref.isolation,
                            disk_mb=ref.disk_mb, network=ref.network,
                            version=ref.version, digest=ref.layers[0].digest if ref.layers else None,
                            key=ref.key, build_seconds=getattr(row, "build_seconds", None),
                            builder=getattr(row, "builder", None))

    async def list(self, node_built: list[TemplateInfo]) -> list[TemplateInfo]:
        """Current store versions (with the nodes holding exactly that version), then node-built ones."""
        current: dict[str, Any] = {}
        for row in await self.store.template_versions():
            current.setdefault(row.name, row)
        holders: dict[str, list[str]] = {n: [] for n in current}
        for node in await self.store.list_nodes():
            for t in node.templates or []:
                row = current.get(t.get("name"))
                if row is not None and t.get("version") == row.version and node.name not in holders[row.name]:
                    holders[row.name].append(node.name)
        out = {n: self._info(ref_of(r), sorted(holders[n]), r) for n, r in current.items()}
        for t in node_built:
            if t.name not in out:
                out[t.name] = t
        return sorted(out.values(), key=lambda t: t.name)

    async def gc(self, min_age_s: float = 600.0) -> tuple[list[tuple[str, int]], list[str]]:
        """Drop versions that are neither current nor run by a sandbox that has not ended, then layers no
        remaining version uses (older than ``min_age_s``: a build in progress has uploaded but not yet
        recorded its layer) and contexts older than an hour. Returns what went."""
        in_use = await self.store.template_versions_in_use()
        rows = await self.store.template_versions()
        seen: set[str] = set()
        dropped: list[tuple[str, int]] = []
        keep_layers: set[str] = set()
        for row in rows:           # newest first per name: the first of each name is current
            current = row.name not in seen
            seen.add(row.name)
            if current or (row.name, row.version) in in_use:
                keep_layers.update(x["digest"] for x in row.layers)
            else:
                await self.store.delete_template_version(row.name, row.version)
                self._versions.pop((row.name, row.version), None)
                dropped.append((row.name, row.version))
        blobs = []
        cutoff = datetime.now().timestamp() - min_age_s
        for digest in self.blobs.digests("layers"):
            path = self.blobs.path("layers", digest)
            if digest not in keep_layers and path.stat().st_mtime < cutoff:
                self.blobs.delete("layers", digest)
                blobs.append(digest)
        for digest in self.blobs.digests("contexts"):    # contexts are only needed while a build runs
            if self.blobs.path("contexts", digest).stat().st_mtime < datetime.now().timestamp() - 3600:
                self.blobs.delete("contexts", digest)
        if dropped or blobs:
            log.info("template store gc: dropped versions %s, layers %s", dropped, blobs)
        return dropped, blobs
