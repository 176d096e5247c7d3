"""``DELETE /v1/sandboxes/{id}`` (the SDK's ``kill``) as a small raw ASGI handler in front of the control
plane's FastAPI app (issue 15), as ``api.createroute`` does for the create.

Every kill pays this edge. Through FastAPI it paid for the middleware stack, the route table, dependency
injection, and the response model's second validation and ``jsonable_encoder`` pass over the answer. Here
the same request is answered the same way with less: the API key checked by the same ``AuthService`` first
(a missing or bad key is the same ``unauthenticated``), the same ``SandboxService.kill`` (the caller's team
only: another team's id is ``sandbox_not_found``, as an unknown one; an ended sandbox answers its final
record) and ``info`` calls, and the ``SandboxInfo`` answer serialised as the response model would (200,
``model_dump_json``), with an ``x-request-id``. As the FastAPI route, it reads no body and no query
parameter (the end reason is always ``killed``). Every failure is the same typed error body as
``_internal.http``'s handlers make. The FastAPI route stays: it documents the call in the OpenAPI schema
and answers for an app without this handler in front (the parity test compares the two).
"""

from __future__ import annotations

import logging
import re
from typing import TYPE_CHECKING

from starlette.requests import HTTPConnection
from starlette.types import ASGIApp, Receive, Scope

from pilldrops._internal.asgibody import JsonRoute
from pilldrops._internal.http import bearer

if TYPE_CHECKING:
    from pilldrops.server.api.app import Services

log = logging.getLogger("pilldrops.server.kill")

PATTERN = re.compile(r"/v1/sandboxes/(?P<sandbox_id>[^/]+)")     # the router's ``/v1/sandboxes/{sandbox_id}``


class KillRoute(JsonRoute):
    """ASGI middleware: ``DELETE /v1/sandboxes/{id}`` answered here, everything else by ``app``."""

    method = "DELETE"
    pattern = PATTERN
    log = log

    def __init__(self, app: ASGIApp, services: Services) -> None:
        super().__init__(app)
        self.services = services

    async def answer(self, scope: Scope, receive: Receive) -> tuple[int, bytes]:
        p = await self.services.auth.authenticate(bearer(HTTPConnection(scope)))   # type: ignore[arg-type]
        sbx = self.services.sandboxes
        info = await sbx.info(await sbx.kill(p.team_id, scope["path_params"]["sandbox_id"]))
        return 200, info.model_dump_json().encode()       # as the response model serialises it
