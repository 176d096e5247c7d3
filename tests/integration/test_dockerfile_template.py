"""A Dockerfile template built for real (``template build NAME -f``: chroot over an overlay, as root) FROM tiny,
then a crun sandbox started from it through the node's own TemplateCache and DataPlane: every instruction's
effect is checked inside the sandbox (issue 19 parts 3 and 4)."""

from __future__ import annotations

import base64
import io
import json
import os
import tarfile
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from click.testing import CliRunner

from pilldrops.cli.main import cli
from pilldrops.node.dataplane import DataPlane
from pilldrops.node.template_cache import TemplateCache
from pilldrops.node.templates import SPEC_DIR, TemplateStore
from pilldrops.schema.api import RunRequest
from pilldrops.schema.node import NodeSandboxSpec

pytestmark = [pytest.mark.integration, pytest.mark.anyio, pytest.mark.usefixtures("host_ready")]

DOCKERFILE = r"""# syntax=docker/dockerfile:1
# a comment before FROM
ARG BASE=tiny
FROM ${BASE}
ARG GREETING=hello
ARG LEVEL
ENV APP_HOME=/srv/app \
    MODE="fast and small"
ENV PATH=/opt/tools:$PATH
WORKDIR $APP_HOME
COPY env/ ./env/
COPY ["tools/hello", "/opt/tools/"]
ADD data.tar.gz /srv/data/
RUN echo "$GREETING $LEVEL" > /srv/greeting && \
    # comments inside a continuation are dropped
    chmod 755 /opt/tools/hello
RUN ["sh", "-c", "echo exec form $MODE > /srv/exec-form"]
RUN echo 'app:x:1234:1234:app:/home/app:/bin/sh' >> /etc/passwd \
 && echo 'app:x:1234:' >> /etc/group && mkdir -p /home/app && chown 1234:1234 /home/app
COPY --chown=app:app --chmod=600 env/episode.py /home/app/private.py
USER app
WORKDIR work
RUN id -u > built-by && touch made-by-app
EXPOSE 8080
CMD ["ignored"]
"""


def _context(tmp_path: Path) -> Path:
    ctx = tmp_path / "ctx"
    (ctx / "env" / "cache").mkdir(parents=True)
    (ctx / "env" / "episode.py").write_text("print(0.5)\n")
    (ctx / "env" / "cache" / "big.bin").write_bytes(b"x" * 1000)        # excluded by .dockerignore
    (ctx / "env" / "notes.md").write_text("kept\n")
    (ctx / "tools").mkdir()
    (ctx / "tools" / "hello").write_text("#!/bin/sh\necho hello from tools\n")
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        info = tarfile.TarInfo("inner/value.txt")
        info.size = 3
        tar.addfile(info, io.BytesIO(b"42\n"))
    (ctx / "data.tar.gz").write_bytes(buf.getvalue())
    (ctx / ".dockerignore").write_text("# build junk\nenv/cache\n*.log\n")
    (ctx / "Dockerfile").write_text(DOCKERFILE)
    return ctx


def _build(data_dir: Path, ctx: Path, *args: str) -> str:
    res = CliRunner().invoke(cli, ["template", "build", "dftest", "-f", str(ctx / "Dockerfile"), str(ctx),
                                   "--data-dir", str(data_dir), *args])
    assert res.exit_code == 0, res.output
    return res.output


async def _run(dp: DataPlane, target, cmd: str) -> tuple[int, str, str]:  # type: ignore[no-untyped-def]
    out, err, code = [], [], None
    async for chunk in await dp.run(target, RunRequest(cmd=cmd)):
        for line in chunk.splitlines():        # NDJSON: a chunk may carry several lines
            ev = json.loads(line)
            if ev["type"] in ("stdout", "stderr"):
                (out if ev["type"] == "stdout" else err).append(base64.b64decode(ev["data"]).decode())
            elif ev["type"] == "exit":
                code = ev["exit_code"]
    assert code is not None
    return code, "".join(out), "".join(err)


async def test_dockerfile_template_builds_and_runs(tmp_path: Path, data_dir: Path, runtime, tiny,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    ctx = _context(tmp_path)
    out = _build(data_dir, ctx, "--build-arg", "LEVEL=3", "--build-arg", "UNUSED=1")
    assert "EXPOSE is ignored" in out and "CMD is ignored" in out and "UNUSED" in out
    store = TemplateStore(data_dir)
    tpl = store.get("dftest")
    assert tpl.user == "1234:1234" and tpl.home == "/home/app" and tpl.workdir == "/srv/app/work"
    assert tpl.env["MODE"] == "fast and small" and tpl.env["PATH"].startswith("/opt/tools:/usr/local/sbin:")
    assert "GREETING" not in tpl.env and "LEVEL" not in tpl.env               # ARGs are not kept
    assert "dftest" in [t.name for t in store.list() if t.built]             # a node would announce it

    # cached: same inputs -> same hash, no rebuild; an ignored file's change changes nothing either
    (ctx / "env" / "cache" / "big.bin").write_bytes(b"y" * 10)
    _build(data_dir, ctx, "--build-arg", "LEVEL=3")
    assert store.get("dftest").hash == tpl.hash
    # ... but the content of a copied file is in its step's key
    (ctx / "env" / "notes.md").write_text("changed\n")
    _build(data_dir, ctx, "--build-arg", "LEVEL=3")
    rebuilt = store.get("dftest")
    assert rebuilt.hash != tpl.hash

    cache = TemplateCache(store, "it")
    spec = NodeSandboxSpec(id="dockerfile", template="dftest", vcpu=1, memory_mb=256, access_token="t",
                           end_at=datetime.now(UTC) + timedelta(minutes=5))
    handle = await runtime.create(cache.runtime_spec(spec))
    try:
        target = cache.target(spec, handle)
        dp = DataPlane(runtime)
        checks = {
            "id -u; id -g": "1234\n1234\n",                                   # USER at run time
            "pwd": "/srv/app/work\n",                                          # WORKDIR (relative one joined)
            "echo $HOME": "/home/app\n",
            'echo "$MODE|$APP_HOME|${GREETING-unset}"': "fast and small|/srv/app|unset\n",   # ENV; ARG not kept
            "cat /srv/greeting": "hello 3\n",                                  # ARG default + --build-arg
            "cat /srv/exec-form": "exec form fast and small\n",                # exec-form RUN saw ENV
            "hello": "hello from tools\n",                                     # COPY into PATH dir + chmod
            "cat /srv/app/env/episode.py /srv/app/env/notes.md": "print(0.5)\nchanged\n",
            "test -e /srv/app/env/cache && echo there || echo ignored": "ignored\n",   # .dockerignore
            "cat /srv/data/inner/value.txt": "42\n",                           # ADD unpacked the archive
            "cat built-by; stat -c '%u %a' made-by-app /home/app/private.py": "1234\n1234 644\n1234 600\n",
            "touch /srv/nope 2>/dev/null && echo wrote || echo denied": "denied\n",   # not root
        }
        for cmd, want in checks.items():
            code, got, err = await _run(dp, target, cmd)
            assert (code, got) == (0, want), (cmd, err)
        # file transfers and the agent's own commands stay root (like docker cp)
        proc = await runtime.exec(handle, ["id", "-u"], env={}, cwd="/")
        chunks = []
        while (c := await proc.read()) is not None:
            chunks.append(c[1])
        assert (await proc.wait(), b"".join(chunks)) == (0, b"0\n")
        # the crun-exec path (no pd-init socket) runs commands as the USER too
        monkeypatch.setenv("PILLDROPS_EXEC", "crun")
        assert await _run(dp, target, "id -u") == (0, "1234\n", "")
    finally:
        await runtime.destroy(handle)


def test_build_steps_cannot_write_outside_the_layer(tmp_path: Path, data_dir: Path, tiny,  # type: ignore[no-untyped-def]
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A RUN step plants absolute symlinks; COPY through them, and a child's build (which puts the host's CA
    bundle in /tmp and makes its WORKDIR), still land inside the template's root."""
    ctx = tmp_path / "esc"
    ctx.mkdir()
    (ctx / "payload").write_text("pwned\n")
    host_target = tmp_path / "host-dir"
    host_target.mkdir()
    (ctx / "Dockerfile").write_text(f"FROM tiny\nRUN ln -s {host_target} /trap && ln -s {host_target}/f /trapfile\n"
                                    "COPY payload /trap/\nCOPY payload /trapfile\n")
    res = CliRunner().invoke(cli, ["template", "build", "dfescape", "-f", str(ctx / "Dockerfile"),
                                   "--data-dir", str(data_dir)])
    assert res.exit_code == 0, res.output
    assert list(host_target.iterdir()) == []                         # nothing reached the host
    layer = TemplateStore(data_dir).get("dfescape").layers[0]
    inside = layer / str(host_target).lstrip("/")
    assert (inside / "payload").read_text() == "pwned\n" and (inside / "f").read_text() == "pwned\n"
    ca = tmp_path / "ca.pem"
    ca.write_text("CA\n")
    monkeypatch.setenv("SSL_CERT_FILE", str(ca))
    (ctx / "Dockerfile").write_text(f"FROM tiny\nRUN rm -rf /tmp && ln -s {host_target} /tmp && ln -s "
                                    f"{host_target} /wd\n")
    (ctx / "Child").write_text("FROM dfescape2\nWORKDIR /wd/made\nRUN cat $SSL_CERT_FILE > /seen || true\n")
    res = CliRunner().invoke(cli, ["template", "build", "dfescape2", "-f", str(ctx / "Dockerfile"), str(ctx),
                                   "--data-dir", str(data_dir)])
    assert res.exit_code == 0, res.output
    # host_target is under /tmp, so inside the root /tmp and /wd are symlink loops: the CA bundle is skipped
    # and the WORKDIR is a clear error; either way nothing lands on the host
    res = CliRunner().invoke(cli, ["template", "build", "dfescape3", "-f", str(ctx / "Child"), str(ctx),
                                   "--data-dir", str(data_dir)])
    assert res.exit_code == 1 and "(Child:2 WORKDIR) workdir failed: too many levels of symlinks" in res.output
    assert list(host_target.iterdir()) == []


def test_errors_name_the_line_and_context_escapes_are_refused(tmp_path: Path, data_dir: Path) -> None:
    ctx = tmp_path / "bad"
    ctx.mkdir()
    (ctx / "ok.txt").write_text("x")
    os.symlink("/etc/passwd", ctx / "link")
    cases = {
        "FROM tiny\nHEALTHCHECK CMD true\n": "Dockerfile:2: HEALTHCHECK: not supported",
        "FROM tiny AS build\n": "Dockerfile:1: FROM: `FROM ... AS name` (multi-stage builds) is not supported",
        "FROM tiny\nCOPY ../secret /x\n": "Dockerfile:2: COPY: ../secret: outside the build context",
        "FROM tiny\nRUN true\nCOPY link /x\n": "Dockerfile:3: COPY: link: link is a symlink",
        "FROM tiny\nADD https://example.invalid/x /x\n": "Dockerfile:2: ADD: https://example.invalid/x: URLs are",
        "FROM ubuntu:22.04\n": "Dockerfile:1: FROM: ubuntu:22.04: only our templates",
        "FROM tiny\nRUN exit 3\n": "template dfbad: step 1/1 (Dockerfile:2 RUN) `exit 3` failed (exit 3)",
    }
    for text, want in cases.items():
        (ctx / "Dockerfile").write_text(text)
        res = CliRunner().invoke(cli, ["template", "build", "dfbad", "-f", str(ctx / "Dockerfile"),
                                       "--data-dir", str(data_dir)])
        assert res.exit_code == 1 and want in res.output, (text, res.output)
        assert "Traceback" not in res.output


def test_sdk_builds_on_this_machine(tmp_path: Path, data_dir: Path, tiny) -> None:  # type: ignore[no-untyped-def]
    from pilldrops import InvalidRequest, Template
    ctx = tmp_path / "sdk"
    ctx.mkdir()
    (ctx / "Dockerfile").write_text("FROM tiny\nARG N=0\nRUN echo $N > /n\n")
    lines: list[str] = []
    built = Template.build("dfsdk", dockerfile=ctx / "Dockerfile", build_args={"N": "7"}, local=True,
                           data_dir=data_dir, on_log=lines.append)
    tpl = TemplateStore(data_dir).get("dfsdk")
    assert (built.name, built.hash, built.size_bytes) == ("dfsdk", tpl.hash, tpl.size)
    assert (tpl.layers[0] / "n").read_text() == "7\n"
    assert any("Dockerfile:3 RUN" in ln for ln in lines)
    (ctx / "Dockerfile").write_text("FROM tiny\nHEALTHCHECK CMD true\n")
    with pytest.raises(InvalidRequest, match="Dockerfile:2: HEALTHCHECK: not supported"):
        Template.build("dfsdk", dockerfile=ctx / "Dockerfile", local=True, data_dir=data_dir)


def test_a_toml_copy_cannot_write_through_a_planted_symlink(tmp_path: Path, data_dir: Path, tiny) -> None:  # type: ignore[no-untyped-def]
    """The same guard for a TOML spec's copy (a remote build sends those too): the link resolves in the root."""
    host_target = tmp_path / "host-dir"
    host_target.mkdir()
    specs = tmp_path / "specs"
    (specs / "files").mkdir(parents=True)
    (specs / "files" / "payload").write_text("pwned\n")
    os.symlink("payload", specs / "files" / "alias")                # a spec's own symlink is copied as one
    (specs / "tomlesc.toml").write_text(f'name = "tomlesc"\nfrom = "tiny"\n[[steps]]\nrun = "ln -s {host_target} '
                                        f'/trap"\n[[steps]]\ncopy = {{src = "files", dest = "/trap"}}\n')
    tpl = TemplateStore(data_dir, spec_dirs=[SPEC_DIR, specs]).build("tomlesc")
    assert list(host_target.iterdir()) == []
    inside = tpl.layers[0] / str(host_target).lstrip("/")
    assert (inside / "payload").read_text() == "pwned\n" and os.readlink(inside / "alias") == "payload"


async def test_user_under_gvisor(tmp_path: Path, data_dir: Path, gvisor, tiny,  # type: ignore[no-untyped-def]
                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """USER holds under gVisor too: through pd-init's socket and through `runsc exec --user`."""
    ctx = tmp_path / "gv"
    ctx.mkdir()
    (ctx / "Dockerfile").write_text("FROM tiny\nUSER nobody\nWORKDIR /\n")
    res = CliRunner().invoke(cli, ["template", "build", "dfgvisor", "-f", str(ctx / "Dockerfile"),
                                   "--data-dir", str(data_dir)])
    assert res.exit_code == 0, res.output
    cache = TemplateCache(TemplateStore(data_dir), "it")
    spec = NodeSandboxSpec(id="dfgv", template="dfgvisor", vcpu=1, memory_mb=256, access_token="t",
                           end_at=datetime.now(UTC) + timedelta(minutes=5), isolation="gvisor")
    handle = await gvisor.create(cache.runtime_spec(spec))
    try:
        dp = DataPlane(gvisor)
        target = cache.target(spec, handle)
        assert await _run(dp, target, "id -u") == (0, "65534\n", "")
        monkeypatch.setenv("PILLDROPS_EXEC", "crun")
        assert await _run(dp, target, "id -u") == (0, "65534\n", "")
    finally:
        await gvisor.destroy(handle)
