"""``AsyncTemplate.build`` against a control plane, over a scripted transport: what goes up (the packaged
parent first, then the Dockerfile's spec document, its COPY sources by digest minus .dockerignore) and how
the NDJSON log, the result and a typed error come back."""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
from pathlib import Path
from typing import Any

import httpx
import pytest

from pilldrops import AsyncTemplate, BuiltTemplate, InvalidRequest

pytestmark = pytest.mark.anyio


def _context(tmp_path: Path) -> Path:
    ctx = tmp_path / "ctx"
    (ctx / "src").mkdir(parents=True)
    (ctx / "src" / "main.py").write_text("print(1)\n")
    (ctx / "src" / "junk.log").write_text("x\n")
    (ctx / "unrelated.txt").write_text("not copied\n")
    (ctx / ".dockerignore").write_text("**/*.log\n")
    (ctx / "Dockerfile").write_text("FROM tiny\nCOPY src /src\nUSER nobody\n")
    return ctx


class Scripted:
    def __init__(self, events: dict[str, list[dict[str, Any]]]) -> None:
        self.events, self.seen = events, []

    def transport(self) -> httpx.MockTransport:
        def handler(request: httpx.Request) -> httpx.Response:
            self.seen.append(request)
            if request.method == "PUT":
                return httpx.Response(200, json={"digest": request.url.path.rsplit("/", 1)[1],
                                                 "size": len(request.content)})
            name = json.loads(request.content)["spec"]["name"]
            return httpx.Response(200, content="".join(json.dumps(e) + "\n" for e in self.events[name]).encode(),
                                  headers={"content-type": "application/x-ndjson"})
        return httpx.MockTransport(handler)


def _done(name: str, version: int, cached: bool = False) -> dict[str, Any]:
    return {"type": "done", "cached": cached,
            "template": {"name": name, "version": version, "digest": "sha256:" + "ab" * 32, "size_bytes": 2048}}


async def test_build_sends_parent_spec_and_context_and_streams_the_log(tmp_path: Path) -> None:
    ctx = _context(tmp_path)
    cp = Scripted({"tiny": [{"type": "status", "message": "template tiny v1 is up to date (cached)"},
                            _done("tiny", 1, cached=True)],
                   "env": [{"type": "status", "message": "building template env on node n1"},
                           {"type": "log", "line": "[env step 1/2] copy: src -> /src"}, _done("env", 3)]})
    lines: list[str] = []
    built = await AsyncTemplate.build("env", dockerfile=ctx / "Dockerfile", force=True, on_log=lines.append,
                                      api_url="http://cp.test", api_key="k", transport=cp.transport())
    assert built == BuiltTemplate(name="env", hash="sha256:" + "ab" * 32, size_bytes=2048, version=3,
                                  log=["building template env on node n1", "[env step 1/2] copy: src -> /src"])
    assert lines[0].endswith("(cached)") and lines[-1].endswith("copy: src -> /src")
    tiny_build, put, env_build = cp.seen
    assert json.loads(tiny_build.content) == {
        "spec": {"name": "tiny", "description": json.loads(tiny_build.content)["spec"]["description"],
                 "from": "busybox", "workdir": "/root", "steps": []}, "context": None, "force": False}
    tar_bytes = put.content
    digest = "sha256:" + hashlib.sha256(tar_bytes).hexdigest()
    assert (put.method, put.url.path) == ("PUT", f"/v1/templates/contexts/{digest}")
    with tarfile.open(fileobj=io.BytesIO(tar_bytes)) as tar:
        assert sorted(tar.getnames()) == ["src", "src/main.py"]              # no junk.log, nothing unrelated
        assert {m.mtime for m in tar.getmembers()} == {0}                    # deterministic: same files, same digest
    body = json.loads(env_build.content)
    assert (env_build.url.path, body["context"], body["force"]) == ("/v1/templates/builds", digest, True)
    assert body["spec"]["from"] == "tiny" and body["spec"]["steps"] == [
        {"copy": {"src": "src", "dest": "/src", "entries": ["main.py"]}}, {"user": "nobody"}]
    assert env_build.headers["authorization"] == "Bearer k"


async def test_errors_are_typed_and_bad_input_fails_before_sending(tmp_path: Path) -> None:
    ctx = _context(tmp_path)
    cp = Scripted({"tiny": [_done("tiny", 1, cached=True)],
                   "env": [{"type": "error", "error": {"code": "invalid_request", "request_id": "req_1",
                                                       "message": "copy src 'x' is outside the build context"}}]})
    with pytest.raises(InvalidRequest, match="outside the build context") as e:
        await AsyncTemplate.build("env", dockerfile=ctx / "Dockerfile", api_url="http://cp.test", api_key="k",
                                  transport=cp.transport())
    assert e.value.request_id == "req_1"
    n = len(cp.seen)
    (ctx / "Dockerfile").write_text("FROM tiny\nHEALTHCHECK NONE\n")
    with pytest.raises(InvalidRequest, match="Dockerfile:2: HEALTHCHECK: not supported") as e:
        await AsyncTemplate.build("env", dockerfile=ctx / "Dockerfile", api_url="http://cp.test", api_key="k",
                                  transport=cp.transport())
    assert e.value.details == {"line": 2, "instruction": "HEALTHCHECK"}
    with pytest.raises(InvalidRequest, match="no Dockerfile"):
        await AsyncTemplate.build("env", dockerfile=ctx / "nope", api_url="http://cp.test", api_key="k")
    with pytest.raises(InvalidRequest, match="must match"):
        await AsyncTemplate.build("../x", dockerfile=ctx / "Dockerfile", api_url="http://cp.test", api_key="k")
    assert len(cp.seen) == n                                                  # none of these sent anything
