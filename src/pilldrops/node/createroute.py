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
from typing import TypeVar

import orjson
from pydantic import BaseModel, ValidationError
from starlette.requests import HTTPConnection
from starlette.types import ASGIApp, Receive, Scope, Send

from pilldrops import errors
from pilldrops._internal.http import bearer, error_response, request_id_var
from pilldrops._internal.ids import new_id
from pilldrops._internal.ids import same_secret as same
from pilldrops.node.runroute import Admit, _invalid
from pilldrops.schema.node import NodeSandboxSpec, NodeSandboxStatus

log = logging.getLogger("pilldrops.node.create")

MAX_BODY = 1024 * 1024        # a create spec: ids, envs, a network policy (the control plane's own bounds)
PATH = "/node/v1/sandboxes"
_JSON = (b"content-type", b"application/json")

M = TypeVar("M", bound=BaseModel)
Create = Callable[[NodeSandboxSpec], Awaitable[NodeSandboxStatus]]


class Gone(Exception):
    """The client went away before its request was read."""


async def read_bounded(receive: Receive, declared: int | None, limit: int, what: str) -> bytes:
    """A request's body, refused (``PayloadTooLarge``) past ``limit`` bytes by its declared length before
    anything is read, and by what arrives before more is buffered."""
    if declared is not None and declared > limit:
        raise errors.PayloadTooLarge(f"{what} is at most {limit} bytes")
    parts: list[bytes] = []
    size = 0
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            raise Gone
        part = msg.get("body", b"")
        size += len(part)
        if size > limit:
            raise errors.PayloadTooLarge(f"{what} is at most {limit} bytes")
        parts.append(part)
        if not msg.get("more_body", False):
            return parts[0] if len(parts) == 1 else b"".join(parts)


def validate(model: type[M], raw: bytes) -> M:
    """``raw`` (a JSON body) as ``model``, with the same ``invalid_request`` error FastAPI's validation
    handler (``_internal.http``) makes of a malformed or invalid body."""
    try:
        obj = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise _invalid([{"loc": ["body", str(e.pos)], "msg": "JSON decode error", "type": "json_invalid"}]) from None
    try:
        # not an object: validated as FastAPI does (from attributes), for the same error
        return model.model_validate(obj, from_attributes=not isinstance(obj, dict))
    except ValidationError as e:
        raise _invalid([{"loc": ["body", *(str(p) for p in err.get("loc", ()))], "msg": err.get("msg"),
                         "type": err.get("type")} for err in e.errors()]) from None


class CreateRoute:
    """ASGI middleware: ``POST /node/v1/sandboxes`` answered here, everything else by ``app``."""

    def __init__(self, app: ASGIApp, create: Create, node_token: str, admit: Admit) -> None:
        self.app, self.create, self.token, self.admit = app, create, node_token, admit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] != PATH:
            await self.app(scope, receive, send)
            return
        rid = new_id("req", 12)
        token = request_id_var.set(rid)
        try:
            try:
                body = (await self._answer(scope, receive)).model_dump_json().encode()
            except Gone:
                return
            except errors.PillDropsError as exc:
                await self._error(exc, rid, scope, receive, send)
                return
            except Exception as exc:             # the same answer as the app's last-resort handler
                log.exception("unhandled error (request %s)", rid)
                await self._error(errors.ServerError(f"internal error ({type(exc).__name__}); see server log",
                                                     request_id=rid), rid, scope, receive, send)
                return
            await send({"type": "http.response.start", "status": 200,
                        "headers": [_JSON, (b"content-length", str(len(body)).encode()),
                                    (b"x-request-id", rid.encode())]})
            await send({"type": "http.response.body", "body": body})
        finally:
            request_id_var.reset(token)

    async def _answer(self, scope: Scope, receive: Receive) -> NodeSandboxStatus:
        conn = HTTPConnection(scope)
        await self.admit(conn)                                   # the app's dependency first, as FastAPI
        if not same(bearer(conn) or "", self.token):             # type: ignore[arg-type]
            raise errors.AuthenticationError("invalid node token")
        length = conn.headers.get("content-length", "")
        raw = await read_bounded(receive, int(length) if length.isdigit() else None, MAX_BODY, "a create spec")
        return await self.create(validate(NodeSandboxSpec, raw))

    @staticmethod
    async def _error(exc: errors.PillDropsError, rid: str, scope: Scope, receive: Receive, send: Send) -> None:
        resp = error_response(exc)
        resp.headers["x-request-id"] = rid
        await resp(scope, receive, send)
