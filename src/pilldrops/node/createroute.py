"""``POST /node/v1/sandboxes`` (the control plane's create call) as a small raw ASGI handler in front of the
node's FastAPI app (issue 15), as ``runroute`` does for ``run``.

Every cold create pays this hop. Through FastAPI it paid for the middleware stack, the route table,
dependency injection, pydantic's request parsing through ``jsonable_encoder`` and the response model's
second validation of the answer. Here the same request is answered with less, and the same way: the same
gate (the app's own dependency, ``admit``: the agent has re-adopted its sandboxes), the same node-token
check (before the body is read: nothing of an unauthorised body is buffered), the body bounded
(``MAX_BODY``, by its declared length and by what arrives), parsed by orjson and validated by the same
``NodeSandboxSpec`` model, ``NodeAgent.create``, and the ``NodeSandboxStatus`` answer serialised as the
response model would (``model_dump_json``: the same fields, the same JSON types), with an ``x-request-id``.
Every failure is the same typed error body as ``_internal.http``'s handlers make. The FastAPI route stays
(it documents the call in the node's OpenAPI, and answers for an app without this handler in front).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

from starlette.requests import HTTPConnection
from starlette.types import ASGIApp, Receive, Scope

from pilldrops import errors
from pilldrops._internal.asgibody import JsonRoute, declared_length, read_bounded, validate
from pilldrops._internal.http import bearer
from pilldrops._internal.ids import same_secret as same
from pilldrops.node.runroute import Admit
from pilldrops.schema.api import MAX_CREATE_BYTES
from pilldrops.schema.node import NodeSandboxSpec, NodeSandboxStatus

log = logging.getLogger("pilldrops.node.create")

MAX_BODY = MAX_CREATE_BYTES        # the create's envs and metadata, as the control plane's own bound
PATH = "/node/v1/sandboxes"

Create = Callable[[NodeSandboxSpec], Awaitable[NodeSandboxStatus]]


class CreateRoute(JsonRoute):
    """ASGI middleware: ``POST /node/v1/sandboxes`` answered here, everything else by ``app``."""

    path = PATH
    log = log

    def __init__(self, app: ASGIApp, create: Create, node_token: str, admit: Admit) -> None:
        super().__init__(app)
        self.create, self.token, self.admit = create, node_token, admit

    async def answer(self, scope: Scope, receive: Receive) -> tuple[int, bytes]:
        conn = HTTPConnection(scope)
        await self.admit(conn)                                   # the app's dependency first, as FastAPI
        if not same(bearer(conn) or "", self.token):             # type: ignore[arg-type]
            raise errors.AuthenticationError("invalid node token")
        raw = await read_bounded(receive, declared_length(conn.headers), MAX_BODY, "a create spec")
        status = await self.create(validate(NodeSandboxSpec, raw))
        return 200, status.model_dump_json().encode()      # as the response model serialises it
