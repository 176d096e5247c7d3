"""The node's view of its built templates, cached off the hot path, and what a sandbox spec becomes with them:
the runtime's ``SandboxSpec`` (layers, env, workdir) and the data plane's ``Target``."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Protocol

from pilldrops import errors
from pilldrops.node.dataplane import Target
from pilldrops.node.runtime.base import Handle, SandboxSpec
from pilldrops.schema.api import TemplateInfo
from pilldrops.schema.node import NodeSandboxSpec

PIDS_LIMIT = 1024


class Templates(Protocol):
    def get(self, name: str) -> Any: ...

    def list(self) -> list[Any]: ...


class TemplateCache:
    def __init__(self, templates: Templates, node_name: str) -> None:
        self.templates = templates
        self.node_name = node_name
        self._cache: dict[str, Any] = {}

    def refresh(self) -> list[TemplateInfo]:
        """Re-read the built templates (off the hot path: at start and with each heartbeat)."""
        cache, infos = {}, []
        for st in self.templates.list():
            if not getattr(st, "built", True):
                continue
            t = self.templates.get(st.name)
            cache[st.name] = t
            built = datetime.fromtimestamp(t.built_at, UTC) if t.built_at else None
            infos.append(TemplateInfo(name=st.name, description=getattr(st, "description", ""),
                                      layers=[str(p) for p in t.layers], size_bytes=t.size, built_at=built,
                                      isolation=getattr(st, "isolation", None),
                                      workdir=getattr(t, "workdir", None)))
        self._cache = cache
        return infos

    def get(self, name: str) -> Any:
        tpl = self._cache.get(name)
        if tpl is None:
            tpl = self._cache[name] = self.templates.get(name)
        return tpl

    def has(self, name: str) -> bool:
        return name in self._cache

    def version(self, name: str) -> object:
        """What changes when the template is rebuilt (warm-pool members of an older build are replaced)."""
        tpl = self._cache.get(name)
        if tpl is None:
            return None
        return tuple(str(p) for p in tpl.layers), getattr(tpl, "built_at", None)

    def runtime_spec(self, spec: NodeSandboxSpec) -> SandboxSpec:
        try:
            tpl = self.get(spec.template)
        except Exception as exc:  # template stores raise their own errors
            raise errors.TemplateNotFound(f"template {spec.template!r} is not built on node "
                                          f"{self.node_name}: {exc}") from exc
        return SandboxSpec(id=spec.id, layers=tuple(Path(p) for p in tpl.layers), vcpu=spec.vcpu,
                           memory_mb=spec.memory_mb, pids_limit=PIDS_LIMIT,
                           envs={**_home(tpl), **dict(tpl.env), **spec.envs}, workdir=tpl.workdir or "/",
                           hostname=spec.id.replace("_", "-"), isolation=spec.isolation,
                           user=getattr(tpl, "user", None))

    def target(self, spec: NodeSandboxSpec, handle: Handle) -> Target:
        tpl = self.get(spec.template)
        return Target(id=spec.id, handle=handle, env={**_home(tpl), **dict(tpl.env), **spec.envs},
                      workdir=tpl.workdir or "/", user=getattr(tpl, "user", None))


def _home(tpl: Any) -> dict[str, str]:
    """HOME of a template whose commands run as another user (its USER's home), unless its env sets one."""
    home = getattr(tpl, "home", None)
    return {"HOME": home} if getattr(tpl, "user", None) and home else {}
