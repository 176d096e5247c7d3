"""A test server run INSIDE a sandbox (python3 of the code-interpreter template, stdlib only) on the port
given: plain HTTP routes and a WebSocket echo, each telling what it received.

GET /hello · GET /page/ (relative links) · GET /page/sub.txt · GET /headers (JSON: path, headers) ·
POST /echo (the body back, Content-Length or chunked) · GET /stream (chunks over 0.3 s) · /ws (echo)."""

import base64
import hashlib
import json
import struct
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

GUID = b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11"


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def reply(self, body, ctype="text/plain", status=200):
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def body(self):
        if "chunked" in self.headers.get("Transfer-Encoding", ""):
            out = b""
            while True:
                n = int(self.rfile.readline().split(b";")[0], 16)
                if n == 0:
                    self.rfile.readline()
                    return out
                out += self.rfile.read(n)
                self.rfile.readline()
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    def do_GET(self):
        if self.headers.get("Upgrade", "").lower() == "websocket":
            return self.websocket()
        if self.path == "/hello":
            return self.reply(b"hello from inside")
        if self.path.startswith("/page/sub.txt"):
            return self.reply(b"sub resource")
        if self.path.startswith("/page/"):
            return self.reply(b'<html><a href="sub.txt">sub</a><img src="sub.txt"></html>', "text/html")
        if self.path.startswith("/headers"):
            return self.reply(json.dumps({"path": self.path, "headers": dict(self.headers.items())}).encode(),
                              "application/json")
        if self.path == "/stream":
            self.send_response(200)
            self.send_header("Content-Type", "text/plain")
            self.send_header("Connection", "close")
            self.end_headers()
            for i in range(3):
                self.wfile.write(b"chunk%d\n" % i)
                self.wfile.flush()
                time.sleep(0.1)
            self.close_connection = True
            return None
        return self.reply(b"not here", status=404)

    def do_POST(self):
        data = self.body()
        return self.reply(data, self.headers.get("Content-Type", "application/octet-stream"))

    def do_PUT(self):
        return self.do_POST()

    def websocket(self):
        acc = base64.b64encode(hashlib.sha1(self.headers["Sec-WebSocket-Key"].encode() + GUID).digest())
        self.wfile.write(b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                         b"Sec-WebSocket-Accept: " + acc + b"\r\n\r\n")
        self.wfile.flush()
        f, path = self.rfile, self.path.encode()
        while True:
            h = f.read(2)
            if len(h) < 2:
                break
            op, n = h[0] & 15, h[1] & 127
            if n == 126:
                n = struct.unpack(">H", f.read(2))[0]
            elif n == 127:
                n = struct.unpack(">Q", f.read(8))[0]
            mask = f.read(4)
            data = bytes(b ^ mask[i % 4] for i, b in enumerate(f.read(n)))
            if op == 8:
                self.wfile.write(b"\x88\x02\x03\xe8")
                break
            out = path + b" " + data
            hdr = bytes([128 | op]) + (bytes([len(out)]) if len(out) < 126 else b"\x7e" + struct.pack(">H", len(out)))
            self.wfile.write(hdr + out)
            self.wfile.flush()
        self.close_connection = True


ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), Handler).serve_forever()
