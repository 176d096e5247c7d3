"""envd for E2B clients: the ASGI app the E2B router (``pilldrops.e2b.routing``) hands sandbox traffic on port
49983 to, with the resolved sandbox in ``scope["state"]["e2b_sandbox"]`` (``pilldrops.e2b.context.SandboxRef``).

- ``POST /process.Process/<Method>``, ``POST /filesystem.Filesystem/<Method>``: Connect RPC (connect.py),
  JSON or binary protobuf, unary and streaming (process.py, filesystem.py);
- ``GET|POST /files``: download and upload (files.py);
- ``GET /health``: 204, without a token.

Every other path needs ``X-Access-Token`` equal to the sandbox's token (401 otherwise); ``/files`` also
takes a signed URL instead. ``/init``, ``/envs``, ``/metrics`` and the rest of upstream's internal surface
are not served (404): PillDrops configures sandboxes itself.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from pilldrops._internal.ids import same_secret
from pilldrops.e2b.envd import filesystem, process
from pilldrops.e2b.envd.connect import (
    ConnectError,
    Method,
    Receive,
    Send,
    send_response,
    send_unary_error,
    serve_rpc,
)
from pilldrops.e2b.envd.files import serve_files
from pilldrops.e2b.envd.process import Ctx
from pilldrops.e2b.envd.users import user_from_header

if TYPE_CHECKING:
    from pilldrops.server.api.app import Services

STATE_KEY = "e2b_sandbox"
SERVICES: dict[str, dict[str, Method]] = {"process.Process": process.METHODS,
                                          "filesystem.Filesystem": filesystem.METHODS}


def _headers(scope: dict[str, Any]) -> dict[str, str]:
    return {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}


async def _json(send: Send, status: int, body: dict[str, Any]) -> None:
    await send_response(send, status, json.dumps(body).encode(), "application/json")


class EnvdApp:
    async def __call__(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        ref = (scope.get("state") or {}).get(STATE_KEY)
        path, method = scope.get("path", "/"), scope.get("method", "GET")
        headers = _headers(scope)
        if ref is None:
            await _json(send, 502, {"message": "The sandbox was not found", "code": 502})
            return
        if path == "/health":
            await send_response(send, 204, b"", "text/plain")
            return
        workdir = ref.workdir or "/root"
        if path == "/files":
            await serve_files(ref, workdir, method, scope.get("query_string", b""), headers, receive, send)
            return
        if not same_secret(headers.get("x-access-token") or "", ref.access_token):
            await _json(send, 401, {"code": "unauthenticated",
                                    "message": "unauthorized access, please provide a valid access token"})
            return
        service, _, name = path.lstrip("/").partition("/")
        rpc = SERVICES.get(service, {}).get(name)
        if rpc is None:
            await _json(send, 404, {"code": "not_found" if service in SERVICES else "unimplemented",
                                    "message": f"{path} is not served here"})
            return
        if method != "POST":
            await _json(send, 405, {"code": "invalid_argument", "message": "Connect calls are POSTs"})
            return
        try:
            user = user_from_header(headers.get("authorization"))
        except ConnectError as e:
            await send_unary_error(send, e)
            return
        await serve_rpc(rpc, Ctx(ref=ref, user=user, headers=headers), headers, receive, send)


def make_envd_app(services: Services | None = None) -> EnvdApp:
    """The envd ASGI app (one per control-plane app). It needs nothing from ``services``: the router has
    resolved the sandbox and its node link before calling it."""
    return EnvdApp()
