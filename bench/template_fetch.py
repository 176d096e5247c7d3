"""A node's first create of a template it must fetch from the template store vs a create of one it holds.

    sudo .venv/bin/python bench/template_fetch.py [--samples 3] [--template tiny]

Needs root and crun. Starts its own `pilldrops serve` (SQLite) and node agents WITHOUT `--templates` (the
fleet harness of the end-to-end tests), builds the template once through the control plane (timed), then
per sample: joins a fresh node, drains the others, and times (a) the first create there (the node fetches
and verifies the layers, then starts the sandbox) and (b) a second create on the same node (it holds them
now): the baseline, measured in the same run. Prints the table with ratios; checks nothing is left behind.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from pilldrops import Sandbox
from tests import leakcheck
from tests.e2e.fleet import Fleet


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--samples", type=int, default=3)
    ap.add_argument("--template", default="tiny")
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("needs root (node agents: mounts, cgroups, crun)", file=sys.stderr)
        return 2
    match = f"pilldrops-bfetch{os.getpid()}"
    with tempfile.TemporaryDirectory(prefix=f"{match}-") as tmp:
        fleet = Fleet(Path(tmp), f"bfetch{os.getpid()}")
        before = leakcheck.snapshot(fleet.crun_roots(), match=match)
        fetch, held = [], []
        try:
            fleet.start_cp()
            fleet.add_node(templates="")
            fleet.wait_nodes_ready(1, template=None)
            t0 = time.monotonic()
            res = subprocess.run([sys.executable, "-m", "pilldrops", "--api-url", fleet.url, "--api-key", fleet.key,
                                  "template", "build", args.template], capture_output=True, text=True,
                                 env=fleet.env, check=False)
            build_s = time.monotonic() - t0
            if res.returncode != 0:
                print(res.stderr, file=sys.stderr)
                return 1
            for i in range(args.samples):
                with fleet.api() as c:
                    for n in c.get("/v1/nodes").json()["items"]:
                        c.post(f"/v1/nodes/{n['id']}/drain").raise_for_status()
                fleet.add_node(templates="")
                fleet.wait_nodes_ready(i + 2, template=None)
                for out in (fetch, held):
                    t = time.monotonic()
                    sb = Sandbox.create(template=args.template, memory_mb=128, api_url=fleet.url, api_key=fleet.key)
                    out.append(time.monotonic() - t)
                    sb.run("true")
                    sb.kill()
        finally:
            fleet.stop()
        leakcheck.assert_no_leaks(before, settle=5)
    base = statistics.median(held)
    print(f"\ntemplate {args.template}: one build through the control plane {build_s:.2f} s "
          f"(CLI wall, incl. upload and store)\n")
    print(f"{'create (n=' + str(args.samples) + ')':<44}{'p50 ms':>9}{'min ms':>9}{'max ms':>9}{'ratio':>8}")
    for label, xs in (("first on a node that must fetch the layers", fetch),
                      ("baseline: again on a node that holds them", held)):
        print(f"{label:<44}{statistics.median(xs) * 1000:>9.0f}{min(xs) * 1000:>9.0f}{max(xs) * 1000:>9.0f}"
              f"{statistics.median(xs) / base:>8.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
