"""The "outside host" of the network tests, run inside the network namespace the test suite creates:
HTTP servers answering ``ok <address>`` on each ``--http ADDR:PORT``, and a DNS server answering A queries
for ``--name NAME=ADDR`` (everything else: NXDOMAIN) on ``--dns ADDR:PORT``. Prints ``ready`` once all
listen. Standard library only."""

from __future__ import annotations

import argparse
import socket
import struct
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class Handler(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = f"ok {self.server.server_address[0]}\n".encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


def dns_answer(query: bytes, names: dict[str, str]) -> bytes | None:
    if len(query) < 12:
        return None
    qid, _flags, qd = struct.unpack("!HHH", query[:6])
    if qd != 1:
        return None
    i, labels = 12, []
    while i < len(query) and query[i]:
        n = query[i]
        labels.append(query[i + 1:i + 1 + n].decode(errors="replace"))
        i += 1 + n
    question = query[12:i + 5]
    qtype = struct.unpack("!H", query[i + 1:i + 3])[0] if i + 3 <= len(query) else 0
    name = ".".join(labels).lower()
    addr = names.get(name)
    if addr is None or qtype != 1:
        rcode = 3 if addr is None else 0
        return struct.pack("!HHHHHH", qid, 0x8180 | rcode, 1, 0, 0, 0) + question
    answer = b"\xc0\x0c" + struct.pack("!HHIH", 1, 1, 5, 4) + socket.inet_aton(addr)
    return struct.pack("!HHHHHH", qid, 0x8180, 1, 1, 0, 0) + question + answer


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--http", action="append", default=[])
    ap.add_argument("--dns")
    ap.add_argument("--name", action="append", default=[])
    a = ap.parse_args()
    for spec in a.http:
        host, port = spec.rsplit(":", 1)
        srv = ThreadingHTTPServer((host, int(port)), Handler)
        threading.Thread(target=srv.serve_forever, daemon=True).start()
    if a.dns:
        names = dict(n.split("=", 1) for n in a.name)
        host, port = a.dns.rsplit(":", 1)
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        sock.bind((host, int(port)))

        def serve() -> None:
            while True:
                data, peer = sock.recvfrom(512)
                reply = dns_answer(data, names)
                if reply is not None:
                    sock.sendto(reply, peer)
        threading.Thread(target=serve, daemon=True).start()
    print("ready", flush=True)
    sys.stdin.read()          # until the test closes our stdin


if __name__ == "__main__":
    main()
