"""Node API wire models: the only thing the control plane and the node agent share.

The node registers and heartbeats to the control plane (node token); the control plane asks the node to
create, kill and re-deadline sandboxes (same node token); the node reports sandbox events.
Times on the wire are UTC datetimes from the control plane's clock; the node keeps deadlines on its own.
"""

from __future__ import annotations

from datetime import datetime

from pydantic import BaseModel, ConfigDict, Field

from pilldrops.schema.api import EndReason, SandboxState, TemplateInfo


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class NodeRegister(_Model):
    name: str
    url: str = Field(..., description="base URL of the node API and data plane, as clients should reach it")
    capacity_vcpu: float
    capacity_memory_mb: int
    templates: list[TemplateInfo] = Field(default_factory=list)
    sandboxes: list["NodeSandboxStatus"] = Field(default_factory=list)
    version: str = ""
    instance: str = Field("", description="the agent's identity, kept in its state dir across restarts")


class NodeRegistered(_Model):
    node_id: str
    heartbeat_interval: float = 5.0


class NodeHeartbeat(_Model):
    templates: list[TemplateInfo] = Field(default_factory=list)
    sandboxes: list["NodeSandboxStatus"] = Field(default_factory=list)
    used_vcpu: float = 0
    used_memory_mb: int = 0


class NodeSandboxSpec(_Model):
    """What the control plane asks a node to start."""

    id: str
    template: str
    vcpu: float
    memory_mb: int
    end_at: datetime
    envs: dict[str, str] = Field(default_factory=dict)
    access_token: str
    team_id: str = ""
    timeout_s: float | None = Field(None, description="seconds from now; the node keeps the deadline on its "
                                                      "own clock (end_at is the control plane's view)")


class NodeSandboxStatus(_Model):
    id: str
    state: SandboxState
    pid: int | None = None
    started_at: datetime | None = None
    end_at: datetime | None = None
    ended_at: datetime | None = None
    end_reason: EndReason | None = None
    error: str | None = None
    # Usage: cumulative running seconds on the node's monotonic clock, and a sequence that only grows
    # (milliseconds of running time), so the control plane bills each report exactly once.
    run_s: float | None = None
    seq: int | None = None


class NodeDeadline(_Model):
    end_at: datetime
    timeout_s: float | None = None


class NodeEvent(_Model):
    """A state change the node saw on its own (deadline, init exit, OOM)."""

    sandbox: NodeSandboxStatus


NodeRegister.model_rebuild()
NodeHeartbeat.model_rebuild()
