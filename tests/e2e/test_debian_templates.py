"""The Debian templates the demo uses: `pilldrops template build code-interpreter` (base = debootstrap
bookworm minbase from this machine's mirror, then Python 3 + pip + numpy as a second layer) into the running
server's data dir; the node publishes it with its next heartbeat; a sandbox runs Python with its full
standard library and numpy. About a minute. It runs first in the session (tests/conftest.py), so this is a
build from nothing every time, and the tiers that need these templates later use this build (the shared
`up`'s directly; other data dirs by ``tests.up.seed_templates``, which it registers with)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import httpx
import pytest

from pilldrops import Sandbox
from tests.e2e.conftest import Server
from tests.up import SESSION_BUILDS

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(900)]   # a build from nothing: minutes under load


def test_code_interpreter_template(server: Server, api: httpx.Client) -> None:
    from pilldrops.node.templates import TemplateStore
    env = {**os.environ, "XDG_CONFIG_HOME": str(server.config_home)}
    t0 = time.time()
    build = subprocess.run([sys.executable, "-m", "pilldrops", "template", "build", "code-interpreter",
                            "--data-dir", str(server.data_dir)], capture_output=True, text=True, env=env,
                           timeout=900, check=False)
    assert build.returncode == 0, build.stdout[-2000:] + build.stderr[-3000:]
    store = TemplateStore(server.data_dir)    # built from nothing by this test (it runs first: tests/conftest.py)
    assert min(store.get("base").built_at, store.get("code-interpreter").built_at) >= t0 - 1
    deadline = time.monotonic() + 30
    names: set[str] = set()
    while time.monotonic() < deadline:
        names = {t["name"] for t in api.get("/v1/templates").json()["items"]}
        if {"base", "code-interpreter"} <= names:
            break
        time.sleep(0.5)
    assert {"base", "code-interpreter", "tiny"} <= names
    with Sandbox.create(template="code-interpreter", api_url=server.api_url, api_key=server.api_key) as sb:
        r = sb.run("python -c 'import numpy, secrets, ctypes, sqlite3, json; print(numpy.arange(4).sum())' "
                   "&& python3 --version && pip --version && pwd")
        assert r.exit_code == 0, r.stderr
        lines = r.stdout.splitlines()
        assert lines[0] == "6" and lines[1].startswith("Python 3.11") and lines[-1] == "/home/user"
        assert sb.run("cat /etc/debian_version").stdout.startswith("12")
        tools = sb.run("ps -e >/dev/null && ip -o link show lo && curl --version && git --version")
        assert tools.exit_code == 0, tools.stderr                    # the tools people reach for
    sizes = {t["name"]: t["size_bytes"] for t in api.get("/v1/templates").json()["items"]}
    assert sizes["code-interpreter"] > sizes["base"] > 0             # full size: every layer counted
    SESSION_BUILDS.append(server.data_dir)    # the other tiers' seeds (tests.up.seed_templates) use this build
