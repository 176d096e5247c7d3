"""The node's HTTP surface: the node API for the control plane (node token, ``/node/v1``) and the data
plane for SDKs (per-sandbox access token in ``X-Access-Token``, ``/v1/sandboxes/{id}/...``)."""


from collections.abc import AsyncIterator
from typing import Annotated

from fastapi import APIRouter, Depends, FastAPI, Header, Query, Request, WebSocket
from fastapi.responses import Response, StreamingResponse
from starlette.requests import HTTPConnection
from starlette.types import Send

from pilldrops import errors
from pilldrops._internal.asgibody import declared_length
from pilldrops._internal.http import RequestIdMiddleware, bearer, install_error_handlers
from pilldrops._internal.ids import same_secret as same
from pilldrops._version import __version__
from pilldrops.node import portforward
from pilldrops.node.agent import NodeAgent
from pilldrops.node.createroute import CreateRoute
from pilldrops.node.dataplane import DataPlane, Target
from pilldrops.node.fsops import FileOps, fs_routes
from pilldrops.node.killroute import KillRoute
from pilldrops.node.process_api import process_routes
from pilldrops.node.runroute import RunRoute, send_stream
from pilldrops.node.uploadroute import UploadRoute
from pilldrops.schema.api import FileInfo, RunRequest
from pilldrops.schema.node import (
    NodeBuildRequest,
    NodeDeadline,
    NodeKilledMany,
    NodeKillMany,
    NodePoolSpec,
    NodePoolStatus,
    NodeResume,
    NodeSandboxSpec,
    NodeSandboxStatus,
    NodeTemplateRef,
)

GRANT_WAIT_S = 10.0       # how long a request for a pre-issued member waits for the node to be told of its claim


class RunStream(StreamingResponse):
    """A run's NDJSON stream, sent as ``runroute.send_stream`` sends it (the FastAPI route's answer, for an
    app without the ``RunRoute`` in front)."""

    async def stream_response(self, send: Send) -> None:
        await send_stream(send, self.body_iterator, self.raw_headers, self.status_code)  # type: ignore[arg-type]


def create_node_app(agent: NodeAgent, node_token: str) -> FastAPI:
    async def recovered(conn: HTTPConnection) -> None:
        # a restarted agent serves only once it has re-adopted its sandboxes: until then it would answer
        # 404 for live ones (a kill then recorded as ended and unbilled while the sandbox ran on)
        if not agent.recovered:
            raise errors.NodeUnavailable("the node agent is re-adopting its sandboxes after a restart; retry "
                                         "in a moment")
        # a create answered from a pre-issued warm member reaches the client before this node is told of it:
        # a request for it (data plane or kill) waits for that (milliseconds; a control plane that died in
        # between has its heartbeat handler tell us)
        sid = conn.path_params.get("sandbox_id")
        if sid and agent.sandboxes.get(sid) is None and (grant := agent.pools.granted(sid)) is not None:
            token = conn.headers.get("x-access-token") or conn.query_params.get("access_token") or ""
            node_call = same(bearer(conn) or "", node_token)  # type: ignore[arg-type]
            if same(token, grant.access_token) or node_call:      # only its holder waits: no oracle of ids
                await agent.pools.wait_granted(sid, GRANT_WAIT_S)

    app = FastAPI(title="PillDrops node agent", version=__version__, dependencies=[Depends(recovered)])
    app.add_middleware(RequestIdMiddleware)
    install_error_handlers(app)
    plane = DataPlane(agent.runtime)

    async def node_auth(request: Request) -> None:
        if not same(bearer(request) or "", node_token):
            raise errors.AuthenticationError("invalid node token")

    def target(sandbox_id: str, token: str | None) -> Target:
        """The sandbox for a data-plane request. An unknown id and a known one with a missing or wrong
        token answer the same 404 (issue 16 item 9): the data plane is no oracle of which ids exist."""
        known = agent.sandboxes.get(sandbox_id)
        if known is None or not token or not same(token, known.spec.access_token):
            raise errors.SandboxNotFound(f"no sandbox {sandbox_id} here for this access token "
                                         "(it ended, or X-Access-Token is missing or not its)")
        return agent.get(sandbox_id).target     # the token is its: now its state may speak (paused, ...)

    Token = Annotated[str | None, Header(alias="x-access-token")]
    Path_ = Annotated[str, Query(alias="path", min_length=1, max_length=4096)]

    @app.get("/healthz", include_in_schema=False)
    async def healthz(request: Request) -> dict[str, object]:
        """Liveness for anyone; the node's id and counts only with the node token (issue 16 item 9)."""
        if not same(bearer(request) or "", node_token):
            return {"ok": True}
        st = agent.stats
        return {"ok": True, "node_id": agent.node_id, "sandboxes": len(agent.live), "created": st.created,
                "claimed_from_pools": st.claimed, "failed_starts": st.failed, "ended": st.ended,
                "paused": len(agent.paused)}

    node = APIRouter(prefix="/node/v1", dependencies=[Depends(node_auth)])

    @node.post("/sandboxes", response_model=NodeSandboxStatus)
    async def create(spec: NodeSandboxSpec) -> NodeSandboxStatus:
        return await agent.create(spec)

    @node.get("/sandboxes")
    async def list_() -> dict[str, list[NodeSandboxStatus]]:
        return {"items": agent.statuses()}

    # answered by ``node.killroute`` in front of this app, the same way: this route documents it
    @node.delete("/sandboxes/{sandbox_id}", response_model=NodeSandboxStatus)
    async def kill(sandbox_id: str) -> NodeSandboxStatus:
        return await agent.kill(sandbox_id)

    @node.post("/sandboxes/kill", response_model=NodeKilledMany)
    async def kill_many(body: NodeKillMany) -> NodeKilledMany:
        return NodeKilledMany(items=await agent.kill_many(body.ids))

    @node.put("/sandboxes/{sandbox_id}/deadline", response_model=NodeSandboxStatus)
    async def deadline(sandbox_id: str, body: NodeDeadline) -> NodeSandboxStatus:
        return agent.set_deadline(sandbox_id, body.end_at, body.timeout_s)

    @node.post("/sandboxes/{sandbox_id}/pause", response_model=NodeSandboxStatus)
    async def pause(sandbox_id: str) -> NodeSandboxStatus:
        return await agent.pause(sandbox_id)

    @node.post("/sandboxes/{sandbox_id}/resume", response_model=NodeSandboxStatus)
    async def resume(sandbox_id: str, body: NodeResume) -> NodeSandboxStatus:
        return await agent.resume(sandbox_id, body)

    @node.get("/sandboxes/{sandbox_id}/checkpoint", response_class=StreamingResponse)
    async def export_checkpoint(sandbox_id: str) -> StreamingResponse:
        return StreamingResponse(await agent.export_checkpoint(sandbox_id), media_type="application/x-tar",
                                 headers={"x-pilldrops-runtime-id": agent.runtime_id_of(sandbox_id)})

    @node.delete("/sandboxes/{sandbox_id}/checkpoint")
    async def forget_checkpoint(sandbox_id: str) -> dict[str, bool]:
        await agent.forget(sandbox_id)
        return {"ok": True}

    @node.post("/templates/builds", response_class=StreamingResponse)
    async def build_template(body: NodeBuildRequest) -> StreamingResponse:
        """Build a spec document into a layer for the template store (``node.template_builds``)."""
        return StreamingResponse(await agent.build_template(body), media_type="application/x-ndjson")

    @node.post("/templates/refs")
    async def hold_template(body: NodeTemplateRef) -> dict[str, bool]:
        """Hold this template-store version (fetch what is missing): the builder learns its version here."""
        await agent.hold_template(body)
        return {"ok": True}

    @node.put("/pools")
    async def set_pools(body: list[NodePoolSpec]) -> dict[str, list[NodePoolStatus]]:
        agent.configure_pools(body)
        return {"items": agent.pools.statuses()}

    app.include_router(node)

    data = APIRouter(prefix="/v1/sandboxes/{sandbox_id}")

    @data.post("/run", response_class=StreamingResponse)
    async def run(sandbox_id: str, body: RunRequest, x_access_token: Token = None) -> StreamingResponse:
        stream = await plane.run(target(sandbox_id, x_access_token), body)
        return RunStream(stream, media_type="application/x-ndjson")

    # this and ``write_file`` are answered by ``node.uploadroute`` in front of this app, the same way
    @data.put("/archive")
    async def put_archive(sandbox_id: str, request: Request, path: Path_,
                          x_access_token: Token = None) -> dict[str, int]:
        n = await plane.put_archive(target(sandbox_id, x_access_token), path, request.stream(),
                                    declared=declared_length(request.headers))
        return {"entries": n}

    @data.get("/archive", response_class=StreamingResponse)
    async def get_archive(sandbox_id: str, path: Path_, x_access_token: Token = None) -> StreamingResponse:
        stream: AsyncIterator[bytes] = await plane.get_archive(target(sandbox_id, x_access_token), path)
        return StreamingResponse(stream, media_type="application/x-tar")

    @data.get("/files")
    async def read_file(sandbox_id: str, path: Path_, x_access_token: Token = None) -> Response:
        content = await plane.read_file(target(sandbox_id, x_access_token), path)
        return Response(content, media_type="application/octet-stream")

    @data.put("/files", response_model=FileInfo)
    async def write_file(sandbox_id: str, request: Request, path: Path_,
                         x_access_token: Token = None) -> FileInfo:
        return await plane.write_file(target(sandbox_id, x_access_token), path, request.stream())

    @data.get("/files/list")
    async def list_files(sandbox_id: str, path: Path_, x_access_token: Token = None) -> dict[str, list[FileInfo]]:
        return {"items": await plane.list_dir(target(sandbox_id, x_access_token), path)}

    @data.websocket("/ports/{port}")
    async def port_tunnel(sandbox_id: str, port: int, ws: WebSocket) -> None:
        """A byte tunnel to 127.0.0.1:port inside the sandbox (``node.portforward``): node token and the
        sandbox's access token, like every data-plane call that the control plane relays."""
        if not same(bearer(ws) or "", node_token):     # type: ignore[arg-type]
            await ws.close(code=1008)                     # before accept: an HTTP 403 to the client
            return
        await ws.accept()            # then every failure is a close code the control plane can read
        try:
            t = target(sandbox_id, ws.headers.get("x-access-token"))
            if t.pausing or t.handle.pid is None:
                raise errors.InvalidState(f"sandbox {sandbox_id} is being paused", current="pausing",
                                          target="running")
            stream = await portforward.connect(t.handle.pid, port)
        except ConnectionRefusedError:
            await ws.close(code=portforward.CLOSE_REFUSED, reason="connection refused")
            return
        except (errors.PillDropsError, OSError) as exc:
            await ws.close(code=portforward.CLOSE_GONE, reason=str(exc)[:120])
            return
        tunnel = portforward.Tunnel()
        t.active.add(tunnel)        # type: ignore[arg-type]
        try:
            await ws.send_text(portforward.READY)
            await portforward.relay(ws, stream, tunnel)
        finally:
            t.active.discard(tunnel)    # type: ignore[arg-type]

    app.include_router(data)
    app.include_router(process_routes(agent.processes, target))
    app.include_router(fs_routes(FileOps(plane), target))
    # the kill's (the control plane's call on every kill: ``node.killroute``), behind the three below (a
    # kill is none's method: it passes them at the cost of a comparison, and runs never reach it)
    app.add_middleware(KillRoute, kill=lambda sid: agent.kill(sid), node_token=node_token, admit=recovered)
    # the file write's and the archive upload's (every rollout's ``files.write`` and ``upload``:
    # ``node.uploadroute``; the two FastAPI routes above document them and answer the same way)
    app.add_middleware(UploadRoute, plane=plane, target=target, admit=recovered)
    # the run route's hot path, in front of everything (the FastAPI route above documents it and answers
    # the same way)
    app.add_middleware(RunRoute, plane=plane, target=target, admit=recovered)
    # and the create route's (the control plane's call on every cold create: ``node.createroute``)
    app.add_middleware(CreateRoute, create=lambda spec: agent.create(spec), node_token=node_token, admit=recovered)
    return app
