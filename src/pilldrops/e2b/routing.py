"""The one-port rule (spec §1.5): which requests on the control plane's port are sandbox traffic.

1. ``E2b-Sandbox-Id`` present: sandbox traffic for that id, on port ``E2b-Sandbox-Port`` (default 49983);
2. else a Host of the form ``{port}-{sandboxID}.{domain}``;
3. else a path ``/ports/{id}/{port}/...``: a port URL of our own, sent to the wrong origin: refused with
   ``port_url_misdirected`` naming the port-URL listener's URL (``server.ports.listener`` serves it);
4. else it is ours: E2B's REST paths (``/sandboxes``, ``/v2/sandboxes``) go to ``rest``, the rest to our app.

Sandbox traffic is sent on by port: 49983 to envd (``pilldrops.e2b.envd``) and 49999 to the code
interpreter, both resolved to a running sandbox (``context.SandboxRef``); any other port goes to the port
gateway, the one path of every user port (token or public port checked there, then the node's port
tunnel). An unknown, ended or paused sandbox is E2B's 502 "The sandbox was not found", which the SDKs
turn into ``SandboxNotRunningException`` / ``is_running() == False``.

Neither sandbox form serves a sandbox's page in the API's (and dashboard's) origin: a browser cannot put
``E2b-Sandbox-*`` headers on a navigation, nor on a cross-origin request without a CORS preflight that
this server never grants; and the host form is the origin of the host ``{port}-{id}.{domain}``.

A pure ASGI middleware: nothing is buffered, so streamed answers (Connect streams, NDJSON) stay streamed.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from typing import TYPE_CHECKING, Any

from starlette.types import ASGIApp, Receive, Scope, Send

from pilldrops import errors
from pilldrops._internal.asgibody import NUL_IN_URL, url_has_nul
from pilldrops._internal.ids import new_id
from pilldrops.e2b import code_interpreter
from pilldrops.e2b.context import STATE_KEY, NodeLink, SandboxRef, from_e2b_id, to_e2b_id
from pilldrops.e2b.rest import create_rest_app, is_rest_path
from pilldrops.server.ports.gateway import PortGateway

if TYPE_CHECKING:
    from pilldrops.server.api.app import Services

log = logging.getLogger("pilldrops.e2b")
ENVD_PORT = 49983
CODE_INTERPRETER_PORT = 49999
_HOST_RE = re.compile(r"^(\d{1,5})-([a-z0-9_]{1,64})\.")
_ID_RE = re.compile(r"^[a-z0-9_]{1,64}$")


def sandbox_target(headers: dict[str, str]) -> tuple[str, int] | None:
    """``(sandbox id as sent, port)`` for sandbox traffic, None for control-plane traffic."""
    sid = headers.get("e2b-sandbox-id")
    if sid:
        raw = headers.get("e2b-sandbox-port", str(ENVD_PORT)).strip()
        port = int(raw) if raw.isdigit() and len(raw) <= 5 else -1
        return sid.strip(), port
    m = _HOST_RE.match(headers.get("host", ""))
    if m:
        return m.group(2), int(m.group(1))
    return None


def _headers(scope: Scope) -> dict[str, str]:
    return {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}


async def send_json(send: Send, status: int, body: dict[str, Any], headers: list[tuple[bytes, bytes]] = ()
                    ) -> None:   # type: ignore[assignment]
    data = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode()),
                            *headers]})
    await send({"type": "http.response.body", "body": data})


def gone_body(e2b_id: str, message: str = "The sandbox was not found") -> dict[str, Any]:
    err = errors.SandboxNotFound(message, details={"sandbox_id": e2b_id})
    return {"sandboxId": e2b_id, "message": message, "code": 502, **err.to_body()}


async def reject(scope: Scope, send: Send, status: int, body: dict[str, Any], ws_code: int = 1011) -> None:
    """An error answer for an HTTP request, or a close for a WebSocket (before it was accepted)."""
    if scope["type"] == "websocket":
        await send({"type": "websocket.close", "code": ws_code, "reason": str(body.get("message", ""))[:120]})
        return
    await send_json(send, status, body)


class E2BRouting:
    def __init__(self, app: ASGIApp, services: Services) -> None:
        self.app = app
        self.services = services
        self.rest = create_rest_app(services, on_created=self._created)
        self.envd = _load_envd(services)
        self.code_interpreter = code_interpreter.CodeInterpreter()
        self.ports = PortGateway(services.sandboxes, services.urls)   # type: ignore[arg-type]
        self._warming: set[asyncio.Task[None]] = set()

    def _created(self, row: Any) -> None:
        """A code-interpreter sandbox made through E2B: its kernel starts now, in the background, so the
        first ``run_code`` (which waits for it if needed) does not pay the whole start."""
        if row.template != code_interpreter.TEMPLATE or len(self._warming) > 256:
            return
        task = asyncio.get_running_loop().create_task(self._warm(row.id))
        self._warming.add(task)
        task.add_done_callback(self._warming.discard)

    async def _warm(self, sandbox_id: str) -> None:
        try:
            ref = await self.resolve(sandbox_id)
            if ref is not None:
                await self.code_interpreter.start(ref)
        except Exception as exc:  # noqa: BLE001 - the first run_code tries again and reports it
            log.info("warming the code interpreter of %s failed: %r", sandbox_id, exc)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        target = sandbox_target(_headers(scope))
        if target is None:
            if self.ports.matches(scope.get("path", "")):
                await self.ports.misdirected(scope, receive, send)
            elif scope["type"] == "http" and is_rest_path(scope.get("path", "")):
                if url_has_nul(scope):          # as NulGuard does for ours, in E2B's shape
                    rid = new_id("req", 12)
                    await send_json(send, 400, {"code": 400, "message": NUL_IN_URL,
                                                **errors.InvalidRequest(NUL_IN_URL, request_id=rid).to_body()},
                                    [(b"x-request-id", rid.encode())])
                    return
                await self.rest(scope, receive, send)
            else:
                await self.app(scope, receive, send)
            return
        e2b_id, port = target
        if not 1 <= port <= 65535 or not _ID_RE.match(e2b_id):
            await reject(scope, send, 400, {"code": 400, "message": "invalid E2b-Sandbox-Id or E2b-Sandbox-Port",
                                            **errors.InvalidRequest("invalid sandbox id or port").to_body()})
            return
        if port not in (ENVD_PORT, CODE_INTERPRETER_PORT):
            await self.ports.serve(from_e2b_id(e2b_id), port, scope, receive, send, e2b=True)
            return
        try:
            ref = await self.resolve(e2b_id)
        except errors.PillDropsError as exc:
            await reject(scope, send, 502, gone_body(e2b_id, f"The sandbox is running but unreachable: {exc.message}"))
            return
        if ref is None:
            await reject(scope, send, 502, gone_body(e2b_id))
            return
        scope = {**scope, "state": {**scope.get("state", {}), STATE_KEY: ref}}
        if port == ENVD_PORT:
            if scope["type"] != "http":
                await reject(scope, send, 400, {})
                return
            await self.envd(scope, receive, send)
        else:
            await self.code_interpreter(scope, receive, send)

    async def resolve(self, e2b_id: str) -> SandboxRef | None:
        """The running sandbox behind an id, else None. Read from the store on every request (one lookup
        by primary key): a sandbox killed a moment ago must already answer "not found" (``is_running``)."""
        sbx = self.services.sandboxes
        row = await sbx.store.get_sandbox(from_e2b_id(e2b_id))
        if row is None or row.state != "running":
            return None
        node = await sbx.node_for(row)
        workdir = next((t.get("workdir") for t in node.templates or [] if isinstance(t, dict)
                        and t.get("name") == row.template), None)
        ref = SandboxRef(id=row.id, e2b_id=to_e2b_id(row.id), team_id=row.team_id, template=row.template,
                         access_token=row.access_token, envs=dict(row.envs or {}), workdir=workdir,
                         node=NodeLink(url=node.url, sandbox_id=row.id, access_token=row.access_token,
                                       http=sbx.nodes.http))
        return ref


def _load_envd(services: Services) -> ASGIApp:
    try:
        from pilldrops.e2b.envd.app import make_envd_app  # type: ignore[import-not-found]
    except ImportError as exc:
        log.warning("envd is not available on this server: %s", exc)

        async def unavailable(scope: Scope, receive: Receive, send: Send) -> None:
            await send_json(send, 501, {"code": "unimplemented", "message": "envd is not available on this server",
                                        **errors.NotSupported("envd is not available on this server").to_body()})
        return unavailable
    return make_envd_app(services)
