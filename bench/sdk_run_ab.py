"""The SDK's own CPU per ``run("true")``, two source trees side by side (issue 15's client-side figure).

    .venv/bin/python bench/sdk_run_ab.py --base-src /path/to/other/checkout/src [--n 500] [--rounds 3]

No sandbox and no root: a stand-in node (this script with ``--serve``, a plain asyncio server in its own
process) answers every request with the NDJSON a silent command's run gets (start + exit, chunked, one
write), so the only thing that differs between the two sides is the client. Each round runs a client
process of each tree in turn (``PYTHONPATH``), order alternated; each client makes one sync ``Sandbox`` for
the stand-in node, warms up, then times ``--n`` runs five times and reports its CPU (``time.process_time``:
user + system, so the client's socket calls count) per run. Prints both trees' figures per round, the
medians and their ratio, with /proc/loadavg.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

BODY = (b'{"type":"start"}\n'
        b'{"type":"exit","exit_code":0,"duration":0.004123,"truncated":false,"timed_out":false}\n')
ANSWER = (b"HTTP/1.1 200 OK\r\ncontent-type: application/x-ndjson\r\ntransfer-encoding: chunked\r\n"
          b"x-request-id: bench\r\n\r\n" + f"{len(BODY):x}\r\n".encode() + BODY + b"\r\n0\r\n\r\n")
MAX_HEAD = 64 * 1024


async def _handle(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
    buf = b""
    while d := await r.read(65536):
        buf += d
        while b"\r\n\r\n" in buf:
            head, rest = buf.split(b"\r\n\r\n", 1)
            n = next((int(ln.split(b":", 1)[1]) for ln in head.split(b"\r\n")
                      if ln.lower().startswith(b"content-length:")), 0)
            if len(rest) < n:
                break
            buf = rest[n:]
            w.write(ANSWER)
        if len(buf) > MAX_HEAD:
            break
    w.close()


def serve(port: int) -> None:
    async def main() -> None:
        server = await asyncio.start_server(_handle, "127.0.0.1", port)
        async with server:
            await server.serve_forever()
    asyncio.run(main())


def client(port: int, n: int) -> None:
    """One tree's client (run with that tree on PYTHONPATH): prints its median CPU µs per run."""
    os.environ.update(PILLDROPS_API_KEY="pd_bench", PILLDROPS_API_URL="http://127.0.0.1:9")
    from pilldrops import Sandbox
    from pilldrops.schema.api import SandboxInfo
    from pilldrops.sdk._sync.client import APIClient

    info = SandboxInfo(id="sb_bench", template="tiny", state="running", vcpu=1, memory_mb=256, timeout=600,
                       created_at="2026-01-01T00:00:00Z", envd_url=f"http://127.0.0.1:{port}",
                       access_token="t" * 32)
    sb = Sandbox(info, client=APIClient.from_options())
    for _ in range(200):
        assert sb.run("true").exit_code == 0
    cpu = []
    for _ in range(5):
        c0 = time.process_time()
        for _ in range(n):
            sb.run("true")
        cpu.append((time.process_time() - c0) * 1e6 / n)
    print(f"{statistics.median(cpu):.1f}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--base-src", type=Path, help="the other tree's src/ directory")
    ap.add_argument("--n", type=int, default=500, help="runs per timed batch (five batches a client)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--serve", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--client", type=int, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.serve:
        serve(a.serve)
        return 0
    if a.client:
        client(a.client, a.n)
        return 0
    if a.base_src is None:
        ap.error("--base-src is required")
    port = free_port()
    server = subprocess.Popen([sys.executable, __file__, "--serve", str(port)])
    trees = {"base": a.base_src.resolve(), "this tree": Path(__file__).resolve().parent.parent / "src"}
    res: dict[str, list[float]] = {k: [] for k in trees}
    try:
        for _ in range(50):
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.1)
        load0 = Path("/proc/loadavg").read_text().split()[:3]
        for rnd in range(a.rounds):
            order = list(trees.items()) if rnd % 2 == 0 else list(reversed(trees.items()))
            for k, src in order:
                out = subprocess.run([sys.executable, __file__, "--client", str(port), "--n", str(a.n)],
                                     env={**os.environ, "PYTHONPATH": str(src)}, capture_output=True, text=True,
                                     check=True).stdout
                res[k].append(float(out.split()[-1]))
                print(f"round {rnd + 1} {k:<10} {res[k][-1]:8.1f} µs CPU per run", flush=True)
        load1 = Path("/proc/loadavg").read_text().split()[:3]
    finally:
        server.terminate()
        server.wait()
    base, new = statistics.median(res["base"]), statistics.median(res["this tree"])
    print(f"loadavg before {' '.join(load0)}, after {' '.join(load1)}")
    print(f"{'tree':<10} {'SDK CPU per run (median of rounds)':>36}")
    print(f"{'base':<10} {base:33.1f} µs")
    print(f"{'this tree':<10} {new:33.1f} µs   ({new / base:.2f}× base)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
