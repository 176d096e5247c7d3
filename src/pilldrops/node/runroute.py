"""``POST /v1/sandboxes/{id}/run`` as a small raw ASGI handler in front of the node's FastAPI app (issue 15).

The run route is the data plane's hot path: one request per command. Through FastAPI it paid for a stack
of middlewares, the route table, dependency injection, pydantic's request parsing and a task group per
streamed answer. Here the same request is answered with less: the body is read (bounded:
``MAX_BODY``), parsed by orjson and validated by the same ``RunRequest`` model; the sandbox is found by its
access token exactly as the FastAPI route does (``target``), after the same gate (the app's own
dependency, ``admit``: the agent has re-adopted its sandboxes; a pre-issued member's holder waits for its
claim); the answer is the same NDJSON
stream with the same headers (``x-request-id`` included). Every failure is the same typed error body as
``_internal.http``'s handlers make (``invalid_request`` for a malformed or invalid body, with FastAPI's
``details`` shape). Every other request goes on to FastAPI untouched.

The answer is sent in as few writes as it can: the head waits (at most ``HEAD_WAIT_S``) for the first line
so the two leave together (``serving.OneWrite`` sends one loop tick's writes as one), and the exit line
(``dataplane.Last``) ends the body in the same write as the chunked terminator. If the client goes away
while the command runs, the stream is cancelled and the command killed (``DataPlane._stream``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
from collections.abc import AsyncIterator, Awaitable, Callable

from starlette.requests import HTTPConnection
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pilldrops import errors
from pilldrops._internal.asgibody import Gone, read_bounded, validate
from pilldrops._internal.http import error_response, request_id_var
from pilldrops._internal.ids import new_id
from pilldrops.node.dataplane import DataPlane, Last, Target
from pilldrops.schema.api import RunRequest

log = logging.getLogger("pilldrops.node.run")

MAX_BODY = 64 * 1024 * 1024        # a run request (its stdin is text in the JSON body)
HEAD_WAIT_S = 0.05
_PATH = re.compile(r"/v1/sandboxes/([^/]+)/run")
_NDJSON = [(b"content-type", b"application/x-ndjson")]

Admit = Callable[[HTTPConnection], Awaitable[None]]     # the app's gate for a request: None, or it raises


async def send_stream(send: Send, body: AsyncIterator[bytes], headers: list[tuple[bytes, bytes]],
                      status: int = 200) -> None:
    """A run's NDJSON answer (``body``: ``DataPlane.run``'s stream) with its head sent together with the
    first line when that comes within ``HEAD_WAIT_S``, and the exit line (``Last``) ending the body."""
    head: Message | None = {"type": "http.response.start", "status": status, "headers": headers}
    it = body.__aiter__()
    first = asyncio.ensure_future(it.__anext__())
    try:
        await asyncio.wait((first,), timeout=HEAD_WAIT_S)
        if not first.done():           # a command silent for a while: its client sees the head now
            await send(head)
            head = None
        try:
            chunk: bytes | None = await first
        except StopAsyncIteration:
            chunk = None
    finally:
        if not first.done():           # cancelled while waiting (the client went away)
            first.cancel()
            with contextlib.suppress(BaseException):
                await first
    if head is not None:
        await send(head)
    ended = False
    while chunk is not None:
        if not ended:                   # nothing follows the exit line; the generator runs to its end
            ended = isinstance(chunk, Last)
            await send({"type": "http.response.body", "body": bytes(chunk), "more_body": not ended})
        try:
            chunk = await it.__anext__()
        except StopAsyncIteration:
            chunk = None
    if not ended:
        await send({"type": "http.response.body", "body": b"", "more_body": False})


def parse(raw: bytes) -> RunRequest:
    return validate(RunRequest, raw)


class RunRoute:
    """ASGI middleware: ``POST /v1/sandboxes/{id}/run`` answered here, everything else by ``app``."""

    def __init__(self, app: ASGIApp, plane: DataPlane, target: Callable[[str, str | None], Target],
                 admit: Admit) -> None:
        self.app, self.plane, self.target, self.admit = app, plane, target, admit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or not (m := _PATH.fullmatch(scope["path"])):
            await self.app(scope, receive, send)
            return
        rid = new_id("req", 12)
        token = request_id_var.set(rid)
        headers = [*_NDJSON, (b"x-request-id", rid.encode())]
        try:
            stream = await self._start(m.group(1), scope, receive)
        except Gone:
            request_id_var.reset(token)
            return
        except errors.PillDropsError as exc:
            await self._error(exc, rid, scope, receive, send)
            request_id_var.reset(token)
            return
        except Exception as exc:             # the same answer as the app's last-resort handler
            log.exception("unhandled error (request %s)", rid)
            await self._error(errors.ServerError(f"internal error ({type(exc).__name__}); see server log",
                                                 request_id=rid), rid, scope, receive, send)
            request_id_var.reset(token)
            return
        # the stream runs in a task of its own, cancelled if the client goes away first (as Starlette's
        # disconnect listener does): its generator then kills the command
        started = False

        async def send_tracked(msg: Message) -> None:
            nonlocal started
            started = started or msg["type"] == "http.response.start"
            await send(msg)

        streaming = asyncio.ensure_future(send_stream(send_tracked, stream, headers))
        watch: asyncio.Future[Message] | None = None
        try:
            while not streaming.done():
                watch = asyncio.ensure_future(receive())
                await asyncio.wait((streaming, watch), return_when=asyncio.FIRST_COMPLETED)
                if streaming.done():
                    break
                if watch.result()["type"] == "http.disconnect":
                    streaming.cancel()
                    break
            await asyncio.wait((streaming,))     # raises only if this request's own task is cancelled
            if not streaming.cancelled() and (exc := streaming.exception()) is not None \
                    and not isinstance(exc, OSError):          # OSError: the client went away mid-write
                if isinstance(exc, errors.PillDropsError) and not started:
                    await self._error(exc, rid, scope, receive, send)      # its own code, as the app's
                else:
                    raise exc
        finally:
            if watch is not None and not watch.done():
                watch.cancel()
            if not streaming.done():            # this request's own task was cancelled
                streaming.cancel()
                with contextlib.suppress(BaseException):
                    await streaming
            with contextlib.suppress(BaseException):
                await stream.aclose()    # type: ignore[attr-defined]
            request_id_var.reset(token)

    async def _start(self, sid: str, scope: Scope, receive: Receive) -> AsyncIterator[bytes]:
        scope["path_params"] = {"sandbox_id": sid}       # as the router would set them, for the gate
        conn = HTTPConnection(scope)
        await self.admit(conn)
        where = self.target(sid, conn.headers.get("x-access-token"))    # before the body: nothing of an
        length = conn.headers.get("content-length", "")                  # unauthorised body is buffered
        raw = await read_bounded(receive, int(length) if length.isdigit() else None, MAX_BODY, "a run request")
        req = parse(raw)
        return await self.plane.run(where, req)

    @staticmethod
    async def _error(exc: errors.PillDropsError, rid: str, scope: Scope, receive: Receive, send: Send) -> None:
        resp = error_response(exc)
        resp.headers["x-request-id"] = rid
        await resp(scope, receive, send)
