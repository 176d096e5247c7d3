"""What the per-command shepherd (issue 16 part 3) costs per run, measured in one run against the pd-init
from before it (built from git ``main``'s source, or ``--old-init PATH``).

    .venv/bin/python bench/detach.py [--n 300] [--old-rev main] [--runtime crun|gvisor] [--json out.json]

With ``--runtime gvisor`` (runsc installed) the two sandboxes are gVisor's, the new one with pd-init's cgroup
per command (``--cgroups``, its config from ``GvisorRuntime``), the baseline without it.

Needs root, crun and gcc. Two sandboxes of the tiny template on one CrunRuntime, one per init; ``--n``
interleaved rounds of ``exec(["true"])`` through pd-init's socket (the fast path ``run("true")`` uses,
without HTTP) in each, then the same for a kill of ``sh -c "sleep 100 & sleep 100; wait"`` (the tree
kill). Prints p50/p99 and the difference; checks nothing is left.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import anyio
from _harness import MATCH, check_leaks, machine, pct, seed_templates
from rich import box
from rich.console import Console
from rich.table import Table

from pilldrops.node.isolation.host import prepare_host
from pilldrops.node.runtime.base import SandboxSpec
from pilldrops.node.runtime.crun import CrunRuntime
from pilldrops.node.runtime.gvisor import GvisorRuntime
from pilldrops.node.runtime.init import CFLAGS, SOURCE, build_init
from pilldrops.node.templates import TemplateStore

console = Console(width=140)


def old_init(tmp: Path, rev: str) -> Path:
    src = subprocess.run(["git", "-C", str(SOURCE.parent), "show", f"{rev}:src/pilldrops/node/runtime/init/pd-init.c"],
                         capture_output=True, check=True).stdout
    (tmp / "old.c").write_bytes(src)
    out = tmp / "pd-init-old"
    subprocess.run(["gcc", *CFLAGS, "-o", str(out), str(tmp / "old.c")], check=True, capture_output=True)
    return out


def runtimes(tmp: Path, inits: dict[str, Path], runtime: str) -> dict[str, CrunRuntime]:
    if runtime == "crun":
        return {k: CrunRuntime(tmp / f"state-{k}", name=f"{MATCH}-{k}", init_path=p) for k, p in inits.items()}
    rts: dict[str, CrunRuntime] = {}
    for k, p in inits.items():
        rt = GvisorRuntime(tmp / f"state-{k}", name=f"{MATCH}-{k}", init_path=p)
        rt.COMMAND_CGROUPS = k != "before"
        rts[k] = rt
    return rts


async def bench(tmp: Path, layers: tuple[Path, ...], inits: dict[str, Path], n: int,
                runtime: str = "crun") -> dict[str, dict[str, list[float]]]:
    rts = runtimes(tmp, inits, runtime)
    hs = {k: await rt.create(SandboxSpec(id=f"det-{k}", layers=layers)) for k, rt in rts.items()}
    out: dict[str, dict[str, list[float]]] = {k: {"run": [], "kill": []} for k in inits}
    try:
        for i in range(n + 10):
            for k, rt in rts.items():
                t = time.perf_counter()
                p = await rt.exec(hs[k], ["true"], env={}, cwd=None)
                while await p.read() is not None:
                    pass
                assert await p.wait() == 0
                if i >= 10:
                    out[k]["run"].append((time.perf_counter() - t) * 1000)
        for _ in range(max(10, n // 10)):
            for k, rt in rts.items():
                p = await rt.exec(hs[k], ["sh", "-c", "sleep 100 & sleep 100; wait"], env={}, cwd=None)
                await anyio.sleep(0.05)
                t = time.perf_counter()
                await p.kill()
                assert await p.wait() == 137
                out[k]["kill"].append((time.perf_counter() - t) * 1000)
    finally:
        for k, rt in rts.items():
            await rt.destroy(hs[k])
            await rt.close()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=300)
    ap.add_argument("--old-rev", default="main", help="git revision whose pd-init.c is the baseline")
    ap.add_argument("--old-init", type=Path, help="a pd-init binary to compare against instead")
    ap.add_argument("--runtime", choices=("crun", "gvisor"), default="crun")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("needs root", file=sys.stderr)
        return 2
    os.environ["PILLDROPS_EXEC"] = "supervisor"
    prepare_host()
    tmp = Path(tempfile.mkdtemp(prefix=f"{MATCH}-detach-"))
    try:
        seed_templates(tmp, ["tiny"])
        layers = TemplateStore(tmp).get("tiny").layers
        inits = {"before": args.old_init or old_init(tmp, args.old_rev), "shepherd": build_init(tmp)}
        info = machine()
        res = anyio.run(bench, tmp, layers, inits, args.n, args.runtime)
        console.print(f"[bold]pd-init shepherd cost[/] ({args.runtime}) — {args.n} runs of `true` per init; {info['cores']} cores, "
                      f"kernel {info['kernel']}, {info['date']}")
        t = Table(box=box.ASCII)
        for c in ("operation", "before p50", "p99", "shepherd p50", "p99", "difference p50"):
            t.add_column(c, justify="left" if c == "operation" else "right")
        for op in ("run", "kill"):
            b, s = res["before"][op], res["shepherd"][op]
            t.add_row('exec("true")' if op == "run" else "kill (tree of 3)", f"{pct(b, 50):.2f} ms",
                      f"{pct(b, 99):.2f} ms", f"{pct(s, 50):.2f} ms", f"{pct(s, 99):.2f} ms",
                      f"{pct(s, 50) - pct(b, 50):+.2f} ms")
        console.print(t)
        if args.json:
            args.json.write_text(json.dumps({"machine": info, **res}, indent=1))
        sub = "crun" if args.runtime == "crun" else "runsc"
        left = check_leaks(tmp, [tmp / "state-before" / sub, tmp / "state-shepherd" / sub])
        if left:
            print("LEFT BEHIND:", *left, sep="\n  ", file=sys.stderr)
            return 1
        return 0
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
