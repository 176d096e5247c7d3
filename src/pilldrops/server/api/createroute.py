"""``POST /v1/sandboxes`` (the SDK's create) as a small raw ASGI handler in front of the control plane's
FastAPI app (issue 15), as the node's ``createroute`` and ``runroute`` are.

Every create pays this edge. Through FastAPI it paid for the middleware stack, the route table, dependency
injection, pydantic's request parsing and the response model's second validation and ``jsonable_encoder``
pass over the answer. Here the same request is answered the same way with less: the API key checked by the
same ``AuthService`` first (nothing of an unauthenticated body is buffered), the ``Idempotency-Key`` header
and the body (bounded: ``MAX_BODY``, by its declared length and by what arrives) validated by the same rules
(the header's 256 characters, ``CreateSandboxRequest``) with FastAPI's error details, the same
``SandboxService`` calls, and the ``SandboxInfo`` answer serialised as the response model would (201, or 200
for a replayed retry). Every failure is the same typed error body as ``_internal.http``'s handlers make.
The FastAPI route stays: it documents the call in the OpenAPI schema and answers for an app without this
handler in front (the parity test compares the two).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from pydantic import BaseModel, Field, ValidationError
from starlette.requests import HTTPConnection
from starlette.types import ASGIApp, Receive, Scope

from pilldrops._internal.asgibody import JsonRoute, declared_length, details_of, read_bounded, validate
from pilldrops._internal.http import bearer
from pilldrops.schema.api import MAX_CREATE_BYTES, CreateSandboxRequest

if TYPE_CHECKING:
    from pilldrops.server.api.app import Services

log = logging.getLogger("pilldrops.server.create")

MAX_BODY = MAX_CREATE_BYTES
PATH = "/v1/sandboxes"


class _Headers(BaseModel):
    """The route's header parameter, with the FastAPI route's bound (``Header(max_length=256)``)."""
    idempotency_key: str | None = Field(None, max_length=256, alias="idempotency-key")


class CreateRoute(JsonRoute):
    """ASGI middleware: ``POST /v1/sandboxes`` answered here, everything else by ``app``."""

    path = PATH
    log = log

    def __init__(self, app: ASGIApp, services: Services) -> None:
        super().__init__(app)
        self.services = services

    async def answer(self, scope: Scope, receive: Receive) -> tuple[int, bytes]:
        conn = HTTPConnection(scope)
        p = await self.services.auth.authenticate(bearer(conn))   # type: ignore[arg-type]
        key = conn.headers.get("idempotency-key")
        bad = []
        if key is not None:
            try:
                _Headers.model_validate({"idempotency-key": key})
            except ValidationError as e:
                bad = details_of(e, "header")
        raw = await read_bounded(receive, declared_length(conn.headers), MAX_BODY, "a create request")
        req = validate(CreateSandboxRequest, raw, also=bad)
        sbx = self.services.sandboxes
        row, created = await sbx.create(p.team_id, req, key)
        info = await sbx.info(row, with_token=True)
        return (201 if created else 200), info.model_dump_json().encode()   # as the response model serialises it
