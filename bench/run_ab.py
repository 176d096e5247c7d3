"""run("true") of two source trees side by side in the same minutes (issue 15's before/after).

    .venv/bin/python bench/run_ab.py --base-src /path/to/other/checkout/src [--n 600] [--block 25]

Needs root and crun. Starts two ``pilldrops up`` (the bench harness's ``Up``: own data dirs, ports, node
names), one running the tree at ``--base-src`` (through ``PYTHONPATH``), one this tree; creates one sandbox
in each, then alternates blocks of ``--block`` × (``sb.run("true")`` + one bare ``GET /healthz`` to the same
node on the same kept-alive client: the floor of one request) between the two, in alternating order. The
client (this process) is this tree's SDK. Prints p50/p90 of both, the ratio to the GET, the exit event's
``duration`` (the node's own view: from its ``DataPlane.run`` to the exit frame) and the node agent's CPU
(utime+stime) per run + GET, with /proc/loadavg before and after.

``--wire N`` adds the sandbox side alone: N commands (``/bin/true``) from a blocking client straight to each
side's pd-init socket, with the run's flag 8 (pd-init may hold the pid frame until the exit) and without,
alternated: p50 of the pid frame and of the exit frame after the request, and recv calls per command (the
client's wake-ups: 1.0 when the pid came with the exit). A base init that predates flag 8 ignores it.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from _harness import pct, two_ups

from pilldrops import Sandbox
from pilldrops.node.isolation.superexec import HDR, encode_request


def cpu_s(pid: int) -> float:
    f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")


def wire_one(path: Path, late: bool) -> tuple[float, float, int]:
    """One ``/bin/true`` on pd-init's socket: ms to the pid frame, ms to the exit frame, recv calls."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.connect(str(path))
        t0 = time.perf_counter()
        s.sendall(encode_request(["/bin/true"], {"PATH": "/usr/bin:/bin"}, "/", stdin=False, pid_late=late))
        buf, tp, tx, recvs = b"", 0.0, 0.0, 0
        while not tx:
            d = s.recv(65536)
            recvs += 1
            if not d:
                raise RuntimeError("pd-init hung up before the exit frame")
            buf += d
            while len(buf) >= HDR.size and len(buf) >= HDR.size + HDR.unpack_from(buf)[1]:
                typ, n = HDR.unpack_from(buf)
                if typ == ord("P"):
                    tp = (time.perf_counter() - t0) * 1000
                elif typ == ord("X"):
                    tx = (time.perf_counter() - t0) * 1000
                buf = buf[HDR.size + n:]
    return tp, tx, recvs


def wire(ctl: dict[str, Path], n: int) -> None:
    res = {(k, late): [] for k in ctl for late in (False, True)}
    for i in range(n):
        for k, path in ctl.items():
            for late in (False, True) if i % 2 else (True, False):
                res[(k, late)].append(wire_one(path, late))
    print(f"sandbox side alone (blocking client on pd-init's socket, /bin/true, N={n} each):")
    print(f"{'tree':<10} {'flag 8':>6} {'P p50':>8} {'X p50':>8} {'X p90':>8} {'recv/cmd':>9}")
    for (k, late), r in res.items():
        print(f"{k:<10} {'yes' if late else 'no':>6} {pct([x[0] for x in r], 50):6.2f}ms {pct([x[1] for x in r], 50):6.2f}ms "
              f"{pct([x[1] for x in r], 90):6.2f}ms {sum(x[2] for x in r) / len(r):9.2f}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--base-src", type=Path, required=True, help="the other tree's src/ directory")
    ap.add_argument("--n", type=int, default=600, help='timed run("true") per side')
    ap.add_argument("--block", type=int, default=25)
    ap.add_argument("--template", default="tiny")
    ap.add_argument("--wire", type=int, default=0, help="also N commands straight on each pd-init's socket")
    a = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("bench/run_ab.py needs root (crun, mounts, cgroups)")
    with two_ups(a.base_src, a.template) as ups:
        sbs = {k: Sandbox.create(template=a.template, memory_mb=256, api_url=u.url, api_key=u.key)
               for k, u in ups.items()}
        node = {k: int(subprocess.run(["pgrep", "-P", str(u.proc.pid)], capture_output=True, text=True,
                                      check=True).stdout.split()[0]) for k, u in ups.items()}
        res: dict[str, dict[str, list[float]]] = {k: {"run": [], "get": [], "dur": []} for k in sbs}
        cpu = dict.fromkeys(sbs, 0.0)
        for sb in sbs.values():
            for _ in range(20):
                sb.run("true")
        load = [Path("/proc/loadavg").read_text().split()[:3]]
        for blk in range(max(1, a.n // a.block)):
            order = list(sbs.items()) if blk % 2 == 0 else list(reversed(sbs.items()))
            for k, sb in order:
                http, url = sb._client._http, f"{(sb.info.envd_url or '').rstrip('/')}/healthz"
                c0 = cpu_s(node[k])
                for _ in range(a.block):
                    t = time.perf_counter()
                    r = sb.run("true")
                    res[k]["run"].append((time.perf_counter() - t) * 1000)
                    assert r.exit_code == 0, r
                    res[k]["dur"].append(r.duration * 1000)
                    t = time.perf_counter()
                    http.get(url).raise_for_status()
                    res[k]["get"].append((time.perf_counter() - t) * 1000)
                cpu[k] += cpu_s(node[k]) - c0
        load.append(Path("/proc/loadavg").read_text().split()[:3])
        if a.wire:
            wire({k: next(u.data.glob(f"**/{sbs[k].id}/pd/ctl")) for k, u in ups.items()}, a.wire)
        for sb in sbs.values():
            sb.kill()
    print(f"loadavg before {' '.join(load[0])}, after {' '.join(load[1])}; N={len(res['base']['run'])} a side")
    print(f"{'tree':<10} {'run p50':>8} {'run p90':>8} {'GET p50':>8} {'run÷GET':>8} {'duration':>9} {'node CPU/run+GET':>17}")
    for k, r in res.items():
        print(f"{k:<10} {pct(r['run'], 50):7.2f}ms {pct(r['run'], 90):7.2f}ms {pct(r['get'], 50):7.2f}ms "
              f"{pct(r['run'], 50) / pct(r['get'], 50):7.2f}× {pct(r['dur'], 50):7.2f}ms "
              f"{cpu[k] * 1000 / len(r['run']):15.2f}ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
