"""A Dockerfile `FROM debian:bookworm-slim` built into a running `pilldrops up`'s data dir, announced by its
node, and used through the SDK: the Debian base is our `base` (built by test_debian_templates earlier in the
session, so this adds one small layer; run alone it builds base first, about a minute)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from pilldrops import Sandbox
from tests.e2e.conftest import Server

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(900)]   # base: ~1 min, more under load

DOCKERFILE = """FROM debian:bookworm-slim
ARG TOOL=grep
ENV EPISODES=3
RUN useradd -m -u 1500 agent && command -v $TOOL > /tool-path
COPY env/ /env/
USER agent
WORKDIR /home/agent/run
RUN echo "built as $(id -un)" > note
"""


def test_a_debian_dockerfile_template_runs_through_the_stack(server: Server, api: httpx.Client,
                                                              tmp_path: Path) -> None:
    ctx = tmp_path / "ctx"
    (ctx / "env").mkdir(parents=True)
    (ctx / "env" / "episode.py").write_text("import os; print(int(os.environ['EPISODES']) * 0.5)\n")
    (ctx / "Dockerfile").write_text(DOCKERFILE)
    env = {**os.environ, "XDG_CONFIG_HOME": str(server.config_home)}
    build = subprocess.run([sys.executable, "-m", "pilldrops", "template", "build", "dfdebian", "-f",
                            str(ctx / "Dockerfile"), str(ctx), "--build-arg", "TOOL=sed",
                            "--data-dir", str(server.data_dir)],
                           capture_output=True, text=True, env=env, timeout=900, check=False)
    assert build.returncode == 0, build.stdout[-2000:] + build.stderr[-3000:]
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if "dfdebian" in {t["name"] for t in api.get("/v1/templates").json()["items"]}:
            break
        time.sleep(0.5)
    with Sandbox.create(template="dfdebian", api_url=server.api_url, api_key=server.api_key) as sb:
        r = sb.run("id -un; pwd; echo $HOME; cat note /tool-path /etc/debian_version")
        assert r.exit_code == 0, r.stderr
        lines = r.stdout.splitlines()
        assert lines[:5] == ["agent", "/home/agent/run", "/home/agent", "built as agent", "/usr/bin/sed"]
        assert lines[5].startswith("12")
        sb.upload(str(ctx / "env" / "episode.py"), "/opt/uploaded.py")      # transfers stay root
        r = sb.run("echo $EPISODES; stat -c %U /opt/uploaded.py /env/episode.py; touch /opt/x 2>/dev/null || "
                   "echo denied")
        assert r.stdout.splitlines() == ["3", "root", "root", "denied"]      # ENV kept; commands are not root
