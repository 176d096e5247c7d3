"""Colour-free SDK helpers: everything that does no network I/O, shared by ``_async`` and ``_sync``.

Request targets and headers, error mapping (HTTP status/body and transport exceptions, each in one place),
the retry decision and backoff, decoding a streamed run into a :class:`RunResult`, tar packing for
``upload`` and safe extraction for ``download``, and the shared-connection-pool caches.
"""

from __future__ import annotations

import asyncio
import codecs
import email.utils
import functools
import json
import os
import posixpath
import random
import shutil
import tarfile
import tempfile
import threading
import time
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, date, datetime
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import quote

import anyio
import anyio.to_thread
import httpx
import pydantic

from pilldrops._internal.timeparse import parse_time
from pilldrops.errors import (
    AuthenticationError,
    CommandFailed,
    InvalidRequest,
    InvalidState,
    PillDropsError,
    RequestTimeout,
    ServerError,
    TransportError,
    from_wire,
)
from pilldrops.schema.api import DEFAULT_OUTPUT_CAP, RunEvent, SandboxInfo, SandboxState
from pilldrops.sdk._config import MAX_CONNECTIONS, MAX_KEEPALIVE_CONNECTIONS, ClientConfig

try:  # pragma: no cover - trivial
    from importlib.metadata import version as _dist_version

    SDK_VERSION = _dist_version("pilldrops")
except Exception:  # pragma: no cover  # noqa: BLE001 - any failure here is reported, never raised
    SDK_VERSION = "0.0.0"

USER_AGENT = f"pilldrops-python/{SDK_VERSION}"
T = TypeVar("T")
M = TypeVar("M", bound=pydantic.BaseModel)

# ---------------------------------------------------------------------------------------------- targets


@dataclass(frozen=True)
class Target:
    """Where a request goes: a base URL and the auth headers that base URL wants."""

    base_url: str
    headers: dict[str, str]

    def url(self, path: str) -> str:
        return self.base_url.rstrip("/") + path


@functools.lru_cache(maxsize=4096)
def parsed_url(url: str) -> httpx.URL:
    """``url`` parsed once: httpx parses a string URL on every request (~50 µs; issue 15), and a sandbox's
    data-plane URLs repeat on every call. ``httpx.URL`` is immutable, so one parse serves every request."""
    return httpx.URL(url)


def control_target(config: ClientConfig) -> Target:
    """The control plane, authenticated with the API key."""
    return Target(config.api_url, {"Authorization": f"Bearer {config.api_key}"})


def data_target(info: SandboxInfo, config: ClientConfig) -> Target:
    """The sandbox's data plane: the node directly when ``envd_url`` is known, else the control plane's proxy.

    The API key is never sent to a node; the node gets only the per-sandbox access token.
    """
    if info.envd_url and info.access_token:
        return Target(info.envd_url, {"X-Access-Token": info.access_token})
    return control_target(config)


def sandbox_path(sandbox_id: str, suffix: str = "") -> str:
    return f"/v1/sandboxes/{quote(sandbox_id, safe='')}{suffix}"


def check_remote_path(path: str, what: str = "path") -> str:
    """A path inside the sandbox must be absolute; anything else is an :class:`InvalidRequest` before any I/O."""
    if not isinstance(path, str) or not path.startswith("/"):
        raise InvalidRequest(f"{what} {path!r} is not absolute: paths inside the sandbox must be absolute "
                             f"(start with '/'), e.g. {posixpath.join('/home/user', str(path or 'file'))!r}")
    return path


STATE_VALUES = tuple(s.value for s in SandboxState)


def state_values(state: str | list[str] | None) -> list[str]:
    """One state or several as their wire values; an unknown one is an :class:`InvalidRequest` naming the valid ones."""
    states = [state] if isinstance(state, str) else list(state or [])
    out = []
    for s in states:
        value = getattr(s, "value", s)
        if value not in STATE_VALUES:
            raise InvalidRequest(f"unknown sandbox state {value!r}; valid states: {', '.join(STATE_VALUES)}")
        out.append(value)
    return out


def list_params(state: str | list[str] | None, metadata: dict[str, str] | None, limit: int,
                cursor: str | None) -> list[tuple[str, str]]:
    """Query parameters of ``GET /v1/sandboxes`` (``state`` repeats, metadata is ``metadata.<k>=<v>``)."""
    params: list[tuple[str, str]] = []
    params += [("state", s) for s in state_values(state)]
    params += [(f"metadata.{k}", v) for k, v in (metadata or {}).items()]
    params.append(("limit", str(limit)))
    if cursor:
        params.append(("cursor", cursor))
    return params


def iso_param(value: datetime | date | str | None, what: str) -> str | None:
    """A time query parameter as ISO 8601 UTC (``...Z``); a naive datetime or a date is taken as UTC.

    A string must parse as ISO 8601 (``2025-01-31``, ``2025-01-31T12:00``, ``...+02:00``, ``...Z``) or be a
    time ago (``90s``, ``30m``, ``1h``, ``2d``, ``1w``); otherwise it is an :class:`InvalidRequest` before
    any I/O.
    """
    if value is None:
        return None
    if isinstance(value, str):
        try:
            value = parse_time(value)
        except ValueError as exc:
            raise InvalidRequest(f"{what}: {exc}") from None
    if not isinstance(value, datetime):
        value = datetime(value.year, value.month, value.day)
    if value.tzinfo is None:
        value = value.replace(tzinfo=UTC)
    return value.astimezone(UTC).isoformat().replace("+00:00", "Z")


def period_params(since: datetime | date | str | None,
                  until: datetime | date | str | None) -> list[tuple[str, str]]:
    """``since``/``until`` query parameters of ``GET /v1/history`` and ``GET /v1/usage`` (omitted when None)."""
    params: list[tuple[str, str]] = []
    for name, value in (("since", since), ("until", until)):
        iso = iso_param(value, name)
        if iso is not None:
            params.append((name, iso))
    return params


def history_params(since: datetime | date | str | None, until: datetime | date | str | None,
                   state: str | list[str] | None, template: str | None, metadata: dict[str, str] | None,
                   limit: int, cursor: str | None) -> list[tuple[str, str]]:
    """Query parameters of ``GET /v1/history`` (``state`` repeats, metadata is ``metadata.<k>=<v>``)."""
    params = period_params(since, until)
    if template:
        params.append(("template", template))
    return params + list_params(state, metadata, limit, cursor)


def check_limit(limit: int | None, what: str = "limit") -> None:
    """A client-side cap on returned records must be a positive integer (or None for no cap)."""
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise InvalidRequest(f"{what} must be a positive integer, got {limit!r}")


Metadata = dict[str, str] | Callable[[T], dict[str, str]] | None


def item_metadata(metadata: Metadata[T], item: T) -> dict[str, str]:
    """The metadata of one item's sandbox: the dict, or what the function gives for the item (as strings)."""
    got = metadata(item) if callable(metadata) else metadata
    if got is None:
        return {}
    if not isinstance(got, dict):
        raise TypeError(f"metadata for item {item!r} must be a dict, not {type(got).__name__}")
    return {str(k): str(v) for k, v in got.items()}


def new_idempotency_key() -> str:
    """One key per logical create, reused by every retry of it."""
    import uuid

    return f"pd-{uuid.uuid4().hex}"


def http_client_kwargs(config: ClientConfig) -> dict[str, Any]:
    """Keyword arguments for ``httpx.Client`` / ``httpx.AsyncClient`` (no auth: it is set per target)."""
    kw: dict[str, Any] = {
        "timeout": httpx.Timeout(config.request_timeout),
        "limits": httpx.Limits(max_connections=MAX_CONNECTIONS,
                               max_keepalive_connections=MAX_KEEPALIVE_CONNECTIONS),
        "headers": {"User-Agent": USER_AGENT},
        "follow_redirects": False,
    }
    if config.transport is not None:
        kw["transport"] = config.transport
    return kw


def stream_timeout(config: ClientConfig) -> httpx.Timeout:
    """Timeout for a streamed run: connect/write/pool bounded, but no read timeout (commands may be long)."""
    return httpx.Timeout(config.request_timeout, read=None)


# ---------------------------------------------------------------------------------------------- errors

_NOT_SENT = (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout)


@contextmanager
def map_transport_errors(url: str | httpx.URL | None = None) -> Iterator[None]:
    """Translate every ``httpx`` exception into a PillDrops error (the one place this happens).

    ``url`` (the request's URL; its query is left out) is named in the message.
    """
    where = f" {str(url).split('?', 1)[0]}" if url else ""
    try:
        yield
    except httpx.ConnectError as exc:   # nothing listens there: say what usually fixes it
        at = f" at{where}" if where else ""
        raise TransportError(f"cannot reach PillDrops{at} — is `pilldrops up` running? (or set "
                             f"PILLDROPS_API_URL) [{exc.__class__.__name__}: {exc}]") from exc
    except httpx.TimeoutException as exc:
        what = f"request to{where}" if where else "request"
        raise RequestTimeout(f"{what} timed out: {exc.__class__.__name__}: {exc}".rstrip(": ")) from exc
    except httpx.TransportError as exc:
        at = f" at{where}" if where else ""
        raise TransportError(f"could not reach PillDrops{at}: {exc.__class__.__name__}: {exc}".rstrip(": ")) \
            from exc
    except httpx.HTTPError as exc:  # stream/decoding errors and the like: still "no usable response"
        at = f" from{where}" if where else ""
        raise TransportError(f"HTTP error{at}: {exc.__class__.__name__}: {exc}".rstrip(": ")) from exc
    except httpx.InvalidURL as exc:
        raise InvalidRequest(f"invalid URL: {exc}") from exc


def name_key_source(exc: PillDropsError, config: ClientConfig, target: Target) -> PillDropsError:
    """A 401 from the control plane says which key was used and where it came from (a stale
    ``E2B_API_KEY`` in the shell or an old config file are the usual causes)."""
    if isinstance(exc, AuthenticationError) and "Authorization" in target.headers:
        hint = f" (API key from {config.api_key_source})"
        if hint not in exc.message:
            exc.message = f"{exc.message}{hint}"
            exc.args = (exc.message,)
    return exc


ENDED_STATES = frozenset({SandboxState.stopping, SandboxState.stopped, SandboxState.failed, SandboxState.lost})


def stopped_error(info: SandboxInfo) -> InvalidState | None:
    """The error for using a sandbox that has ended ("sandbox sb_x is stopped (killed at ...)"), or None."""
    if info.state not in ENDED_STATES:
        return None
    why = info.end_reason.value if info.end_reason is not None else info.state.value
    when = f" at {info.ended_at.strftime('%Y-%m-%d %H:%M:%S %Z').strip()}" if info.ended_at else ""
    return InvalidState(f"sandbox {info.id} is {info.state.value} ({why}{when})", current=info.state.value,
                        details={"from": info.state.value, "end_reason": why,
                                 "ended_at": info.ended_at.isoformat() if info.ended_at else None})


def error_from_response(response: httpx.Response) -> PillDropsError:
    """The typed error for a non-2xx response; the body need not be JSON. The response must be read."""
    try:
        body = response.json()
    except ValueError:
        body = None
    request_id = response.headers.get("x-request-id")
    if not (isinstance(body, dict) and isinstance(body.get("error"), dict)):
        snippet = response.text[:200].strip() if response.content else ""
        message = f"HTTP {response.status_code} {response.reason_phrase}".strip()
        body = {"error": {"message": f"{message}: {snippet}" if snippet else message,
                          "request_id": request_id}}
    exc = from_wire(response.status_code, body)
    if exc.request_id is None:
        exc.request_id = request_id
    return exc


def egress_fields(allow_internet_access: bool | None, network: Any) -> dict[str, Any]:
    """The create's egress fields, only those the caller gave (unset ones are the template's)."""
    out: dict[str, Any] = {}
    if allow_internet_access is not None:
        out["allow_internet_access"] = allow_internet_access
    if network is not None:
        out["network"] = network.model_dump() if hasattr(network, "model_dump") else network
    return out


def build_model(model: type[M], **fields: Any) -> M:
    """Validate a request body locally; a bad argument is an :class:`InvalidRequest` before any I/O."""
    try:
        return model(**fields)
    except pydantic.ValidationError as exc:
        details = [{"loc": list(e["loc"]), "msg": e["msg"], "type": e["type"]} for e in exc.errors()]
        first = details[0] if details else {"loc": [], "msg": str(exc)}
        where = ".".join(str(x) for x in first["loc"])
        raise InvalidRequest(f"invalid {where or 'argument'}: {first['msg']}", details=details) from None


def parse_model(model: type[M], response: httpx.Response) -> M:
    """Validate a 2xx JSON body; a malformed one is a :class:`ServerError`, never a pydantic error."""
    try:
        return model.model_validate_json(response.content)
    except (pydantic.ValidationError, ValueError) as exc:
        raise ServerError(f"unexpected response from {response.request.url.path}: {exc}") from exc


# ---------------------------------------------------------------------------------------------- retries

RETRY_STATUSES = frozenset({429, 500, 502, 503})
BACKOFF_BASE_S = 0.25
BACKOFF_CAP_S = 4.0
MAX_RETRY_AFTER_S = 60.0


def should_retry(exc: PillDropsError, *, idempotent: bool) -> bool:
    """Whether a failed attempt may be repeated.

    Idempotent calls retry on transport errors and on 429/500/502/503. Other calls (``run``, ``upload``)
    retry only when the request provably never left this process (connect errors, pool timeouts).
    """
    if isinstance(exc, TransportError):
        return idempotent or isinstance(exc.__cause__, _NOT_SENT)
    return idempotent and exc.status in RETRY_STATUSES


def parse_retry_after(value: str | None, *, now: float | None = None) -> float | None:
    """Seconds from a ``Retry-After`` header (delta-seconds or an HTTP date), or None."""
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value).timestamp()
    except (TypeError, ValueError, IndexError):
        return None
    return max(0.0, when - (time.time() if now is None else now))


def backoff_delay(attempt: int, retry_after: float | None = None, *, base: float = BACKOFF_BASE_S,
                  cap: float = BACKOFF_CAP_S, rng: random.Random | None = None) -> float:
    """Seconds to wait before retry number ``attempt`` (0-based): exponential with jitter, capped.

    A server's ``Retry-After`` wins (up to 60 s).
    """
    if retry_after is not None:
        return min(retry_after, MAX_RETRY_AFTER_S)
    delay = min(cap, base * (2 ** attempt))
    return delay * (0.5 + 0.5 * (rng or random).random())


CAPACITY_BACKOFF_BASE_S = 0.5
CAPACITY_BACKOFF_CAP_S = 10.0


def is_capacity_error(exc: PillDropsError) -> bool:
    """No room right now (503 ``capacity_unavailable`` or 429 ``rate_limited``): worth waiting for."""
    return exc.code == "capacity_unavailable" or exc.status == 429


OUTAGE_WAIT_S = 30.0      # how long a create or a kill rides out a control plane or node restarting


def is_outage_error(exc: PillDropsError) -> bool:
    """The deployment is not answering right now (no HTTP answer, or 502 ``node_unavailable``): a control
    plane or node agent restarting. An idempotent call may wait for it to come back."""
    return isinstance(exc, TransportError) or exc.code == "node_unavailable"


def check_capacity_wait(capacity_wait: float) -> float:
    """``capacity_wait`` must be a finite number of seconds >= 0."""
    if isinstance(capacity_wait, bool) or not isinstance(capacity_wait, (int, float)) \
            or not 0 <= capacity_wait < float("inf"):
        raise InvalidRequest(f"capacity_wait must be a number of seconds >= 0, got {capacity_wait!r}")
    return float(capacity_wait)


class RetryPolicy:
    """Decides, failure after failure of one logical request, whether to send it again and after how long.

    Ordinary failures follow :func:`should_retry` for at most ``max_retries`` retries with
    :func:`backoff_delay`. With a ``capacity_wait`` (a create), capacity failures (see
    :func:`is_capacity_error`) of an idempotent request are instead retried with backoff (``Retry-After``
    honoured) for as long as the delays slept for them add up to at most ``capacity_wait`` seconds (the
    last delay is shortened to fit; 0 never waits). With ``capacity_wait=None`` they are ordinary failures.

    With an ``outage_wait`` (a create, a kill), an idempotent request whose ordinary retries ran out on an
    outage (see :func:`is_outage_error`: a control plane or node restarting) goes on retrying until that many
    seconds have passed since its first failure: a restart takes a few seconds, and a create that gave up
    meanwhile left a sandbox running that nobody holds (its idempotent retry would have returned it).
    """

    def __init__(self, max_retries: int, *, idempotent: bool, capacity_wait: float | None = None,
                 outage_wait: float | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.max_retries = max_retries
        self.idempotent = idempotent
        self.capacity_wait = capacity_wait
        self.outage_wait = outage_wait
        self.retries = 0
        self.capacity_retries = 0
        self.capacity_waited = 0.0
        self._clock = clock
        self._first_failure: float | None = None
        self._slept = 0.0

    def next_delay(self, exc: PillDropsError, retry_after: float | None) -> float | None:
        """Seconds to wait before the next attempt, or None to give up (raise ``exc``)."""
        if self._first_failure is None:
            self._first_failure = self._clock()
        delay = self._next_delay(exc, retry_after)
        if delay is None and self.outage_wait and self.idempotent and is_outage_error(exc):
            delay = self._outage_delay()
        if delay is not None:
            self._slept += delay
        return delay

    def _outage_delay(self) -> float | None:
        # time since the first failure: the clock's, or the delays slept if they say more (tests fake sleep)
        elapsed = max(self._clock() - (self._first_failure or 0.0), self._slept)
        remaining = self.outage_wait - elapsed  # type: ignore[operator]
        if remaining <= 0:
            return None
        return min(remaining, backoff_delay(3, None, base=BACKOFF_BASE_S, cap=1.0))

    def _next_delay(self, exc: PillDropsError, retry_after: float | None) -> float | None:
        if self.capacity_wait is not None and self.idempotent and is_capacity_error(exc):
            remaining = self.capacity_wait - self.capacity_waited
            if remaining <= 0:
                return None
            delay = min(remaining, backoff_delay(self.capacity_retries, retry_after,
                                                 base=CAPACITY_BACKOFF_BASE_S, cap=CAPACITY_BACKOFF_CAP_S))
            self.capacity_retries += 1
            self.capacity_waited += delay
            return delay
        if self.retries >= self.max_retries or not should_retry(exc, idempotent=self.idempotent):
            return None
        delay = backoff_delay(self.retries, retry_after)
        self.retries += 1
        return delay


# ---------------------------------------------------------------------------------------------- batch

BATCH_CHUNK = 100     # items per POST /v1/sandboxes/batch


def batch_timeout(config: Any, count: int, capacity_wait: float) -> httpx.Timeout:
    """A batch answers once every item is made or failed: allow the waiting plus ~0.5 s per item."""
    return httpx.Timeout(config.request_timeout + capacity_wait + 0.5 * count, connect=10.0)


# ---------------------------------------------------------------------------------------------- run


class hybridmethod:
    """A method with one name on the class and on its instances (``Sandbox.resume(id)`` and
    ``sb.resume()``): the first function is bound to the class, the second to the instance."""

    def __init__(self, on_class: Callable[..., Any], on_instance: Callable[..., Any]) -> None:
        self.on_class, self.on_instance = on_class, on_instance
        self.__doc__ = on_instance.__doc__

    def __get__(self, obj: Any, objtype: type | None = None) -> Callable[..., Any]:
        import types
        if obj is None:
            return types.MethodType(self.on_class, objtype)
        return types.MethodType(self.on_instance, obj)


@dataclass(frozen=True)
class RunResult:
    """What a finished command produced.

    ``stdout``/``stderr`` are UTF-8 decoded with replacement characters; the raw bytes are in
    ``stdout_bytes``/``stderr_bytes``. ``duration`` is in seconds. ``truncated`` means output passed
    ``max_output_bytes`` and the rest was dropped; ``timed_out`` means the command hit its ``timeout``
    (``exit_code`` is then 124); ``paused`` means the sandbox was paused while the command ran, which
    ended it (``exit_code`` 137); ``oom_killed`` means the sandbox's memory limit (``memory_mb``) killed the
    command or one of its processes (``exit_code`` 137; the sandbox lives on). A non-zero exit is data; call
    :meth:`check_returncode` to raise.
    """

    exit_code: int
    stdout: str = ""
    stderr: str = ""
    stdout_bytes: bytes = b""
    stderr_bytes: bytes = b""
    duration: float = 0.0
    truncated: bool = False
    timed_out: bool = False
    paused: bool = False
    oom_killed: bool = False
    cmd: str | list[str] | None = field(default=None, compare=False)

    @property
    def ok(self) -> bool:
        return self.exit_code == 0

    def check_returncode(self) -> RunResult:
        """Raise :class:`CommandFailed` (with ``.result``) when ``exit_code`` is not 0; else return self."""
        if self.exit_code != 0:
            what = ("timed out" if self.timed_out else "was ended by a pause of its sandbox" if self.paused
                    else "was killed by the sandbox's memory limit (memory_mb)" if self.oom_killed
                    else f"exited with code {self.exit_code}")
            tail = self.stderr.strip().splitlines()[-1:] if self.stderr.strip() else []
            msg = f"command {self.cmd!r} {what}" + (f": {tail[0][:300]}" if tail else "")
            raise CommandFailed(msg, result=self)
        return self

    def __repr__(self) -> str:
        return (f"RunResult(exit_code={self.exit_code}, stdout={len(self.stdout_bytes)}B, "
                f"stderr={len(self.stderr_bytes)}B, duration={self.duration:.3f}s"
                + (", truncated" if self.truncated else "") + (", timed_out" if self.timed_out else "")
                + (", paused" if self.paused else "") + (", oom_killed" if self.oom_killed else "") + ")")


class _Stream:
    def __init__(self, callback: Callable[[str], Any] | None, cap: int) -> None:
        self.callback = callback
        self.cap = cap
        self.chunks: list[bytes] = []
        self.size = 0
        self.truncated = False
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, data: bytes) -> None:
        room = self.cap - self.size
        if len(data) > room:
            data, self.truncated = data[:max(room, 0)], True
        if data:
            self.chunks.append(data)
            self.size += len(data)
            if self.callback is not None:
                text = self.decoder.decode(data)
                if text:
                    self.callback(text)

    def finish(self) -> bytes:
        if self.callback is not None:
            tail = self.decoder.decode(b"", final=True)
            if tail:
                self.callback(tail)
        return b"".join(self.chunks)


_EVENT_FIELDS: dict[str, tuple[type, ...]] = {      # a plain event's fields and the JSON types each may have
    "pid": (int,), "data": (str,), "exit_code": (int,), "duration": (float, int), "truncated": (bool,),
    "timed_out": (bool,), "paused": (bool,), "oom_killed": (bool,)}
MAX_EVENT_LINE = 1 << 20        # the node's longest line is one 64 KiB chunk in base64 (~88 KiB)
AFTER_EXIT_MAX = 65536          # bytes read after the exit event before the stream is given up on


def _plain_event(line: str | bytes) -> dict[str, Any] | None:
    """A start/stdout/stderr/exit event as a dict, parsed without a model (issue 15: a run's events cost
    ~2× less so); None when it is anything else (an error event, an unknown field, a field of the wrong
    type): the caller then validates it with :class:`RunEvent`, which says what is wrong."""
    try:
        obj = json.loads(line)
    except ValueError:
        return None
    if type(obj) is not dict or obj.get("type") not in ("start", "stdout", "stderr", "exit"):
        return None
    for k, v in obj.items():
        if k != "type" and v is not None and (type(v) not in _EVENT_FIELDS.get(k, ())):
            return None
    return obj


class RunDecoder:
    """Turns the NDJSON lines of ``POST .../run`` into callbacks and a :class:`RunResult`.

    Feed it each line with :meth:`feed`, or the body's raw chunks with :meth:`feed_bytes`; an ``error``
    event raises the matching PillDrops error. Callbacks receive decoded text chunks; a multi-byte
    character split across chunks is decoded whole.
    """

    def __init__(self, *, cmd: str | list[str] | None = None, on_stdout: Callable[[str], Any] | None = None,
                 on_stderr: Callable[[str], Any] | None = None,
                 max_output_bytes: int = DEFAULT_OUTPUT_CAP) -> None:
        self.cmd = cmd
        self.pid: int | None = None
        self._out = _Stream(on_stdout, max_output_bytes)
        self._err = _Stream(on_stderr, max_output_bytes)
        self._exit: dict[str, Any] | None = None
        self._partial = bytearray()         # feed_bytes: the line not yet ended
        self._after = 0                     # feed_bytes: bytes seen after the exit event

    @property
    def done(self) -> bool:
        return self._exit is not None

    def feed_bytes(self, chunk: bytes) -> bool:
        """Feed raw body bytes (split into lines here, each bounded by ``MAX_EVENT_LINE``); False once the
        caller may stop reading: the exit event came and more than ``AFTER_EXIT_MAX`` bytes followed it.
        Call :meth:`end_bytes` at the end of the body (a last line without a newline)."""
        if self._exit is not None:
            self._after += len(chunk)
            return self._after <= AFTER_EXIT_MAX
        start = 0
        while (nl := chunk.find(b"\n", start)) >= 0:
            if self._partial:
                self._partial += chunk[start:nl]
                line, self._partial = bytes(self._partial), bytearray()
            else:
                line = chunk[start:nl]
            start = nl + 1
            self.feed(line)
            if self._exit is not None:      # the stream ends here; the rest is read and dropped
                self._after = len(chunk) - start
                return self._after <= AFTER_EXIT_MAX
        if len(self._partial) + len(chunk) - start > MAX_EVENT_LINE:
            raise ServerError(f"a run event longer than {MAX_EVENT_LINE} bytes")
        self._partial += chunk[start:]
        return True

    def end_bytes(self) -> None:
        """The body ended: feed the line it did not end with a newline, if any."""
        line, self._partial = bytes(self._partial), bytearray()
        if self._exit is None:
            self.feed(line)

    def feed(self, line: str | bytes) -> None:
        if isinstance(line, str):
            line = line.encode("utf-8", "surrogateescape")
        if not line.strip():
            return
        event = _plain_event(line)
        if event is None:
            try:
                event = RunEvent.model_validate_json(line).model_dump()
            except (pydantic.ValidationError, ValueError) as exc:
                raise ServerError(f"malformed run event: {line[:200].decode('utf-8', 'replace')!r}") from exc
        typ = event["type"]
        if typ == "start":
            self.pid = event.get("pid")
        elif typ in ("stdout", "stderr"):
            import base64
            import binascii

            try:
                data = base64.b64decode(event.get("data") or "", validate=True)
            except (binascii.Error, ValueError) as exc:
                raise ServerError("malformed base64 in run output") from exc
            (self._out if typ == "stdout" else self._err).feed(data)
        elif typ == "exit":
            self._exit = event
        elif typ == "error":
            code = event.get("code")
            raise from_wire(0, {"error": {"code": code, "message": event.get("message") or code}})

    def result(self) -> RunResult:
        """The final result; raises :class:`TransportError` if the stream ended without an ``exit`` event."""
        out, err = self._out.finish(), self._err.finish()
        if self._exit is None:
            raise TransportError("the run stream ended before the command's exit was reported")
        ev = self._exit
        code = ev.get("exit_code")
        return RunResult(
            exit_code=code if code is not None else -1,
            stdout=out.decode("utf-8", "replace"), stderr=err.decode("utf-8", "replace"),
            stdout_bytes=out, stderr_bytes=err, duration=float(ev.get("duration") or 0.0),
            truncated=bool(ev.get("truncated")) or self._out.truncated or self._err.truncated,
            timed_out=bool(ev.get("timed_out")), paused=bool(ev.get("paused")),
            oom_killed=bool(ev.get("oom_killed")), cmd=self.cmd,
        )


# ---------------------------------------------------------------------------------------------- tar

CHUNK_SIZE = 1 << 20


@dataclass(frozen=True)
class UploadPlan:
    """A packed upload: the tar file on local disk, the remote directory to unpack it under, member count."""

    tar_path: str
    dest: str
    entries: int

    def cleanup(self) -> None:
        try:
            os.unlink(self.tar_path)
        except FileNotFoundError:
            pass


def _reset_owner(ti: tarfile.TarInfo) -> tarfile.TarInfo:
    ti.uid = ti.gid = 0
    ti.uname = ti.gname = ""
    return ti


def pack_upload(local: str | os.PathLike[str], remote: str) -> UploadPlan:
    """Pack ``local`` (a file or a directory) into a temporary tar file for ``PUT .../archive``.

    - a directory: its *contents* with names relative to it, unpacked under ``remote`` (so ``remote``
      becomes the directory);
    - a file: one member named ``basename(remote)`` unpacked under ``dirname(remote)``; a ``remote``
      ending in ``/`` is a directory and keeps the local file name.

    Symlinks are stored as symlinks, never followed. The caller must ``cleanup()`` the plan.
    """
    src = Path(local)
    if not src.exists() and not src.is_symlink():
        raise FileNotFoundError(f"no such file or directory: {src}")
    if not remote:
        raise InvalidRequest("remote path must not be empty")
    fd, tar_path = tempfile.mkstemp(prefix="pilldrops-upload-", suffix=".tar")
    entries = 0
    try:
        with os.fdopen(fd, "wb") as f, tarfile.open(fileobj=f, mode="w", format=tarfile.PAX_FORMAT) as tar:
            if src.is_dir() and not src.is_symlink():
                dest = remote if remote == "/" else remote.rstrip("/")
                for root, dirs, files in os.walk(src, followlinks=False):
                    dirs.sort()
                    rel_root = os.path.relpath(root, src)
                    for name in sorted(dirs) + sorted(files):
                        path = os.path.join(root, name)
                        arc = name if rel_root == "." else posixpath.join(Path(rel_root).as_posix(), name)
                        tar.add(path, arcname=arc, recursive=False, filter=_reset_owner)
                        entries += 1
            else:
                if remote.endswith("/"):
                    dest, arc = remote.rstrip("/") or "/", src.name
                else:
                    dest, arc = posixpath.dirname(remote) or ".", posixpath.basename(remote)
                tar.add(str(src), arcname=arc, recursive=False, filter=_reset_owner)
                entries = 1
    except BaseException:
        os.unlink(tar_path)
        raise
    return UploadPlan(tar_path=tar_path, dest=dest, entries=entries)


def iter_file(path: str, chunk_size: int = CHUNK_SIZE) -> Iterator[bytes]:
    """A file's bytes in chunks (a request body streamed from disk, not held in memory)."""
    with open(path, "rb") as f:
        while chunk := f.read(chunk_size):
            yield chunk


async def aiter_file(path: str, chunk_size: int = CHUNK_SIZE) -> AsyncIterator[bytes]:
    """Async twin of :func:`iter_file`; disk reads run in a worker thread."""
    with open(path, "rb") as f:  # noqa: ASYNC230 - a local temp file, read in chunks
        while chunk := await anyio.to_thread.run_sync(f.read, chunk_size):
            yield chunk


def download_tempfile(local: str | os.PathLike[str]) -> tuple[str, Any]:
    """A temporary file next to ``local`` (same filesystem, so the final move is a rename)."""
    parent = Path(local).absolute().parent
    parent.mkdir(parents=True, exist_ok=True)
    fd, path = tempfile.mkstemp(prefix=".pilldrops-download-", suffix=".tar", dir=parent)
    return path, os.fdopen(fd, "wb")


def extract_download(tar_path: str, remote: str, local: str | os.PathLike[str]) -> Path:
    """Safely unpack a ``GET .../archive`` tar (holding ``basename(remote)``) so ``local`` becomes it.

    Extraction uses tarfile's ``data`` filter: absolute names, ``../`` members, links out of the
    destination and device files are refused with :class:`InvalidRequest`. If ``local`` is an existing
    directory, a downloaded directory is merged into it and a downloaded file is placed inside it.
    """
    dst = Path(local).absolute()
    dst.parent.mkdir(parents=True, exist_ok=True)
    workdir = tempfile.mkdtemp(prefix=".pilldrops-extract-", dir=dst.parent)
    try:
        try:
            with tarfile.open(tar_path, mode="r:*") as tar:
                tar.extractall(workdir, filter="data")
        except tarfile.FilterError as exc:
            raise InvalidRequest(f"refusing unsafe archive from the sandbox: {exc}") from exc
        except tarfile.TarError as exc:
            raise ServerError(f"the sandbox returned a broken archive: {exc}") from exc
        name = posixpath.basename(remote.rstrip("/"))
        top = Path(workdir) / name if name else Path(workdir)
        if name and not (top.exists() or top.is_symlink()):
            found = os.listdir(workdir)
            if len(found) != 1:
                raise ServerError(f"archive for {remote!r} does not hold {name!r}")
            top = Path(workdir) / found[0]
        if dst.is_dir() and not dst.is_symlink():
            if top.is_dir() and not top.is_symlink():
                shutil.copytree(top, dst, symlinks=True, dirs_exist_ok=True)
                return dst
            final = dst / top.name
            if final.is_dir() and not final.is_symlink():
                shutil.rmtree(final)
            os.replace(top, final)
            return final
        if dst.is_symlink() or dst.exists():
            dst.unlink()
        if top == Path(workdir):
            os.rename(workdir, dst)
            workdir = ""
        else:
            os.replace(top, dst)
        return dst
    finally:
        if workdir:
            shutil.rmtree(workdir, ignore_errors=True)


# ---------------------------------------------------------------------------------------------- pools


class ClientCache:
    """One shared ``httpx.Client`` (one connection pool) per (api_url, api_key, transport); thread-safe."""

    def __init__(self, factory: Callable[..., Any]) -> None:
        self._factory = factory
        self._lock = threading.Lock()
        self._clients: dict[tuple[str, str, int], Any] = {}

    def get(self, config: ClientConfig) -> Any:
        with self._lock:
            client = self._clients.get(config.pool_key)
            if client is None or client.is_closed:
                client = self._clients[config.pool_key] = self._factory(**http_client_kwargs(config))
            return client

    def clear(self) -> None:
        """Forget (and close) every cached client."""
        with self._lock:
            clients, self._clients = list(self._clients.values()), {}
        for c in clients:
            c.close()

    def __len__(self) -> int:
        return len(self._clients)


class AsyncClientCache:
    """One shared ``httpx.AsyncClient`` per running event loop and (api_url, api_key, transport).

    An AsyncClient's connections belong to the loop that opened them, so loops never share one. Entries
    vanish with their loop. Outside asyncio (e.g. trio) a fresh client is made per sandbox.
    """

    def __init__(self, factory: Callable[..., Any]) -> None:
        self._factory = factory
        self._lock = threading.Lock()
        self._by_loop: weakref.WeakKeyDictionary[Any, dict[tuple[str, str, int], Any]] = \
            weakref.WeakKeyDictionary()

    def get(self, config: ClientConfig) -> Any:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return self._factory(**http_client_kwargs(config))
        with self._lock:
            clients = self._by_loop.setdefault(loop, {})
            client = clients.get(config.pool_key)
            if client is None or client.is_closed:
                client = clients[config.pool_key] = self._factory(**http_client_kwargs(config))
            return client

    def clear(self) -> None:
        with self._lock:
            self._by_loop = weakref.WeakKeyDictionary()

    def __len__(self) -> int:
        return sum(len(v) for v in self._by_loop.values())


class Shield:
    """No-op twin of :class:`AsyncShield` (sync code cannot be cancelled mid-call)."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


class AsyncShield:
    """Shields cleanup (the kill in ``__aexit__``) from an enclosing cancellation."""

    def __init__(self) -> None:
        self._scope = anyio.CancelScope(shield=True)

    def __enter__(self) -> None:
        self._scope.__enter__()

    def __exit__(self, *exc: object) -> bool | None:
        return self._scope.__exit__(*exc)  # type: ignore[arg-type]


class Cleanup:
    """Runs cleanup inline. Twin of :class:`AsyncCleanup` (sync code cannot be cancelled mid-call)."""

    @staticmethod
    def run(fn: Callable[..., T], *args: Any) -> T:
        return fn(*args)


class AsyncCleanup:
    """Runs cleanup (the kill on leaving ``async with``) to completion even when the caller is cancelled.

    Under trio (or anyio cancel scopes), an anyio shield suffices. Native asyncio cancellation
    (``task.cancel()``, e.g. twice by ``asyncio.run`` on Ctrl-C, or by ``gather``) goes through an anyio
    shield, so on asyncio the cleanup runs as its own task that the caller waits for with
    ``asyncio.shield`` in a loop that swallows cancellations until the cleanup is done; then the
    cancellation is re-raised. If the cleanup task itself is cancelled (``asyncio.run`` cancels every
    task on shutdown), it is started again, up to :attr:`MAX_RESTARTS` times: cleanups must be idempotent.
    """

    MAX_RESTARTS = 3

    @staticmethod
    async def run(fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        try:
            loop = asyncio.get_running_loop()
            current = asyncio.current_task()
        except RuntimeError:
            loop = current = None
        with anyio.CancelScope(shield=True):
            if loop is None or current is None:  # trio: the anyio shield is enough
                return await fn(*args)
            base = current.cancelling()
            task = loop.create_task(fn(*args))
            restarts = 0
            cancelled: BaseException | None = None
            while True:
                if task.cancelled():  # the cleanup itself was cancelled: run it again
                    if restarts >= AsyncCleanup.MAX_RESTARTS:
                        raise cancelled or asyncio.CancelledError()
                    restarts += 1
                    task = loop.create_task(fn(*args))
                try:
                    result = await asyncio.shield(task)
                    break
                except asyncio.CancelledError as exc:
                    if current.cancelling() > base and cancelled is None:
                        cancelled = exc  # the caller was cancelled: finish the cleanup, then re-raise
                except BaseException:
                    if cancelled is not None:
                        raise cancelled from None
                    raise
        if cancelled is not None:
            raise cancelled
        return result


class Blocking:
    """Runs blocking local work (tar packing, extraction) inline. Twin of :class:`AsyncBlocking`."""

    @staticmethod
    def run(fn: Callable[..., T], *args: Any) -> T:
        return fn(*args)


class AsyncBlocking:
    """Runs blocking local work (tar packing, extraction) in a worker thread, off the event loop."""

    @staticmethod
    async def run(fn: Callable[..., T], *args: Any) -> T:
        return await anyio.to_thread.run_sync(functools.partial(fn, *args))
