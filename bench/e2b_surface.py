"""The E2B-compatible surface against our own API, in the same run on the same server and template:

- create -> kill through the stock ``e2b`` SDK vs through the PillDrops SDK (baseline);
- ``run_code("1")`` round trip (stock ``e2b-code-interpreter``, warm kernel) vs our ``run("true")``;
- the first ``run_code`` after create (the kernel's start, partly hidden by the warm-up at create);
- a GET of a small file from a server on a port inside the sandbox (``E2b-Sandbox-Port``, the port tunnel)
  (client -> control plane -> node tunnel -> sandbox) vs reading the same file with our SDK
  (``files.read_bytes``, client -> node data plane -> exec in the sandbox).

Prints p50/p99 and the ratio to the baseline. Run as root: ``.venv/bin/python bench/e2b_surface.py [--n 30]``.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import MATCH, Up, pct


def timed(fn) -> float:  # type: ignore[no-untyped-def]
    t = time.perf_counter()
    fn()
    return (time.perf_counter() - t) * 1000


def row(name: str, xs: list[float], base: list[float] | None) -> str:
    p50, p99 = pct(xs, 50), pct(xs, 99)
    ratio = f"{p50 / pct(base, 50):.2f}x" if base else "-"
    return f"| {name} | {len(xs)} | {p50:.1f} | {p99:.1f} | {ratio} |"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=30)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix=f"{MATCH}-") as tmp:
        up = Up(Path(tmp), "code-interpreter", seed=["base", "code-interpreter"])
        try:
            os.environ.update(E2B_API_URL=up.url, E2B_SANDBOX_URL=up.url, E2B_API_KEY=up.key)
            from e2b import Sandbox as E2BSandbox
            from e2b_code_interpreter import Sandbox as CISandbox

            from pilldrops import Sandbox as PDSandbox
            pd = {"api_url": up.url, "api_key": up.key}
            res: dict[str, list[float]] = {k: [] for k in ("pd_create", "e2b_create", "pd_run", "run_code",
                                                           "first_run_code", "pd_read", "port_get")}
            for _ in range(args.n):
                res["pd_create"].append(timed(lambda: PDSandbox.create(template="base", **pd).kill()))
                res["e2b_create"].append(timed(lambda: E2BSandbox.create().kill()))
            for i in range(max(3, args.n // 10)):
                sb = CISandbox.create()
                try:
                    res["first_run_code"].append(timed(lambda: sb.run_code("1")))  # noqa: B023 - called at once, in the loop
                    if i == 0:
                        pds = PDSandbox.connect(sb.sandbox_id.replace("sb", "sb_", 1), **pd)
                        pds.files.write("/srv/f.txt", b"x" * 1024)
                        pds.run("setsid -f python3 -m http.server 8000 --bind 127.0.0.1 -d /srv "
                                ">/dev/null 2>&1 </dev/null")
                        time.sleep(1.0)
                        h = {"E2b-Sandbox-Id": sb.sandbox_id, "E2b-Sandbox-Port": "8000"}
                        with httpx.Client(base_url=up.url, headers=h) as c:
                            assert c.get("/f.txt").status_code == 200
                            for _ in range(args.n):
                                res["pd_run"].append(timed(lambda: pds.run("true")))  # noqa: B023 - called at once, in the loop
                                res["run_code"].append(timed(lambda: sb.run_code("1")))  # noqa: B023 - called at once, in the loop
                                res["pd_read"].append(timed(lambda: pds.files.read_bytes("/srv/f.txt")))  # noqa: B023 - called at once, in the loop
                                res["port_get"].append(timed(lambda: c.get("/f.txt").raise_for_status()))
                finally:
                    sb.kill()
        finally:
            code = up.stop()
    print(f"\nE2B surface vs our API, same server, same run (ms; exit of `up`: {code})\n")
    print("| operation | n | p50 | p99 | ratio (p50) |\n|---|---|---|---|---|")
    print(row("create+kill, PillDrops SDK (baseline)", res["pd_create"], None))
    print(row("create+kill, stock e2b SDK", res["e2b_create"], res["pd_create"]))
    print(row("run('true'), PillDrops SDK (baseline)", res["pd_run"], None))
    print(row("run_code('1'), warm kernel", res["run_code"], res["pd_run"]))
    print(row("first run_code after create", res["first_run_code"], res["pd_run"]))
    print(row("read_file 1 KiB, PillDrops SDK (baseline)", res["pd_read"], None))
    print(row("GET 1 KiB from a sandbox port (E2b-Sandbox-Port)", res["port_get"], res["pd_read"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
