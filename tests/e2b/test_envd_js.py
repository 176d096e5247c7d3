"""envd through the stock npm ``e2b`` client (2.51.0, the spec's version), in E2B debug mode against the envd
under test: commands (exit codes, background + stdin, kill), files (write/read/list/exists/getInfo/makeDir/
rename/remove), watchDir (the streaming call), PTY. The script is ``envd_check.mjs``."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.e2b.envd_fixtures import *

pytestmark = pytest.mark.integration
HERE = Path(__file__).resolve().parent
E2B_JS = "2.51.0"


@pytest.fixture(scope="session")
def js_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if not shutil.which("node") or not shutil.which("npm"):
        pytest.skip("node and npm are not installed (scripts/install-node, run by scripts/setup, installs them)")
    ours = HERE / "js"                       # the E2B tier's driver package, when it is installed
    if (ours / "node_modules" / "e2b" / "package.json").is_file():
        return ours
    d = tmp_path_factory.mktemp("envd-js")
    (d / "package.json").write_text(f'{{"private": true, "type": "module", "dependencies": {{"e2b": "{E2B_JS}"}}}}')
    subprocess.run(["npm", "install", "--no-audit", "--no-fund", "--silent"], cwd=d, check=True, timeout=600)
    return d


def test_stock_js_client(envd, js_dir):  # type: ignore[no-untyped-def]
    env = {**os.environ, "E2B_DEBUG": "true", "E2B_SANDBOX_URL": envd.url, "E2B_API_KEY": "e2b_" + "0" * 40}
    script = js_dir / "envd_check.mjs"
    shutil.copy(HERE / "envd_check.mjs", script)
    try:
        r = subprocess.run(["node", str(script)], cwd=js_dir, env=env, capture_output=True, text=True, timeout=180, check=False)
    finally:
        script.unlink(missing_ok=True)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = r.stdout.splitlines()
    assert lines[0] == '{"stdout":"hi-js\\n","stderr":"err\\n","code":0}'
    assert lines[1:] == ["exit-err 4", "bg got-js", "read from js", "list a.txt:file", "exists true false", "info 7",
                         "mkdir true false", "renamed from js", "watch create:w.txt,write:w.txt", "kill true",
                         "pty-exit 3", "pty true", "removed false"]
