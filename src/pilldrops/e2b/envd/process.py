"""envd's ``process.Process`` service, over the node's process routes (``/processes``, docs/api.md).

Semantics as E2B's envd (spec §4.3): the first streamed message is ``start{pid}``; output arrives as
``data.stdout|stderr|pty``; ``end`` carries Go-style ``exitCode``/``exited``/``status``/``error``; the
``Connect-Timeout-Ms`` header bounds the *process* (it is killed then, and the stream ends with
``deadline_exceeded``); a client that leaves does not end the process (``Connect`` re-attaches, new output
only); keepalives go out after ``Keepalive-Ping-Interval`` seconds without data. ``stdin`` absent means true.
"""

from __future__ import annotations

import base64
import json
import signal as signals
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import anyio

from pilldrops import errors
from pilldrops.e2b.envd import node
from pilldrops.e2b.envd.connect import CLIENT_STREAM, SERVER_STREAM, UNARY, ConnectError, Method
from pilldrops.e2b.envd.proto import process_pb2 as pb
from pilldrops.e2b.envd.users import home, resolve

DEFAULT_KEEPALIVE_S = 90.0
MIN_KEEPALIVE_S = 1.0
_GO_SIGNAL = {signals.SIGKILL: "killed", signals.SIGTERM: "terminated", signals.SIGINT: "interrupt",
              signals.SIGHUP: "hangup", signals.SIGQUIT: "quit", signals.SIGABRT: "aborted",
              signals.SIGSEGV: "segmentation fault", signals.SIGPIPE: "broken pipe", signals.SIGUSR1: "user defined signal 1",
              signals.SIGUSR2: "user defined signal 2"}


@dataclass
class Ctx:
    """One request: the sandbox (the router's ``SandboxRef``), the resolved user, the request's headers."""

    ref: Any
    user: str | None                 # None: the default user
    headers: dict[str, str]

    @property
    def workdir(self) -> str:
        return self.ref.workdir or "/root"

    def timeout_s(self) -> float | None:
        raw = self.headers.get("connect-timeout-ms")
        try:
            ms = int(raw) if raw else 0
        except ValueError:
            raise ConnectError("invalid_argument", f"bad connect-timeout-ms {raw!r}") from None
        return ms / 1000 if ms > 0 else None

    def keepalive_s(self) -> float:
        try:
            return max(MIN_KEEPALIVE_S, float(self.headers.get("keepalive-ping-interval") or DEFAULT_KEEPALIVE_S))
        except ValueError:
            return DEFAULT_KEEPALIVE_S


def end_event(ev: dict[str, Any]) -> pb.ProcessEvent:
    code = int(ev.get("exit_code") if ev.get("exit_code") is not None else -1)
    sig = ev.get("signal")
    out = pb.ProcessEvent()
    if sig:
        status = f"signal: {_GO_SIGNAL.get(sig, f'signal {sig}')}"
        out.end.exit_code, out.end.exited, out.end.status, out.end.error = -1, False, status, status
    else:
        out.end.exit_code, out.end.exited, out.end.status = code, True, f"exit status {code}"
        if code != 0:
            out.end.error = f"exit status {code}"
    return out


async def _events(ctx: Ctx, lines: AsyncIterator[dict[str, Any]], wrap: type) -> AsyncIterator[Any]:
    """Node process events -> ``wrap(event=ProcessEvent)`` messages, with keepalives while it is quiet."""
    send, recv = anyio.create_memory_object_stream[dict[str, Any]](1)

    async def pump() -> None:
        async with send:
            async for ev in lines:
                await send.send(ev)

    async with anyio.create_task_group() as tg:
        tg.start_soon(pump)
        keepalive = ctx.keepalive_s()
        try:
            while True:
                ev: dict[str, Any] | None = None
                with anyio.move_on_after(keepalive):
                    try:
                        ev = await recv.receive()
                    except anyio.EndOfStream:
                        return
                if ev is None:
                    yield wrap(event=pb.ProcessEvent(keepalive=pb.ProcessEvent.KeepAlive()))
                    continue
                kind = ev.get("type")
                if kind == "start":
                    yield wrap(event=pb.ProcessEvent(start=pb.ProcessEvent.StartEvent(pid=int(ev["pid"]))))
                elif kind in ("stdout", "stderr", "pty"):
                    data = pb.ProcessEvent.DataEvent(**{kind: base64.b64decode(ev.get("data") or "")})
                    yield wrap(event=pb.ProcessEvent(data=data))
                elif kind == "exit":
                    if ev.get("timed_out"):
                        raise ConnectError("deadline_exceeded", "context deadline exceeded")
                    yield wrap(event=end_event(ev))
                    return
                elif kind == "error":
                    raise ConnectError("internal", str(ev.get("message") or "the process stream failed"))
        finally:
            tg.cancel_scope.cancel()


async def pid_of(ctx: Ctx, sel: pb.ProcessSelector) -> int:
    which = sel.WhichOneof("selector")
    if which == "pid":
        return sel.pid
    if which == "tag":
        found = await node.call(ctx.ref, "GET", "/processes", params={"tag": sel.tag})
        running = [p for p in found["items"] if p["running"]] or found["items"]
        if not running:
            raise ConnectError("not_found", f"process with tag {sel.tag} not found")
        return int(running[-1]["pid"])
    raise ConnectError("invalid_argument", "a process selector needs a pid or a tag")


async def _not_found_as(ctx: Ctx, pid: int, coro: Any) -> Any:
    try:
        return await coro
    except errors.NotFound:
        raise ConnectError("not_found", f"process with pid {pid} not found") from None


# -- RPCs -------------------------------------------------------------------------------------------------

async def start(ctx: Ctx, req: pb.StartRequest) -> AsyncIterator[pb.StartResponse]:
    cfg = req.process
    if not cfg.cmd:
        raise ConnectError("invalid_argument", "process.cmd is empty")
    cwd = resolve(cfg.cwd, ctx.user, ctx.workdir) if cfg.HasField("cwd") else ctx.workdir
    if cfg.HasField("cwd"):
        try:
            entry = await node.call(ctx.ref, "GET", "/fs/stat", params={"path": cwd})
        except errors.FileNotFound:
            raise ConnectError("invalid_argument", f"cwd '{cwd}' does not exist") from None
        if entry.get("type") != "dir":
            raise ConnectError("invalid_argument", f"cwd '{cwd}' is not a directory")
    envs = {"HOME": home(ctx.user, ctx.workdir), "USER": ctx.user or "root", **dict(ctx.ref.envs or {}),
            **dict(cfg.envs)}
    body: dict[str, Any] = {"cmd": [cfg.cmd, *cfg.args], "envs": envs, "cwd": cwd,
                            "stdin": req.stdin if req.HasField("stdin") else True,
                            "timeout": ctx.timeout_s()}
    if req.HasField("tag"):
        body["tag"] = req.tag
    if req.HasField("pty"):
        body["pty"] = {"rows": req.pty.size.rows or 24, "cols": req.pty.size.cols or 80}
    async with node.lines(ctx.ref, "POST", "/processes", content=json.dumps(body).encode(),
                          headers={"content-type": "application/json"}) as lines:
        async for m in _events(ctx, lines, pb.StartResponse):
            yield m


async def connect(ctx: Ctx, req: pb.ConnectRequest) -> AsyncIterator[pb.ConnectResponse]:
    pid = await pid_of(ctx, req.process)
    try:
        async with node.lines(ctx.ref, "GET", f"/processes/{pid}/events") as lines:
            async for m in _events(ctx, lines, pb.ConnectResponse):
                yield m
    except errors.NotFound:
        raise ConnectError("not_found", f"process with pid {pid} not found") from None


async def list_(ctx: Ctx, req: pb.ListRequest) -> pb.ListResponse:
    found = await node.call(ctx.ref, "GET", "/processes")
    out = pb.ListResponse()
    for p in found["items"]:
        if not p["running"]:
            continue
        cmd = p["cmd"] or [""]
        info = out.processes.add(pid=int(p["pid"]))
        info.config.cmd = cmd[0]
        info.config.args.extend(cmd[1:])
        info.config.envs.update(p.get("envs") or {})
        if p.get("cwd"):
            info.config.cwd = p["cwd"]
        if p.get("tag") is not None:
            info.tag = p["tag"]
    return out


async def send_input(ctx: Ctx, req: pb.SendInputRequest) -> pb.SendInputResponse:
    pid = await pid_of(ctx, req.process)
    data = req.input.stdin if req.input.WhichOneof("input") == "stdin" else req.input.pty
    if data:
        await _write(ctx, pid, data)
    return pb.SendInputResponse()


async def _write(ctx: Ctx, pid: int, data: bytes) -> None:
    try:
        await _not_found_as(ctx, pid, node.call(ctx.ref, "POST", f"/processes/{pid}/stdin", content=data))
    except errors.InvalidState as e:
        raise ConnectError("internal", e.message) from None


async def stream_input(ctx: Ctx, reqs: AsyncIterator[pb.StreamInputRequest]) -> pb.StreamInputResponse:
    pid: int | None = None
    async for r in reqs:
        which = r.WhichOneof("event")
        if which == "start":
            pid = await pid_of(ctx, r.start.process)
        elif which == "data":
            if pid is None:
                raise ConnectError("invalid_argument", "StreamInput: the first message must be start")
            inp = r.data.input
            data = inp.stdin if inp.WhichOneof("input") == "stdin" else inp.pty
            if data:
                await _write(ctx, pid, data)
    return pb.StreamInputResponse()


async def close_stdin(ctx: Ctx, req: pb.CloseStdinRequest) -> pb.CloseStdinResponse:
    pid = await pid_of(ctx, req.process)
    await _not_found_as(ctx, pid, node.call(ctx.ref, "DELETE", f"/processes/{pid}/stdin"))
    return pb.CloseStdinResponse()


async def send_signal(ctx: Ctx, req: pb.SendSignalRequest) -> pb.SendSignalResponse:
    pid = await pid_of(ctx, req.process)
    if req.signal not in (pb.SIGNAL_SIGKILL, pb.SIGNAL_SIGTERM):
        raise ConnectError("invalid_argument", f"unsupported signal {req.signal}")
    info = await _not_found_as(ctx, pid, node.call(ctx.ref, "GET", f"/processes/{pid}"))
    if not info["running"]:
        raise ConnectError("not_found", f"process with pid {pid} not found")
    await _not_found_as(ctx, pid, node.call(ctx.ref, "POST", f"/processes/{pid}/signal",
                                            json={"signal": int(req.signal)}))
    return pb.SendSignalResponse()


async def update(ctx: Ctx, req: pb.UpdateRequest) -> pb.UpdateResponse:
    pid = await pid_of(ctx, req.process)
    if req.HasField("pty"):
        size = {"rows": req.pty.size.rows or 24, "cols": req.pty.size.cols or 80}
        await _not_found_as(ctx, pid, node.call(ctx.ref, "POST", f"/processes/{pid}/resize", json=size))
    return pb.UpdateResponse()


METHODS: dict[str, Method] = {
    "Start": Method(SERVER_STREAM, pb.StartRequest, start),
    "Connect": Method(SERVER_STREAM, pb.ConnectRequest, connect),
    "List": Method(UNARY, pb.ListRequest, list_),
    "SendInput": Method(UNARY, pb.SendInputRequest, send_input),
    "StreamInput": Method(CLIENT_STREAM, pb.StreamInputRequest, stream_input),
    "CloseStdin": Method(UNARY, pb.CloseStdinRequest, close_stdin),
    "SendSignal": Method(UNARY, pb.SendSignalRequest, send_signal),
    "Update": Method(UNARY, pb.UpdateRequest, update),
}
