"""Ports by URL (issue 14): what a request through a sandbox port's URL costs over the same request made
inside the sandbox's own network namespace, in the same run, on the same server (busybox httpd in a `tiny`
sandbox, a 1 KiB and a 1 MiB file):

- baseline: a raw HTTP/1.1 GET on a fresh connection to 127.0.0.1:PORT made in the sandbox's network
  namespace (setns from a helper thread, as the node's port tunnel does): the sandbox-internal request;
- the URL from ``sb.get_url(port)`` (token in the query), one keep-alive client: client -> control plane
  (token check, store read) -> node's port tunnel (WebSocket, setns connect) -> the server;
- the same port made public (no token), and the E2B header form (``E2b-Sandbox-Port``) of a public port.

Prints p50/p99 (ms) and the ratio to the baseline. Run as root: ``.venv/bin/python bench/port_urls.py [--n 200]``.
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import MATCH, Up, pct

from pilldrops.node.portforward import _connect_in_netns


def inside_get(pid: int, port: int, path: str) -> int:
    """A GET made inside the sandbox's network namespace; the body's length."""
    box: dict[str, object] = {}
    t = threading.Thread(target=lambda: box.update(s=_connect_in_netns(pid, port, 5.0)))
    t.start()
    t.join()
    s: socket.socket = box["s"]  # type: ignore[assignment]
    s.setblocking(True)
    try:
        s.sendall(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n".encode())
        data = bytearray()
        while chunk := s.recv(65536):
            data += chunk
    finally:
        s.close()
    head, _, body = bytes(data).partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.") and b" 200 " in head.split(b"\r\n")[0], head[:80]
    return len(body)


def timed(fn) -> float:  # type: ignore[no-untyped-def]
    t = time.perf_counter()
    fn()
    return (time.perf_counter() - t) * 1000


def row(name: str, xs: list[float], base: list[float] | None) -> str:
    ratio = f"{pct(xs, 50) / pct(base, 50):.2f}x" if base else "1.00x (baseline)"
    return f"| {name} | {len(xs)} | {pct(xs, 50):.2f} | {pct(xs, 99):.2f} | {ratio} |"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=200)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    from pilldrops import Sandbox
    res: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory(prefix=f"{MATCH}-") as tmp:
        up = Up(Path(tmp), "tiny")
        try:
            with Sandbox.create("tiny", api_url=up.url, api_key=up.key, public_ports=[8081]) as sb:
                sb.files.write("/srv/small", b"x" * 1024)
                sb.files.write("/srv/big", b"y" * (1 << 20))
                assert sb.run("busybox httpd -p 127.0.0.1:8080 -h /srv && busybox httpd -p 127.0.0.1:8081 -h /srv"
                              ).exit_code == 0
                time.sleep(0.5)
                journal = json.loads((up.data / "node" / "journal" / f"{sb.id}.json").read_text())
                pid = int(journal["handle"]["pid"])
                url = sb.get_url(8080, path="/small")
                big = sb.get_url(8080, path="/big")
                public = sb.get_url(8081, path="/small")
                e2b = {"E2b-Sandbox-Id": sb.id.replace("_", "", 1), "E2b-Sandbox-Port": "8081"}
                with httpx.Client(timeout=30) as c:
                    cases = {
                        "small_inside": lambda: inside_get(pid, 8080, "/small"),
                        "small_url": lambda: c.get(url).raise_for_status(),
                        "small_public": lambda: c.get(public).raise_for_status(),
                        "small_e2b": lambda: c.get(f"{up.url}/small", headers=e2b).raise_for_status(),
                        "big_inside": lambda: inside_get(pid, 8080, "/big"),
                        "big_url": lambda: c.get(big).raise_for_status(),
                    }
                    for fn in cases.values():          # warm-up: connections, caches, the secret
                        for _ in range(5):
                            fn()
                    res = {k: [] for k in cases}
                    for _ in range(args.n):            # interleaved, so load on the machine hits all alike
                        for k, fn in cases.items():
                            res[k].append(timed(fn))
                    assert len(c.get(big).content) == 1 << 20
        finally:
            code = up.stop()
    print(f"\nA request through a port URL vs inside the sandbox's netns, same run (ms; exit of `up`: {code})\n")
    print("| request | n | p50 | p99 | ratio (p50) |\n|---|---|---|---|---|")
    print(row("GET 1 KiB inside the sandbox's netns (baseline)", res["small_inside"], None))
    print(row("GET 1 KiB by sb.get_url (signed token)", res["small_url"], res["small_inside"]))
    print(row("GET 1 KiB by URL, public port (no token)", res["small_public"], res["small_inside"]))
    print(row("GET 1 KiB, E2B header form (public port)", res["small_e2b"], res["small_inside"]))
    print(row("GET 1 MiB inside the sandbox's netns (baseline)", res["big_inside"], None))
    print(row("GET 1 MiB by sb.get_url (signed token)", res["big_url"], res["big_inside"]))
    over = pct(res["small_url"], 50) - pct(res["small_inside"], 50)
    print(f"\nOverhead per small request (p50): {over:.2f} ms")
    if args.json:
        args.json.write_text(json.dumps({k: {"p50": pct(v, 50), "p99": pct(v, 99), "n": len(v)}
                                         for k, v in res.items()}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
