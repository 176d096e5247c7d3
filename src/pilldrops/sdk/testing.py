"""An in-memory PillDrops control plane (and data plane) for ``httpx.MockTransport``: test without a server.

Example::

    from pilldrops import Sandbox
    from pilldrops.sdk.testing import FakeControlPlane

    fake = FakeControlPlane()
    fake.on_command(r"python /env/episode\\.py.*", lambda c: "0.75\\n")
    with Sandbox.create(**fake.client_options()) as sb:      # api_url, api_key and transport
        assert float(sb.run("python /env/episode.py").stdout) == 0.75

It implements the REST contract of ``docs/api.md`` (sandboxes, batch create, pause and resume, run as
NDJSON, archive, files, keys, templates, pools, whoami, history, usage, rates, credits) with a tiny simulated
shell: ``echo [-n]``, ``printf``, ``cat``, ``exit N``, ``true``,
``false``, ``pwd``, ``ls``, ``mkdir -p``, ``printenv``, ``sleep N`` (honours the run ``timeout``), joined
by ``;``, ``&&`` or ``||``, with ``>&2`` and ``> file``. Register your own commands with
:meth:`FakeControlPlane.on_command`; inject failures with :meth:`FakeControlPlane.fail_next`.
Thread-safe; the same handler serves sync and async clients.

Usage accrues deterministically on the fake clock (:meth:`FakeControlPlane.advance`): a sandbox's running
seconds are ``(ended_at or now, capped at end_at) - started_at`` minus its paused time; ``vcpu_s``, ``gb_s``
and ``cost_usd`` follow from ``vcpu``, ``memory_mb`` and :attr:`FakeControlPlane.rates`, and
``storage_gb_s`` is its checkpoint's GiB x paused seconds (a pause keeps the files, its checkpoint is
``CHECKPOINT_BASE_BYTES`` plus their size). The team starts with ``credits_usd`` (default $5.00, None for
unlimited); when the balance reaches zero, create answers 402 ``insufficient_credits``. Pools are kept as
configured and reported full at once (one fake node with ``size`` ready members).

``tests/contract/sdk`` runs the same SDK tests against this fake and the real control plane.
"""

from __future__ import annotations

import base64
import io
import itertools
import json
import posixpath
import re
import secrets
import shlex
import tarfile
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any
from urllib.parse import parse_qsl

import httpx
import pydantic

from pilldrops.errors import (
    AuthenticationError,
    Conflict,
    FileNotFound,
    InsufficientCredits,
    InvalidRequest,
    InvalidState,
    NotFound,
    PillDropsError,
    SandboxNotFound,
    TemplateNotFound,
)
from pilldrops.schema.api import (
    BatchCreateRequest,
    BatchCreateResponse,
    BatchItem,
    CreateSandboxRequest,
    EndReason,
    ErrorInfo,
    FileInfo,
    HistoryRecord,
    KeyCreated,
    KeyCreateRequest,
    KeyInfo,
    KillItem,
    KillSandboxesRequest,
    KillSandboxesResponse,
    PauseInterval,
    PoolInfo,
    PoolSetRequest,
    PortURL,
    PortURLRequest,
    Rates,
    RunRequest,
    SandboxInfo,
    SandboxState,
    SetTimeoutRequest,
    TemplateInfo,
    UsageSummary,
)

__all__ = ["CommandContext", "FakeControlPlane", "FakeResult", "FakeSandbox"]

#: Default rates of docs/api.md; a month of storage is 30 days here.
DEFAULT_RATES = Rates(vcpu_s_usd=0.0000140, gb_s_usd=0.0000045, storage_gb_month_usd=0.15)
SECONDS_PER_MONTH = 30 * 86_400
CHECKPOINT_BASE_BYTES = 1 << 20     # a paused fake sandbox's checkpoint: this plus its files


@dataclass
class FakeResult:
    """What a simulated command produced."""

    stdout: bytes | str = b""
    stderr: bytes | str = b""
    exit_code: int = 0
    timed_out: bool = False


@dataclass
class CommandContext:
    """Handed to :meth:`FakeControlPlane.on_command` handlers."""

    cmd: str
    argv: list[str] | None
    envs: dict[str, str]
    cwd: str
    stdin: str
    timeout: float | None
    sandbox: FakeSandbox


CommandHandler = Callable[[CommandContext], "FakeResult | tuple[Any, ...] | str | bytes | int"]


@dataclass
class FakeSandbox:
    """One simulated sandbox: its record, its access token and a tiny in-memory filesystem."""

    info: SandboxInfo
    access_token: str
    envs: dict[str, str]
    files: dict[str, bytes] = field(default_factory=dict)
    dirs: set[str] = field(default_factory=lambda: {"/", "/tmp", "/home", "/home/user"})
    links: dict[str, str] = field(default_factory=dict)
    seq: int = 0
    pauses: list[PauseInterval] = field(default_factory=list)   # closed paused intervals, then the open one
    paused_s: float = 0.0                                       # resumed paused intervals, in seconds

    # -------------------------------------------------------------------------------- filesystem
    def exists(self, path: str) -> bool:
        return path in self.files or path in self.dirs or path in self.links

    def mkdirs(self, path: str) -> None:
        while path not in self.dirs:
            if path in self.files or path in self.links:
                raise InvalidRequest(f"{path} exists and is not a directory")
            self.dirs.add(path)
            path = posixpath.dirname(path)

    def write(self, path: str, data: bytes) -> None:
        if path in self.dirs:
            raise InvalidRequest(f"{path} is a directory")
        self.mkdirs(posixpath.dirname(path))
        self.links.pop(path, None)
        self.files[path] = data

    def children(self, path: str) -> list[str]:
        prefix = path.rstrip("/") + "/"
        out = set()
        for p in itertools.chain(self.files, self.dirs, self.links):
            if p != path and p.startswith(prefix) and "/" not in p[len(prefix):]:
                out.add(p)
        return sorted(out)

    def descendants(self, path: str) -> list[str]:
        prefix = path.rstrip("/") + "/"
        return sorted(p for p in itertools.chain(self.files, self.dirs, self.links) if p.startswith(prefix))

    def file_info(self, path: str) -> FileInfo:
        if path in self.links:
            kind, size, mode = "symlink", len(self.links[path]), 0o777
        elif path in self.dirs:
            kind, size, mode = "dir", 4096, 0o755
        elif path in self.files:
            kind, size, mode = "file", len(self.files[path]), 0o644
        else:
            raise FileNotFound(f"no such file or directory: {path}")
        return FileInfo(name=posixpath.basename(path) or "/", path=path, type=kind, size=size,  # type: ignore[arg-type]
                        mode=mode, mtime=0.0)

    def remove(self, path: str) -> None:
        for p in [path, *self.descendants(path)]:
            self.files.pop(p, None)
            self.links.pop(p, None)
            self.dirs.discard(p)


@dataclass
class _Failure:
    method: str | None
    path: re.Pattern[str]
    status: int
    code: str | None
    message: str
    times: int
    after: bool
    retry_after: str | None
    body: bytes | None
    content_type: str
    exc: Exception | None


def _norm(path: str, cwd: str = "/") -> str:
    return posixpath.normpath(posixpath.join(cwd, path)) if path else cwd


def _storage(checkpoint_bytes: int, seconds: float) -> float:
    """Storage GiB-seconds of a checkpoint kept for ``seconds``."""
    return max(0, checkpoint_bytes) / 1024**3 * max(0.0, seconds)


def _bytes(v: bytes | str) -> bytes:
    return v.encode() if isinstance(v, str) else v


class FakeControlPlane:
    """An ``httpx.MockTransport`` handler implementing the PillDrops REST API in memory.

    ``data_plane=True`` (default) makes create/connect return an ``envd_url`` on a separate fake node host
    with an access token, so the SDK's direct data-plane path is exercised; ``False`` omits it so the SDK
    uses the control plane's proxied routes. ``chunk_size`` splits command output into stream chunks of
    that many bytes (small values exercise multi-byte UTF-8 characters split across chunks).
    ``credits_usd`` is the team's starting credit (None: unlimited); ``rates`` price the usage.
    """

    api_url = "http://pilldrops.test"
    node_url = "http://node-1.pilldrops.test"

    def __init__(self, *, api_key: str = "pd_test_key", data_plane: bool = True, chunk_size: int = 4096,
                 templates: tuple[str, ...] = ("base", "code-interpreter"),
                 credits_usd: float | None = 5.0, rates: Rates | None = None) -> None:
        self.api_key = api_key
        self.data_plane = data_plane
        self.chunk_size = chunk_size
        self.sandboxes: dict[str, FakeSandbox] = {}
        self.requests: list[httpx.Request] = []
        self.templates = {name: TemplateInfo(name=name, description=f"fake {name}", nodes=["node_fake"])
                          for name in templates}
        self.team_id = "team_test"
        self.credits_usd = credits_usd
        self.rates = rates if rates is not None else DEFAULT_RATES
        self._now = datetime(2025, 1, 1, tzinfo=UTC)
        self._keys: dict[str, KeyInfo] = {}
        self._secrets: dict[str, str] = {}
        self._idempotency: dict[str, tuple[str, str]] = {}
        self._failures: list[_Failure] = []
        self._commands: list[tuple[re.Pattern[str], CommandHandler]] = []
        self._lock = threading.RLock()
        self._ids = itertools.count(1)
        self.pools: dict[tuple[str, float, int, object], PoolInfo] = {}
        self._add_key("default", api_key)
        self.transport = httpx.MockTransport(self)

    # ------------------------------------------------------------------------------------ test API

    def client_options(self) -> dict[str, Any]:
        """``api_url``, ``api_key`` and ``transport`` for ``Sandbox.create(**fake.client_options())``."""
        return {"api_url": self.api_url, "api_key": self.api_key, "transport": self.transport}

    def on_command(self, pattern: str, handler: CommandHandler) -> None:
        """Simulate commands whose text fully matches the regex ``pattern`` (checked before built-ins).

        The handler gets a :class:`CommandContext` and returns a :class:`FakeResult`, a tuple
        ``(stdout, stderr, exit_code)``, just stdout (``str``/``bytes``), or just an exit code.
        """
        with self._lock:
            self._commands.insert(0, (re.compile(pattern, re.DOTALL), handler))

    def fail_next(self, method: str | None = None, path: str = "", *, status: int = 503,
                  code: str | None = None, message: str = "injected failure", times: int = 1,
                  after: bool = False, retry_after: float | str | None = None, body: bytes | None = None,
                  content_type: str = "text/plain", exc: Exception | None = None) -> None:
        """Fail the next ``times`` requests matching ``method`` and the regex ``path`` (searched).

        The answer is a ``status`` error (``code`` defaults to the status's code; ``body`` sends raw bytes
        instead of the JSON error) or, with ``exc``, the transport raises ``exc`` (e.g.
        ``httpx.ConnectError("refused")``). ``after=True`` processes the request first and then fails:
        a lost answer, as when a proxy times out after the server acted.
        """
        with self._lock:
            self._failures.append(_Failure(
                method.upper() if method else None, re.compile(path), status, code, message, times, after,
                None if retry_after is None else str(retry_after), body, content_type, exc))

    def requests_to(self, method: str, path: str) -> list[httpx.Request]:
        """Recorded requests with this method whose path fully matches the regex ``path``."""
        rx = re.compile(path)
        return [r for r in self.requests if r.method == method.upper() and rx.fullmatch(r.url.path)]

    def advance(self, seconds: float) -> None:
        """Move the fake clock (``created_at``, ``end_at``...) forward."""
        with self._lock:
            self._now += timedelta(seconds=seconds)

    def balance_usd(self) -> float | None:
        """Credits left: ``credits_usd`` minus the cost of every sandbox so far (None when unlimited)."""
        with self._lock:
            if self.credits_usd is None:
                return None
            return self.credits_usd - sum(self._accrue(sb).cost_usd for sb in self.sandboxes.values())

    # ------------------------------------------------------------------------------------ plumbing

    def __call__(self, request: httpx.Request) -> httpx.Response:
        with self._lock:
            self.requests.append(request)
            failure = self._take_failure(request)
            if failure is not None and failure.exc is not None:
                raise failure.exc
            if failure is not None and not failure.after:
                return self._failure_response(failure)
            try:
                response = self._route(request)
            except PillDropsError as exc:
                response = self._error(exc)
            if failure is not None:
                return self._failure_response(failure)
            return response

    def _take_failure(self, request: httpx.Request) -> _Failure | None:
        for f in self._failures:
            if (f.method is None or f.method == request.method) and f.path.search(request.url.path):
                f.times -= 1
                if f.times <= 0:
                    self._failures.remove(f)
                return f
        return None

    def _failure_response(self, f: _Failure) -> httpx.Response:
        headers = {"Retry-After": f.retry_after} if f.retry_after is not None else {}
        if f.body is not None:
            return httpx.Response(f.status, content=f.body, headers={**headers, "Content-Type": f.content_type})
        from pilldrops.errors import BY_STATUS

        cls = BY_STATUS.get(f.status, PillDropsError)
        exc = cls.__new__(cls)
        PillDropsError.__init__(exc, f.message, request_id=self._request_id())
        body = exc.to_body()
        if f.code:
            body["error"]["code"] = f.code
        return httpx.Response(f.status, json=body, headers=headers)

    def _request_id(self) -> str:
        return f"req_fake{next(self._ids)}"

    def _error(self, exc: PillDropsError) -> httpx.Response:
        if exc.request_id is None:
            exc.request_id = self._request_id()
        status = exc.status or 500
        return httpx.Response(status, json=exc.to_body())

    def _add_key(self, name: str, secret: str) -> KeyCreated:
        key_id = f"key_{secrets.token_hex(6)}"
        info = KeyCreated(id=key_id, name=name, team_id=self.team_id, prefix=secret[:8],
                          created_at=self._now, secret=secret)
        self._keys[key_id] = KeyInfo(**info.model_dump(exclude={"secret"}))
        self._secrets[secret] = key_id
        return info

    def _auth_control(self, request: httpx.Request) -> KeyInfo:
        auth = request.headers.get("authorization", "")
        secret = auth[7:] if auth.lower().startswith("bearer ") else request.headers.get("x-api-key", "")
        key_id = self._secrets.get(secret)
        key = self._keys.get(key_id or "")
        if key is None or key.revoked_at is not None:
            raise AuthenticationError("invalid or missing API key")
        return key

    def _body(self, model: type[pydantic.BaseModel], request: httpx.Request) -> Any:
        try:
            return model.model_validate_json(request.content or b"{}")
        except pydantic.ValidationError as exc:
            details = [{"loc": list(e["loc"]), "msg": e["msg"], "type": e["type"]} for e in exc.errors()]
            raise InvalidRequest("invalid request body", details=details) from None

    def _sandbox(self, sandbox_id: str) -> FakeSandbox:
        sb = self.sandboxes.get(sandbox_id)
        if sb is None:
            raise SandboxNotFound(f"sandbox {sandbox_id} not found")
        return sb

    def _accrue(self, sb: FakeSandbox) -> SandboxInfo:
        """Bring ``sb.info``'s usage fields up to the fake clock (a pure function of it: idempotent)."""
        info = sb.info
        if info.started_at is None:
            return info
        end = info.ended_at or self._now
        if info.paused_at is not None:
            end = min(end, info.paused_at)
        elif sb.pauses and sb.pauses[-1].resumed_at is None:    # ended while paused: it ran until that pause
            end = min(end, sb.pauses[-1].paused_at)
        elif info.end_at is not None:
            end = min(end, info.end_at)
        running_s = max(0.0, (end - info.started_at).total_seconds() - sb.paused_s)
        vcpu_s = info.vcpu * running_s
        gb_s = info.memory_mb / 1024 * running_s
        storage = sum(p.storage_gb_s for p in sb.pauses)
        if info.paused_at is not None:           # the open interval, so far
            storage += _storage(info.checkpoint_bytes or 0, (self._now - info.paused_at).total_seconds())
        r = self.rates
        cost = (vcpu_s * r.vcpu_s_usd + gb_s * r.gb_s_usd + storage * r.storage_gb_month_usd / SECONDS_PER_MONTH)
        sb.info = info.model_copy(update={"vcpu_s": vcpu_s, "gb_s": gb_s, "storage_gb_s": storage,
                                          "cost_usd": cost})
        return sb.info

    def _close_pause(self, sb: FakeSandbox, *, resumed: bool) -> None:
        """End the open paused interval now (storage billed for it), as a resume or an end."""
        info = sb.info
        if info.paused_at is None:
            return
        secs = max(0.0, (self._now - info.paused_at).total_seconds())
        sb.pauses[-1] = sb.pauses[-1].model_copy(update={
            "resumed_at": self._now if resumed else None,
            "storage_gb_s": _storage(info.checkpoint_bytes or 0, secs)})
        if resumed:         # an end while paused keeps it out: its running time stops at that pause
            sb.paused_s += secs
        sb.info = info.model_copy(update={"paused_at": None, "checkpoint_bytes": None})

    def _check_move(self, sb: FakeSandbox, src: SandboxState, target: SandboxState) -> None:
        """409 unless the sandbox is in ``src`` (the server's wording: it names both states)."""
        state = sb.info.state
        if state == src:
            return
        if state == target:
            raise InvalidState(f"sandbox {sb.info.id} is already {state.value} (asked for: {target.value})",
                               current=state.value, target=target.value)
        raise InvalidState(f"sandbox {sb.info.id} is {state.value}, not {src.value}: it cannot go to "
                           f"{target.value}", current=state.value, target=target.value)

    def _public(self, sb: FakeSandbox, *, with_token: bool) -> dict[str, Any]:
        info = self._accrue(sb)
        if with_token:
            info = info.model_copy(update={"access_token": sb.access_token,
                                           "envd_url": self.node_url if self.data_plane else None})
        return info.model_dump(mode="json")

    # ------------------------------------------------------------------------------------ routes

    def _route(self, request: httpx.Request) -> httpx.Response:
        path, method = request.url.path, request.method
        params = parse_qsl(request.url.query.decode(), keep_blank_values=True)
        query = dict(params)
        if path == "/healthz":
            return httpx.Response(200, json={"ok": True})
        on_node = request.url.host == httpx.URL(self.node_url).host
        m = re.fullmatch(r"/v1/sandboxes/([^/]+)/(run|archive|files|files/list)", path)
        if m:
            sb = self._sandbox(m.group(1))
            if on_node:
                if request.headers.get("x-access-token") != sb.access_token:
                    raise AuthenticationError("invalid access token")
            else:
                self._auth_control(request)
            if sb.info.state != SandboxState.running:
                raise InvalidState(current=sb.info.state.value, target="running")
            return self._data_plane(sb, m.group(2), method, query, request)
        if on_node:
            raise NotFound(f"no route {method} {path} on the node")
        self._auth_control(request)
        if path == "/v1/sandboxes" and method == "POST":
            return self._create(request)
        if path == "/v1/sandboxes" and method == "GET":
            return self._list(params)
        if path == "/v1/sandboxes/batch" and method == "POST":
            return self._batch(request)
        if path == "/v1/sandboxes/kill" and method == "POST":
            return self._kill_many(self._body(KillSandboxesRequest, request))
        m = re.fullmatch(r"/v1/sandboxes/([^/]+)(/connect|/timeout|/pause|/resume|/urls)?", path)
        if m:
            sb = self._sandbox(m.group(1))
            action = m.group(2)
            if action == "/urls" and method == "POST":
                return self._port_url(sb, self._body(PortURLRequest, request), request)
            if action is None and method == "GET":
                return httpx.Response(200, json=self._public(sb, with_token=False))
            if action is None and method == "DELETE":
                self._end(sb)
                return httpx.Response(200, json=self._public(sb, with_token=False))
            if action == "/pause" and method == "POST":
                return self._pause(sb)
            if action == "/resume" and method == "POST":
                return self._resume(sb)
            if action == "/connect" and method == "POST":
                if sb.info.state != SandboxState.running:
                    raise InvalidState(current=sb.info.state.value, target="running")
                return httpx.Response(200, json=self._public(sb, with_token=True))
            if action == "/timeout" and method == "POST":
                req = self._body(SetTimeoutRequest, request)
                if sb.info.state == SandboxState.paused:    # the time it will have left after resume
                    sb.info = sb.info.model_copy(update={"timeout_left": float(req.timeout),
                                                         "timeout": req.timeout})
                    return httpx.Response(200, json=self._public(sb, with_token=False))
                if sb.info.state != SandboxState.running:
                    raise InvalidState(current=sb.info.state.value, target="running")
                sb.info = sb.info.model_copy(update={"end_at": self._now + timedelta(seconds=req.timeout),
                                                     "timeout": req.timeout})
                return httpx.Response(200, json=self._public(sb, with_token=False))
        if path == "/v1/keys" and method == "POST":
            req = self._body(KeyCreateRequest, request)
            created = self._add_key(req.name, f"pd_{secrets.token_urlsafe(24)}")
            return httpx.Response(201, json=created.model_dump(mode="json"))
        if path == "/v1/keys" and method == "GET":
            return httpx.Response(200, json={"items": [k.model_dump(mode="json") for k in self._keys.values()]})
        m = re.fullmatch(r"/v1/keys/([^/]+)", path)
        if m and method == "DELETE":
            key = self._keys.get(m.group(1))
            if key is None:
                raise NotFound(f"key {m.group(1)} not found")
            if key.revoked_at is None:
                key = self._keys[key.id] = key.model_copy(update={"revoked_at": self._now})
            return httpx.Response(200, json=key.model_dump(mode="json"))
        if path == "/v1/templates" and method == "GET":
            return httpx.Response(200, json={"items": [t.model_dump(mode="json") for t in self.templates.values()]})
        if path == "/v1/pools" and method == "GET":
            return httpx.Response(200, json={"items": [p.model_dump(mode="json") for p in self.pools.values()]})
        if path == "/v1/pools" and method == "PUT":
            return self._set_pool(self._body(PoolSetRequest, request))
        if path == "/v1/history" and method == "GET":
            return self._history(params)
        if path == "/v1/usage" and method == "GET":
            return self._usage(query)
        if path == "/v1/rates" and method == "GET":
            return httpx.Response(200, json=self.rates.model_dump(mode="json"))
        if path == "/v1/whoami" and method == "GET":
            key = self._auth_control(request)
            return httpx.Response(200, json={"team_id": self.team_id, "team_name": "test", "key_id": key.id})
        raise NotFound(f"no route {method} {path}")

    def _port_url(self, sb: FakeSandbox, req: PortURLRequest, request: httpx.Request) -> httpx.Response:
        """A URL of the real form; nothing serves it here (there is no sandbox to reach)."""
        if sb.info.state in (SandboxState.stopped, SandboxState.failed, SandboxState.lost):
            raise InvalidState(current=sb.info.state.value, target="running")
        public = sb.info.public or req.port in sb.info.public_ports
        expires = None if public else self._now + timedelta(seconds=req.expires_in)
        token = "" if public else f"{'&' if '?' in req.path else '?'}pd_token=v1.fake{secrets.token_hex(8)}"
        base = f"{request.url.scheme}://{request.url.host}:{(request.url.port or 80) + 2}"   # the ports listener
        out = PortURL(url=f"{base}/ports/{sb.info.id}/{req.port}{req.path}{token}", port=req.port,
                      expires_at=expires, public=public)
        return httpx.Response(201, json=out.model_dump(mode="json"))

    def _create(self, request: httpx.Request) -> httpx.Response:
        req: CreateSandboxRequest = self._body(CreateSandboxRequest, request)
        sb, created = self._create_one(req, request.headers.get("idempotency-key"))
        return httpx.Response(201 if created else 200, json=self._public(sb, with_token=True))

    def _check_credits(self) -> None:
        balance = self.balance_usd()
        if balance is not None and balance <= 0:
            raise InsufficientCredits(f"team {self.team_id} has no credits left (balance ${balance:.2f})")

    def _create_one(self, req: CreateSandboxRequest, idem: str | None) -> tuple[FakeSandbox, bool]:
        """``(sandbox, created)``: created is False when ``idem`` replays an earlier create."""
        canonical = json.dumps(req.model_dump(mode="json"), sort_keys=True)
        if idem and idem in self._idempotency:
            body, sandbox_id = self._idempotency[idem]
            if body != canonical:
                raise Conflict("Idempotency-Key reused with a different request body")
            return self.sandboxes[sandbox_id], False
        if req.template not in self.templates:
            raise TemplateNotFound(f"template {req.template!r} not found")
        self._check_credits()
        sandbox_id = f"sb_{secrets.token_hex(8)}"
        self._now += timedelta(milliseconds=1)  # keep created_at strictly increasing for ordering
        info = SandboxInfo(id=sandbox_id, template=req.template, state=SandboxState.running, vcpu=req.vcpu,
                           memory_mb=req.memory_mb, timeout=req.timeout, metadata=req.metadata,
                           node_id="node_fake", created_at=self._now, started_at=self._now,
                           end_at=self._now + timedelta(seconds=req.timeout), public_ports=req.public_ports,
                           public=req.public)
        sb = FakeSandbox(info=info, access_token=f"tok_{secrets.token_hex(8)}", envs=dict(req.envs),
                         seq=len(self.sandboxes))
        self.sandboxes[sandbox_id] = sb
        if idem:
            self._idempotency[idem] = (canonical, sandbox_id)
        return sb, True

    def _batch(self, request: httpx.Request) -> httpx.Response:
        """Each item created on its own (item ``i`` replays with the key ``<key>:<i>``); a failed item is
        its error, the others are made. No credits at all is one 402 for the whole batch."""
        req: BatchCreateRequest = self._body(BatchCreateRequest, request)
        idem = request.headers.get("idempotency-key")
        self._check_credits()
        items = []
        for i in range(req.count):
            try:
                sb, _ = self._create_one(req.item_request(i), f"{idem}:{i}" if idem else None)
                items.append(BatchItem(index=i, sandbox=SandboxInfo.model_validate(self._public(sb, with_token=True))))
            except PillDropsError as exc:
                items.append(BatchItem(index=i, error=ErrorInfo(code=exc.code, message=exc.message,
                                                                details=exc.details)))
        created = sum(1 for it in items if it.sandbox is not None)
        body = BatchCreateResponse(items=items, created=created, failed=req.count - created)
        return httpx.Response(200, json=body.model_dump(mode="json"))

    def _pause(self, sb: FakeSandbox) -> httpx.Response:
        self._check_move(sb, SandboxState.running, SandboxState.paused)
        info = self._accrue(sb)
        size = CHECKPOINT_BASE_BYTES + sum(len(d) for d in sb.files.values())
        left = max(0.0, ((info.end_at or self._now) - self._now).total_seconds())
        sb.pauses.append(PauseInterval(paused_at=self._now, checkpoint_bytes=size))
        sb.info = info.model_copy(update={"state": SandboxState.paused, "paused_at": self._now,
                                          "checkpoint_bytes": size, "timeout_left": left})
        return httpx.Response(200, json=self._public(sb, with_token=False))

    def _resume(self, sb: FakeSandbox) -> httpx.Response:
        self._check_move(sb, SandboxState.paused, SandboxState.running)
        left = max(sb.info.timeout_left if sb.info.timeout_left is not None else float(sb.info.timeout), 1.0)
        self._close_pause(sb, resumed=True)
        sb.info = sb.info.model_copy(update={"state": SandboxState.running, "timeout_left": None,
                                             "end_at": self._now + timedelta(seconds=left)})
        return httpx.Response(200, json=self._public(sb, with_token=True))

    def _set_pool(self, req: PoolSetRequest) -> httpx.Response:
        # a pool is one template, shape and network policy (the fake has no template [network] defaults)
        allow = sorted(req.network.allow_out) if req.network else []
        egress = req.allow_internet_access or bool(allow)
        key = (req.template, round(float(req.vcpu), 3), req.memory_mb,
               (req.allow_internet_access, tuple(allow), tuple(sorted(req.network.deny_out)) if req.network else ())
               if egress else None)
        if req.size == 0:
            if key not in self.pools:
                have = ", ".join(f"{t} {c:g} vCPU / {m} MiB" + (" with egress" if n else "")
                                 for t, c, m, n in self.pools) or "none"
                raise NotFound(f"no pool {req.template} {req.vcpu:g} vCPU / {req.memory_mb} MiB to remove "
                               f"(a pool is one template and shape; pools: {have})")
            removed = self.pools.pop(key)
            return httpx.Response(200, json=removed.model_copy(update={"size": 0}).model_dump(mode="json"))
        if req.template not in self.templates:
            raise TemplateNotFound(f"template {req.template!r} is not built on any node; build it first "
                                   f"(`pilldrops template build {req.template}`)")
        self.pools[key] = PoolInfo(template=req.template, vcpu=req.vcpu, memory_mb=req.memory_mb, size=req.size,
                                   nodes=1, ready=req.size, allow_internet_access=req.allow_internet_access,
                                   network=req.network if egress else None)
        return httpx.Response(200, json=self.pools[key].model_dump(mode="json"))

    def _end(self, sb: FakeSandbox) -> None:
        """Kill it (idempotent: an ended one keeps its final record)."""
        if sb.info.state not in (SandboxState.stopped, SandboxState.failed, SandboxState.lost):
            self._accrue(sb)
            self._close_pause(sb, resumed=False)
            sb.info = sb.info.model_copy(update={"state": SandboxState.stopped, "ended_at": self._now,
                                                 "end_reason": EndReason.killed})

    def _kill_many(self, req: KillSandboxesRequest) -> httpx.Response:
        """``POST /v1/sandboxes/kill``: by ids or every live one with the labels, per-id outcomes."""
        if (req.ids is None) == (req.labels is None) or req.ids == [] or req.labels == {}:
            raise InvalidRequest("give exactly one of ids or labels (not empty)")
        if req.ids is not None:
            ids = list(dict.fromkeys(req.ids))
        else:
            ended = (SandboxState.stopped, SandboxState.failed, SandboxState.lost)
            ids = [s.info.id for s in sorted(self.sandboxes.values(), key=lambda s: s.seq, reverse=True)
                   if s.info.state not in ended
                   and all(s.info.metadata.get(k) == v for k, v in (req.labels or {}).items())]
        items = []
        for sid in ids:
            sb = self.sandboxes.get(sid)
            if sb is None:
                items.append(KillItem(id=sid, error=ErrorInfo(code="sandbox_not_found",
                                                             message=f"sandbox {sid!r} not found")))
                continue
            self._end(sb)
            items.append(KillItem(id=sid, sandbox=SandboxInfo.model_validate(self._public(sb, with_token=False))))
        killed = sum(1 for it in items if it.sandbox is not None)
        body = KillSandboxesResponse(items=items, killed=killed, failed=len(items) - killed)
        return httpx.Response(200, json=body.model_dump(mode="json"))

    def _list(self, params: list[tuple[str, str]]) -> httpx.Response:
        states = {v for k, v in params if k == "state"}
        meta = {k[len("metadata."):]: v for k, v in params if k.startswith("metadata.")}
        rows = sorted(self.sandboxes.values(), key=lambda s: s.seq, reverse=True)
        rows = [s for s in rows if (not states or s.info.state.value in states)
                and all(s.info.metadata.get(k) == v for k, v in meta.items())]
        page, nxt = self._page(rows, dict(params))
        return httpx.Response(200, json={"items": [self._public(s, with_token=False) for s in page],
                                         "next_cursor": nxt})

    @staticmethod
    def _page(rows: list[FakeSandbox], query: dict[str, str]) -> tuple[list[FakeSandbox], str | None]:
        try:
            limit = max(1, min(int(query.get("limit", "100")), 1000))
            offset = int(query.get("cursor", "0") or 0)
        except ValueError:
            raise InvalidRequest("bad limit or cursor") from None
        nxt = str(offset + limit) if offset + limit < len(rows) else None
        return rows[offset:offset + limit], nxt

    @staticmethod
    def _time_param(query: dict[str, str], name: str) -> datetime | None:
        raw = query.get(name)
        if not raw:
            return None
        try:
            value = datetime.fromisoformat(raw)
        except ValueError:
            raise InvalidRequest(f"{name} must be an ISO 8601 date or time, got {raw!r}") from None
        return value if value.tzinfo is not None else value.replace(tzinfo=UTC)

    def _period(self, query: dict[str, str]) -> tuple[datetime | None, datetime | None, list[FakeSandbox]]:
        """``since``/``until`` and the sandboxes created in ``[since, until)``, newest first."""
        since, until = self._time_param(query, "since"), self._time_param(query, "until")
        rows = sorted(self.sandboxes.values(), key=lambda s: s.seq, reverse=True)
        rows = [s for s in rows if (since is None or s.info.created_at >= since)
                and (until is None or s.info.created_at < until)]
        return since, until, rows

    def _history(self, params: list[tuple[str, str]]) -> httpx.Response:
        query = dict(params)
        states = {v for k, v in params if k == "state"}
        meta = {k[len("metadata."):]: v for k, v in params if k.startswith("metadata.")}
        template = query.get("template")
        _, _, rows = self._period(query)
        rows = [s for s in rows if (not states or s.info.state.value in states)
                and (not template or s.info.template == template)
                and all(s.info.metadata.get(k) == v for k, v in meta.items())]
        page, nxt = self._page(rows, query)
        fields = set(HistoryRecord.model_fields)
        items = [HistoryRecord(**self._accrue(s).model_dump(include=fields), pauses=self._intervals(s)
                               ).model_dump(mode="json") for s in page]
        return httpx.Response(200, json={"items": items, "next_cursor": nxt})

    def _intervals(self, sb: FakeSandbox) -> list[PauseInterval]:
        """Its paused intervals, the open one with the storage it has accrued so far."""
        out = list(sb.pauses)
        if sb.info.paused_at is not None and out:
            secs = (self._now - sb.info.paused_at).total_seconds()
            out[-1] = out[-1].model_copy(update={"storage_gb_s": _storage(out[-1].checkpoint_bytes, secs)})
        return out

    def _usage(self, query: dict[str, str]) -> httpx.Response:
        since, until, rows = self._period(query)
        infos = [self._accrue(s) for s in rows]
        balance = self.balance_usd()
        summary = UsageSummary(
            team_id=self.team_id, since=since, until=until, sandboxes=len(infos),
            vcpu_s=sum(i.vcpu_s for i in infos), gb_s=sum(i.gb_s for i in infos),
            storage_gb_s=sum(i.storage_gb_s for i in infos), cost_usd=sum(i.cost_usd for i in infos),
            credits_usd=None if balance is None else max(balance, 0.0), credits_unlimited=balance is None)
        return httpx.Response(200, json=summary.model_dump(mode="json"))

    # ------------------------------------------------------------------------------------ data plane

    def _data_plane(self, sb: FakeSandbox, what: str, method: str, query: dict[str, str],
                    request: httpx.Request) -> httpx.Response:
        if what == "run" and method == "POST":
            return self._run(sb, self._body(RunRequest, request))
        path = query.get("path")
        if not path:
            raise InvalidRequest("missing query parameter 'path'")
        path = _norm(path, "/home/user")
        if what == "files" and method == "GET":
            if path not in sb.files:
                raise FileNotFound(f"no such file: {path}")
            return httpx.Response(200, content=sb.files[path],
                                  headers={"Content-Type": "application/octet-stream"})
        if what == "files" and method == "PUT":
            sb.write(path, request.content)
            return httpx.Response(200, json=sb.file_info(path).model_dump(mode="json"))
        if what == "files/list" and method == "GET":
            if path not in sb.dirs:
                raise FileNotFound(f"no such directory: {path}")
            return httpx.Response(200, json={"items": [sb.file_info(p).model_dump(mode="json")
                                                       for p in sb.children(path)]})
        if what == "archive" and method == "PUT":
            return httpx.Response(200, json={"entries": self._untar(sb, path, request.content)})
        if what == "archive" and method == "GET":
            return httpx.Response(200, content=self._tar(sb, path), headers={"Content-Type": "application/x-tar"})
        raise NotFound(f"no route {method} {what}")

    def _untar(self, sb: FakeSandbox, dest: str, data: bytes) -> int:
        try:
            tar = tarfile.open(fileobj=io.BytesIO(data), mode="r:*")
        except tarfile.TarError as exc:
            raise InvalidRequest(f"not a tar stream: {exc}") from None
        with tar:
            return self._apply_tar(sb, dest, tar)

    def _apply_tar(self, sb: FakeSandbox, dest: str, tar: tarfile.TarFile) -> int:
        try:
            members = tar.getmembers()
        except tarfile.TarError as exc:
            raise InvalidRequest(f"not a tar stream: {exc}") from None
        plan = []
        for m in members:
            if m.name.startswith("/") or ".." in m.name.split("/"):
                raise InvalidRequest(f"archive member {m.name!r} escapes the destination")
            target = _norm(m.name, dest)
            if m.issym() or m.islnk():
                link = _norm(m.linkname, posixpath.dirname(target) if m.issym() else dest)
                if m.linkname.startswith("/") or not (link == dest or link.startswith(dest.rstrip("/") + "/")):
                    raise InvalidRequest(f"archive link {m.name!r} -> {m.linkname!r} points outside")
            elif not (m.isfile() or m.isdir()):
                raise InvalidRequest(f"archive member {m.name!r} is a device or fifo")
            plan.append((m, target))
        sb.mkdirs(dest)
        for m, target in plan:
            if m.isdir():
                sb.mkdirs(target)
            elif m.issym():
                sb.mkdirs(posixpath.dirname(target))
                sb.files.pop(target, None)
                sb.links[target] = m.linkname
            elif m.islnk():
                sb.write(target, sb.files.get(_norm(m.linkname, dest), b""))
            else:
                f = tar.extractfile(m)
                sb.write(target, f.read() if f else b"")
        return len(plan)

    def _tar(self, sb: FakeSandbox, src: str) -> bytes:
        if not sb.exists(src):
            raise FileNotFound(f"no such file or directory: {src}")
        buf = io.BytesIO()
        base = posixpath.dirname(src)
        with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
            for p in [src, *sb.descendants(src)]:
                ti = tarfile.TarInfo(posixpath.relpath(p, base) if base != p else posixpath.basename(p))
                if p in sb.links:
                    ti.type, ti.linkname = tarfile.SYMTYPE, sb.links[p]
                    tar.addfile(ti)
                elif p in sb.dirs:
                    ti.type, ti.mode = tarfile.DIRTYPE, 0o755
                    tar.addfile(ti)
                else:
                    ti.size, ti.mode = len(sb.files[p]), 0o644
                    tar.addfile(ti, io.BytesIO(sb.files[p]))
        return buf.getvalue()

    # ------------------------------------------------------------------------------------ commands

    def _run(self, sb: FakeSandbox, req: RunRequest) -> httpx.Response:
        text = req.cmd if isinstance(req.cmd, str) else shlex.join(req.cmd)
        ctx = CommandContext(cmd=text, argv=None if isinstance(req.cmd, str) else list(req.cmd),
                             envs={**sb.envs, **req.envs}, cwd=req.cwd or "/home/user", stdin=req.stdin or "",
                             timeout=req.timeout, sandbox=sb)
        result = self._execute(ctx)
        out, err = _bytes(result.stdout), _bytes(result.stderr)
        cap = req.max_output_bytes
        truncated = len(out) > cap or len(err) > cap
        out, err = out[:cap], err[:cap]
        lines = [{"type": "start", "pid": 1000 + sb.seq}]
        for kind, data in (("stdout", out), ("stderr", err)):
            for i in range(0, len(data), self.chunk_size):
                lines.append({"type": kind, "data": base64.b64encode(data[i:i + self.chunk_size]).decode()})
        code = 124 if result.timed_out else result.exit_code
        lines.append({"type": "exit", "exit_code": code, "duration": 0.001, "truncated": truncated,
                      "timed_out": result.timed_out})
        body = "".join(json.dumps(line) + "\n" for line in lines).encode()
        return httpx.Response(200, content=body, headers={"Content-Type": "application/x-ndjson"})

    def _execute(self, ctx: CommandContext) -> FakeResult:
        for pattern, handler in self._commands:
            if pattern.fullmatch(ctx.cmd):
                res = handler(ctx)
                if isinstance(res, FakeResult):
                    return res
                if isinstance(res, tuple):
                    return FakeResult(*res)
                if isinstance(res, int) and not isinstance(res, bool):
                    return FakeResult(exit_code=res)
                return FakeResult(stdout=res)  # type: ignore[arg-type]
        return _Shell(ctx).run()


class _Shell:
    """Just enough of ``sh -c`` for tests."""

    def __init__(self, ctx: CommandContext) -> None:
        self.ctx = ctx
        self.sb = ctx.sandbox
        self.out = bytearray()
        self.err = bytearray()
        self.elapsed = 0.0

    def run(self) -> FakeResult:
        if self.ctx.argv is not None:
            groups: list[tuple[str, list[str]]] = [(";", self.ctx.argv)]
        else:
            lex = shlex.shlex(self.ctx.cmd, posix=True, punctuation_chars=";&|>")
            lex.whitespace_split = True
            try:
                tokens = list(lex)
            except ValueError as exc:
                return FakeResult(stderr=f"sh: syntax error: {exc}\n", exit_code=2)
            groups, cur, op = [], [], ";"
            for tok in tokens:
                if tok in (";", "&&", "||"):
                    groups.append((op, cur))
                    cur, op = [], tok
                else:
                    cur.append(tok)
            groups.append((op, cur))
        code = 0
        for op, argv in groups:
            if (op == "&&" and code != 0) or (op == "||" and code == 0) or not argv:
                continue
            try:
                code = self._simple(argv)
            except _Exit as e:
                code = e.code
                break
            except _Timeout:
                return FakeResult(bytes(self.out), bytes(self.err), 124, timed_out=True)
        return FakeResult(bytes(self.out), bytes(self.err), code)

    def _simple(self, argv: list[str]) -> int:
        to_err, redirect = False, None
        args: list[str] = []
        i = 0
        while i < len(argv):
            tok = argv[i]
            if tok == ">&" and i + 1 < len(argv) and argv[i + 1] == "2":
                to_err, i = True, i + 2
                continue
            if tok in (">", ">>") and i + 1 < len(argv):
                redirect, i = argv[i + 1], i + 2
                continue
            args.append(tok)
            i += 1
        out = bytearray()
        err = self.err
        code = self._builtin(args, out, err)
        if redirect is not None:
            self.sb.write(_norm(redirect, self.ctx.cwd), bytes(out))
        elif to_err:
            err += out
        else:
            self.out += out
        return code

    def _builtin(self, args: list[str], out: bytearray, err: bytearray) -> int:
        name, rest = args[0], args[1:]
        if name == "echo":
            newline = True
            if rest[:1] == ["-n"]:
                newline, rest = False, rest[1:]
            out += (" ".join(rest) + ("\n" if newline else "")).encode()
            return 0
        if name == "printf":
            fmt = rest[0] if rest else ""
            text = fmt.encode().decode("unicode_escape").encode("latin-1") if "\\" in fmt else fmt.encode()
            out += text.replace(b"%s", " ".join(rest[1:]).encode())
            return 0
        if name == "exit":
            raise _Exit(int(rest[0]) if rest else 0)
        if name in ("true", ":"):
            return 0
        if name == "false":
            return 1
        if name == "pwd":
            out += (self.ctx.cwd + "\n").encode()
            return 0
        if name == "printenv":
            if not rest:
                out += "".join(f"{k}={v}\n" for k, v in sorted(self.ctx.envs.items())).encode()
                return 0
            if rest[0] not in self.ctx.envs:
                return 1
            out += (self.ctx.envs[rest[0]] + "\n").encode()
            return 0
        if name == "sleep":
            self.elapsed += float(rest[0]) if rest else 0.0
            if self.ctx.timeout is not None and self.elapsed > self.ctx.timeout:
                raise _Timeout
            return 0
        if name == "cat":
            if not rest:
                out += self.ctx.stdin.encode()
                return 0
            code = 0
            for p in rest:
                path = _norm(p, self.ctx.cwd)
                if path in self.sb.files:
                    out += self.sb.files[path]
                else:
                    err += f"cat: {p}: No such file or directory\n".encode()
                    code = 1
            return code
        if name == "ls":
            path = _norm(rest[-1] if rest and not rest[-1].startswith("-") else ".", self.ctx.cwd)
            if path not in self.sb.dirs:
                err += f"ls: cannot access '{path}': No such file or directory\n".encode()
                return 2
            out += "".join(posixpath.basename(c) + "\n" for c in self.sb.children(path)).encode()
            return 0
        if name == "mkdir":
            for p in rest:
                if not p.startswith("-"):
                    self.sb.mkdirs(_norm(p, self.ctx.cwd))
            return 0
        if name == "rm":
            for p in rest:
                if not p.startswith("-"):
                    self.sb.remove(_norm(p, self.ctx.cwd))
            return 0
        err += f"sh: {name}: command not found\n".encode()
        return 127


class _Exit(Exception):
    def __init__(self, code: int) -> None:
        self.code = code


class _Timeout(Exception):
    pass
