"""The control plane's port-URL listener (``--ports-port``): an ASGI app that serves sandbox ports and
nothing else, so that a sandbox's page never runs in the origin of the API and the dashboard (which keeps
the user's API key in sessionStorage). Listening on its own port makes it its own origin (scheme, host
and port).

- ``/ports/{id}/{port}/...``: the path form (``PortGateway.handle_path``);
- ``Host: {port}-{id}.{domain}``: the host form (``--public-host`` pointed here), our own error bodies;
- ``/healthz``: ``{"ok": true}``;
- anything else: 404 ``not_found`` (no API, no dashboard here).
"""

from __future__ import annotations

import json
import re

from starlette.types import Receive, Scope, Send

from pilldrops import errors
from pilldrops.server.ports.gateway import PortGateway, send_error
from pilldrops.server.service.urls import from_host_id

_HOST_RE = re.compile(r"^(\d{1,5})-([a-z0-9_]{1,64})\.")


class PortsApp:
    def __init__(self, gateway: PortGateway) -> None:
        self.gateway = gateway

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            return                     # lifespan: nothing to start
        path = scope.get("path", "")
        host = next((v.decode("latin-1") for k, v in scope.get("headers", []) if k.lower() == b"host"), "")
        m = _HOST_RE.match(host)
        if m is not None and 1 <= int(m.group(1)) <= 65535:
            await self.gateway.serve(from_host_id(m.group(2)), int(m.group(1)), scope, receive, send)
        elif self.gateway.matches(path):
            await self.gateway.handle_path(scope, receive, send)
        elif path == "/healthz" and scope["type"] == "http":
            body = json.dumps({"ok": True}).encode()
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]})
            await send({"type": "http.response.body", "body": body})
        else:
            if scope["type"] == "websocket":
                await receive()
            await send_error(scope, send, errors.NotFound(
                "this address serves sandbox ports only (/ports/{sandbox_id}/{port}/...; get a URL with "
                "sb.get_url(port)); the API and the dashboard are on the control plane's own port"))
