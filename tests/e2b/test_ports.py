"""User ports: a request with ``E2b-Sandbox-Port: N`` (or ``Host: N-<id>.<domain>``) reaches
127.0.0.1:N inside the sandbox (its own network namespace, loopback only), HTTP and WebSocket, through the
node's port tunnel. A closed port and a gone sandbox answer as E2B's proxy does."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator

import httpx
import pytest
from websockets.exceptions import InvalidStatus
from websockets.sync.client import connect as ws_connect

from tests.e2b.conftest import Up

pytestmark = pytest.mark.integration

WS_ECHO = r'''
import base64, hashlib, socket, struct, sys, threading
def handle(c):
    req = b""
    while b"\r\n\r\n" not in req:
        req += c.recv(4096)
    line = [l for l in req.split(b"\r\n") if l.lower().startswith(b"sec-websocket-key")][0]
    key = line.split(b":", 1)[1].strip()
    acc = base64.b64encode(hashlib.sha1(key + b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11").digest())
    path = req.split(b" ")[1]
    c.sendall(b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
              b"Sec-WebSocket-Accept: " + acc + b"\r\n\r\n")
    f = c.makefile("rb")
    while True:
        h = f.read(2)
        if len(h) < 2:
            return
        op, n = h[0] & 15, h[1] & 127
        if n == 126:
            n = struct.unpack(">H", f.read(2))[0]
        elif n == 127:
            n = struct.unpack(">Q", f.read(8))[0]
        mask = f.read(4)
        data = bytes(b ^ mask[i % 4] for i, b in enumerate(f.read(n)))
        if op == 8:
            c.sendall(b"\x88\x02\x03\xe8")
            return
        out = path + b" " + data
        hdr = bytes([128 | op]) + (bytes([len(out)]) if len(out) < 126 else b"\x7e" + struct.pack(">H", len(out)))
        c.sendall(hdr + out)
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("127.0.0.1", int(sys.argv[1])))
s.listen()
while True:
    c, _ = s.accept()
    threading.Thread(target=handle, args=(c,), daemon=True).start()
'''


def _run(api: httpx.Client, sid: str, cmd: str) -> int:
    r = api.post(f"/v1/sandboxes/{sid}/run", json={"cmd": cmd, "timeout": 30})
    r.raise_for_status()
    return next(json.loads(x)["exit_code"] for x in r.text.splitlines() if json.loads(x)["type"] == "exit")


@pytest.fixture
def served(e2b_http: httpx.Client, api: httpx.Client, pd_up: Up) -> Iterator[dict[str, str]]:
    """A code-interpreter sandbox (made through E2B) serving HTTP on :8000 and a WebSocket echo on :8765,
    both bound to its own loopback only."""
    sb = e2b_http.post("/v2/sandboxes", json={"templateID": "code-interpreter-v1"}).json()
    sid = "sb_" + sb["sandboxID"][2:]
    try:
        api.put(f"/v1/sandboxes/{sid}/files", params={"path": "/srv/hello.txt"},
                content=b"hello from inside").raise_for_status()
        api.put(f"/v1/sandboxes/{sid}/files", params={"path": "/srv/ws.py"}, content=WS_ECHO.encode()
                ).raise_for_status()
        assert _run(api, sid, "setsid -f python3 -m http.server 8000 --bind 127.0.0.1 -d /srv "
                              ">/dev/null 2>&1 </dev/null; setsid -f python3 /srv/ws.py 8765 >/dev/null 2>&1 "
                              "</dev/null") == 0
        deadline = time.monotonic() + 20
        while _run(api, sid, "python3 -c \"import socket; [socket.create_connection(('127.0.0.1', p)) "
                             "for p in (8000, 8765)]\"") != 0:
            assert time.monotonic() < deadline, "servers in the sandbox did not start"
            time.sleep(0.2)
        yield sb
    finally:
        e2b_http.delete(f"/sandboxes/{sb['sandboxID']}")


def test_http_by_header_and_by_host(served: dict[str, str], pd_up: Up) -> None:
    sid = served["sandboxID"]
    r = httpx.get(f"{pd_up.api_url}/hello.txt", headers={"E2b-Sandbox-Id": sid, "E2b-Sandbox-Port": "8000"})
    assert r.status_code == 200 and r.text == "hello from inside"
    assert r.headers["content-length"] == str(len("hello from inside"))
    r = httpx.get(f"{pd_up.api_url}/hello.txt", headers={"Host": f"8000-{sid}.sandbox.localhost"})
    assert r.status_code == 200 and r.text == "hello from inside"
    r = httpx.get(f"{pd_up.api_url}/missing", headers={"E2b-Sandbox-Id": sid, "E2b-Sandbox-Port": "8000"})
    assert r.status_code == 404                               # the sandbox's server's own answer
    r = httpx.post(f"{pd_up.api_url}/x", content=b"body", headers={"E2b-Sandbox-Id": sid, "E2b-Sandbox-Port": "8000"})
    assert r.status_code == 501                               # http.server has no POST: its answer, relayed


def test_closed_port_and_gone_sandbox(served: dict[str, str], pd_up: Up, e2b_http: httpx.Client) -> None:
    sid = served["sandboxID"]
    r = httpx.get(f"{pd_up.api_url}/", headers={"E2b-Sandbox-Id": sid, "E2b-Sandbox-Port": "8001"})
    assert r.status_code == 502 and r.json()["message"] == "The sandbox is running but port is not open"
    assert e2b_http.delete(f"/sandboxes/{sid}").status_code == 204
    r = httpx.get(f"{pd_up.api_url}/hello.txt", headers={"E2b-Sandbox-Id": sid, "E2b-Sandbox-Port": "8000"})
    assert r.status_code == 502 and r.json() | {"error": None} == {
        "sandboxId": sid, "message": "The sandbox was not found", "code": 502, "error": None}


def test_websocket(served: dict[str, str], pd_up: Up) -> None:
    sid = served["sandboxID"]
    ws_url = pd_up.api_url.replace("http", "ws", 1)
    with ws_connect(f"{ws_url}/chat?room=1", additional_headers={"E2b-Sandbox-Id": sid,
                                                                 "E2b-Sandbox-Port": "8765"}) as ws:
        ws.send("hi")
        assert ws.recv(timeout=10) == "/chat?room=1 hi"
        ws.send(b"\x00\x01" * 100)
        assert ws.recv(timeout=10) == b"/chat?room=1 " + b"\x00\x01" * 100
    port = int(pd_up.api_url.rsplit(":", 1)[1])
    with ws_connect(f"ws://8765-{sid}.sandbox.localhost:{port}/h",          # Host: {port}-{id}.{domain}
                    sock=socket.create_connection(("127.0.0.1", port))) as ws:
        ws.send("x")
        assert ws.recv(timeout=10) == "/h x"
    with pytest.raises(InvalidStatus):    # nothing listens there: the handshake is refused
        ws_connect(f"{ws_url}/", additional_headers={"E2b-Sandbox-Id": sid, "E2b-Sandbox-Port": "8766"},
                   open_timeout=10).close()

