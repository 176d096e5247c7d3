"""HTTP plumbing shared by the control plane and the node agent (both FastAPI apps):
request ids, and one place that turns every exception into the typed JSON error body."""

from __future__ import annotations

import contextvars
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pilldrops import errors
from pilldrops._internal.ids import new_id

log = logging.getLogger("pilldrops.http")
request_id_var: contextvars.ContextVar[str | None] = contextvars.ContextVar("request_id", default=None)

_STATUS_CODES = {400: errors.InvalidRequest, 401: errors.AuthenticationError, 403: errors.PermissionDenied,
                 404: errors.NotFound, 405: errors.InvalidRequest, 409: errors.Conflict,
                 413: errors.PayloadTooLarge, 429: errors.RateLimited}


class RequestIdMiddleware:
    """Pure ASGI (no buffering, so streamed answers stay streamed): a ``req_…`` id per request."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        rid = new_id("req", 12)
        token = request_id_var.set(rid)

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                message.setdefault("headers", []).append((b"x-request-id", rid.encode()))
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            request_id_var.reset(token)


def error_response(exc: errors.PillDropsError) -> JSONResponse:
    exc.request_id = exc.request_id or request_id_var.get()
    headers = {"Retry-After": "1"} if exc.retryable and exc.status in (429, 503) else None
    return JSONResponse(exc.to_body(), status_code=exc.status or 500, headers=headers)


def _validation_details(exc: RequestValidationError) -> list[dict[str, Any]]:
    out = []
    for e in exc.errors():
        out.append({"loc": [str(p) for p in e.get("loc", ())], "msg": e.get("msg"), "type": e.get("type")})
    return out


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(errors.PillDropsError)
    async def _typed(_: Request, exc: errors.PillDropsError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        details = _validation_details(exc)
        first = details[0] if details else {}
        where = ".".join(p for p in first.get("loc", []) if p != "body")
        msg = f"invalid request: {where + ': ' if where else ''}{first.get('msg', 'malformed body')}"
        return error_response(errors.InvalidRequest(msg, details=details))

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        cls = _STATUS_CODES.get(exc.status_code, errors.ServerError)
        err = cls(str(exc.detail))
        resp = error_response(err)
        resp.status_code = exc.status_code
        return resp

    @app.exception_handler(Exception)
    async def _crash(_: Request, exc: Exception) -> JSONResponse:
        rid = request_id_var.get()
        log.exception("unhandled error (request %s)", rid)
        return error_response(errors.ServerError(f"internal error ({type(exc).__name__}); see server log",
                                                 request_id=rid))


def bearer(request: Request) -> str | None:
    auth = request.headers.get("authorization", "")
    if auth[:7].lower() == "bearer ":
        return auth[7:].strip() or None
    return request.headers.get("x-api-key") or None
