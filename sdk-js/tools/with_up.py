"""Run a command against a real `pilldrops up` of its own, then check it left nothing behind.

    with_up.py [--template NAME ...] -- COMMAND...

Starts `pilldrops up` the way the end-to-end tests do (tests/up.py: free ports, its own data dir,
config dir and node name, the `tiny` template, a warm-up sandbox), seeds extra built templates from the
user's template cache (``Up.seed``: built there once if missing), and runs COMMAND with
PILLDROPS_API_URL / PILLDROPS_API_KEY set, plus PD_CONFIG_HOME (the config dir `up` wrote),
PD_LEAK_SNAPSHOT / PD_LEAKS_PY / PD_PYTHON (for per-test host leak checks with tools/leaks.py) and
PD_CRUN_ROOT. Afterwards: no sandbox may be left in a live state, `up` must stop cleanly on SIGINT, and no
container, mount, cgroup or process of the session may remain (tests/leakcheck.py). Exit code: COMMAND's,
or 1 when a check fails.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import leakcheck

from tests.e2e.fleet import clean_env
from tests.up import Up

COMMAND_TIMEOUT_S = 900   # a hung test run fails instead of holding CI
LIVE = ["pending", "starting", "running", "pausing", "paused", "resuming", "stopping"]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--template", action="append", default=[])
    ap.add_argument("cmd", nargs=argparse.REMAINDER)
    args = ap.parse_args()
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if os.geteuid() != 0 or not shutil.which("crun"):
        print("with_up.py: needs root and crun (scripts/install-system-deps)", file=sys.stderr)
        return 1
    name = f"tsjs{os.getpid()}"          # scope the node name (cgroups) and paths to this session
    match = f"pilldrops-{name}"
    root = Path(tempfile.mkdtemp(prefix=f"{match}-"))
    up = Up(root, name)
    config_home, log, crun_root = up.config_home, up.log, up.crun_root
    before = leakcheck.snapshot([crun_root], match=match)
    t0 = time.monotonic()
    up.start()
    url = up.api_url
    rc = 1
    try:
        key = up.api_key
        with up.client() as c:
            sid = c.post("/v1/sandboxes", json={"template": "tiny"}).raise_for_status().json()["id"]
            c.delete(f"/v1/sandboxes/{sid}").raise_for_status()
            if args.template:
                up.seed(*args.template)
            snap = root / "leak-snapshot.json"
            subprocess.run([sys.executable, str(Path(__file__).with_name("leaks.py")), "snapshot", str(crun_root),
                            match, str(snap)], check=True)
            print(f"with_up.py: pilldrops up at {url} ready in {time.monotonic() - t0:.1f}s", file=sys.stderr)
            env = {**clean_env(config_home), "PILLDROPS_API_URL": url, "PILLDROPS_API_KEY": key,
                   "PD_CONFIG_HOME": str(config_home), "PD_LEAK_SNAPSHOT": str(snap), "PD_CRUN_ROOT": str(crun_root),
                   "PD_LEAKS_PY": str(Path(__file__).with_name("leaks.py")), "PD_PYTHON": sys.executable}
            env.pop("XDG_CONFIG_HOME")
            try:
                rc = subprocess.run(cmd, check=False, env=env, timeout=COMMAND_TIMEOUT_S).returncode
            except subprocess.TimeoutExpired:
                print(f"with_up.py: {cmd} did not finish in {COMMAND_TIMEOUT_S} s", file=sys.stderr)
                rc = 1
            left = c.get("/v1/sandboxes", params=[("state", s) for s in LIVE] + [("limit", "1000")]).json()["items"]
            if left:
                print(f"with_up.py: sandboxes left live: {[s['id'] for s in left]}", file=sys.stderr)
                rc = rc or 1
    finally:
        code = up.stop()
        if code != 0:
            print(f"with_up.py: `pilldrops up` exited {code} on SIGINT:\n{log.read_text()[-3000:]}", file=sys.stderr)
            rc = rc or 1
    try:
        leakcheck.assert_no_leaks(before, settle=5)
    except AssertionError as exc:
        print(f"with_up.py: {exc}", file=sys.stderr)
        return rc or 1
    shutil.rmtree(root, ignore_errors=True)
    return rc


if __name__ == "__main__":
    sys.exit(main())
