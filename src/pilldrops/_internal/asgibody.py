"""What the raw ASGI hot routes share (the node's create, run, kill, file write and archive upload, the
control plane's create and kill): the route itself (``JsonRoute``: method and path matched, the answer sent
with a request id, every failure the same typed error ``_internal.http``'s FastAPI handlers make of it), and
request bodies read bounded (``payload_too_large``), parsed by orjson and validated by the route's own
pydantic model (``invalid_request`` with FastAPI's ``details`` shape), or streamed to their reader
(``stream_body``)."""

from __future__ import annotations

import logging
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import orjson
from pydantic import BaseModel, ValidationError
from starlette.types import ASGIApp, Receive, Scope, Send

from pilldrops import errors
from pilldrops._internal.http import error_response, request_id_var
from pilldrops._internal.ids import new_id

M = TypeVar("M", bound=BaseModel)
_JSON = (b"content-type", b"application/json")


class Gone(Exception):
    """The client went away before its request was read."""


def invalid(details: list[dict[str, Any]]) -> errors.InvalidRequest:
    """The error FastAPI's validation handler (``_internal.http``) makes of the same details."""
    first = details[0] if details else {}
    where = ".".join(p for p in first.get("loc", []) if p != "body")
    return errors.InvalidRequest(f"invalid request: {where + ': ' if where else ''}"
                                 f"{first.get('msg', 'malformed body')}", details=details)


def details_of(e: ValidationError, where: str) -> list[dict[str, Any]]:
    """FastAPI's ``details`` of a validation error of the request's ``where`` (``body``, ``header``)."""
    return [{"loc": [where, *(str(p) for p in err.get("loc", ()))], "msg": err.get("msg"), "type": err.get("type")}
            for err in e.errors()]


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


async def stream_body(receive: Receive) -> AsyncIterator[bytes]:
    """A request's body as it arrives, part by part (nothing buffered here: its reader bounds it);
    ``Gone`` if the client goes away before its end."""
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            raise Gone
        if part := msg.get("body", b""):
            yield part
        if not msg.get("more_body", False):
            return


def declared_length(headers: Any) -> int | None:
    length = headers.get("content-length", "")
    return int(length) if length.isdigit() else None


def validate(model: type[M], raw: bytes, also: list[dict[str, Any]] | None = None) -> M:
    """``raw`` (a JSON body) as ``model``; ``also``: the request's other validation errors (its headers'),
    reported first and with the body's, as FastAPI does."""
    try:
        obj = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise invalid([{"loc": ["body", str(e.pos)], "msg": "JSON decode error", "type": "json_invalid"}]) from None
    try:
        # not an object: validated as FastAPI does (from attributes), for the same error
        out = model.model_validate(obj, from_attributes=not isinstance(obj, dict))
    except ValidationError as e:
        raise invalid([*(also or []), *details_of(e, "body")]) from None
    if also:
        raise invalid(also)
    return out


async def serve_json(scope: Scope, receive: Receive, send: Send, handle: Callable[[], Awaitable[tuple[int, bytes]]],
                     log: logging.Logger) -> None:
    """One request answered by ``handle`` (its status and JSON body) with a fresh request id, as a FastAPI
    app with ``_internal.http``'s middleware and handlers would: every PillDrops error its typed body, anything
    else the last-resort ``server_error``; a client gone before its body was read gets nothing."""
    rid = new_id("req", 12)
    token = request_id_var.set(rid)
    try:
        try:
            status, body = await handle()
        except Gone:
            return
        except errors.PillDropsError as exc:
            await _send_error(exc, rid, scope, receive, send)
            return
        except Exception as exc:
            log.exception("unhandled error (request %s)", rid)
            await _send_error(errors.ServerError(f"internal error ({type(exc).__name__}); see server log",
                                                 request_id=rid), rid, scope, receive, send)
            return
        await send({"type": "http.response.start", "status": status,
                    "headers": [_JSON, (b"content-length", str(len(body)).encode()), (b"x-request-id", rid.encode())]})
        await send({"type": "http.response.body", "body": body})
    finally:
        request_id_var.reset(token)


async def _send_error(exc: errors.PillDropsError, rid: str, scope: Scope, receive: Receive, send: Send) -> None:
    resp = error_response(exc)
    resp.headers["x-request-id"] = rid
    await resp(scope, receive, send)


class JsonRoute:
    """ASGI middleware answering ``<method> <path>`` itself (``answer``: its status and JSON body, through
    ``serve_json``); every other request goes on to ``app`` untouched. ``path``: one exact path; or
    ``pattern``, a path with parameters (named groups, each ``[^/]+`` as the router's ``{name}``), which
    become the request's ``path_params`` as the router would set them (the app's gate reads them)."""

    method = "POST"
    path = ""
    pattern: re.Pattern[str] | None = None
    log = logging.getLogger("pilldrops.http")

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != self.method:
            await self.app(scope, receive, send)
            return
        if self.pattern is None:
            if scope["path"] != self.path:
                await self.app(scope, receive, send)
                return
        else:
            m = self.pattern.fullmatch(scope["path"])
            if m is None:
                await self.app(scope, receive, send)
                return
            scope["path_params"] = m.groupdict()
        await serve_json(scope, receive, send, lambda: self.answer(scope, receive), self.log)

    async def answer(self, scope: Scope, receive: Receive) -> tuple[int, bytes]:
        raise NotImplementedError


NUL_IN_URL = "the URL holds a NUL character (%00), which no id, name or filter value can"


def url_has_nul(scope: Scope) -> bool:
    """The request's path (decoded) or query string (``%00``, or a raw NUL) holds a NUL character."""
    qs = scope.get("query_string", b"")
    return "\x00" in scope.get("path", "") or b"%00" in qs or b"\x00" in qs


class NulGuard:
    """ASGI middleware: a request whose path or query string holds a NUL character is answered ``400
    invalid_request`` before any route reads it; every other request goes on to ``app`` untouched. No id,
    name or filter value of the API can hold one, and PostgreSQL's text refuses one: a lookup or filter with
    it failed as a 500 there (and matched nothing on SQLite). It sits behind E2B's routing: traffic for a
    sandbox's own ports is the sandbox's to judge, and E2B's REST answers in E2B's error shape."""

    log = logging.getLogger("pilldrops.http")

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and url_has_nul(scope):
            await serve_json(scope, receive, send, _refuse_nul, self.log)
            return
        await self.app(scope, receive, send)


async def _refuse_nul() -> tuple[int, bytes]:
    raise errors.InvalidRequest(NUL_IN_URL)
