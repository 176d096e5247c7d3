#!/usr/bin/env python3
"""Runs INSIDE a ``code-interpreter`` sandbox (copied there and started by the control plane on first use):
E2B's code-interpreter HTTP protocol on 127.0.0.1:49999, backed by real Jupyter kernels (Debian's
``python3-ipykernel`` + ``python3-jupyter-client``). Standard library + jupyter_client only; it must not
import pilldrops (the sandbox does not have it).

- ``POST /execute {"code","context_id","language","env_vars"}``: NDJSON lines ``stdout``/``stderr``
  (streamed as the kernel prints), ``result`` (the MIME bundle of ``execute_result`` / ``display_data``;
  ``is_main_result`` for the former), ``error`` (name, value, traceback), ``number_of_executions``,
  ``end_of_execution``. A client that goes away interrupts the kernel.
- ``GET/POST /contexts``, ``POST /contexts/{id}/restart``, ``DELETE /contexts/{id}``: one kernel per context.
- ``GET /health``: ``OK``.

Everything it writes is treated as untrusted by the control plane (bounded lines, validated JSON).
"""

from __future__ import annotations

import datetime
import json
import os
import queue
import select
import socket
import sys
import threading
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from jupyter_client import KernelManager

MIME = {"text/plain": "text", "text/html": "html", "text/markdown": "markdown", "image/svg+xml": "svg",
        "image/png": "png", "image/jpeg": "jpeg", "application/pdf": "pdf", "text/latex": "latex",
        "application/json": "json", "application/javascript": "javascript"}
MAX_BODY = 64 * 1024 * 1024


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat().replace("+00:00", "Z")


class ClientGone(Exception):
    pass


class Context:
    def __init__(self, cwd: str | None = None, language: str = "python") -> None:
        self.id = uuid.uuid4().hex[:16]
        self.language = language
        self.cwd = cwd if cwd and os.path.isdir(cwd) else _default_cwd()
        self.lock = threading.Lock()          # one execution at a time per context (as a notebook)
        self.km = KernelManager(kernel_name="python3")
        self.km.start_kernel(cwd=self.cwd)
        self.kc = self.km.client()
        self.kc.start_channels()
        self.kc.wait_for_ready(timeout=60)

    def info(self) -> dict:
        return {"id": self.id, "language": self.language, "cwd": self.cwd}

    def restart(self) -> None:
        with self.lock:
            self.km.restart_kernel(now=True)
            self.kc.wait_for_ready(timeout=60)

    def shutdown(self) -> None:
        try:
            self.kc.stop_channels()
        finally:
            self.km.shutdown_kernel(now=True)

    def _silent(self, code: str) -> None:
        msg_id = self.kc.execute(code, silent=True, store_history=False)
        self._drain(msg_id)

    def _drain(self, msg_id: str) -> None:
        while True:
            msg = self.kc.get_iopub_msg(timeout=None)
            if msg["parent_header"].get("msg_id") == msg_id and msg["msg_type"] == "status" \
                    and msg["content"].get("execution_state") == "idle":
                return

    def execute(self, code: str, env_vars: dict | None, emit, client_gone=lambda: False) -> None:
        with self.lock:
            if env_vars:
                self._silent(f"import os as __pd_os\n__pd_saved = {{k: __pd_os.environ.get(k) for k in {list(env_vars)!r}}}\n"
                             f"__pd_os.environ.update({env_vars!r})")
            try:
                self._run(code, emit, client_gone)
            finally:
                if env_vars:
                    self._silent("for __k, __v in __pd_saved.items():\n"
                                 "    (__pd_os.environ.pop(__k, None) if __v is None "
                                 "else __pd_os.environ.__setitem__(__k, __v))\n"
                                 "del __pd_saved")

    def _run(self, code: str, emit, client_gone=lambda: False) -> None:
        msg_id = self.kc.execute(code, store_history=True, allow_stdin=False)
        gone = False

        def out(line: dict) -> None:
            nonlocal gone
            if gone:
                return
            try:
                emit(line)
            except ClientGone:
                gone = True
                self.km.interrupt_kernel()      # nobody reads: stop the code, keep the kernel's state

        while True:
            try:
                msg = self.kc.get_iopub_msg(timeout=0.5)
            except queue.Empty:
                if not gone and client_gone():
                    gone = True
                    self.km.interrupt_kernel()
                continue
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            kind, c = msg["msg_type"], msg["content"]
            if kind == "stream":
                out({"type": "stderr" if c.get("name") == "stderr" else "stdout", "text": c.get("text", ""),
                     "timestamp": _now()})
            elif kind in ("execute_result", "display_data"):
                out(_result(c.get("data") or {}, main=kind == "execute_result"))
            elif kind == "error":
                out({"type": "error", "name": c.get("ename", ""), "value": c.get("evalue", ""),
                     "traceback": "\n".join(c.get("traceback") or [])})
            elif kind == "execute_input":
                out({"type": "number_of_executions", "execution_count": c.get("execution_count")})
            elif kind == "status" and c.get("execution_state") == "idle":
                break
        out({"type": "end_of_execution"})


def _result(data: dict, main: bool) -> dict:
    out: dict = {"type": "result", "is_main_result": main, "extra": {}}
    for mime, value in data.items():
        key = MIME.get(mime)
        if key:
            out[key] = value
        else:
            out["extra"][mime] = value
    for key in MIME.values():
        out.setdefault(key, None)
    out.setdefault("data", None)
    out.setdefault("chart", None)
    return out


def _default_cwd() -> str:
    for d in (os.environ.get("PD_CI_CWD"), "/home/user", os.path.expanduser("~"), "/"):
        if d and os.path.isdir(d):
            return d
    return "/"


class State:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.default = Context()
        self.contexts = {self.default.id: self.default}


STATE: State


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.0"        # close-delimited answers: every line reaches the client at once
    server_version = "pilldrops-code-interpreter"

    def log_message(self, fmt: str, *args: object) -> None:
        sys.stderr.write(f"{self.command} {self.path}\n")

    def _json(self, status: int, body: object) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _text(self, status: int, text: str) -> None:
        data = text.encode()
        self.send_response(status)
        self.send_header("Content-Type", "text/plain")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _body(self) -> dict:
        n = int(self.headers.get("Content-Length") or 0)
        if n > MAX_BODY:
            raise ValueError("body too large")
        raw = self.rfile.read(n) if n else b""
        data = json.loads(raw) if raw.strip() else {}
        if not isinstance(data, dict):
            raise ValueError("the body must be a JSON object")  # noqa: TRY004 - a protocol error, not a caller's type error
        return data

    def do_GET(self) -> None:
        if self.path == "/health":
            self._text(200, "OK")
        elif self.path.split("?")[0] == "/contexts":
            with STATE.lock:
                self._json(200, [c.info() for c in STATE.contexts.values()])
        else:
            self._text(404, "not found")

    def do_DELETE(self) -> None:
        parts = self.path.strip("/").split("/")
        if len(parts) == 2 and parts[0] == "contexts":
            with STATE.lock:
                ctx = STATE.contexts.pop(parts[1], None)
            if ctx is None:
                self._text(404, f"context {parts[1]} not found")
                return
            ctx.shutdown()
            self._json(200, {})
            return
        self._text(404, "not found")

    def do_POST(self) -> None:
        try:
            body = self._body()
        except ValueError as e:
            self._text(400, str(e))
            return
        parts = self.path.split("?")[0].strip("/").split("/")
        if parts == ["execute"]:
            self._execute(body)
        elif parts == ["contexts"]:
            lang = body.get("language") or "python"
            if lang != "python":
                self._text(400, f"language {lang!r} is not supported (python only)")
                return
            ctx = Context(cwd=body.get("cwd"), language=lang)
            with STATE.lock:
                STATE.contexts[ctx.id] = ctx
            self._json(200, ctx.info())
        elif len(parts) == 3 and parts[0] == "contexts" and parts[2] == "restart":
            with STATE.lock:
                ctx = STATE.contexts.get(parts[1])
            if ctx is None:
                self._text(404, f"context {parts[1]} not found")
                return
            ctx.restart()
            self._json(200, {})
        else:
            self._text(404, "not found")

    def _execute(self, body: dict) -> None:
        code, ctx_id, lang = body.get("code"), body.get("context_id"), body.get("language")
        env_vars = body.get("env_vars") or None
        if not isinstance(code, str):
            self._text(400, "code must be a string")
            return
        if ctx_id and lang:
            self._text(400, "only one of context_id and language may be given")
            return
        if lang and lang != "python":
            self._text(400, f"language {lang!r} is not supported (python only)")
            return
        if env_vars is not None and (not isinstance(env_vars, dict)
                                     or not all(isinstance(v, str) for v in env_vars.values())):
            self._text(400, "env_vars must map names to strings")
            return
        with STATE.lock:
            ctx = STATE.contexts.get(ctx_id) if ctx_id else STATE.default
        if ctx is None:
            self._text(404, f"context {ctx_id} not found")
            return
        self.send_response(200)
        self.send_header("Content-Type", "application/x-ndjson")
        self.end_headers()

        def emit(line: dict) -> None:
            try:
                self.wfile.write(json.dumps(line).encode() + b"\n")
                self.wfile.flush()
            except OSError as e:
                raise ClientGone() from e

        def client_gone() -> bool:
            """The request was read whole, so a readable socket with nothing to read is the peer's close."""
            try:
                if not select.select([self.connection], [], [], 0)[0]:
                    return False
                return self.connection.recv(1, socket.MSG_PEEK) == b""
            except OSError:
                return True

        ctx.execute(code, env_vars, emit, client_gone)


def main() -> None:
    global STATE
    port = int(sys.argv[1]) if len(sys.argv) > 1 else 49999
    server = ThreadingHTTPServer(("127.0.0.1", port), Handler)   # bind first: a second copy exits here
    server.daemon_threads = True
    STATE = State()
    server.serve_forever()


if __name__ == "__main__":
    main()
