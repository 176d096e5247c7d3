"""Isolation per sandbox on the control plane (issue 11): which mode a create runs in, and which nodes
can run it.

A sandbox's mode is, in order: the request's ``isolation``, the template's default (its spec's ``isolation``
key, as the nodes report it), the deployment's ``--default-isolation``, ``container``. A node reports at
registration what it probed for every mode (``NodeRegister.isolation``); a node that reported nothing (an
agent from before isolation modes) runs containers only. Placement rejects a node lacking the mode with the
reason the node gave: ``0/1 nodes fit: 1 no microvm (qemu-system-x86_64 not installed)``.
"""

from __future__ import annotations

from typing import Any

from pilldrops.schema.api import DEFAULT_ISOLATION, ISOLATION_MODES, IsolationSupport

CONTAINER_ONLY = {DEFAULT_ISOLATION: {"available": True, "reason": "", "detail": ""}}


def node_support(isolation: dict[str, Any] | None) -> dict[str, IsolationSupport]:
    """A node row's ``isolation`` column as models (None: an old agent, containers only)."""
    raw = isolation or CONTAINER_ONLY
    return {m: IsolationSupport.model_validate(v) for m, v in raw.items() if m in ISOLATION_MODES}


def offered(isolation: dict[str, Any] | None) -> tuple[frozenset[str], tuple[tuple[str, str], ...]]:
    """(modes the node runs, (mode, why not) for the others): what ``scheduler.NodeView`` carries."""
    sup = node_support(isolation)
    modes = frozenset(m for m, s in sup.items() if s.available)
    why = tuple((m, sup[m].reason if m in sup else "not reported by the node")
                for m in ISOLATION_MODES if m not in modes)
    return modes, why


def view_fields(isolation: dict[str, Any] | None) -> dict[str, Any]:
    """The ``scheduler.NodeView`` fields of a node row's ``isolation`` column."""
    modes, missing = offered(isolation)
    return {"isolation": modes, "isolation_missing": missing}


def template_default(nodes: list[Any], template: str) -> str | None:
    """The template's default mode as the nodes that have it report it (the first that names one)."""
    for n in nodes:
        for t in n.templates or []:
            if t.get("name") == template and t.get("isolation") in ISOLATION_MODES:
                return str(t["isolation"])
    return None


def template_disk_mb(nodes: list[Any], template: str) -> int | None:
    """The template's default disk size as the nodes that have it report it (the first that names one)."""
    for n in nodes:
        for t in n.templates or []:
            if t.get("name") == template and isinstance(t.get("disk_mb"), int) and t["disk_mb"] > 0:
                return int(t["disk_mb"])
    return None


def resolve(requested: str | None, nodes: list[Any], template: str, deployment_default: str,
            stored: str | None = None) -> str:
    """``stored``: the template store's version names its default (issue 19), before what nodes report."""
    return (requested or stored or template_default(nodes, template) or deployment_default
            or DEFAULT_ISOLATION)
