"""E2B's code interpreter (``E2b-Sandbox-Port: 49999``): ``/execute``, ``/contexts``, ``/health``.

The work is done inside the sandbox by ``kernel_server`` (real Jupyter kernels), which this module copies
in and starts on first use through the node's exec channel (detached with ``setsid``, so it outlives the
command that started it), then reaches on 127.0.0.1:49999 through the port tunnel (``ports``).

What comes back from the sandbox is attacker input: ``/execute`` is relayed line by line, each line at most
``MAX_LINE`` bytes and a JSON object with a string ``type`` (anything else ends the stream with an
``error`` line); other answers are relayed up to ``MAX_ANSWER`` bytes.
"""

from __future__ import annotations

import json
import logging
from importlib import resources
from typing import Any

import anyio
from starlette.types import Receive, Scope, Send

from pilldrops import errors
from pilldrops._internal.ids import same_secret
from pilldrops.e2b import ports
from pilldrops.e2b.context import STATE_KEY, SandboxRef

log = logging.getLogger("pilldrops.e2b")
PORT = 49999
TEMPLATE = "code-interpreter"
SERVER_PATH = "/opt/pilldrops/code_interpreter_server.py"
SERVER_LOG = "/var/log/pilldrops-code-interpreter.log"
MAX_REQUEST = 16 * 1024 * 1024
MAX_LINE = 16 * 1024 * 1024
MAX_ANSWER = 1024 * 1024
START_TIMEOUT_S = 30.0
_NO_PYTHON, _NO_JUPYTER = 127, 3
_START = ('command -v python3 >/dev/null 2>&1 || exit 127; '
          'python3 -c "import jupyter_client, ipykernel" >/dev/null 2>&1 || exit 3; '
          'exec setsid -f python3 "$1" 49999 >>"$2" 2>&1 </dev/null')


def _server_source() -> bytes:
    return resources.files("pilldrops.e2b").joinpath("kernel_server.py").read_bytes()


async def _send(send: Send, status: int, body: bytes, content_type: bytes = b"text/plain") -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", content_type), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


def _line(obj: dict[str, Any]) -> bytes:
    return json.dumps(obj).encode() + b"\n"


async def ndjson_lines(body: Any, max_line: int = MAX_LINE) -> Any:
    """Validated lines of an NDJSON stream from the sandbox: each a JSON object with a string ``type``.
    Blank lines are dropped (the SDKs ``json.loads`` every line); a line that is too long or not such an
    object ends the stream with one ``error`` line."""
    buf = bytearray()
    async for chunk in body:
        buf += chunk
        while (i := buf.find(b"\n")) >= 0:
            raw, buf = bytes(buf[:i]), buf[i + 1:]
            if not raw.strip():
                continue
            try:
                obj = json.loads(raw)
            except ValueError:
                obj = None
            if not isinstance(obj, dict) or not isinstance(obj.get("type"), str):
                yield _line({"type": "error", "name": "ProtocolError", "value": "the code interpreter in the "
                             "sandbox sent a malformed line", "traceback": ""})
                return
            yield raw + b"\n"
        if len(buf) > max_line:
            yield _line({"type": "error", "name": "OutputTooLarge",
                         "value": f"one output of the code interpreter is larger than {max_line} bytes",
                         "traceback": ""})
            return


class CodeInterpreter:
    def __init__(self) -> None:
        self._starting: dict[str, anyio.Lock] = {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        ref: SandboxRef = scope["state"][STATE_KEY]
        if scope["type"] != "http":
            await send({"type": "websocket.close", "code": 1008})
            return
        path, method = scope.get("path", "/"), scope.get("method", "GET")
        if path == "/health":
            await _send(send, 200, b"OK")
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        if path == "/execute" and not same_secret(headers.get("x-access-token", ""), ref.access_token):
            await _send(send, 401, json.dumps({"code": 401, "message": "unauthorized access: invalid or missing "
                                               "X-Access-Token", **errors.AuthenticationError(
                                                   "invalid X-Access-Token").to_body()}).encode(),
                        b"application/json")
            return
        try:
            body = await self._read(receive)
        except errors.PayloadTooLarge as exc:
            await _send(send, 413, exc.message.encode())
            return
        failure: errors.PillDropsError | None = None
        async with anyio.create_task_group() as tg:
            async def watch() -> None:       # the client went away: the tunnel closes, the kernel stops
                while (await receive())["type"] != "http.disconnect":
                    pass
                tg.cancel_scope.cancel()

            tg.start_soon(watch)
            try:
                await self._relay(ref, scope, send, path, method, body, headers)
            except errors.PillDropsError as exc:
                failure = exc
            tg.cancel_scope.cancel()
        if failure is not None:
            # 502 is what the SDKs read as "sandbox timeout"; a template without a kernel is a plain 400
            status = 400 if isinstance(failure, errors.InvalidRequest) else 502
            await _send(send, status, failure.message.encode())

    @staticmethod
    async def _read(receive: Receive) -> bytes:
        out = bytearray()
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                break
            out += msg.get("body", b"")
            if len(out) > MAX_REQUEST:
                raise errors.PayloadTooLarge(f"request is larger than {MAX_REQUEST} bytes")
            if not msg.get("more_body"):
                break
        return bytes(out)

    async def _relay(self, ref: SandboxRef, scope: Scope, send: Send, path: str, method: str, body: bytes,
                     headers: dict[str, str]) -> None:
        target = ports._target(scope)
        fwd = [(b"content-type", headers.get("content-type", "application/json").encode())]

        async def one() -> Any:
            yield body

        for attempt in range(2):
            try:
                async with ports.open_tunnel(ref, PORT) as tunnel:
                    status, _, answer = await ports.request_stream(tunnel, PORT, method, target, fwd, one(),
                                                                   length=len(body))
                    if path == "/execute" and status == 200:
                        await send({"type": "http.response.start", "status": 200,
                                    "headers": [(b"content-type", b"application/x-ndjson")]})
                        async for line in ndjson_lines(answer):
                            await send({"type": "http.response.body", "body": line, "more_body": True})
                        await send({"type": "http.response.body", "body": b""})
                        return
                    data = bytearray()
                    async for chunk in answer:
                        data += chunk
                        if len(data) > MAX_ANSWER:
                            raise errors.NodeUnavailable("the code interpreter's answer is too large")
                    ctype = b"application/json" if data[:1] in (b"{", b"[") else b"text/plain"
                    await _send(send, status, bytes(data), ctype)
                    return
            except ports.PortClosed:
                if attempt:
                    raise errors.NodeUnavailable("the code interpreter did not start in the sandbox") from None
                await self.start(ref)

    async def start(self, ref: SandboxRef) -> None:
        """Copy the kernel server in and start it (once, even for concurrent first calls); then wait
        until it listens."""
        lock = self._starting.setdefault(ref.id, anyio.Lock())
        async with lock:
            if await self._listening(ref):
                return
            log.info("starting the code interpreter in %s", ref.id)
            r = await ref.node.request("PUT", "/files", params={"path": SERVER_PATH}, content=_server_source())
            if r.status_code >= 300:
                raise errors.NodeUnavailable(f"could not copy the code interpreter in: HTTP {r.status_code}")
            code = await self._run(ref, ["/bin/sh", "-c", _START, "sh", SERVER_PATH, SERVER_LOG])
            if code in (_NO_PYTHON, _NO_JUPYTER):
                raise errors.InvalidRequest(
                    f"template {ref.template!r} has no Jupyter kernel (python3-ipykernel); create the sandbox "
                    "from template 'code-interpreter' (E2B's 'code-interpreter-v1')")
            if code != 0:
                raise errors.NodeUnavailable(f"starting the code interpreter failed (exit {code})")
            with anyio.move_on_after(START_TIMEOUT_S):
                while not await self._listening(ref):
                    await anyio.sleep(0.1)
                return
            raise errors.NodeUnavailable(f"the code interpreter did not listen within {START_TIMEOUT_S:.0f} s "
                                         f"(see {SERVER_LOG} in the sandbox)")
        if len(self._starting) > 10_000:
            self._starting.clear()

    @staticmethod
    async def _listening(ref: SandboxRef) -> bool:
        try:
            async with ports.open_tunnel(ref, PORT):
                return True
        except ports.PortClosed:
            return False

    @staticmethod
    async def _run(ref: SandboxRef, argv: list[str]) -> int:
        """Exit code of a short command (the node's ``/run`` NDJSON stream, read to its end, bounded)."""
        r = await ref.node.request("POST", "/run", json={"cmd": argv, "timeout": 30, "max_output_bytes": 65536},
                                   timeout=60)
        if r.status_code >= 300:
            raise errors.NodeUnavailable(f"the node refused the command: HTTP {r.status_code}")
        for raw in r.content[-(1 << 20):].splitlines():
            try:
                ev = json.loads(raw)
            except ValueError:
                continue
            if isinstance(ev, dict) and ev.get("type") == "exit":
                return int(ev.get("exit_code") or 0)
        raise errors.NodeUnavailable("the command ended without an exit code")
