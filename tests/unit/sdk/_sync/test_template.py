# DO NOT EDIT — generated from _async by scripts/unasync.py
"""``Template.build`` against a control plane, over a scripted transport: what goes up (the context minus
.dockerignore, no symlinks, the build args) and how the NDJSON log, the result and a typed error come back."""

from __future__ import annotations

import io
import json
import os
import tarfile
from pathlib import Path

import httpx
import pytest

from pilldrops import Template, BuiltTemplate, InvalidRequest
from pilldrops._internal.dockerignore import PACKED_CONTEXT, PACKED_DOCKERFILE



def _context(tmp_path: Path) -> Path:
    ctx = tmp_path / "ctx"
    (ctx / "src").mkdir(parents=True)
    (ctx / "src" / "main.py").write_text("print(1)\n")
    (ctx / "src" / "junk.log").write_text("x\n")
    (ctx / ".dockerignore").write_text("*.log\n**/*.log\n")
    (ctx / "Dockerfile").write_text("FROM tiny\nCOPY src /src\n")
    os.symlink("/etc/passwd", ctx / "link")
    return ctx


def _scripted(events: list[dict], seen: list[httpx.Request]) -> httpx.MockTransport:  # type: ignore[type-arg]
    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, content="".join(json.dumps(e) + "\n" for e in events).encode(),
                              headers={"content-type": "application/x-ndjson"})
    return httpx.MockTransport(handler)


def test_build_sends_the_context_and_streams_the_log(tmp_path: Path) -> None:
    ctx = _context(tmp_path)
    seen: list[httpx.Request] = []
    transport = _scripted([{"type": "log", "line": "building template env (abc) from tiny"},
                           {"type": "log", "line": "[env step 1/1 (Dockerfile:2 COPY)] copy: src -> /src"},
                           {"type": "done", "template": {"name": "env", "hash": "abc", "size_bytes": 2048}}], seen)
    lines: list[str] = []
    built = Template.build("env", dockerfile=ctx / "Dockerfile", build_args={"PY": "3", "X": "a b"},
                                      force=True, on_log=lines.append, api_url="http://cp.test", api_key="k",
                                      transport=transport)
    assert built == BuiltTemplate(name="env", hash="abc", size_bytes=2048, log=lines)
    assert lines[1].endswith("copy: src -> /src")
    (req,) = seen
    assert (req.method, req.url.path) == ("POST", "/v1/templates/env/builds")
    assert req.url.params.get_list("build_arg") == ["PY=3", "X=a b"] and req.url.params["force"] == "true"
    assert req.headers["content-type"] == "application/gzip" and req.headers["authorization"] == "Bearer k"
    with tarfile.open(fileobj=io.BytesIO(req.content)) as tar:
        names = set(tar.getnames())
        assert tar.extractfile(PACKED_DOCKERFILE).read() == (ctx / "Dockerfile").read_bytes()  # type: ignore[union-attr]
    assert names == {PACKED_DOCKERFILE, PACKED_CONTEXT, *(f"{PACKED_CONTEXT}/{n}" for n in
                     ("Dockerfile", ".dockerignore", "src", "src/main.py"))}          # no junk.log, no link


def test_a_build_error_is_typed_and_bad_input_fails_before_sending(tmp_path: Path) -> None:
    ctx = _context(tmp_path)
    seen: list[httpx.Request] = []
    transport = _scripted([{"type": "log", "line": "parsing"},
                           {"type": "error", "error": {"code": "invalid_request", "request_id": "req_1",
                                                       "message": "Dockerfile:2: HEALTHCHECK: not supported"}}], seen)
    with pytest.raises(InvalidRequest, match="Dockerfile:2: HEALTHCHECK") as e:
        Template.build("env", dockerfile=ctx / "Dockerfile", api_url="http://cp.test", api_key="k",
                                  transport=transport)
    assert e.value.request_id == "req_1"
    with pytest.raises(InvalidRequest, match="no Dockerfile"):
        Template.build("env", dockerfile=ctx / "nope", api_url="http://cp.test", api_key="k",
                                  transport=transport)
    with pytest.raises(InvalidRequest, match="must match"):
        Template.build("../x", dockerfile=ctx / "Dockerfile", api_url="http://cp.test", api_key="k",
                                  transport=transport)
    assert len(seen) == 1
