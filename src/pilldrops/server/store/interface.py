"""What the services need from a store: the records they read and the operations they call.

Services are written against these ``Protocol`` types, never against the SQLAlchemy tables (``models``)
or the SQL store itself (``sql.Store`` satisfies ``Store`` structurally; a test double could too). Each
operation is one short transaction; none is held across a call to a node. State changes are
compare-and-set: they apply only while the row is in one of ``from_states`` (and return None / False
otherwise).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Protocol

from pilldrops.server.domain.billing import Rates

Allocations = dict[str, tuple[float, int]]        # node id -> (vCPU, MiB) held by its sandboxes


# ---- records ---------------------------------------------------------------------------------------------

class TeamRecord(Protocol):
    id: str
    name: str
    credits_usd: float


class ApiKeyRecord(Protocol):
    id: str
    team_id: str
    name: str
    prefix: str
    admin: bool
    created_at: datetime
    revoked_at: datetime | None
    last_used_at: datetime | None


class NodeRecord(Protocol):
    id: str
    name: str
    instance: str | None
    url: str
    capacity_vcpu: float
    capacity_memory_mb: int
    ram_mb: int | None                      # the host's RAM: no sandbox's memory_mb can be more
    state: str
    draining: bool
    templates: list[Any]
    last_heartbeat_at: datetime
    pool_status: list[Any] | None
    isolation: dict[str, Any] | None        # mode -> {available, reason, detail}; None: containers only


class PoolRecord(Protocol):
    template: str
    vcpu: float
    memory_mb: int
    network_id: str                          # "" loopback only, else the digest of the policy's key
    network: dict[str, Any] | None           # the members' egress policy, stored like a sandbox's
    size: int


class SandboxRecord(Protocol):
    id: str
    team_id: str
    template: str
    isolation: str
    network: dict[str, Any] | None          # egress policy (issue 14); None: loopback only
    template_version: int | None
    vcpu: float
    memory_mb: int
    disk_mb: int | None
    timeout: int
    state: str
    node_id: str | None
    metadata_: dict[str, str] | None
    envs: dict[str, str]
    access_token: str
    idempotency_key: str | None
    request_hash: str | None
    replayed_at: datetime | None
    error: str | None
    end_reason: str | None
    created_at: datetime
    started_at: datetime | None
    end_at: datetime | None
    ended_at: datetime | None
    op_started_at: datetime | None
    billed_seq: int
    billed_run_s: float
    vcpu_s: float
    gb_s: float
    storage_gb_s: float
    cost_usd: float
    paused_at: datetime | None
    paused_s: float | None
    pause_count: int | None
    checkpoint_bytes: int | None
    timeout_left: float | None
    public_ports: list[int] | None
    public: bool


class TemplateVersionRecord(Protocol):
    name: str
    version: int
    key: str
    layers: list[Any]          # [{"digest", "size"}], top first
    env: dict[str, str]
    workdir: str
    user: str | None
    home: str | None
    size_bytes: int
    description: str
    isolation: str | None
    disk_mb: int | None
    network: dict[str, Any] | None
    parent: str | None
    builder: str | None
    build_seconds: float
    built_at: datetime


class PauseRecord(Protocol):
    sandbox_id: str
    paused_at: datetime
    resumed_at: datetime | None
    checkpoint_bytes: int
    storage_gb_s: float


class UsageRecord(Protocol):
    team_id: str
    cost_usd: float


class PageOf(Protocol):
    items: list[Any]            # SandboxRecord
    next_cursor: str | None


@dataclass
class NewSandbox:
    """A sandbox to record (``place_and_insert`` picks its node and writes it in one transaction)."""
    id: str
    team_id: str
    template: str
    vcpu: float
    memory_mb: int
    timeout: int
    state: str
    access_token: str
    created_at: datetime
    end_at: datetime
    metadata: dict[str, str] = field(default_factory=dict)
    envs: dict[str, str] = field(default_factory=dict)
    idempotency_key: str | None = None
    request_hash: str | None = None
    isolation: str = "container"      # set by the placement's choose (it resolves the template's default)
    disk_mb: int | None = None        # set by the placement's choose too (the template's default, or the request's)
    network: dict[str, Any] | None = None   # egress policy, set by the placement's choose too (issue 14)
    template_version: int | None = None   # the template store's version it runs (None: a node-built template)
    public_ports: list[int] = field(default_factory=list)
    public: bool = False


Choose = Callable[[list[Any], Allocations], Any]     # (nodes, allocations) -> the chosen NodeRecord


@dataclass(frozen=True)
class EndSandbox:
    """One sandbox to end (``Store.end_sandboxes``): its new state and end reason, and the node's final
    usage report when the node answered one (``final``; ``seq``/``run_s`` None when it carried none)."""
    sandbox_id: str
    state: str
    end_reason: str
    final: bool = False
    seq: int | None = None
    run_s: float | None = None


@dataclass
class Ended:
    """What ``Store.end_sandboxes`` did: each sandbox's row after the transaction (ended, or as it was
    when it was not in ``from_states``; absent when there is no such row), the ledger rows of the final
    running usage it billed, and whether a paused interval's storage was charged."""
    rows: dict[str, Any] = field(default_factory=dict)          # id -> SandboxRecord
    entries: list[Any] = field(default_factory=list)            # UsageRecord
    ended: set[str] = field(default_factory=set)                 # the ids this call ended
    storage_charged: bool = False


class DuplicateIdempotencyKey(Exception):
    """``place_and_insert``: another sandbox of the team already holds this idempotency key."""


# ---- operations ------------------------------------------------------------------------------------------

class Store(Protocol):
    # teams and keys
    async def create_team(self, name: str, now: datetime, credits_usd: float = 5.0) -> TeamRecord: ...
    async def list_teams(self) -> list[Any]: ...
    async def get_team(self, team_id: str) -> TeamRecord | None: ...
    async def exhausted_teams(self, before: datetime) -> list[Any]: ...
    async def add_key(self, team_id: str, name: str, prefix: str, key_hash: str, now: datetime,
                      admin: bool = False) -> ApiKeyRecord: ...
    async def key_by_hash(self, key_hash: str) -> ApiKeyRecord | None: ...
    async def touch_key(self, key_id: str, now: datetime) -> None: ...
    async def list_keys(self, team_id: str) -> list[Any]: ...
    async def revoke_key(self, team_id: str, key_id: str, now: datetime) -> ApiKeyRecord | None: ...

    # nodes
    async def upsert_node(self, *, name: str, url: str, capacity_vcpu: float, capacity_memory_mb: int,
                          templates: list[dict[str, Any]], now: datetime, instance: str | None = None,
                          isolation: dict[str, Any] | None = None) -> NodeRecord: ...
    async def heartbeat(self, node_id: str, templates: list[dict[str, Any]], now: datetime,
                        pool_status: list[dict[str, Any]] | None = None) -> NodeRecord | None: ...
    async def get_node(self, node_id: str) -> NodeRecord | None: ...
    async def list_nodes(self) -> list[Any]: ...
    async def node_by_id_or_name(self, ref: str) -> NodeRecord | None: ...
    async def set_node(self, node_id: str, **values: Any) -> NodeRecord | None: ...
    async def live_counts(self) -> dict[str, int]: ...
    async def allocations(self) -> Allocations: ...

    # placement: choose with the node rows locked, record in the same transaction
    async def place_and_insert(self, new: NewSandbox, choose: Choose) -> tuple[NodeRecord, SandboxRecord]: ...
    async def insert_claimed(self, new: NewSandbox, node_id: str, started_at: datetime) -> SandboxRecord | None: ...
    async def place_existing(self, sandbox_id: str, from_state: str, choose: Choose) -> NodeRecord | None: ...

    # sandboxes
    async def get_sandbox(self, sandbox_id: str, team_id: str | None = None) -> SandboxRecord | None: ...
    async def get_sandboxes(self, ids: Iterable[str]) -> dict[str, Any]: ...
    async def sandbox_by_idempotency_key(self, team_id: str, key: str) -> SandboxRecord | None: ...
    async def list_sandboxes(self, team_id: str, *, states: Iterable[str] = (),
                             labels: dict[str, str] | None = None, limit: int = 100,
                             cursor: str | None = None, template: str | None = None,
                             since: datetime | None = None, until: datetime | None = None) -> PageOf: ...
    async def live_sandboxes_on(self, node_id: str) -> list[Any]: ...
    async def claim_replay(self, sandbox_id: str, key: str, now: datetime) -> bool: ...
    async def release_unclaimed_key(self, sandbox_id: str, key: str) -> bool: ...
    async def set_sandbox(self, sandbox_id: str, *, from_states: Iterable[str], **values: Any) -> bool: ...
    async def update_sandbox(self, sandbox_id: str, *, from_states: Iterable[str] | None = None,
                             not_paused: bool = False, **values: Any) -> SandboxRecord | None: ...

    # usage, pauses and the billing intervals
    async def commit_usage(self, sandbox_id: str, seq: int, run_s: float, *, now: datetime, rates: Rates,
                           charge_credits: bool, before_commit: Callable[[], None] | None = None
                           ) -> UsageRecord | None: ...
    async def commit_usage_many(self, reports: list[tuple[str, int, float]], *, now: datetime, rates: Rates,
                                charge_credits: bool, before_commit: Callable[[], None] | None = None
                                ) -> list[Any]: ...
    async def end_sandboxes(self, ends: list[EndSandbox], *, from_states: Iterable[str], now: datetime,
                            rates: Rates, charge_credits: bool, before_commit: Callable[[], None] | None = None
                            ) -> Ended: ...
    async def record_pause(self, sandbox_id: str, *, paused_at: datetime, checkpoint_bytes: int,
                           timeout_left: float) -> SandboxRecord | None: ...
    async def end_interval(self, sandbox_id: str, *, from_states: Iterable[str], until: datetime, rates: Rates,
                           charge_credits: bool, resumed: bool, **values: Any) -> SandboxRecord | None: ...
    async def pauses_of(self, sandbox_ids: Iterable[str]) -> dict[str, list[Any]]: ...
    async def paused_before(self, cutoff: datetime, limit: int = 500) -> list[Any]: ...
    async def usage_totals(self, team_id: str, since: datetime | None, until: datetime | None
                           ) -> tuple[int, float, float, float, float]: ...

    # the template store
    async def add_template_version(self, **values: Any) -> TemplateVersionRecord: ...
    async def template_versions(self, name: str | None = None) -> list[Any]: ...
    async def template_version(self, name: str, version: int | None = None) -> TemplateVersionRecord | None: ...
    async def template_versions_in_use(self) -> set[tuple[str, int]]: ...
    async def delete_template_version(self, name: str, version: int) -> None: ...
    # secrets the deployment's control-plane processes share
    async def shared_secret(self, name: str, new_value: str, now: datetime) -> str: ...

    # warm pools
    async def set_pool(self, template: str, vcpu: float, memory_mb: int, size: int, now: datetime,
                       network: dict[str, Any] | None = None, network_id: str = "") -> None: ...
    async def list_pools(self) -> list[Any]: ...
