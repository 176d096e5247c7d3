"""Template builds for real (chroot over an overlay, as root): the host's proxy and CA reach build steps and
leave nothing in the layer, a failed step is one line naming the step and its log, sizes count every layer,
and ``copy`` takes sources outside the spec's folder."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from click.testing import CliRunner

from pilldrops.cli.main import cli
from pilldrops.node import templates as T

pytestmark = pytest.mark.usefixtures("host_ready")


def _specs(tmp_path: Path, body: str, name: str = "child") -> Path:
    d = tmp_path / "project" / "templates"
    d.mkdir(parents=True, exist_ok=True)
    (d / f"{name}.toml").write_text(body)
    return d


def test_steps_see_the_hosts_proxy_and_ca_and_keep_neither(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ca = tmp_path / "corp-ca.pem"
    ca.write_text("-----BEGIN CERTIFICATE-----\nCORP\n-----END CERTIFICATE-----\n")
    monkeypatch.setenv("SSL_CERT_FILE", str(ca))
    monkeypatch.setenv("https_proxy", "http://127.0.0.1:9")
    env_dir = tmp_path / "project" / "env"
    env_dir.mkdir(parents=True)
    (env_dir / "episode.py").write_text("print(0.5)\n")
    specs = _specs(tmp_path, 'name = "child"\nfrom = "tiny"\n[[steps]]\n'
                             'run = "cat $PIP_CERT > /ca-seen && echo $HTTPS_PROXY > /proxy-seen"\n'
                             '[[steps]]\ncopy = {src = "../env", dest = "/env"}\n')
    store = T.TemplateStore(tmp_path / "data", spec_dirs=[T.SPEC_DIR, specs])
    tpl = store.build("child")
    layer = tpl.layers[0]
    assert (layer / "ca-seen").read_text() == ca.read_text()
    assert (layer / "proxy-seen").read_text().strip() == "http://127.0.0.1:9"
    assert (layer / "env" / "episode.py").read_text() == "print(0.5)\n"       # from outside the spec dir
    assert not (layer / T.BUILD_CA.lstrip("/")).exists()
    assert not (layer / "tmp" / Path(T.BUILD_CA).name).exists()
    parent = store.get("tiny")
    own = json.loads((layer.parent / "manifest.json").read_text())["size"]
    assert tpl.size == own + parent.size and tpl.size > own                  # full size, every layer


def test_a_failed_step_is_one_line_with_its_log(tmp_path: Path) -> None:
    specs = _specs(tmp_path, 'name = "broken"\nfrom = "tiny"\n[[steps]]\nrun = "echo fine"\n'
                             '[[steps]]\nrun = "echo lots; echo of; echo output; echo boom: no such package >&2; '
                             'exit 3"\n', name="broken")
    data = tmp_path / "data"
    res = CliRunner().invoke(cli, ["template", "build", "broken", "--data-dir", str(data),
                                   "--templates-dir", str(specs)])
    assert res.exit_code == 1
    err = [line for line in res.output.splitlines() if line.startswith("Error:")]
    log = data / "templates" / "broken" / "build.log"
    assert err == [(f"Error: template broken: step 2/2 `echo lots; echo of; echo output; echo boom: no such "
                   f"package >&2; exit 3` failed (exit 3): boom: no such package (full log: {log})")]
    assert "Traceback" not in res.output and "boom: no such package" in log.read_text()
    assert not any(p.name.startswith(".tmp-") for p in (data / "templates" / "broken").iterdir())
    assert os.path.isdir(data / "templates" / "tiny")


def test_a_build_killed_mid_way_is_reaped_by_the_next_build(tmp_path: Path) -> None:
    """A build killed while its steps ran (SIGKILL, a test timeout) leaves its ``.tmp-*`` dir with the
    overlay, ``proc`` and ``dev`` mounted under the data dir; the next build of the template, holding its
    build lock, unmounts and removes it."""
    import subprocess
    specs = _specs(tmp_path, 'name = "child"\nfrom = "tiny"\n[[steps]]\nrun = "echo ok > /ok"\n')
    store = T.TemplateStore(tmp_path / "data", spec_dirs=[T.SPEC_DIR, specs])
    store.build("tiny")
    stale = tmp_path / "data" / "templates" / "child" / ".tmp-0123456789abcdef-dead0000"
    (stale / "merged" / "proc").mkdir(parents=True)
    subprocess.run(["mount", "-t", "tmpfs", "stale", str(stale / "merged")], check=True)
    (stale / "merged" / "proc").mkdir()
    subprocess.run(["mount", "-t", "proc", "proc", str(stale / "merged" / "proc")], check=True)
    try:
        tpl = store.build("child")
        assert (tpl.layers[0] / "ok").read_text() == "ok\n"
        assert not stale.exists()
        assert str(stale) not in Path("/proc/self/mountinfo").read_text()
    finally:
        if stale.exists():
            subprocess.run(["umount", "-R", "-l", str(stale / "merged")], check=False)
