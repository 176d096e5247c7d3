"""Public REST wire models: what the SDK, the CLI and the control plane exchange.

Pydantic only, no I/O. Requests forbid unknown fields so a typo is a 400, not silently ignored.
Units are in the names (``memory_mb``); ``timeout`` is in seconds everywhere.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable
from datetime import datetime
from enum import Enum
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, field_validator, model_validator

MAX_TIMEOUT_S = 86_400
DEFAULT_DISK_MB = 10_240        # a sandbox's writable layer when neither the request nor its template says
DEFAULT_MAX_DISK_MB = 102_400   # the largest a deployment allows unless `--max-disk-mb` says otherwise
DISK_MB_CAP = 4_194_304         # 4 TiB: the schema's bound; a deployment's own maximum is lower (--max-disk-mb)
MIN_DISK_MB = 16
DEFAULT_TIMEOUT_S = 300
MAX_BATCH = 1000
# The smallest CPU quota: the kernel's CFS floor is 1 ms per 100 ms period (0.01 core); below it crun fails
# the create and a quota rounding to 0 would mean no limit at all (and nothing billed).
MIN_VCPU = 0.01
DEFAULT_OUTPUT_CAP = 16 * 1024 * 1024
# Isolation per sandbox (issue 11): crun container (shared host kernel), gVisor (user-space kernel, runsc),
# QEMU microVM (own guest kernel). The one list of valid names; a request naming another is a 400.
ISOLATION_MODES: tuple[str, ...] = ("container", "gvisor", "microvm")
DEFAULT_ISOLATION = "container"
# Ports by URL (issue 14): a signed URL's default and longest life, and how many ports a create may make public
DEFAULT_URL_EXPIRES_S = 3600
MAX_URL_EXPIRES_S = 7 * 86_400
MAX_PUBLIC_PORTS = 64


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid")


# Egress (issue 14): a sandbox reaches nothing outside its own loopback unless its create asks for it.
MAX_EGRESS_RULES = 64


def check_cidrs(v: list[str], what: str) -> list[str]:
    """IPv4 CIDRs or addresses, normalised (``10.1.2.3`` -> ``10.1.2.3/32``, host bits cleared); at most
    ``MAX_EGRESS_RULES``. IPv6 is refused: sandboxes get no IPv6 route."""
    if len(v) > MAX_EGRESS_RULES:
        raise ValueError(f"at most {MAX_EGRESS_RULES} {what} entries")
    out: list[str] = []
    for item in v:
        try:
            net = ipaddress.ip_network(str(item).strip(), strict=False)
        except ValueError:
            raise ValueError(f"{what}: {item!r} is not an IP address or CIDR") from None
        if net.version != 4:
            raise ValueError(f"{what}: {item!r} is IPv6; sandbox egress is IPv4 only")
        if str(net) not in out:
            out.append(str(net))
    return out


class NetworkPolicy(BaseModel):
    """Where a sandbox may connect to besides its own loopback. ``allow_out`` is reachable even when
    ``allow_internet_access`` is off; ``deny_out`` is cut out of the internet; allow wins over deny (as E2B).
    Never reachable whatever the policy: the node itself, other sandboxes, 169.254.0.0/16."""

    model_config = ConfigDict(extra="forbid")
    allow_out: list[str] = Field(default_factory=list, description="IPv4 CIDRs or addresses always reachable")
    deny_out: list[str] = Field(default_factory=list, description="IPv4 CIDRs or addresses never reachable "
                                                                  "(unless also in allow_out)")

    @field_validator("allow_out")
    @classmethod
    def _allow(cls, v: list[str]) -> list[str]:
        return check_cidrs(v, "network.allow_out")

    @field_validator("deny_out")
    @classmethod
    def _deny(cls, v: list[str]) -> list[str]:
        return check_cidrs(v, "network.deny_out")


class TemplateNetwork(NetworkPolicy):
    """A template's ``[network]`` table: the default egress of its sandboxes (a create's own fields win)."""

    allow_internet_access: bool = False


class _Response(BaseModel):
    # Responses ignore unknown fields so an older SDK keeps working against a newer server.
    model_config = ConfigDict(extra="ignore")


class SandboxState(str, Enum):
    pending = "pending"
    starting = "starting"
    running = "running"
    pausing = "pausing"
    paused = "paused"
    resuming = "resuming"
    stopping = "stopping"
    stopped = "stopped"
    failed = "failed"
    lost = "lost"


#: States of a sandbox that has not ended: what listings show unless asked for ended ones too.
LIVE_STATES: tuple[SandboxState, ...] = (SandboxState.starting, SandboxState.running, SandboxState.pausing,
                                         SandboxState.paused, SandboxState.resuming)


class EndReason(str, Enum):
    killed = "killed"
    timeout = "timeout"
    oom = "oom"
    exited = "exited"
    node_lost = "node_lost"
    failed_start = "failed_start"
    evicted = "evicted"
    shutdown = "shutdown"
    credits_exhausted = "credits_exhausted"
    paused_expired = "paused_expired"


def _no_nul(v: str, what: str) -> str:
    if "\0" in v:
        raise ValueError(f"{what} must not contain NUL bytes")
    return v


def _check_env(v: dict[str, str]) -> dict[str, str]:
    for k, val in v.items():
        if not k or "=" in k or "\0" in k:
            raise ValueError(f"invalid environment variable name {k!r}")
        _no_nul(val, f"environment variable {k}")
    return v


def check_isolation(v: str | None) -> str | None:
    if v is not None and v not in ISOLATION_MODES:
        raise ValueError(f"unknown isolation mode {v!r}; valid modes: {', '.join(ISOLATION_MODES)}")
    return v


def check_ports(v: list[int]) -> list[int]:
    bad = [p for p in v if not 1 <= p <= 65535]
    if bad:
        raise ValueError(f"port {bad[0]} is out of range 1..65535")
    return sorted(set(v))


def refuse_nul(texts: Iterable[str], what: str) -> None:
    """ValueError when any of ``texts`` holds a NUL character: no name, id, metadata pair or environment
    variable can (the kernel's strings end at one, PostgreSQL's text refuses one)."""
    if any("\x00" in t for t in texts):
        raise ValueError(f"{what} cannot hold a NUL character")


def _check_string_map(v: dict[str, str], what: str, max_items: int = 128) -> dict[str, str]:
    if len(v) > max_items:
        raise ValueError(f"at most {max_items} {what} entries")
    for k, val in v.items():
        if not k or len(k) > 256:
            raise ValueError(f"{what} keys must be 1..256 characters")
        if len(val) > 8192:
            raise ValueError(f"{what} value for {k!r} is longer than 8192 characters")
        refuse_nul((k, val), f"{what} keys and values")
    return v


# the largest body a valid create can be (envs: 1,024 x (256 + 8,192) characters, metadata 128 x the same:
# ~9.7 M characters, up to 6 bytes each JSON-escaped: ~58 MB), with room: the raw create routes (control
# plane and node) refuse bigger ones unread (docs/api.md)
MAX_CREATE_BYTES = 64 * 1024 * 1024


class CreateSandboxRequest(_Request):
    template: str = Field("base", min_length=1, max_length=128, pattern=r"^[a-z0-9][a-z0-9._-]*$")
    vcpu: float = Field(1, ge=MIN_VCPU, le=64, description=f"CPU quota in cores (at least {MIN_VCPU})")
    memory_mb: int = Field(512, ge=16, le=262_144, description="memory limit in MiB, no swap")
    disk_mb: int | None = Field(None, ge=MIN_DISK_MB, le=DISK_MB_CAP,
                                description="size of the writable layer in MiB (writes past it fail with ENOSPC); "
                                            "default: the template's, else the deployment's (10240); past the "
                                            "deployment's maximum: 400 invalid_request")
    timeout: int = Field(DEFAULT_TIMEOUT_S, ge=1, le=MAX_TIMEOUT_S,
                         description="seconds until the sandbox is killed (max 86400)")
    metadata: dict[str, str] = Field(default_factory=dict)
    envs: dict[str, str] = Field(default_factory=dict)
    isolation: str | None = Field(None, description="container | gvisor | microvm; default: the template's, "
                                                    "else the deployment's (container)")
    allow_internet_access: bool = Field(False, description="egress to the internet (NAT through the node); "
                                                           "unset: the template's [network] default, else off")
    network: NetworkPolicy | None = Field(None, description="allow_out / deny_out CIDRs; unset: the template's")
    public_ports: list[int] = Field(default_factory=list, max_length=MAX_PUBLIC_PORTS,
                                    description="ports served by URL without a token (see POST .../urls)")
    public: bool = Field(False, description="every port is served by URL without a token")

    @field_validator("public_ports")
    @classmethod
    def _public_ports(cls, v: list[int]) -> list[int]:
        return check_ports(v)

    @field_validator("isolation")
    @classmethod
    def _isolation(cls, v: str | None) -> str | None:
        return check_isolation(v)

    @field_validator("metadata")
    @classmethod
    def _metadata(cls, v: dict[str, str]) -> dict[str, str]:
        return _check_string_map(v, "metadata")

    @field_validator("envs")
    @classmethod
    def _envs(cls, v: dict[str, str]) -> dict[str, str]:
        return _check_string_map(_check_env(v), "envs", max_items=1024)


class BatchCreateRequest(CreateSandboxRequest):
    """``count`` sandboxes of one spec. They queue on the server under admission control (and wait up to
    ``capacity_wait`` seconds for room) instead of failing fast; each succeeds or fails on its own."""

    count: int = Field(..., ge=1, le=MAX_BATCH)
    capacity_wait: float = Field(60.0, ge=0, le=600, description="seconds each item may wait for capacity")
    item_metadata: list[dict[str, str]] | None = Field(
        None, description="one dict per item (count of them), merged over metadata: each episode findable")

    @model_validator(mode="after")
    def _item_metadata(self) -> BatchCreateRequest:
        if self.item_metadata is not None:
            if len(self.item_metadata) != self.count:
                raise ValueError(f"item_metadata has {len(self.item_metadata)} entries for count {self.count}")
            for i, m in enumerate(self.item_metadata):
                _check_string_map({**self.metadata, **m}, f"item {i} metadata")
        return self

    def item_request(self, i: int) -> CreateSandboxRequest:
        """Item ``i`` as a single create (its own metadata merged over the shared one)."""
        extra = self.item_metadata[i] if self.item_metadata is not None else {}
        # exclude_unset: a field the batch left unset stays unset per item (the template's network default)
        return CreateSandboxRequest(**{**self.model_dump(exclude={"count", "capacity_wait", "item_metadata"},
                                                         exclude_unset=True),
                                       "metadata": {**self.metadata, **extra}})


class ErrorInfo(_Response):
    code: str
    message: str
    details: Any = None


class SandboxInfo(_Response):
    id: str
    template: str
    isolation: str = DEFAULT_ISOLATION
    allow_internet_access: bool = False
    network: NetworkPolicy | None = None
    state: SandboxState
    vcpu: float
    memory_mb: int
    timeout: int
    # Disk: the writable layer's limit, and the bytes it holds (the node's last report, every few seconds;
    # None before the first report, once ended, or on a node from before disk quotas)
    disk_mb: int | None = None
    disk_used_bytes: int | None = None
    metadata: dict[str, str] = Field(default_factory=dict)
    node_id: str | None = None
    created_at: datetime
    started_at: datetime | None = None
    end_at: datetime | None = None
    ended_at: datetime | None = None
    end_reason: EndReason | None = None
    error: str | None = None
    # Usage so far (running) or final (ended): vcpu_s = vcpu x running seconds, gb_s = memory GiB x running
    # seconds, storage_gb_s accrues only while paused; cost_usd from the deployment's rates.
    vcpu_s: float = 0.0
    gb_s: float = 0.0
    storage_gb_s: float = 0.0
    cost_usd: float = 0.0
    # Pause: when the current pause began, the checkpoint's size, and the timeout left for after resume.
    paused_at: datetime | None = None
    checkpoint_bytes: int | None = None
    timeout_left: float | None = None
    # Data plane: where the SDK talks to the sandbox directly, and the token it must present there.
    # Only returned by create and connect (never in listings).
    envd_url: str | None = None
    access_token: str | None = Field(default=None, repr=False)  # a secret: never in repr()/str()
    # Ports served by URL without a token (``public``: all of them).
    public_ports: list[int] = Field(default_factory=list)
    public: bool = False


class BatchItem(_Response):
    index: int
    sandbox: SandboxInfo | None = None     # with its access token, like a single create
    error: ErrorInfo | None = None


class BatchCreateResponse(_Response):
    items: list[BatchItem]
    created: int
    failed: int


class KillSandboxesRequest(_Request):
    """Kill many sandboxes in one call: by ``ids`` (up to ``MAX_BATCH``), or every live one whose
    metadata has all of ``labels``. Exactly one of the two."""

    ids: list[Annotated[str, StringConstraints(min_length=1, max_length=128)]] | None = Field(
        None, max_length=MAX_BATCH, description="sandbox ids (unknown ones: an item error)")
    labels: dict[str, str] | None = Field(None, max_length=32,
                                          description="kill every live sandbox with all these metadata pairs")

    @field_validator("labels")
    @classmethod
    def _labels(cls, v: dict[str, str] | None) -> dict[str, str] | None:
        if v is not None:
            refuse_nul((*v, *v.values()), "labels")
        return v


class KillItem(_Response):
    id: str
    sandbox: SandboxInfo | None = None     # its final record (state stopped, final cost), as a single kill
    error: ErrorInfo | None = None


class KillSandboxesResponse(_Response):
    items: list[KillItem]
    killed: int
    failed: int


class SandboxList(_Response):
    items: list[SandboxInfo]
    next_cursor: str | None = None


class SetTimeoutRequest(_Request):
    timeout: int = Field(..., ge=1, le=MAX_TIMEOUT_S, description="seconds from now")


class PortURLRequest(_Request):
    """A URL that reaches ``port`` inside the sandbox through the control plane (HTTP and WebSocket)."""

    port: int = Field(..., ge=1, le=65535)
    expires_in: int = Field(DEFAULT_URL_EXPIRES_S, ge=1, le=MAX_URL_EXPIRES_S,
                            description="seconds the URL's token stays valid (a public port's URL has none)")
    path: str = Field("/", max_length=4096, pattern=r"^/[^\s#]*$", description="path (and query) inside the sandbox")


class PortURL(_Response):
    url: str
    port: int
    expires_at: datetime | None = None      # None: a public port, served without a token
    public: bool = False


class RunRequest(_Request):
    cmd: str | list[str] = Field(..., description="a shell command line, or an argv list run without a shell")
    envs: dict[str, str] = Field(default_factory=dict)
    cwd: str | None = Field(None, max_length=4096)
    timeout: float | None = Field(None, gt=0, le=MAX_TIMEOUT_S, description="seconds; kills the process tree")
    stdin: str | None = Field(None, description="text fed to the command's stdin, then closed")
    max_output_bytes: int = Field(DEFAULT_OUTPUT_CAP, ge=1, le=256 * 1024 * 1024,
                                  description="cap per stream; output past it is dropped and truncated is set")

    @field_validator("cmd")
    @classmethod
    def _cmd(cls, v: str | list[str]) -> str | list[str]:
        if isinstance(v, list) and not v:
            raise ValueError("argv must not be empty")
        if isinstance(v, str) and not v.strip():
            raise ValueError("command must not be empty")
        for part in [v] if isinstance(v, str) else v:
            _no_nul(part, "the command")
        return v

    @field_validator("envs")
    @classmethod
    def _envs(cls, v: dict[str, str]) -> dict[str, str]:
        return _check_env(v)

    @field_validator("cwd")
    @classmethod
    def _cwd(cls, v: str | None) -> str | None:
        return None if v is None else _no_nul(v, "cwd")


class RunEvent(_Response):
    """One NDJSON line of a streamed run. ``data`` is base64 for stdout/stderr chunks."""

    type: Literal["start", "stdout", "stderr", "exit", "error"]
    pid: int | None = None
    data: str | None = None
    exit_code: int | None = None
    duration: float | None = None
    truncated: bool | None = None
    timed_out: bool | None = None
    paused: bool | None = None      # the sandbox was paused while the command ran: it was ended (exit 137)
    oom_killed: bool | None = None  # the sandbox's memory limit killed it (exit 137): memory_mb was exceeded
    code: str | None = None
    message: str | None = None


class FileInfo(_Response):
    name: str
    path: str
    type: Literal["file", "dir", "symlink", "other"]
    size: int
    mode: int
    mtime: float


class KeyCreateRequest(_Request):
    name: str = Field("default", min_length=1, max_length=128)

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        refuse_nul((v,), "a key's name")
        return v


class KeyInfo(_Response):
    id: str
    name: str
    team_id: str
    prefix: str
    created_at: datetime
    revoked_at: datetime | None = None
    last_used_at: datetime | None = None


class KeyCreated(KeyInfo):
    secret: str


class TemplateInfo(_Response):
    name: str
    description: str = ""
    layers: list[str] = Field(default_factory=list)
    size_bytes: int = 0
    built_at: datetime | None = None
    nodes: list[str] = Field(default_factory=list)
    workdir: str | None = None          # where commands start (the spec's workdir)
    isolation: str | None = None      # the template's default isolation mode (None: the deployment's)
    disk_mb: int | None = None        # the template's default disk size in MiB (None: the deployment's)
    network: TemplateNetwork | None = None   # the template's default egress ([network]; None: none)
    # the template store (issue 19): set for templates built once and shipped to the nodes
    version: int | None = None          # a rebuild is the next version; running sandboxes keep theirs
    digest: str | None = None           # the top layer's digest (sha256:...); ``layers`` then lists digests
    key: str | None = None              # the cache key: spec document + parent + context, hashed
    build_seconds: float | None = None
    builder: str | None = None          # the node that built it


class IsolationSupport(_Response):
    """Whether a node can run one isolation mode, probed when its agent starts."""

    available: bool
    reason: str = ""    # why not, e.g. "qemu-system-x86_64 not installed"
    detail: str = ""    # e.g. "tcg" / "kvm" (microvm), "ptrace" (gvisor)


class TemplateList(_Response):
    items: list[TemplateInfo]


class TemplateBuildRequest(BaseModel):
    """``POST /v1/templates/builds``: build a spec document (the TOML spec's table, as JSON) once, on a node
    the scheduler picks, into the template store. ``context`` names a build context uploaded before with
    ``PUT /v1/templates/contexts/{digest}`` (the files ``copy`` steps read, relative to its root)."""

    model_config = ConfigDict(extra="forbid")
    spec: dict[str, Any]
    context: str | None = Field(None, pattern=r"^sha256:[0-9a-f]{64}$")
    force: bool = False


class ContextUploaded(_Response):
    digest: str
    size: int


class WhoAmI(_Response):
    team_id: str
    team_name: str
    key_id: str


class PoolSetRequest(_Request):
    """Keep ``size`` ready sandboxes of this template and shape on every node that has the template
    (0 removes the pool). A pool is one template, shape AND egress policy: ``allow_internet_access`` /
    ``network`` as in a create (unset: the template's ``[network]`` default, resolved when the pool is set;
    checked against the deployment's ``--no-egress`` / ``--egress-allow`` like a create). Members of a pool
    with egress have it attached already, so a create with that policy claims one without any network set-up."""

    template: str = Field(..., min_length=1, max_length=128, pattern=r"^[a-z0-9][a-z0-9._-]*$")
    vcpu: float = Field(1, ge=MIN_VCPU, le=64)
    memory_mb: int = Field(512, ge=16, le=262_144)
    size: int = Field(..., ge=0, le=10_000)
    allow_internet_access: bool = Field(False, description="members' egress to the internet; unset: the template's")
    network: NetworkPolicy | None = Field(None, description="members' allow_out / deny_out; unset: the template's")


class PoolInfo(_Response):
    template: str
    vcpu: float
    memory_mb: int
    allow_internet_access: bool = False     # the members' egress policy (none: loopback only)
    network: NetworkPolicy | None = None
    size: int                       # per node
    nodes: int = 0                  # nodes that reported this pool
    ready: int = 0
    starting: int = 0
    hits: int = 0
    misses: int = 0
    hit_rate: float | None = None   # hits / (hits + misses), None before any create of this shape
    breaker_open: bool = False
    last_error: str | None = None


class PoolList(_Response):
    items: list[PoolInfo]


class PauseInterval(_Response):
    """One paused interval: billed as storage only (``storage_gb_s`` = checkpoint GiB x paused seconds)."""

    paused_at: datetime
    resumed_at: datetime | None = None    # None while still paused (or ended while paused: see ended_at)
    checkpoint_bytes: int
    storage_gb_s: float = 0.0


class HistoryRecord(_Response):
    """One sandbox in the usage history (running ones with their cost so far)."""

    id: str
    template: str
    isolation: str = DEFAULT_ISOLATION
    allow_internet_access: bool = False
    network: NetworkPolicy | None = None
    vcpu: float
    memory_mb: int
    vcpu_s: float
    gb_s: float
    storage_gb_s: float
    cost_usd: float
    started_at: datetime | None = None
    ended_at: datetime | None = None
    state: SandboxState
    end_reason: EndReason | None = None
    metadata: dict[str, str] = Field(default_factory=dict)
    pauses: list[PauseInterval] = Field(default_factory=list)


class HistoryPage(_Response):
    items: list[HistoryRecord]
    next_cursor: str | None = None


class UsageSummary(_Response):
    team_id: str
    since: datetime | None = None
    until: datetime | None = None
    sandboxes: int
    vcpu_s: float
    gb_s: float
    storage_gb_s: float
    cost_usd: float
    credits_usd: float | None = Field(None, description="remaining balance; null when credits are unlimited")
    credits_unlimited: bool = False


class Rates(_Response):
    vcpu_s_usd: float
    gb_s_usd: float
    storage_gb_month_usd: float


class NodeInfo(_Response):
    """A node as the operator sees it (admin only)."""

    id: str
    name: str
    url: str
    state: str = Field(..., description="ready | unreachable")
    draining: bool
    capacity_vcpu: float
    capacity_memory_mb: int
    used_vcpu: float
    used_memory_mb: int
    sandboxes: int
    templates: list[str] = Field(default_factory=list)
    isolation: dict[str, IsolationSupport] = Field(default_factory=dict)
    last_heartbeat_at: datetime


class NodeList(_Response):
    items: list[NodeInfo]
