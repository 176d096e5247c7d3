"""Building a node agent on this host: prepared host, runtimes (one per isolation mode the host can run),
template store, agent, app.
Used by `pilldrops node` and `pilldrops up`. Needs root."""

from __future__ import annotations

import os
import re
import socket
from dataclasses import dataclass
from pathlib import Path

import anyio
from fastapi import FastAPI

from pilldrops.node.agent import NodeAgent, Settings, instance_id
from pilldrops.node.api import create_node_app
from pilldrops.node.isolation.diskspares import DiskSpares
from pilldrops.node.isolation.host import prepare_host
from pilldrops.node.runtime.registry import RuntimeRegistry
from pilldrops.node.templates import TemplateStore, default_spec_dirs


@dataclass
class Node:
    agent: NodeAgent
    app: FastAPI
    runtime: RuntimeRegistry
    templates: TemplateStore
    spares: DiskSpares | None = None

    async def aclose(self) -> None:
        await self.agent.shutdown()
        if self.spares is not None:        # never outlive the agent, even when its sandboxes do
            await anyio.to_thread.run_sync(self.spares.close)
        if not self.agent.settings.keep_on_exit:
            await self.runtime.close()


def default_node_name() -> str:
    return re.sub(r"[^a-z0-9-]", "-", socket.gethostname().lower())[:40] or "node"


def build_node(settings: Settings, data_dir: Path, templates_dirs: tuple[Path, ...] = ()) -> Node:
    if os.geteuid() != 0:
        raise PermissionError("the node agent needs root (cgroups, mounts, namespaces): run it as root")
    prepare_host()
    templates = TemplateStore(data_dir, spec_dirs=default_spec_dirs(templates_dirs))
    safe = re.sub(r"[^a-zA-Z0-9_-]", "-", settings.name)[:40]
    # the cgroup parent is this agent's own (name + instance), never shared with another agent on the host
    # the crun runtime keeps <data_dir>/node; gVisor and microVM runtimes get <data_dir>/node/runtimes/<mode>
    runtime = RuntimeRegistry.build(data_dir / "node", name=f"{safe}-{instance_id(data_dir / 'node')[:8]}")
    agent = NodeAgent(settings, runtime, templates, data_dir / "node")
    # ready disks per size for cold creates of containers (isolation.diskspares; 0 turns them off)
    spares = getattr(runtime.runtimes.get("container"), "disk_spares", None)
    if spares is not None:
        spares.keep = spare_disks()
    return Node(agent, create_node_app(agent, settings.node_token), runtime, templates, spares)


def spare_disks() -> int:
    """``PILLDROPS_DISK_SPARES``: ready disks kept per size (default 2)."""
    try:
        return max(0, int(os.environ.get("PILLDROPS_DISK_SPARES", "2")))
    except ValueError:
        return 2
