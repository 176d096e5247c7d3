"""The Connect protocol (connectrpc.com/docs/protocol) over raw ASGI, as envd speaks it to the E2B SDKs.

- Unary: ``POST /<pkg.Service>/<Method>`` with ``application/json`` or ``application/proto``; the answer is
  the bare message in the same codec, or an error: HTTP status per code and ``{"code","message"}`` JSON.
- Streams (server, client): ``application/connect+json`` or ``application/connect+proto``, messages in
  envelopes (u8 flags | u32 big-endian length | payload); the answer has that exact content type (no
  parameters: Python SDK 2.63 rejects ``; charset=...``), one envelope per message, flushed as it is
  made, then an end-of-stream envelope (flag 0x02) with ``{}`` or ``{"error":{"code","message"}}``.
- Messages are the generated protobuf classes (``proto/``); JSON uses protobuf's own JSON mapping
  (lowerCamelCase out, both spellings and unknown fields accepted in).
- No compression either way; requests may be chunked. Every size read is bounded (``MAX_MESSAGE``).
"""

from __future__ import annotations

import json
import logging
import struct
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

import anyio
from google.protobuf import json_format
from google.protobuf.message import DecodeError, Message

from pilldrops import errors

MAX_MESSAGE = 16 * 1024 * 1024
log = logging.getLogger("pilldrops.envd")
END_STREAM = 0x02
COMPRESSED = 0x01
_ENV = struct.Struct(">BI")

HTTP_STATUS = {
    "canceled": 499, "unknown": 500, "invalid_argument": 400, "deadline_exceeded": 504, "not_found": 404,
    "already_exists": 409, "permission_denied": 403, "resource_exhausted": 429, "failed_precondition": 400,
    "aborted": 409, "out_of_range": 400, "unimplemented": 501, "internal": 500, "unavailable": 503,
    "data_loss": 500, "unauthenticated": 401,
}

Send = Callable[[dict[str, Any]], Awaitable[None]]
Receive = Callable[[], Awaitable[dict[str, Any]]]


class ConnectError(Exception):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message

    def body(self) -> dict[str, str]:
        return {"code": self.code, "message": self.message}


def from_pilldrops(exc: errors.PillDropsError) -> ConnectError:
    """The Connect code the E2B SDKs map to the matching exception."""
    if isinstance(exc, errors.NotFound):
        code = "not_found"
    elif isinstance(exc, (errors.InvalidRequest,)):
        code = "invalid_argument"
    elif isinstance(exc, errors.AuthenticationError):
        code = "unauthenticated"
    elif isinstance(exc, errors.PermissionDenied):
        code = "permission_denied"
    elif isinstance(exc, errors.InvalidState):
        code = "failed_precondition"
    elif isinstance(exc, errors.Conflict):
        code = "aborted"
    elif isinstance(exc, (errors.PayloadTooLarge, errors.RateLimited)):
        code = "resource_exhausted"
    elif isinstance(exc, errors.NotSupported):
        code = "unimplemented"
    elif isinstance(exc, (errors.NodeUnavailable, errors.CapacityUnavailable)):
        code = "unavailable"
    else:
        code = "internal"
    return ConnectError(code, exc.message)


@dataclass
class Codec:
    name: str                   # "json" | "proto"
    stream: bool

    @property
    def content_type(self) -> str:
        return f"application/{'connect+' if self.stream else ''}{self.name}"

    def decode(self, data: bytes, cls: type[Message]) -> Message:
        msg = cls()
        try:
            if self.name == "json":
                json_format.Parse(data.decode("utf-8") if data.strip() else "{}", msg, ignore_unknown_fields=True)
            else:
                msg.ParseFromString(data)
        except (json_format.ParseError, DecodeError, UnicodeDecodeError, ValueError) as e:
            raise ConnectError("invalid_argument", f"cannot decode {cls.DESCRIPTOR.name}: {e}") from None
        return msg

    def encode(self, msg: Message) -> bytes:
        if self.name == "json":
            return json.dumps(json_format.MessageToDict(msg), separators=(",", ":")).encode()
        return msg.SerializeToString()


def codec_for(content_type: str) -> Codec | None:
    ct = content_type.split(";", 1)[0].strip().lower()
    return {"application/json": Codec("json", False), "application/proto": Codec("proto", False),
            "application/connect+json": Codec("json", True),
            "application/connect+proto": Codec("proto", True)}.get(ct)


def envelope(payload: bytes, flags: int = 0) -> bytes:
    return _ENV.pack(flags, len(payload)) + payload


def end_stream(err: ConnectError | None = None) -> bytes:
    body = {"error": err.body()} if err else {}
    return envelope(json.dumps(body, separators=(",", ":")).encode(), END_STREAM)


class Body:
    """The request body as it arrives (chunked or not), read with bounds."""

    def __init__(self, receive: Receive) -> None:
        self._receive = receive
        self._buf = bytearray()
        self._more = True
        self.disconnected = False

    async def _fill(self) -> bool:
        if not self._more:
            return False
        msg = await self._receive()
        if msg["type"] == "http.disconnect":
            self._more = False
            self.disconnected = True
            return False
        self._buf += msg.get("body", b"")
        self._more = bool(msg.get("more_body"))
        return True

    async def read_all(self, limit: int = MAX_MESSAGE) -> bytes:
        while await self._fill():
            if len(self._buf) > limit:
                raise ConnectError("resource_exhausted", f"request body is larger than {limit} bytes")
        return bytes(self._buf)

    async def envelopes(self) -> AsyncIterator[bytes]:
        """The payloads of the request's envelopes (an end-stream envelope ends them)."""
        while True:
            while len(self._buf) < _ENV.size:
                if not await self._fill():
                    if self._buf:
                        raise ConnectError("invalid_argument", "truncated envelope")
                    return
            flags, n = _ENV.unpack_from(self._buf)
            if n > MAX_MESSAGE:
                raise ConnectError("resource_exhausted", f"message of {n} bytes (at most {MAX_MESSAGE})")
            if flags & COMPRESSED:
                raise ConnectError("unimplemented", "compressed messages are not supported (use identity)")
            while len(self._buf) < _ENV.size + n:
                if not await self._fill():
                    raise ConnectError("invalid_argument", "truncated envelope")
            payload = bytes(self._buf[_ENV.size:_ENV.size + n])
            del self._buf[:_ENV.size + n]
            if flags & END_STREAM:
                return
            yield payload

    async def wait_disconnect(self) -> None:
        """Return once the client has gone away (call only after the body was read)."""
        while True:
            msg = await self._receive()
            if msg["type"] == "http.disconnect":
                self.disconnected = True
                return


async def send_response(send: Send, status: int, body: bytes, content_type: str,
                        headers: list[tuple[bytes, bytes]] | None = None) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", content_type.encode()), (b"content-length", str(len(body)).encode()),
                            *(headers or [])]})
    await send({"type": "http.response.body", "body": body})


async def send_unary_error(send: Send, err: ConnectError) -> None:
    await send_response(send, HTTP_STATUS.get(err.code, 500), json.dumps(err.body()).encode(), "application/json")


# -- dispatch -------------------------------------------------------------------------------------------

UNARY, SERVER_STREAM, CLIENT_STREAM = "unary", "server_stream", "client_stream"


@dataclass
class Method:
    kind: str
    request: type[Message]
    handler: Callable[..., Any]       # (ctx, request) -> response | AsyncIterator[response]; (ctx, AsyncIterator) -> response


async def serve_rpc(method: Method, ctx: Any, headers: dict[str, str], receive: Receive, send: Send) -> None:
    codec = codec_for(headers.get("content-type", ""))
    stream = method.kind != UNARY
    if codec is None or codec.stream != stream:
        want = "application/connect+json" if stream else "application/json"
        await send_response(send, 415, b"", "text/plain", [(b"accept-post", want.encode())])
        return
    enc = (headers.get("connect-content-encoding" if stream else "content-encoding") or "identity").lower()
    body = Body(receive)
    if enc != "identity":
        err = ConnectError("unimplemented", f"request encoding {enc!r} is not supported (use identity)")
        if stream:
            await _stream_answer(send, codec, _failing(err), body)
        else:
            await send_unary_error(send, err)
        return
    if method.kind == UNARY:
        try:
            req = codec.decode(await body.read_all(), method.request)
            resp = await method.handler(ctx, req)
        except ConnectError as e:
            await send_unary_error(send, e)
            return
        except errors.PillDropsError as e:
            await send_unary_error(send, from_pilldrops(e))
            return
        except Exception as e:
            log.exception("envd call failed")
            await send_unary_error(send, ConnectError("internal", f"{type(e).__name__}: {e}"[:500]))
            return
        await send_response(send, 200, codec.encode(resp), codec.content_type)
        return
    if method.kind == CLIENT_STREAM:
        async def requests() -> AsyncIterator[Message]:
            async for payload in body.envelopes():
                yield codec.decode(payload, method.request)

        async def one() -> AsyncIterator[Message]:
            yield await method.handler(ctx, requests())
        await _stream_answer(send, codec, one(), None)
        return

    first: Message | None = None
    try:
        async for payload in body.envelopes():
            if first is None:
                first = codec.decode(payload, method.request)
        if first is None:
            raise ConnectError("invalid_argument", "a server-streaming call needs one request message")
    except ConnectError as e:
        await _stream_answer(send, codec, _failing(e), None)
        return
    await _stream_answer(send, codec, method.handler(ctx, first), body)


async def _failing(err: ConnectError) -> AsyncIterator[Message]:
    raise err
    yield  # pragma: no cover


async def _stream_answer(send: Send, codec: Codec, messages: AsyncIterator[Message], body: Body | None) -> None:
    """200, then each message as an envelope, then end-of-stream. ``body``: a request already read whole,
    watched for the client's disconnect, which stops the stream (and closes ``messages``)."""
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", codec.content_type.encode())]})
    err: ConnectError | None = None
    async with anyio.create_task_group() as tg:
        if body is not None:
            async def watch() -> None:
                await body.wait_disconnect()
                tg.cancel_scope.cancel()
            tg.start_soon(watch)
        try:
            async with aclosing(messages) as it:
                async for m in it:
                    await send({"type": "http.response.body", "body": envelope(codec.encode(m)), "more_body": True})
        except ConnectError as e:
            err = e
        except errors.PillDropsError as e:
            err = from_pilldrops(e)
        except TimeoutError:
            err = ConnectError("deadline_exceeded", "context deadline exceeded")
        except Exception as e:
            log.exception("envd stream failed")
            err = ConnectError("internal", f"{type(e).__name__}: {e}"[:500])
        await send({"type": "http.response.body", "body": end_stream(err), "more_body": False})
        tg.cancel_scope.cancel()
