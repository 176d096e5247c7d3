"""The data plane's process routes (``/v1/sandboxes/{id}/processes...``, per-sandbox access token), over
``processes.Processes``. Documented in docs/api.md ("Processes").

``WS /processes/pty`` is the interactive terminal of ``pilldrops sandbox shell``: the first client message is
a JSON ``ProcessStartRequest`` (``pty`` defaults to 24x80); then binary messages are terminal input, text
messages are JSON control (``{"type":"resize","rows":R,"cols":C}``, ``{"type":"signal","signal":"INT"}``,
``{"type":"eof"}``); the server sends ``{"type":"start","pid":N}``, binary terminal output, and
``{"type":"exit","exit_code":N}`` last, then closes. A client that goes away kills the shell (a terminal
nobody holds has nobody to read it).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from typing import Annotated

import anyio
from fastapi import APIRouter, Header, Query, Request, WebSocket, WebSocketDisconnect
from fastapi.responses import StreamingResponse

from pilldrops import errors
from pilldrops.node.dataplane import Target
from pilldrops.node.processes import STDIN_CHUNK, Managed, Processes, line, parse_signal
from pilldrops.schema.processes import (
    ProcessInfo,
    ProcessOutput,
    ProcessStartRequest,
    PtySize,
    ResizeRequest,
    SignalRequest,
)

MAX_STDIN_REQUEST = 1024 * 1024
NDJSON = "application/x-ndjson"
Token = Annotated[str | None, Header(alias="x-access-token")]


def process_routes(procs: Processes, target: Callable[[str, str | None], Target]) -> APIRouter:
    r = APIRouter(prefix="/v1/sandboxes/{sandbox_id}/processes")

    def proc(sandbox_id: str, token: str | None, pid: int) -> tuple[Target, Managed]:
        t = target(sandbox_id, token)
        return t, procs.get(t, pid)

    async def stream(m: Managed, reader) -> AsyncIterator[bytes]:  # type: ignore[no-untyped-def]
        async for ev in procs.events(m, reader):
            yield line(ev)

    @r.post("", response_class=StreamingResponse)
    async def start(sandbox_id: str, body: ProcessStartRequest, x_access_token: Token = None,
                    detach: bool = False) -> StreamingResponse:
        t = target(sandbox_id, x_access_token)
        m, reader = await procs.start(t, body, attach=not detach)
        if reader is None:
            return StreamingResponse(iter([line(m.start_event())]), media_type=NDJSON)
        return StreamingResponse(stream(m, reader), media_type=NDJSON)

    @r.get("")
    async def list_(sandbox_id: str, x_access_token: Token = None,
                    tag: str | None = None) -> dict[str, list[ProcessInfo]]:
        items = procs.list(target(sandbox_id, x_access_token))
        return {"items": [i for i in items if tag is None or i.tag == tag]}

    @r.get("/{pid}", response_model=ProcessInfo)
    async def get(sandbox_id: str, pid: int, x_access_token: Token = None) -> ProcessInfo:
        return proc(sandbox_id, x_access_token, pid)[1].info()

    @r.get("/{pid}/events", response_class=StreamingResponse)
    async def events(sandbox_id: str, pid: int, x_access_token: Token = None) -> StreamingResponse:
        m = proc(sandbox_id, x_access_token, pid)[1]
        return StreamingResponse(stream(m, procs.attach(m)), media_type=NDJSON)

    @r.get("/{pid}/output", response_model=ProcessOutput)
    async def output(sandbox_id: str, pid: int, x_access_token: Token = None) -> ProcessOutput:
        return procs.output(proc(sandbox_id, x_access_token, pid)[1])

    @r.post("/{pid}/stdin")
    async def stdin(sandbox_id: str, pid: int, request: Request, x_access_token: Token = None) -> dict[str, int]:
        m = proc(sandbox_id, x_access_token, pid)[1]
        n = 0
        async for chunk in request.stream():
            n += len(chunk)
            if n > MAX_STDIN_REQUEST:
                raise errors.PayloadTooLarge(f"one stdin request takes at most {MAX_STDIN_REQUEST} bytes")
            if chunk:
                await procs.write(m, chunk)
        return {"bytes": n}

    @r.delete("/{pid}/stdin")
    async def close_stdin(sandbox_id: str, pid: int, x_access_token: Token = None) -> dict[str, bool]:
        procs.close_stdin(proc(sandbox_id, x_access_token, pid)[1])
        return {"ok": True}

    @r.post("/{pid}/signal")
    async def signal(sandbox_id: str, pid: int, body: SignalRequest, x_access_token: Token = None
                     ) -> dict[str, bool]:
        m = proc(sandbox_id, x_access_token, pid)[1]
        return {"delivered": await procs.signal(m, parse_signal(body.signal))}

    @r.post("/{pid}/resize")
    async def resize(sandbox_id: str, pid: int, body: ResizeRequest, x_access_token: Token = None
                     ) -> dict[str, bool]:
        m = proc(sandbox_id, x_access_token, pid)[1]
        return {"resized": await procs.resize(m, body.rows, body.cols)}

    @r.delete("/{pid}", response_model=ProcessInfo)
    async def kill(sandbox_id: str, pid: int, x_access_token: Token = None) -> ProcessInfo:
        m = proc(sandbox_id, x_access_token, pid)[1]
        await procs.signal(m, 9)
        with anyio.move_on_after(5):
            await m.done.wait()
        return m.info()

    @r.websocket("/pty")
    async def pty(ws: WebSocket, sandbox_id: str,
                  token: Annotated[str | None, Query(alias="access_token")] = None) -> None:
        tok = ws.headers.get("x-access-token") or token
        try:
            t = target(sandbox_id, tok)
        except errors.PillDropsError as e:
            await ws.close(code=4401 if isinstance(e, errors.AuthenticationError) else 4404, reason=e.message[:120])
            return
        await ws.accept()
        await terminal(ws, procs, t)

    return r


async def terminal(ws: WebSocket, procs: Processes, t: Target) -> None:
    """One interactive terminal session over an accepted WebSocket (see the module doc)."""
    try:
        first = await ws.receive_text()
        req = ProcessStartRequest.model_validate_json(first)
        if req.pty is None:
            req.pty = PtySize()
        m, reader = await procs.start(t, req)
    except (errors.PillDropsError, ValueError, WebSocketDisconnect) as e:
        body = e.to_body()["error"] if isinstance(e, errors.PillDropsError) else {
            "code": "invalid_request", "message": str(e)[:500]}
        with anyio.CancelScope(shield=True):
            try:
                await ws.send_text(json.dumps({"type": "error", **body}))
                await ws.close(code=1011)
            except Exception:  # noqa: BLE001 - the client is gone already
                pass
        return
    assert reader is not None
    finished = False
    try:
        await ws.send_text(m.start_event().model_dump_json(exclude_none=True))
        async with anyio.create_task_group() as tg:
            async def pump_in() -> None:
                while True:
                    msg = await ws.receive()
                    if msg["type"] == "websocket.disconnect":
                        tg.cancel_scope.cancel()
                        return
                    try:
                        if msg.get("bytes"):
                            data: bytes = msg["bytes"]
                            for i in range(0, len(data), STDIN_CHUNK):
                                await procs.write(m, data[i:i + STDIN_CHUNK])
                        elif msg.get("text"):
                            await control(procs, m, msg["text"])
                    except errors.PillDropsError as e:      # e.g. input after EOF, a bad signal name
                        await ws.send_text(json.dumps({"type": "error", **e.to_body()["error"]}))
                    except ValueError as e:                 # a malformed control message
                        await ws.send_text(json.dumps({"type": "error", "code": "invalid_request",
                                                       "message": str(e)[:500]}))
            tg.start_soon(pump_in)
            with reader:
                async for _kind, data in reader:
                    await ws.send_bytes(data)
            await m.done.wait()
            finished = True
            await ws.send_text(m.exit_event().model_dump_json(exclude_none=True))
            tg.cancel_scope.cancel()
        await ws.close()
    except (WebSocketDisconnect, errors.PillDropsError, RuntimeError):
        pass                      # the client went away (RuntimeError: a send after the close)
    finally:
        if not finished and m.running:
            with anyio.CancelScope(shield=True):
                await procs.signal(m, 9)


async def control(procs: Processes, m: Managed, text: str) -> None:
    try:
        msg = json.loads(text)
    except ValueError:
        return
    if not isinstance(msg, dict):
        return
    kind = msg.get("type")
    if kind == "resize":
        size = ResizeRequest.model_validate(msg)
        await procs.resize(m, size.rows, size.cols)
    elif kind == "signal":
        await procs.signal(m, parse_signal(msg.get("signal", "INT")))
    elif kind == "eof":
        procs.close_stdin(m)
