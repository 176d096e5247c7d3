"""E2B's control-plane REST API (``/sandboxes``, ``/v2/sandboxes``), mapped onto the same services as
``/v1``: the same keys, credits, billing, history, placement, pools and idempotency.

Its own small app (mounted by ``routing`` on the same port, by path), because E2B clients read errors in
E2B's shape: ``{"code": <http status>, "message": …}``. The body also carries our typed
``{"error": {code, message, details, request_id}}``, so both kinds of client can read it.

Mapping:
- ids: ``sb_abc…`` is ``sbabc…`` on this surface (E2B ids are ``[a-z0-9]+``); both are accepted;
- templates: ``code-interpreter-v1`` -> ``code-interpreter``; other names as they are (``base``, ...);
- the sandbox's access token is E2B's ``envdAccessToken``; ``timeout`` defaults to 300 s;
- egress: ``allow_internet_access`` and ``network.allowOut`` / ``network.denyOut`` map onto the sandbox's
  policy (allow wins over deny, as E2B). Absent, ``allow_internet_access`` is off (PillDrops' default; E2B's
  server defaults to on). On a ``--no-egress`` deployment an ``allow_internet_access: true`` is ignored
  (older E2B SDKs send it on every create), an ``allowOut`` is refused (``egress_forbidden``);
- unknown fields are ignored, as E2B does; ``autoPause``, ``mcp``, ``volumeMounts`` have no effect, and of
  ``network`` only ``allowOut`` / ``denyOut`` (above) and ``allowPublicTraffic`` (default true: the sandbox's
  ports are public; false: they need a port URL's token) (see the README's "Coming from E2B").
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qsl

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from pilldrops import errors
from pilldrops._internal.http import RequestIdMiddleware, request_id_var
from pilldrops.e2b.context import ENVD_VERSION, from_e2b_id, to_e2b_id
from pilldrops.schema.api import CreateSandboxRequest, NetworkPolicy, SandboxState, refuse_nul
from pilldrops.server.domain.states import ENDED

if TYPE_CHECKING:
    from pilldrops.server.api.app import Services
    from pilldrops.server.service.auth import Principal
    from pilldrops.server.store.interface import SandboxRecord as Sandbox

log = logging.getLogger("pilldrops.e2b")
S = SandboxState
TEMPLATE_ALIASES = {"code-interpreter-v1": "code-interpreter", "code-interpreter": "code-interpreter"}
DEFAULT_TIMEOUT_S = 300
CLIENT_ID = "pilldrops"
MAX_BODY = 1024 * 1024
# E2B shows two states; ours map onto them (anything else is not listed)
LISTED = {"running": [S.running.value, S.starting.value, S.pausing.value],
          "paused": [S.paused.value, S.resuming.value]}
PREFIXES = ("/sandboxes", "/v2/sandboxes")


def is_rest_path(path: str) -> bool:
    return any(path == p or path.startswith(p + "/") for p in PREFIXES)


def _ts(t: datetime | None) -> str | None:
    if t is None:
        return None
    if t.tzinfo is None:
        t = t.replace(tzinfo=UTC)
    return t.astimezone(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def e2b_error(exc: errors.PillDropsError, status: int | None = None) -> JSONResponse:
    exc.request_id = exc.request_id or request_id_var.get()
    status = status or exc.status or 500
    body = {"code": status, "message": exc.message, **exc.to_body()}
    headers = {}
    if status >= 500 and not exc.retryable:
        headers["Should-Retry"] = "false"       # the SDK retries bare 5xx: never re-run a failed create
    elif exc.retryable and status in (429, 503):
        headers["Retry-After"] = "1"
    return JSONResponse(body, status_code=status, headers=headers)


def encode_key(key: str) -> str:
    """A PillDrops key in the form E2B SDKs 2.25 to 2.45 insist on (``e2b_`` + lowercase hex)."""
    return "e2b_" + key.encode().hex()


def decode_key(key: str) -> str:
    """``e2b_<hex of a PillDrops key>`` -> that key; anything else as it is."""
    rest = key[4:]
    if key.startswith("e2b_") and rest and len(rest) % 2 == 0 and len(rest) <= 512:
        try:
            decoded = bytes.fromhex(rest).decode()
        except ValueError:
            return key
        if decoded.startswith("pd_"):
            return decoded
    return key


def e2b_template(name: str) -> str:
    return TEMPLATE_ALIASES.get(name, name)


def _aware(t: datetime | None) -> datetime | None:
    return t.replace(tzinfo=UTC) if t is not None and t.tzinfo is None else t


class E2BApi:
    def __init__(self, services: Services, on_created: Callable[[Sandbox], None] | None = None) -> None:
        self.s = services
        self.sbx = services.sandboxes
        self.on_created = on_created

    # ---- plumbing ------------------------------------------------------------------------------------

    async def principal(self, request: Request) -> Principal:
        key = request.headers.get("x-api-key")
        if not key:
            auth = request.headers.get("authorization", "")
            key = auth[7:].strip() if auth[:7].lower() == "bearer " else None
        try:
            return await self.s.auth.authenticate(decode_key(key) if key else key)
        except errors.AuthenticationError as exc:
            raise errors.AuthenticationError("Invalid API key") from exc

    @staticmethod
    async def body(request: Request) -> dict[str, Any]:
        raw = bytearray()
        async for chunk in request.stream():
            raw += chunk
            if len(raw) > MAX_BODY:
                raise errors.PayloadTooLarge(f"request body is larger than {MAX_BODY} bytes")
        if not raw.strip():
            return {}
        try:
            data = json.loads(raw)
        except ValueError as exc:
            raise errors.InvalidRequest(f"malformed JSON body: {exc}") from exc
        if not isinstance(data, dict):
            raise errors.InvalidRequest("the body must be a JSON object")
        return data

    @staticmethod
    def _int(data: dict[str, Any], key: str, default: int | None = None) -> int | None:
        v = data.get(key, default)
        if v is None:
            return default
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0:
            raise errors.InvalidRequest(f"{key} must be a non-negative number of seconds")
        return int(v)

    async def row(self, p: Principal, e2b_id: str) -> Sandbox:
        """The team's sandbox; an ended one is not found (as on E2B)."""
        row = await self.sbx.get_row(p.team_id, from_e2b_id(e2b_id))
        if S(row.state) in ENDED:
            raise errors.SandboxNotFound(f"sandbox {e2b_id!r} not found")
        return row

    # ---- views ---------------------------------------------------------------------------------------

    @staticmethod
    def sandbox(row: Sandbox, alias: str | None = None) -> dict[str, Any]:
        return {"templateID": alias or row.template, "sandboxID": to_e2b_id(row.id), "clientID": CLIENT_ID,
                "envdVersion": ENVD_VERSION, "envdAccessToken": row.access_token, "trafficAccessToken": None,
                "domain": None, "alias": alias or row.template}

    def detail(self, row: Sandbox, *, token: bool) -> dict[str, Any]:
        state = "paused" if row.state in LISTED["paused"] else "running"
        end = row.end_at
        if state == "paused" and row.timeout_left is not None:
            end = self.sbx.clock.now() + timedelta(seconds=row.timeout_left)
        meta = dict(row.metadata_ or {})
        net = getattr(row, "network", None)
        out = {"templateID": row.template, "alias": row.template, "sandboxID": to_e2b_id(row.id),
               "clientID": CLIENT_ID, "startedAt": _ts(row.started_at or row.created_at), "endAt": _ts(end),
               "envdVersion": ENVD_VERSION, "cpuCount": max(1, round(row.vcpu)), "memoryMB": row.memory_mb,
               "diskSizeMB": 0, "state": state, "metadata": meta,
               "lifecycle": {"autoResume": False, "onTimeout": "kill"}, "volumeMounts": [],
               "allowInternetAccess": bool(net and net.get("allow_internet_access")),
               "envdUnresponsiveAtPause": False}
        if net:     # absent, never null: the stock clients parse a present "network" as an object
            out["network"] = {"allowOut": net.get("allow_out") or [], "denyOut": net.get("deny_out") or []}
        if token:
            out.update(envdAccessToken=row.access_token, domain=None)
        return out

    # ---- endpoints -----------------------------------------------------------------------------------

    async def create(self, request: Request) -> Response:
        p = await self.principal(request)
        data = await self.body(request)
        asked = data.get("templateID") or "base"
        if not isinstance(asked, str):
            raise errors.InvalidRequest("templateID must be a string")
        metadata = data.get("metadata") or {}
        envs = data.get("envVars") or {}
        if not isinstance(metadata, dict) or not isinstance(envs, dict):
            raise errors.InvalidRequest("metadata and envVars must be objects")
        network = data.get("network") if isinstance(data.get("network"), dict) else {}
        try:   # user ports are public unless network.allowPublicTraffic is false, as on E2B
            req = CreateSandboxRequest(template=e2b_template(asked), metadata=metadata, envs=envs,
                                       timeout=self._int(data, "timeout", DEFAULT_TIMEOUT_S) or DEFAULT_TIMEOUT_S,
                                       public=network.get("allowPublicTraffic", True) is not False,
                                       **self._egress(data))
        except ValidationError as exc:
            first = exc.errors()[0] if exc.errors() else {}
            raise errors.InvalidRequest(f"invalid request: {'.'.join(map(str, first.get('loc', ())))}: "
                                        f"{first.get('msg', 'invalid')}") from exc
        key = request.headers.get("idempotency-key")
        row, created = await self.sbx.create(p.team_id, req, key[:256] if key else None)
        if created and self.on_created is not None:
            self.on_created(row)
        return JSONResponse(self.sandbox(row, asked), status_code=201)

    def _egress(self, data: dict[str, Any]) -> dict[str, Any]:
        """E2B's egress fields as ours (only those the body names: the rest stay the template's)."""
        out: dict[str, Any] = {}
        internet = data.get("allow_internet_access")
        if internet is not None:
            if not isinstance(internet, bool):
                raise errors.InvalidRequest("allow_internet_access must be a boolean")
            out["allow_internet_access"] = internet and self.sbx.ctx.egress.enabled
        net = data.get("network")
        if isinstance(net, dict) and ("allowOut" in net or "denyOut" in net):
            allow, deny = net.get("allowOut") or [], net.get("denyOut") or []
            if not isinstance(allow, list) or not isinstance(deny, list):
                raise errors.InvalidRequest("network.allowOut and network.denyOut must be lists of CIDRs")
            out["network"] = NetworkPolicy(allow_out=allow, deny_out=deny)
        return out

    async def connect(self, request: Request, sandbox_id: str, *, legacy_resume: bool = False) -> Response:
        """Running: extend its life to at least ``timeout`` from now (200). Paused: resume it (201)."""
        p = await self.principal(request)
        data = await self.body(request)
        timeout = self._int(data, "timeout")
        row = await self.row(p, sandbox_id)
        status = 200
        if row.state in LISTED["paused"]:
            row = await self.sbx.resume(p.team_id, row.id)
            status = 201
        elif legacy_resume:
            raise errors.Conflict(f"sandbox {sandbox_id} is already running")
        if timeout:
            end = _aware(row.end_at)
            if end is None or self.sbx.clock.now() + timedelta(seconds=timeout) > end:
                row = await self.sbx.set_timeout(p.team_id, row.id, timeout)
        if row.state != S.running.value:
            row = await self.sbx.connect(p.team_id, row.id)        # a 409 naming its state
        return JSONResponse(self.sandbox(row), status_code=status)

    async def kill(self, request: Request, sandbox_id: str) -> Response:
        p = await self.principal(request)
        row = await self.row(p, sandbox_id)
        await self.sbx.kill(p.team_id, row.id)
        return Response(status_code=204)

    async def set_timeout(self, request: Request, sandbox_id: str) -> Response:
        p = await self.principal(request)
        data = await self.body(request)
        timeout = self._int(data, "timeout")
        if not timeout:
            raise errors.InvalidRequest("timeout (seconds, > 0) is required")
        row = await self.row(p, sandbox_id)
        await self.sbx.set_timeout(p.team_id, row.id, timeout)
        return Response(status_code=204)

    async def refresh(self, request: Request, sandbox_id: str) -> Response:
        """Keep-alive: its end is at least ``duration`` (default 60 s) from now."""
        p = await self.principal(request)
        data = await self.body(request)
        duration = self._int(data, "duration", 60) or 60
        row = await self.row(p, sandbox_id)
        end = _aware(row.end_at)
        if row.state == S.running.value and (end is None or
                                             self.sbx.clock.now() + timedelta(seconds=duration) > end):
            await self.sbx.set_timeout(p.team_id, row.id, duration)
        return Response(status_code=204)

    async def get(self, request: Request, sandbox_id: str) -> Response:
        p = await self.principal(request)
        return JSONResponse(self.detail(await self.row(p, sandbox_id), token=True))

    async def list(self, request: Request, *, v2: bool) -> Response:
        p = await self.principal(request)
        q = request.query_params
        labels = dict(parse_qsl(q.get("metadata", ""), keep_blank_values=True))
        try:                    # %2500: a NUL once decoded twice, past NulGuard
            refuse_nul((*labels, *labels.values()), "metadata filters")
        except ValueError as exc:
            raise errors.InvalidRequest(str(exc)) from exc
        wanted = [s.strip() for s in q.get("state", "").split(",") if s.strip()] if v2 else ["running"]
        bad = [s for s in wanted if s not in LISTED]
        if bad:
            raise errors.InvalidRequest(f"unknown state {bad[0]!r}", details={"allowed": list(LISTED)})
        states = [st for name in (wanted or list(LISTED)) for st in LISTED[name]]
        try:
            limit = min(max(int(q.get("limit", "100")), 1), 1000)
        except ValueError as exc:
            raise errors.InvalidRequest("limit must be an integer") from exc
        try:
            page = await self.sbx.store.list_sandboxes(p.team_id, states=states, labels=labels, limit=limit,
                                                       cursor=q.get("nextToken") or None)
        except ValueError as exc:       # a nextToken this listing did not give (was a 500)
            raise errors.InvalidRequest("invalid nextToken") from exc
        headers = {"X-Next-Token": page.next_cursor} if v2 and page.next_cursor else {}
        return JSONResponse([self.detail(r, token=False) for r in page.items], headers=headers)

    async def pause(self, request: Request, sandbox_id: str) -> Response:
        p = await self.principal(request)
        row = await self.row(p, sandbox_id)
        if row.state in LISTED["paused"]:
            raise errors.Conflict(f"sandbox {sandbox_id} is already paused")
        await self.sbx.pause(p.team_id, row.id)
        return Response(status_code=204)

    async def metrics(self, request: Request, sandbox_id: str) -> Response:
        p = await self.principal(request)
        await self.row(p, sandbox_id)
        raise errors.NotSupported("sandbox metrics are not collected by PillDrops; use `pilldrops history` "
                                  "for usage and cost")


def create_rest_app(services: Services, on_created: Callable[[Sandbox], None] | None = None) -> FastAPI:
    """``on_created``: called (synchronously, must not block) with each sandbox made here."""
    app = FastAPI(title="PillDrops: E2B-compatible control plane", openapi_url=None, docs_url=None,
                  redoc_url=None)
    app.add_middleware(RequestIdMiddleware)
    api = E2BApi(services, on_created)

    @app.exception_handler(errors.PillDropsError)
    async def _typed(_: Request, exc: errors.PillDropsError) -> JSONResponse:
        return e2b_error(exc)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        return e2b_error(errors.InvalidRequest(f"invalid request: {exc.errors()[:1]}"))

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        cls = {404: errors.NotFound, 405: errors.InvalidRequest}.get(exc.status_code, errors.ServerError)
        return e2b_error(cls(str(exc.detail)), status=exc.status_code)

    @app.exception_handler(Exception)
    async def _crash(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on the E2B surface")
        return e2b_error(errors.ServerError(f"internal error ({type(exc).__name__}); see server log"))

    r = app.add_api_route
    for prefix in ("", "/v2"):
        r(f"{prefix}/sandboxes", api.create, methods=["POST"], status_code=201)
        r(f"{prefix}/sandboxes/{{sandbox_id}}/connect", api.connect, methods=["POST"])

    async def list_v1(request: Request) -> Response:
        return await api.list(request, v2=False)

    async def list_v2(request: Request) -> Response:
        return await api.list(request, v2=True)

    async def resume(request: Request, sandbox_id: str) -> Response:
        return await api.connect(request, sandbox_id, legacy_resume=True)

    r("/sandboxes", list_v1, methods=["GET"])
    r("/v2/sandboxes", list_v2, methods=["GET"])
    r("/sandboxes/{sandbox_id}", api.get, methods=["GET"])
    r("/sandboxes/{sandbox_id}", api.kill, methods=["DELETE"])
    r("/sandboxes/{sandbox_id}/timeout", api.set_timeout, methods=["POST"])
    r("/sandboxes/{sandbox_id}/refreshes", api.refresh, methods=["POST"])
    r("/sandboxes/{sandbox_id}/pause", api.pause, methods=["POST"])
    r("/sandboxes/{sandbox_id}/resume", resume, methods=["POST"])
    r("/sandboxes/{sandbox_id}/metrics", api.metrics, methods=["GET"])
    return app
