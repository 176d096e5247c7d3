"""``DELETE /node/v1/sandboxes/{id}`` (the control plane's kill call) as a small raw ASGI handler in front of
the node's FastAPI app (issue 15), as ``createroute`` does for the create.

Every kill pays this hop. Through FastAPI it paid for the middleware stack, the route table, dependency
injection and the response model's second validation and ``jsonable_encoder`` pass over the answer
(~11 % of the node's CPU per kill in a py-spy profile of 250 kills). Here the same request is answered the
same way with less: the same gate first (the app's own dependency, ``admit``: the agent has re-adopted its
sandboxes; a kill of a pre-issued member whose claim the node has not been told of yet waits for it, as the
FastAPI route's gate does, since ``path_params`` are set as the router would set them), then the same
node-token check, ``NodeAgent.kill``, and the ``NodeSandboxStatus`` answer serialised as the response model
would (``model_dump_json``), with an ``x-request-id``. The request's body and query are not read (the
FastAPI route has no parameter for them either). Every failure is the same typed error body as
``_internal.http``'s handlers make. The FastAPI route stays (it documents the call in the node's OpenAPI,
and answers for an app without this handler in front).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Awaitable, Callable

from starlette.requests import HTTPConnection
from starlette.types import ASGIApp, Receive, Scope

from pilldrops import errors
from pilldrops._internal.asgibody import JsonRoute
from pilldrops._internal.http import bearer
from pilldrops._internal.ids import same_secret as same
from pilldrops.node.runroute import Admit
from pilldrops.schema.node import NodeSandboxStatus

log = logging.getLogger("pilldrops.node.kill")

PATTERN = re.compile(r"/node/v1/sandboxes/(?P<sandbox_id>[^/]+)")     # the router's ``/sandboxes/{sandbox_id}``

Kill = Callable[[str], Awaitable[NodeSandboxStatus]]


class KillRoute(JsonRoute):
    """ASGI middleware: ``DELETE /node/v1/sandboxes/{id}`` answered here, everything else by ``app``."""

    method = "DELETE"
    pattern = PATTERN
    log = log

    def __init__(self, app: ASGIApp, kill: Kill, node_token: str, admit: Admit) -> None:
        super().__init__(app)
        self.kill, self.token, self.admit = kill, node_token, admit

    async def answer(self, scope: Scope, receive: Receive) -> tuple[int, bytes]:
        conn = HTTPConnection(scope)
        await self.admit(conn)                                   # the app's dependency first, as FastAPI
        if not same(bearer(conn) or "", self.token):             # type: ignore[arg-type]
            raise errors.AuthenticationError("invalid node token")
        status = await self.kill(scope["path_params"]["sandbox_id"])
        return 200, status.model_dump_json().encode()      # as the response model serialises it
