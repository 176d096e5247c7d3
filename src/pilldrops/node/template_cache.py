"""The node's view of its templates, cached off the hot path, and what a sandbox spec becomes with them:
the runtime's ``SandboxSpec`` (layers, env, workdir) and the data plane's ``Target``.

Two kinds: templates built on this node (``templates.TemplateStore``, by name), and template-store
versions (issue 19) a sandbox spec names by ``template_ref``: their layers come from the control plane
into the ``LayerCache`` (``ensure`` fetches what is missing, verified by digest), each version apart, so a
rebuild never changes what a running sandbox stands on. The versions this node knows are remembered in
``<layer cache>/refs/`` (a restarted agent still reports them and re-adopts their sandboxes).
"""

from __future__ import annotations

import logging
import os
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Protocol

from pilldrops import errors
from pilldrops.node.dataplane import Target
from pilldrops.node.layers import LayerCache
from pilldrops.node.runtime.base import Handle, SandboxSpec, shared_env
from pilldrops.schema.api import DEFAULT_DISK_MB, TemplateInfo
from pilldrops.schema.node import NodeSandboxSpec, NodeTemplateRef

PIDS_LIMIT = 1024
log = logging.getLogger("pilldrops.node.templates")


@dataclass(frozen=True)
class StoredTemplate:
    """A template-store version on this node: its layer dirs (top first) and what its sandboxes see."""
    name: str
    layers: tuple[Path, ...]
    env: dict[str, str]
    workdir: str
    hash: str
    size: int = 0
    built_at: float = 0.0
    version: int = 0
    digests: tuple[str, ...] = field(default=())
    user: str | None = None            # "uid:gid" its commands run as (a Dockerfile's USER); None: root
    home: str | None = None


class Templates(Protocol):
    def get(self, name: str) -> Any: ...

    def list(self) -> list[Any]: ...


class TemplateCache:
    def __init__(self, templates: Templates, node_name: str, layers: LayerCache | None = None,
                 fetch: Callable[[str], Awaitable[AsyncIterator[bytes]]] | None = None) -> None:
        self.templates = templates
        self.node_name = node_name
        self.default_disk_mb = DEFAULT_DISK_MB     # the agent's setting: a spec without disk_mb gets it
        self._disk: dict[str, int | None] = {}     # template -> its spec's default disk_mb
        self._cache: dict[str, Any] = {}
        self.layers = layers
        self._fetch = fetch                     # digest -> its bytes from the control plane's store
        self._refs: dict[tuple[str, int], NodeTemplateRef] = {}
        self._load_refs()

    # ---- template-store versions -------------------------------------------------------------------

    def _refs_dir(self) -> Path | None:
        return self.layers.root / "refs" if self.layers is not None else None

    def _load_refs(self) -> None:
        d = self._refs_dir()
        if d is None or not d.is_dir():
            return
        for f in d.glob("*.json"):
            try:
                ref = NodeTemplateRef.model_validate_json(f.read_text())
            except (OSError, ValueError):
                continue
            self._refs[(ref.name, ref.version)] = ref

    def _remember(self, ref: NodeTemplateRef) -> None:
        if (ref.name, ref.version) in self._refs:
            return
        self._refs[(ref.name, ref.version)] = ref
        d = self._refs_dir()
        if d is not None:
            d.mkdir(parents=True, exist_ok=True)
            tmp = d / f".{ref.name}-{ref.version}.tmp"
            tmp.write_text(ref.model_dump_json())
            os.replace(tmp, d / f"{ref.name}-{ref.version}.json")

    def holds(self, ref: NodeTemplateRef) -> bool:
        return self.layers is not None and all(self.layers.has(x.digest) for x in ref.layers)

    async def ensure(self, ref: NodeTemplateRef | None) -> None:
        """Every layer of ``ref`` on this node: fetched (and verified) from the template store if missing."""
        if ref is None:
            return
        if self.layers is None or self._fetch is None:
            raise errors.TemplateNotFound(f"template {ref.name!r} v{ref.version} is in the template store, but "
                                          f"node {self.node_name} has no control plane to fetch it from")
        for layer in ref.layers:
            await self.layers.ensure(layer.digest, layer.size, self._fetch)
        self._remember(ref)

    def adopt_built(self, ref: NodeTemplateRef) -> None:
        """A version this node built itself (its own layer already in the cache)."""
        self._remember(ref)

    def stored(self, ref: NodeTemplateRef) -> StoredTemplate:
        if not self.holds(ref):
            raise errors.TemplateNotFound(f"template {ref.name!r} v{ref.version} is not on node {self.node_name} "
                                          "(its layers were not fetched)", details={"template": ref.name})
        assert self.layers is not None
        return StoredTemplate(name=ref.name, layers=tuple(self.layers.path(x.digest) for x in ref.layers),
                              env=dict(ref.env), workdir=ref.workdir or "/", hash=ref.key, size=ref.size_bytes,
                              built_at=ref.built_at.timestamp() if ref.built_at else 0.0, version=ref.version,
                              digests=tuple(x.digest for x in ref.layers), user=ref.user, home=ref.home)

    def latest_refs(self) -> dict[str, NodeTemplateRef]:
        """The newest version of each store template this node holds."""
        out: dict[str, NodeTemplateRef] = {}
        for (name, version), ref in sorted(self._refs.items()):
            if self.holds(ref):
                out[name] = ref
        return out

    def pooled_version(self, spec: NodeSandboxSpec) -> bool:
        """Whether a warm member of ``spec.template`` (made from the newest version held here) is of the
        version the create asks for: only then may it be claimed."""
        if spec.template_ref is None:
            return True
        tpl = self._cache.get(spec.template)
        return isinstance(tpl, StoredTemplate) and tpl.version == spec.template_ref.version

    def gc(self, in_use: Iterable[NodeTemplateRef], layer_paths: Iterable[str] = ()) -> list[str]:
        """Drop layers (and remembered versions) that neither a sandbox here, a warm member (its
        ``layer_paths``) nor the newest version of a template uses."""
        if self.layers is None:
            return []
        root = self.layers.root
        members = {"sha256:" + Path(p).parent.name for p in layer_paths if Path(p).parent.parent == root}
        keep_refs = {(r.name, r.version): r for r in [*in_use, *self.latest_refs().values()]}
        for key in list(self._refs):
            if key not in keep_refs:
                del self._refs[key]
                d = self._refs_dir()
                if d is not None:
                    (d / f"{key[0]}-{key[1]}.json").unlink(missing_ok=True)
        dropped = self.layers.gc({x.digest for r in keep_refs.values() for x in r.layers} | members)
        if dropped:
            log.info("dropped unused template layers %s", dropped)
        return dropped

    # ---- both kinds ---------------------------------------------------------------------------------

    def refresh(self) -> list[TemplateInfo]:
        """Re-read the built templates (off the hot path: at start and with each heartbeat)."""
        cache, infos = {}, []
        disk = {}
        stored = self.latest_refs()
        for name, ref in stored.items():
            t = self.stored(ref)
            cache[name] = t
            disk[name] = ref.disk_mb         # a warm member of it gets its default disk
            infos.append(TemplateInfo(name=name, layers=list(t.digests), size_bytes=t.size,
                                      built_at=ref.built_at, isolation=ref.isolation, workdir=ref.workdir,
                                      disk_mb=ref.disk_mb, network=ref.network,
                                      version=ref.version, digest=t.digests[0] if t.digests else None,
                                      key=ref.key))
        for st in self.templates.list():
            if st.name in stored:
                continue
            disk[st.name] = getattr(st, "disk_mb", None)
            if not getattr(st, "built", True):
                continue
            t = self.templates.get(st.name)
            cache[st.name] = t
            built = datetime.fromtimestamp(t.built_at, UTC) if t.built_at else None
            infos.append(TemplateInfo(name=st.name, description=getattr(st, "description", ""),
                                      layers=[str(p) for p in t.layers], size_bytes=t.size, built_at=built,
                                      isolation=getattr(st, "isolation", None),
                                      disk_mb=getattr(st, "disk_mb", None),
                                      network=getattr(st, "network", None),
                                      workdir=getattr(t, "workdir", None)))
        self._cache, self._disk = cache, disk
        return infos

    def get(self, name: str) -> Any:
        tpl = self._cache.get(name)
        if tpl is None:
            tpl = self._cache[name] = self.templates.get(name)
        return tpl

    def has(self, name: str) -> bool:
        return name in self._cache

    def store_version(self, name: str) -> str | None:
        """The template-store version of the template ``name`` held here (None: built on this node)."""
        tpl = self._cache.get(name)
        return str(tpl.version) if isinstance(tpl, StoredTemplate) else None

    def version(self, name: str) -> object:
        """What changes when the template is rebuilt (warm-pool members of an older build are replaced)."""
        tpl = self._cache.get(name)
        if tpl is None:
            return None
        return tuple(str(p) for p in tpl.layers), getattr(tpl, "built_at", None)

    def _for(self, spec: NodeSandboxSpec) -> Any:
        return self.stored(spec.template_ref) if spec.template_ref is not None else self.get(spec.template)

    def runtime_spec(self, spec: NodeSandboxSpec) -> SandboxSpec:
        try:
            tpl = self._for(spec)
        except Exception as exc:  # template stores raise their own errors
            raise errors.TemplateNotFound(f"template {spec.template!r} is not built on node "
                                          f"{self.node_name}: {exc}") from exc
        return SandboxSpec(id=spec.id, layers=tuple(Path(p) for p in tpl.layers), vcpu=spec.vcpu,
                           memory_mb=spec.memory_mb, pids_limit=PIDS_LIMIT,
                           envs={**_home(tpl), **dict(tpl.env), **spec.envs}, workdir=tpl.workdir or "/",
                           hostname=spec.id.replace("_", "-"), isolation=spec.isolation,
                           user=getattr(tpl, "user", None), disk_mb=self.disk_mb(spec))

    def disk_mb(self, spec: NodeSandboxSpec) -> int:
        """The spec's disk size: its own (the control plane resolved it), else its template's, else ours."""
        return spec.disk_mb or self._disk.get(spec.template) or self.default_disk_mb

    def target(self, spec: NodeSandboxSpec, handle: Handle) -> Target:
        tpl = self._for(spec)
        return Target(id=spec.id, handle=handle, env=shared_env({**_home(tpl), **dict(tpl.env), **spec.envs}),
                      workdir=tpl.workdir or "/", user=getattr(tpl, "user", None))


def _home(tpl: Any) -> dict[str, str]:
    """HOME of a template whose commands run as another user (its USER's home), unless its env sets one."""
    home = getattr(tpl, "home", None)
    return {"HOME": home} if getattr(tpl, "user", None) and home else {}
