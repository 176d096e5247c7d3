"""Tables. Times are stored as naive UTC and always returned timezone-aware (``UTCDateTime``)."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    String,
    Text,
    TypeDecorator,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column


class UTCDateTime(TypeDecorator[datetime]):
    impl = DateTime
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Any) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError("naive datetime given to the store")
        return value.astimezone(UTC).replace(tzinfo=None)

    def process_result_value(self, value: datetime | None, dialect: Any) -> datetime | None:
        return value.replace(tzinfo=UTC) if value is not None else None


class Base(DeclarativeBase):
    pass


class Team(Base):
    __tablename__ = "teams"
    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    name: Mapped[str] = mapped_column(String(128), unique=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime())
    credits_usd: Mapped[float] = mapped_column(Float, default=5.0)
    credits_exhausted_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)


class ApiKey(Base):
    __tablename__ = "api_keys"
    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    team_id: Mapped[str] = mapped_column(ForeignKey("teams.id"), index=True)
    name: Mapped[str] = mapped_column(String(128))
    prefix: Mapped[str] = mapped_column(String(16))
    key_hash: Mapped[str] = mapped_column(String(64), unique=True)
    admin: Mapped[bool] = mapped_column(default=False)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime())
    revoked_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)
    last_used_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)


class Node(Base):
    __tablename__ = "nodes"
    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    name: Mapped[str] = mapped_column(String(128), unique=True)
    instance: Mapped[str | None] = mapped_column(String(64), nullable=True)
    url: Mapped[str] = mapped_column(String(512))
    capacity_vcpu: Mapped[float] = mapped_column(Float)
    capacity_memory_mb: Mapped[int] = mapped_column(Integer)
    ram_mb: Mapped[int | None] = mapped_column(Integer, nullable=True)   # the host's RAM (None: not reported)
    state: Mapped[str] = mapped_column(String(16))
    draining: Mapped[bool] = mapped_column(default=False)
    templates: Mapped[list[Any]] = mapped_column(JSON, default=list)
    registered_at: Mapped[datetime] = mapped_column(UTCDateTime())
    last_heartbeat_at: Mapped[datetime] = mapped_column(UTCDateTime())
    pool_status: Mapped[list[Any] | None] = mapped_column(JSON, nullable=True)   # the node's last report
    # mode -> {"available", "reason", "detail"} as probed at its agent's start; None: container only
    isolation: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)


class Pool(Base):
    """A warm pool: every node with the template keeps ``size`` ready sandboxes of this shape and policy."""

    __tablename__ = "pools"
    template: Mapped[str] = mapped_column(String(128), primary_key=True)
    vcpu: Mapped[float] = mapped_column(Float, primary_key=True)
    memory_mb: Mapped[int] = mapped_column(Integer, primary_key=True)
    # the egress policy its members are made with: "" loopback only, else a digest of ``network_key``
    network_id: Mapped[str] = mapped_column(String(64), primary_key=True, default="", server_default="")
    network: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)   # as a sandbox's policy
    size: Mapped[int] = mapped_column(Integer)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime())


class Sandbox(Base):
    __tablename__ = "sandboxes"
    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    team_id: Mapped[str] = mapped_column(ForeignKey("teams.id"))
    template: Mapped[str] = mapped_column(String(128))
    isolation: Mapped[str] = mapped_column(String(16), default="container", server_default="container")
    disk_mb: Mapped[int | None] = mapped_column(Integer, nullable=True)
    network: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)   # egress policy (issue 14)
    template_version: Mapped[int | None] = mapped_column(Integer, nullable=True)   # of the template store
    vcpu: Mapped[float] = mapped_column(Float)
    memory_mb: Mapped[int] = mapped_column(Integer)
    timeout: Mapped[int] = mapped_column(Integer)
    state: Mapped[str] = mapped_column(String(16), index=True)
    end_reason: Mapped[str | None] = mapped_column(String(32), nullable=True)
    error: Mapped[str | None] = mapped_column(Text, nullable=True)
    metadata_: Mapped[dict[str, str]] = mapped_column("metadata", JSON, default=dict)
    envs: Mapped[dict[str, str]] = mapped_column(JSON, default=dict)
    node_id: Mapped[str | None] = mapped_column(String(40), nullable=True, index=True)
    access_token: Mapped[str] = mapped_column(String(64))
    idempotency_key: Mapped[str | None] = mapped_column(String(256), nullable=True)
    request_hash: Mapped[str | None] = mapped_column(String(64), nullable=True)
    # when a retry with its idempotency key was first handed this sandbox: a batch whose client left kills
    # only what nobody was handed (``Store.release_unclaimed_key``)
    replayed_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime())
    started_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)
    end_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)
    ended_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)
    # usage committed so far (the ledger's sums), and how far the node's running clock was billed
    vcpu_s: Mapped[float] = mapped_column(Float, default=0.0)
    gb_s: Mapped[float] = mapped_column(Float, default=0.0)
    storage_gb_s: Mapped[float] = mapped_column(Float, default=0.0)
    cost_usd: Mapped[float] = mapped_column(Float, default=0.0)
    billed_run_s: Mapped[float] = mapped_column(Float, default=0.0)
    billed_seq: Mapped[int] = mapped_column(BigInteger, default=0)
    # pause: the current one (None while not paused), the timeout left for after resume, and totals
    paused_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)
    checkpoint_bytes: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    timeout_left: Mapped[float | None] = mapped_column(Float, nullable=True)
    paused_s: Mapped[float] = mapped_column(Float, default=0.0)
    pause_count: Mapped[int] = mapped_column(Integer, default=0)
    op_started_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)   # pausing/resuming since
    # ports served by URL without a token (issue 14); ``public``: every port
    public_ports: Mapped[list[int] | None] = mapped_column(JSON, nullable=True)
    public: Mapped[bool] = mapped_column(default=False)

    __table_args__ = (
        Index("ix_sandboxes_team_created", "team_id", "created_at", "id"),
        Index("ix_sandboxes_state_paused", "state", "paused_at"),
        Index("ux_sandboxes_team_idem", "team_id", "idempotency_key", unique=True),
    )


class ServerSecret(Base):
    """Secrets every control-plane process of a deployment shares (e.g. the key that signs port URLs),
    made once by whichever process needs one first."""

    __tablename__ = "server_secrets"
    name: Mapped[str] = mapped_column(String(64), primary_key=True)
    value: Mapped[str] = mapped_column(String(256))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime())


class SandboxLabel(Base):
    """Metadata as rows, so ``metadata.<k>=<v>`` filters are indexed and portable across SQLite/PostgreSQL."""

    __tablename__ = "sandbox_labels"
    sandbox_id: Mapped[str] = mapped_column(ForeignKey("sandboxes.id", ondelete="CASCADE"), primary_key=True)
    key: Mapped[str] = mapped_column(String(256), primary_key=True)
    value: Mapped[str] = mapped_column(Text)

    __table_args__ = (Index("ix_labels_key_value", "key", "value"),)


class SandboxPause(Base):
    """One paused interval of a sandbox (``idx`` counts from 1). Its storage is billed exactly once, when
    the interval closes (resume, kill or expiry), as the ledger row ``(sandbox, seq = -idx)``."""

    __tablename__ = "sandbox_pauses"
    sandbox_id: Mapped[str] = mapped_column(ForeignKey("sandboxes.id", ondelete="CASCADE"), primary_key=True)
    idx: Mapped[int] = mapped_column(Integer, primary_key=True)
    node_id: Mapped[str | None] = mapped_column(String(40), nullable=True)
    paused_at: Mapped[datetime] = mapped_column(UTCDateTime())
    resumed_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)
    checkpoint_bytes: Mapped[int] = mapped_column(BigInteger)
    storage_gb_s: Mapped[float] = mapped_column(Float, default=0.0)


class UsageEntry(Base):
    """One billed interval of one sandbox. The key (sandbox, seq) makes every report count exactly once."""

    __tablename__ = "usage_ledger"
    sandbox_id: Mapped[str] = mapped_column(ForeignKey("sandboxes.id", ondelete="CASCADE"), primary_key=True)
    seq: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    team_id: Mapped[str] = mapped_column(String(40))
    state: Mapped[str] = mapped_column(String(16))
    vcpu: Mapped[float] = mapped_column(Float)
    memory_mb: Mapped[int] = mapped_column(Integer)
    storage_gb: Mapped[float] = mapped_column(Float)
    from_s: Mapped[float] = mapped_column(Float)
    to_s: Mapped[float] = mapped_column(Float)
    vcpu_s: Mapped[float] = mapped_column(Float)
    gb_s: Mapped[float] = mapped_column(Float)
    storage_gb_s: Mapped[float] = mapped_column(Float)
    cost_usd: Mapped[float] = mapped_column(Float)
    committed_at: Mapped[datetime] = mapped_column(UTCDateTime())

    __table_args__ = (Index("ix_ledger_team_committed", "team_id", "committed_at"),)


class TemplateVersion(Base):
    """One build of a template in the template store (issue 19): its layers by digest (top first, the
    parents' included), what sandboxes of it see, and where and how long it was built. ``key`` is the
    cache key (the spec document, the parent's key and the build context's digest, hashed): the same key
    is never built twice. The highest version of a name is its current one."""

    __tablename__ = "template_versions"
    name: Mapped[str] = mapped_column(String(128), primary_key=True)
    version: Mapped[int] = mapped_column(Integer, primary_key=True)
    key: Mapped[str] = mapped_column(String(80), index=True)
    layers: Mapped[list[Any]] = mapped_column(JSON)              # [{"digest", "size"}], top first
    env: Mapped[dict[str, str]] = mapped_column(JSON, default=dict)
    workdir: Mapped[str] = mapped_column(String(1024), default="/")
    user: Mapped[str | None] = mapped_column(String(64), nullable=True)     # "uid:gid" (a Dockerfile's USER)
    home: Mapped[str | None] = mapped_column(String(1024), nullable=True)
    size_bytes: Mapped[int] = mapped_column(BigInteger, default=0)
    description: Mapped[str] = mapped_column(Text, default="")
    isolation: Mapped[str | None] = mapped_column(String(16), nullable=True)
    disk_mb: Mapped[int | None] = mapped_column(Integer, nullable=True)            # its sandboxes' defaults:
    network: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)    # disk size and [network]
    parent: Mapped[str | None] = mapped_column(String(128), nullable=True)
    builder: Mapped[str | None] = mapped_column(String(128), nullable=True)
    build_seconds: Mapped[float] = mapped_column(Float, default=0.0)
    built_at: Mapped[datetime] = mapped_column(UTCDateTime())
