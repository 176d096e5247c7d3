"""Node API wire models: the only thing the control plane and the node agent share.

The node registers and heartbeats to the control plane (node token); the control plane asks the node to
create, kill and re-deadline sandboxes (same node token); the node reports sandbox events.
Times on the wire are UTC datetimes from the control plane's clock; the node keeps deadlines on its own.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from datetime import datetime
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from pilldrops.schema.api import (
    DEFAULT_ISOLATION,
    EndReason,
    IsolationSupport,
    SandboxState,
    TemplateInfo,
    TemplateNetwork,
    refuse_nul,
)


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class NodeRegister(_Model):
    name: str
    url: str = Field(..., description="base URL of the node API and data plane, as clients should reach it")
    capacity_vcpu: float
    capacity_memory_mb: int
    templates: list[TemplateInfo] = Field(default_factory=list)
    sandboxes: list[NodeSandboxStatus] = Field(default_factory=list)
    version: str = ""
    instance: str = Field("", description="the agent's identity, kept in its state dir across restarts")
    isolation: dict[str, IsolationSupport] = Field(
        default_factory=dict, description="each isolation mode, probed at agent start; empty (an agent from "
                                          "before isolation modes): container only")
    ram_mb: int = Field(0, ge=0, exclude_if=lambda v: not v, description="the host's RAM in MiB: no sandbox's memory_mb may be more "
                                            "(capacity_memory_mb overcommits it); 0: unknown (an older agent)")

    @field_validator("name", "url", "instance")
    @classmethod
    def _no_nul(cls, v: str) -> str:
        refuse_nul((v,), "a node's name, url and instance")
        return v


class NodePoolSpec(_Model):
    """A warm pool every node with the template keeps: ``size`` ready sandboxes of this shape. With
    ``network`` its members are made with that egress already attached, and only a create of the same
    shape and the same policy (``network_key``) claims one; without, members are loopback only."""

    template: str
    vcpu: float
    memory_mb: int
    size: int = Field(..., ge=0)
    # left out when None: agents and control planes from before per-policy pools (extra="forbid") keep
    # understanding loopback-only pools
    network: NodeNetwork | None = Field(None, exclude_if=lambda v: v is None)


class NodeGrant(_Model):
    """A ready warm-pool member, pre-issued to the control plane: a create of its shape may be answered
    with it from memory (one store write), and the node is told afterwards (a create with this ``id``)."""

    id: str                            # the sandbox id it becomes
    access_token: str                  # its data-plane token (the node checks the create carries it)
    template_version: str | None = None   # a template-store version it was made from (None: node-built)
    # the member's disk (MiB; its runtime spec's): a control plane claims it only for a create whose disk_mb
    # is this (None: an older node that did not say; excluded then, for older control planes)
    disk_mb: int | None = Field(None, exclude_if=lambda v: v is None)


class NodePoolStatus(NodePoolSpec):
    grants: list[NodeGrant] = Field(default_factory=list)   # heartbeats only (never in API views)
    ready: int = 0
    starting: int = 0
    hits: int = 0
    misses: int = 0
    failures: int = 0                  # consecutive failed refills
    breaker_open: bool = False         # refills paused after repeated failures (retried after a back-off)
    last_error: str | None = None


class NodeRegistered(_Model):
    node_id: str
    heartbeat_interval: float = 5.0
    pools: list[NodePoolSpec] = Field(default_factory=list)


class NodeHeartbeatReply(_Model):
    ok: bool = True
    pools: list[NodePoolSpec] = Field(default_factory=list)
    # delta heartbeats (issue 15), only to a node whose heartbeat carried a ``digest`` (an older node's reply
    # stays as it was: extra="forbid" there). ``epoch``: this control-plane process (a delta beat names the
    # epoch that acked its baseline); ``full``: send a full beat now (no baseline here, a digest that did not
    # match, or the periodic safety net); ``usage_every_s``: how much new running time makes a sandbox's
    # usage due (billing's commit cadence)
    epoch: str | None = Field(None, exclude_if=lambda v: v is None)
    full: bool = Field(False, exclude_if=lambda v: not v)
    usage_every_s: float | None = Field(None, exclude_if=lambda v: v is None)
    want: list[str] = Field(default_factory=list, exclude_if=lambda v: not v)   # report these in the next delta


class NodeHeartbeat(_Model):
    templates: list[TemplateInfo] = Field(default_factory=list)
    sandboxes: list[NodeSandboxStatus] = Field(default_factory=list)
    used_vcpu: float = 0
    used_memory_mb: int = 0
    pools: list[NodePoolStatus] = Field(default_factory=list)
    # delta heartbeats (issue 15); all left out by older nodes, whose beats are full. ``count`` and ``digest``
    # (``live_digest``) are of every id the node reports (its sandboxes and undelivered ends), full beat or
    # delta. A delta (``delta_of``: the epoch that acked its baseline) carries only the sandboxes whose status
    # changed since the last acked beat, or whose usage is due, and ``gone``: ids it no longer reports.
    count: int | None = Field(None, ge=0, exclude_if=lambda v: v is None)
    digest: str | None = Field(None, exclude_if=lambda v: v is None)
    delta_of: str | None = Field(None, exclude_if=lambda v: v is None)
    gone: list[str] = Field(default_factory=list, exclude_if=lambda v: not v)


def id_hash(sandbox_id: str) -> int:
    """One id's part of a ``live_digest`` (64 bits)."""
    return int.from_bytes(hashlib.blake2b(sandbox_id.encode(), digest_size=8).digest(), "big")


def live_digest(ids: Iterable[str] = (), acc: int = 0) -> str:
    """An order-independent digest of a set of sandbox ids: the XOR of their ``id_hash``es (so either side
    can keep it incrementally: XOR an id in when it appears, again when it goes), as 16 hex digits."""
    for i in ids:
        acc ^= id_hash(i)
    return f"{acc:016x}"


class NodeNetwork(TemplateNetwork):
    """A sandbox's egress as the node enforces it: its policy, plus the deployment's cap (``--egress-allow``:
    None means no cap; a sandbox never reaches outside the cap, whatever its own policy says)."""

    cap: list[str] | None = None


def network_key(net: TemplateNetwork | dict[str, Any] | None) -> str:
    """The identity of an egress policy, for matching a create to a warm pool: "" for loopback only (no
    internet, no ``allow_out``: a ``deny_out`` alone opens nothing), else the policy with its lists sorted
    (and the deployment's cap, when ``net`` carries one: a member made under another cap never matches)."""
    if net is None:
        return ""
    d = net if isinstance(net, dict) else net.model_dump()
    internet, allow = bool(d.get("allow_internet_access")), sorted(d.get("allow_out") or [])
    if not (internet or allow):
        return ""
    key = f"internet={int(internet)};allow={','.join(allow)};deny={','.join(sorted(d.get('deny_out') or []))}"
    cap = d.get("cap")
    return key if cap is None else f"{key};cap={','.join(sorted(cap))}"


class NodeLayerRef(_Model):
    digest: str = Field(..., pattern=r"^sha256:[0-9a-f]{64}$")
    size: int = Field(..., ge=0)


class NodeTemplateRef(_Model):
    """A template-store version a sandbox runs: the node fetches any layer it lacks from the control plane
    (``GET /internal/v1/templates/layers/{digest}``), verifying each digest before use."""

    name: str = Field(..., pattern=r"^[a-z0-9][a-z0-9_.-]{0,62}$")
    version: int = Field(..., ge=1)
    key: str
    layers: list[NodeLayerRef] = Field(..., min_length=1)          # top first (parents' layers after this template's own)
    env: dict[str, str] = Field(default_factory=dict)
    workdir: str = "/"
    user: str | None = None             # "uid:gid" commands run as (a Dockerfile's USER); None: root
    home: str | None = None
    isolation: str | None = None
    # its sandboxes' default disk size in MiB and egress (the spec's disk_mb and [network]); left out when
    # None, so agents from before these fields (extra="forbid") still take the other templates' creates
    disk_mb: int | None = Field(None, exclude_if=lambda v: v is None)
    network: TemplateNetwork | None = Field(None, exclude_if=lambda v: v is None)
    built_at: datetime | None = None
    size_bytes: int = 0


class NodeBuildRequest(_Model):
    """Build a spec document on this node (``POST /node/v1/templates/builds``): its parent's layers and the
    build context (by digest) are fetched from the control plane; the layer is uploaded back to it. The
    answer is an NDJSON stream: ``log`` events, then ``done`` (``layer``, ``env``, ``workdir``,
    ``build_seconds``) or ``error``."""

    spec: dict[str, Any]
    key: str
    context: str | None = None
    context_size: int = 0
    parent: NodeTemplateRef | None = None


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
    isolation: str = DEFAULT_ISOLATION
    disk_mb: int | None = Field(None, description="the writable layer's size in MiB (None: the node's default)")
    network: NodeNetwork | None = Field(None, description="egress (issue 14); None: loopback only")
    template_ref: NodeTemplateRef | None = None   # a template-store version (None: one built on the node)
    claimed_s: float | None = Field(
        None, ge=0, exclude_if=lambda v: v is None,
        description="a pre-issued warm member's hand-over (issue 15): seconds since the control plane recorded "
                    "the claim, so the node's running seconds count from the claim, never from the hand-over "
                    "(which comes after the answer) nor from before it (the member's pool time)")


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
    checkpoint_bytes: int | None = None     # paused: the checkpoint's size on this node's disk
    disk_used_bytes: int | None = None      # running: bytes in its writable layer (None: no disk quota)
    timeout_left: float | None = None       # paused: seconds its deadline had left when it was paused


class NodeKillMany(_Model):
    """Kill these sandboxes (``POST /node/v1/sandboxes/kill``): one call for many."""
    ids: list[str] = Field(..., max_length=1000)


class NodeKilled(_Model):
    """One sandbox of a ``NodeKillMany``: its final status, or (not on this node) neither, or an error."""
    id: str
    status: NodeSandboxStatus | None = None
    error_code: str | None = None
    error: str | None = None


class NodeKilledMany(_Model):
    items: list[NodeKilled]


class NodeDeadline(_Model):
    end_at: datetime
    timeout_s: float | None = None


class NodeResume(_Model):
    """Resume a paused sandbox here: from this node's own checkpoint, or fetched from ``source_url`` (the
    node that paused it, same node token) when it moves. ``run_s`` is the running time already billed,
    so usage reports continue from it; ``timeout_s`` is the time left (paused time does not count)."""

    spec: NodeSandboxSpec
    run_s: float = 0.0
    timeout_s: float
    source_url: str | None = None


class NodeEvent(_Model):
    """A state change the node saw on its own (deadline, init exit, OOM)."""

    sandbox: NodeSandboxStatus


NodeRegister.model_rebuild()
NodeHeartbeat.model_rebuild()


# The port tunnel (node data plane ``WS /v1/sandboxes/{id}/ports/{port}``, ``node.portforward``): once the
# connection inside the sandbox is made the node sends this one text message, then only bytes; a failure is
# a close with one of these codes.
PORT_TUNNEL_READY = "connected"
PORT_TUNNEL_REFUSED = 4502       # nothing listens on that port in the sandbox
PORT_TUNNEL_GONE = 4404          # the sandbox (or its init) is gone
