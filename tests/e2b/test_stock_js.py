"""The stock npm `e2b` and `@e2b/code-interpreter` clients (tests/e2b/js: 2.51.0 and 2.8.0, pinned by its
lock) driven by node against a real `pilldrops up`, configured by the three environment variables only.
`scripts/install-node` installs node and the packages (`npm ci`); without them these tests skip and say why."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.e2b.conftest import Up, envd_available

pytestmark = pytest.mark.integration
JS = Path(__file__).resolve().parent / "js"


def _why_no_node() -> str | None:
    node = shutil.which("node")
    if node is None:
        return "node is not installed (scripts/install-node)"
    major = int(subprocess.run([node, "--version"], capture_output=True, text=True, check=False).stdout.strip()
                .lstrip("v").split(".")[0] or 0)
    if major < 20:
        return f"npm e2b 2.51 needs node >= 20.18 (found v{major})"
    if not all((JS / "node_modules" / p).is_dir() for p in ("e2b", "@e2b/code-interpreter")):
        return "the npm e2b package is not installed (scripts/install-node runs `npm ci` in tests/e2b/js)"
    return None


def drive(up: Up, mode: str, script: str = "driver.mjs") -> dict:
    why = _why_no_node()
    if why:
        pytest.skip(why)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("E2B_", "PILLDROPS_"))}
    r = subprocess.run(["node", str(JS / script), mode], capture_output=True, text=True, timeout=180, check=False,
                       env={**env, **up.e2b_env}, cwd=JS)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_js_lifecycle(pd_up: Up) -> None:
    out = drive(pd_up, "lifecycle")
    assert out["info"] == {"templateId": "base", "state": "running", "metadata": {"driver": "js"}, "cpuCount": 1}
    assert out["listed"] == [out["id"]] and out["connected"] == out["id"]
    assert 50 <= out["timeoutLeftS"] <= 61
    assert out["killed"] is True and out["killedAgain"] is False
    assert out["getInfoAfterKill"] == "SandboxNotFoundError"


def test_js_commands_and_files(pd_up: Up) -> None:
    if not envd_available():
        pytest.skip("envd (pilldrops.e2b.envd, the sibling branch e2b-envd) is not in this build")
    out = drive(pd_up, "envd")
    assert out["run"] == {"stdout": "hi\n", "stderr": "err\n", "exitCode": 0}
    assert out["exit"] == {"name": "CommandExitError", "exitCode": 3, "isCommandExit": True}
    assert out["read"] == "from js" and out["listDir"] == ["a.txt", "b.txt", "c.txt"]
    assert out["exists"] == [True, False] and out["readMissing"] == "FileNotFoundError"
    assert out["background"] == "bg\n" and out["running"] is True
    assert out["runAfterKill"] in ("SandboxNotFoundError", "TimeoutError", "SandboxError")


def test_js_code_interpreter(pd_up: Up) -> None:
    out = drive(pd_up, "", "driver-code-interpreter.mjs")
    assert out["template"] == "code-interpreter" and out["killed"] is True
    assert out["first"] == {"text": "42", "stdout": ["from js\n"], "streamed": ["from js\n"], "error": None}
    assert out["state"] == "21"                                            # the kernel kept x
    assert out["error"] == {"name": "ValueError", "value": "bad value", "hasTraceback": True}
    assert out["context"] == {"language": "python", "cwd": "/tmp", "isolated": "NameError"}
