"""The control plane's HTTP edge: public REST (API keys), the node API (node token), and a streaming
proxy of the data plane for clients that cannot reach nodes. Only parsing, auth and status mapping live
here; every decision is in ``server.service``."""


from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Annotated, Any

import anyio
from fastapi import APIRouter, Depends, FastAPI, Header, Query, Request, Response
from fastapi import Path as FPath
from fastapi.responses import StreamingResponse

from pilldrops import errors
from pilldrops._internal.asgibody import NulGuard
from pilldrops._internal.http import RequestIdMiddleware, bearer, install_error_handlers
from pilldrops._version import __version__ as VERSION
from pilldrops.e2b.routing import E2BRouting
from pilldrops.schema.api import (
    BatchCreateRequest,
    BatchCreateResponse,
    ContextUploaded,
    CreateSandboxRequest,
    HistoryPage,
    KeyCreated,
    KeyCreateRequest,
    KeyInfo,
    KillSandboxesRequest,
    KillSandboxesResponse,
    NodeInfo,
    NodeList,
    PoolInfo,
    PoolList,
    PoolSetRequest,
    PortURL,
    PortURLRequest,
    Rates,
    SandboxInfo,
    SandboxList,
    SandboxState,
    SetTimeoutRequest,
    TemplateBuildRequest,
    TemplateList,
    UsageSummary,
    WhoAmI,
)
from pilldrops.schema.node import NodeEvent, NodeHeartbeat, NodeHeartbeatReply, NodeRegister, NodeRegistered
from pilldrops.schema.stats import HistoryStats
from pilldrops.server import dashboard
from pilldrops.server.api.createroute import CreateRoute
from pilldrops.server.api.killroute import KillRoute
from pilldrops.server.service.auth import AuthService, Principal
from pilldrops.server.service.billing import BillingService
from pilldrops.server.service.nodes import NodeService
from pilldrops.server.service.pools import PoolService
from pilldrops.server.service.sandboxes import SandboxService
from pilldrops.server.service.stats import history_stats
from pilldrops.server.service.templates import TemplateService
from pilldrops.server.service.urls import URLService


@dataclass
class Services:
    auth: AuthService
    sandboxes: SandboxService
    nodes: NodeService
    billing: BillingService
    pools: PoolService
    templates: TemplateService | None = None     # the template store (issue 19)
    urls: URLService | None = None      # port URLs (made in create_app when not given)


class _Relay(StreamingResponse):
    """Streams a node's answer through; the upstream response is closed whatever happens, including a
    client that goes away before the body starts (the generator's own ``finally`` would never run)."""

    def __init__(self, upstream: Any, cm: Any, **kw: Any) -> None:
        super().__init__(upstream.aiter_raw(), **kw)
        self._cm = cm

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                await self._cm.__aexit__(None, None, None)


def _aware(t: datetime | None) -> datetime | None:
    """Query times without a zone are UTC."""
    return t.replace(tzinfo=UTC) if t is not None and t.tzinfo is None else t


def _labels(request: Request) -> dict[str, str]:
    """``?metadata.<key>=<value>`` filters."""
    return {k[len("metadata."):]: v for k, v in request.query_params.items() if k.startswith("metadata.")}


def _states(states: list[str] | None) -> list[str]:
    bad = [s for s in states or [] if s not in SandboxState.__members__]
    if bad:
        raise errors.InvalidRequest(f"unknown state {bad[0]!r}", details={"allowed": list(SandboxState.__members__)})
    return states or []


def create_app(services: Services) -> FastAPI:
    app = FastAPI(title="PillDrops control plane", version=VERSION,
                  description="Disposable sandboxes for RL rollouts. See docs/api.md.")
    if services.urls is None and services.sandboxes is not None:
        services.urls = URLService(services.sandboxes.store, services.sandboxes.clock)
    app.add_middleware(RequestIdMiddleware)
    # the kill's (``api.killroute``), behind the create's (a kill passes it at the cost of a comparison)
    app.add_middleware(KillRoute, services=services)
    # the create's hot path (``api.createroute``), after E2B's routing (sandbox traffic is never ours); the
    # FastAPI route below documents it and answers the same way
    app.add_middleware(CreateRoute, services=services)
    app.add_middleware(NulGuard)                          # a NUL in the URL is a 400 for every route of ours
    app.add_middleware(E2BRouting, services=services)    # E2B's sandbox traffic and REST (docs: README)
    install_error_handlers(app)
    app.state.services = services

    async def principal(request: Request) -> Principal:
        return await services.auth.authenticate(bearer(request))

    async def node_auth(request: Request) -> None:
        services.nodes.check_token(bearer(request))

    Caller = Annotated[Principal, Depends(principal)]
    sbx = services.sandboxes
    api = APIRouter(prefix="/v1")

    @app.get("/healthz", include_in_schema=False)
    async def healthz() -> dict[str, bool]:
        return {"ok": True}

    @api.get("/whoami", response_model=WhoAmI)
    async def whoami(p: Caller) -> WhoAmI:
        team = await services.auth.store.get_team(p.team_id)
        return WhoAmI(team_id=p.team_id, team_name=team.name if team else "", key_id=p.key_id)

    @api.post("/sandboxes", response_model=SandboxInfo, status_code=201)
    async def create_sandbox(body: CreateSandboxRequest, p: Caller, response: Response,
                             idempotency_key: Annotated[str | None, Header(max_length=256)] = None
                             ) -> SandboxInfo:
        row, created = await sbx.create(p.team_id, body, idempotency_key)
        if not created:
            response.status_code = 200
        return await sbx.info(row, with_token=True)

    @api.post("/sandboxes/batch", response_model=BatchCreateResponse)
    async def create_batch(request: Request, body: BatchCreateRequest, p: Caller,
                           idempotency_key: Annotated[str | None, Header(max_length=200)] = None
                           ) -> BatchCreateResponse:
        return await sbx.create_batch(p.team_id, body, idempotency_key, disconnected=request.is_disconnected)

    @api.post("/sandboxes/kill", response_model=KillSandboxesResponse)
    async def kill_many(body: KillSandboxesRequest, p: Caller) -> KillSandboxesResponse:
        """Kill many sandboxes of the caller's team in one call (by ids, or every live one with labels)."""
        return await sbx.kill_many(p.team_id, body)

    @api.get("/sandboxes", response_model=SandboxList)
    async def list_sandboxes(request: Request, p: Caller, state: Annotated[list[str] | None, Query()] = None,
                             limit: Annotated[int, Query(ge=1, le=1000)] = 100,
                             cursor: str | None = None) -> SandboxList:
        states = _states(state)
        labels = _labels(request)
        return await sbx.list(p.team_id, states=states, labels=labels, limit=limit, cursor=cursor)

    @api.get("/sandboxes/{sandbox_id}", response_model=SandboxInfo)
    async def get_sandbox(sandbox_id: str, p: Caller) -> SandboxInfo:
        return await sbx.info(await sbx.get_row(p.team_id, sandbox_id))

    @api.post("/sandboxes/{sandbox_id}/connect", response_model=SandboxInfo)
    async def connect(sandbox_id: str, p: Caller) -> SandboxInfo:
        return await sbx.info(await sbx.connect(p.team_id, sandbox_id), with_token=True)

    @api.post("/sandboxes/{sandbox_id}/timeout", response_model=SandboxInfo)
    async def set_timeout(sandbox_id: str, body: SetTimeoutRequest, p: Caller) -> SandboxInfo:
        return await sbx.info(await sbx.set_timeout(p.team_id, sandbox_id, body.timeout))

    # answered by ``api.killroute`` in front of this app, the same way: this route documents it
    @api.delete("/sandboxes/{sandbox_id}", response_model=SandboxInfo)
    async def kill(sandbox_id: str, p: Caller) -> SandboxInfo:
        return await sbx.info(await sbx.kill(p.team_id, sandbox_id))

    @api.post("/sandboxes/{sandbox_id}/urls", response_model=PortURL, status_code=201)
    async def port_url(sandbox_id: str, body: PortURLRequest, p: Caller, request: Request) -> PortURL:
        """A URL (signed, expiring; none needed for a public port) that reaches ``port`` inside the sandbox,
        HTTP and WebSocket, through this control plane."""
        assert services.urls is not None
        return await services.urls.create(await sbx.get_row(p.team_id, sandbox_id), body, str(request.base_url))

    @api.post("/sandboxes/{sandbox_id}/pause", response_model=SandboxInfo)
    async def pause(sandbox_id: str, p: Caller) -> SandboxInfo:
        return await sbx.info(await sbx.pause(p.team_id, sandbox_id))

    @api.post("/sandboxes/{sandbox_id}/resume", response_model=SandboxInfo)
    async def resume(sandbox_id: str, p: Caller) -> SandboxInfo:
        return await sbx.info(await sbx.resume(p.team_id, sandbox_id), with_token=True)

    # ---- data plane, proxied to the sandbox's node ----------------------------------------------------

    async def proxy(request: Request, p: Principal, sandbox_id: str, tail: str) -> StreamingResponse:
        row = await sbx.connect(p.team_id, sandbox_id)
        node = await sbx.node_for(row)
        headers = {"x-access-token": row.access_token}
        if "content-type" in request.headers:
            headers["content-type"] = request.headers["content-type"]
        body = request.stream() if request.method in ("POST", "PUT") else None
        cm = sbx.nodes.proxy(request.method, f"{node.url}/v1/sandboxes/{sandbox_id}/{tail}", headers=headers,
                             params=request.query_params, body=body)
        resp = await cm.__aenter__()
        keep = {k: v for k, v in resp.headers.items() if k.lower() == "content-type"}
        return _Relay(resp, cm, status_code=resp.status_code, headers=keep)

    def proxied(method: str, tail: str, name: str) -> None:
        async def route(sandbox_id: str, request: Request, p: Caller) -> StreamingResponse:
            return await proxy(request, p, sandbox_id, tail)

        api.add_api_route(f"/sandboxes/{{sandbox_id}}/{tail}", route, methods=[method], name=name,
                          response_class=StreamingResponse)

    for method, tail, name in [("POST", "run", "run"), ("PUT", "archive", "put_archive"),
                               ("GET", "archive", "get_archive"), ("PUT", "files", "write_file"),
                               ("GET", "files", "read_file"), ("GET", "files/list", "list_files")]:
        proxied(method, tail, name)

    # the process service and filesystem routes (node/process_api.py, node/fsops.py); not the PTY WebSocket
    async def proxy_sub(sandbox_id: str, request: Request, p: Caller, rest: str = "") -> StreamingResponse:
        return await proxy(request, p, sandbox_id, request.url.path.split(f"/{sandbox_id}/", 1)[1])

    for prefix in ("processes", "fs"):
        for path in (f"/sandboxes/{{sandbox_id}}/{prefix}", f"/sandboxes/{{sandbox_id}}/{prefix}/{{rest:path}}"):
            api.add_api_route(path, proxy_sub, methods=["GET", "POST", "DELETE"], name=f"{prefix}{path.count('{')}",
                              response_class=StreamingResponse, include_in_schema=False)   # docs/api.md

    # ---- billing --------------------------------------------------------------------------------------

    @api.get("/history", response_model=HistoryPage)
    async def history(request: Request, p: Caller, since: datetime | None = None, until: datetime | None = None,
                      state: Annotated[list[str] | None, Query()] = None, template: str | None = None,
                      limit: Annotated[int, Query(ge=1, le=1000)] = 100, cursor: str | None = None) -> HistoryPage:
        labels = _labels(request)
        return await services.billing.history(p.team_id, since=_aware(since), until=_aware(until),
                                              states=_states(state), template=template, labels=labels,
                                              limit=limit, cursor=cursor)

    @api.get("/history/stats", response_model=HistoryStats)
    async def stats(request: Request, p: Caller, since: datetime | None = None, until: datetime | None = None,
                    state: Annotated[list[str] | None, Query()] = None, template: str | None = None,
                    buckets: Annotated[int, Query(ge=1, le=500)] = 60,
                    bins: Annotated[int, Query(ge=1, le=200)] = 20) -> HistoryStats:
        return await history_stats(services.billing, p.team_id, since=_aware(since), until=_aware(until),
                                   states=_states(state), template=template, labels=_labels(request),
                                   buckets=buckets, bins=bins)

    @api.get("/usage", response_model=UsageSummary)
    async def usage(p: Caller, since: datetime | None = None, until: datetime | None = None) -> UsageSummary:
        return await services.billing.usage(p.team_id, _aware(since), _aware(until))

    @api.get("/rates", response_model=Rates)
    async def rates(p: Caller) -> Rates:
        r = services.billing.settings.rates
        return Rates(vcpu_s_usd=r.vcpu_s_usd, gb_s_usd=r.gb_s_usd, storage_gb_month_usd=r.storage_gb_month_usd)

    # ---- keys and templates ---------------------------------------------------------------------------

    @api.post("/keys", response_model=KeyCreated, status_code=201)
    async def create_key(body: KeyCreateRequest, p: Caller) -> KeyCreated:
        return await services.auth.create_key(p.team_id, body.name)

    @api.get("/keys")
    async def list_keys(p: Caller) -> dict[str, list[KeyInfo]]:
        return {"items": await services.auth.list_keys(p.team_id)}

    @api.delete("/keys/{key_id}", response_model=KeyInfo)
    async def revoke_key(key_id: str, p: Caller) -> KeyInfo:
        return await services.auth.revoke_key(p.team_id, key_id)

    # ---- nodes (admin) ---------------------------------------------------------------------------------

    @api.get("/nodes", response_model=NodeList)
    async def list_nodes(p: Caller) -> NodeList:
        p.require_admin()
        return NodeList(items=await services.nodes.list())

    @api.post("/nodes/{node_id}/drain", response_model=NodeInfo)
    async def drain(node_id: str, p: Caller) -> NodeInfo:
        p.require_admin()
        return await services.nodes.set_draining(node_id, True)

    @api.post("/nodes/{node_id}/undrain", response_model=NodeInfo)
    async def undrain(node_id: str, p: Caller) -> NodeInfo:
        p.require_admin()
        return await services.nodes.set_draining(node_id, False)

    @api.get("/pools", response_model=PoolList)
    async def list_pools(p: Caller) -> PoolList:
        return PoolList(items=await services.pools.list())

    @api.put("/pools", response_model=PoolInfo)
    async def set_pool(body: PoolSetRequest, p: Caller) -> PoolInfo:
        p.require_admin()
        return await services.pools.set(body)

    @api.get("/templates", response_model=TemplateList)
    async def templates(p: Caller) -> TemplateList:
        node_built = await services.nodes.templates()
        if services.templates is None:
            return TemplateList(items=node_built)
        return TemplateList(items=await services.templates.list(node_built))

    def template_store() -> TemplateService:
        if services.templates is None:
            raise errors.NotSupported("this control plane has no template store")
        return services.templates

    Digest = Annotated[str, FPath(pattern=r"^sha256:[0-9a-f]{64}$")]

    @api.put("/templates/contexts/{digest}", response_model=ContextUploaded)
    async def put_context(digest: Digest, request: Request, p: Caller) -> ContextUploaded:
        p.require_admin()
        size = await template_store().put_context(digest, request.stream())
        return ContextUploaded(digest=digest, size=size)

    @api.post("/templates/builds", response_class=StreamingResponse)
    async def build_template(body: TemplateBuildRequest, p: Caller) -> StreamingResponse:
        """Build once into the template store; the answer streams the build (NDJSON: ``status``/``log``
        events, then ``done`` with the template, or ``error``)."""
        p.require_admin()
        return StreamingResponse(await template_store().build(body), media_type="application/x-ndjson")

    app.include_router(api)

    # ---- node API (node token) ------------------------------------------------------------------------

    internal = APIRouter(prefix="/internal/v1", dependencies=[Depends(node_auth)], include_in_schema=False)

    @internal.post("/nodes/register", response_model=NodeRegistered)
    async def register(body: NodeRegister) -> NodeRegistered:
        return await services.nodes.register(body)

    @internal.post("/nodes/{node_id}/heartbeat", response_model=NodeHeartbeatReply)
    async def heartbeat(node_id: str, body: NodeHeartbeat) -> NodeHeartbeatReply:
        return await services.nodes.heartbeat(node_id, body)

    @internal.post("/nodes/{node_id}/events")
    async def event(node_id: str, body: NodeEvent) -> dict[str, bool]:
        await sbx.apply_node_status(node_id, body.sandbox)
        return {"ok": True}

    @internal.get("/templates/{kind}/{digest}", response_class=StreamingResponse)
    async def get_blob(kind: Annotated[str, FPath(pattern="^(layers|contexts)$")], digest: Digest) -> StreamingResponse:
        return StreamingResponse(await template_store().read(kind, digest), media_type="application/x-tar")

    @internal.put("/templates/layers/{digest}")
    async def put_layer(digest: Digest, request: Request) -> dict[str, int]:
        return {"size": await template_store().put_layer(digest, request.stream())}

    app.include_router(internal)
    app.include_router(dashboard.router())      # the web dashboard at / (static; signs in with an API key)
    return app
