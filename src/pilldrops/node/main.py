"""Building a node agent on this host: prepared host, runtimes (one per isolation mode the host can run),
template store, agent, app.
Used by `pilldrops node` and `pilldrops up`. Needs root."""

from __future__ import annotations

import os
import re
import resource
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
        if not self.agent.settings.keep_on_exit:
            await self.runtime.close()      # its spare disks too
        elif self.spares is not None:       # the sandboxes outlive the agent; its spare disks never do
            await anyio.to_thread.run_sync(self.spares.close)


def default_node_name() -> str:
    return re.sub(r"[^a-z0-9-]", "-", socket.gethostname().lower())[:40] or "node"


def build_node(settings: Settings, data_dir: Path, templates_dirs: tuple[Path, ...] = ()) -> Node:
    if os.geteuid() != 0:
        raise PermissionError("the node agent needs root (cgroups, mounts, namespaces): run it as root")
    prepare_host()
    raise_nofile()
    templates = TemplateStore(data_dir, spec_dirs=default_spec_dirs(templates_dirs))
    safe = re.sub(r"[^a-zA-Z0-9_-]", "-", settings.name)[:40]
    # the cgroup parent is this agent's own (name + instance), never shared with another agent on the host
    # the crun runtime keeps <data_dir>/node; gVisor and microVM runtimes get <data_dir>/node/runtimes/<mode>
    runtime = RuntimeRegistry.build(data_dir / "node", name=f"{safe}-{instance_id(data_dir / 'node')[:8]}")
    agent = NodeAgent(settings, runtime, templates, data_dir / "node")
    # ready disks per size for cold creates of containers (isolation.diskspares; 0 turns them off)
    spares = getattr(runtime.runtimes.get("container"), "disk_spares", None)
    if spares is not None:
        spares.reap()                       # a killed agent's, before anything else uses the host's loop devices
        spares.keep = spare_disks()
    return Node(agent, create_node_app(agent, settings.node_token), runtime, templates, spares)


def spare_disks() -> int:
    """``PILLDROPS_DISK_SPARES``: ready disks kept per size (default 2; 0 turns them off)."""
    raw = os.environ.get("PILLDROPS_DISK_SPARES", "2")
    try:
        n = int(raw)
    except ValueError:
        n = -1
    if n < 0:
        raise ValueError(f"PILLDROPS_DISK_SPARES must be a whole number >= 0 (0 turns spare disks off), not {raw!r}")
    return n


NOFILE_MAX = 65536


def raise_nofile() -> int:
    """The agent's soft RLIMIT_NOFILE raised towards its hard limit (at most ``NOFILE_MAX``): it holds
    descriptors per live sandbox (an idle control connection to each one's init, pipes of running
    commands), and a service manager's default soft limit (1,024) would run out before a thousand
    sandboxes. Returns the soft limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    # at most NOFILE_MAX: what the agent starts (crun, CRIU, runsc) inherits it, and CRIU sizes its own
    # descriptor table by it
    target = NOFILE_MAX if hard == resource.RLIM_INFINITY else min(hard, NOFILE_MAX)
    if target > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            return target
        except (ValueError, OSError):
            pass                # kept as it is (a container's limit): the spares then stop at EMFILE
    return soft
