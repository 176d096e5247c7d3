"""envd's process service through the stock ``e2b`` client (sync and async) and on the wire (Connect JSON and
binary protobuf envelopes), in front of a sandbox of a real ``pilldrops up``."""

from __future__ import annotations

import base64
import json
import struct
import time

import httpx
import pytest

from tests.e2b.envd_fixtures import *

pytestmark = pytest.mark.integration


def test_run_output_exit_codes_env_cwd(e2b_debug):  # type: ignore[no-untyped-def]
    from e2b import CommandExitException, InvalidArgumentException
    sb = e2b_debug
    r = sb.commands.run("echo hi; echo err >&2")
    assert (r.exit_code, r.stdout, r.stderr) == (0, "hi\n", "err\n")
    with pytest.raises(CommandExitException) as ei:
        sb.commands.run("echo out; exit 3")
    assert ei.value.exit_code == 3 and ei.value.stdout == "out\n"
    r = sb.commands.run("echo $FOO; pwd", envs={"FOO": "bar"}, cwd="/tmp")
    assert r.stdout == "bar\n/tmp\n"
    with pytest.raises(InvalidArgumentException, match="does not exist"):
        sb.commands.run("true", cwd="/no/such/dir")
    chunks: list[str] = []
    r = sb.commands.run("for i in 1 2 3; do echo $i; sleep 0.1; done", on_stdout=chunks.append)
    assert "".join(chunks) == "1\n2\n3\n" and r.stdout == "1\n2\n3\n"


def test_background_connect_stdin_kill_list(e2b_debug):  # type: ignore[no-untyped-def]
    sb = e2b_debug
    h = sb.commands.run("read line; echo got-$line", background=True, stdin=True)
    assert h.pid in [p.pid for p in sb.commands.list()]
    sb.commands.send_stdin(h.pid, "hello\n")
    r = h.wait()
    assert r.stdout == "got-hello\n" and r.exit_code == 0
    # close_stdin: cat ends at EOF
    h = sb.commands.run("cat; echo done", background=True, stdin=True)
    sb.commands.send_stdin(h.pid, "abc")
    sb.commands.close_stdin(h.pid)
    assert h.wait().stdout == "abcdone\n"
    # a background process outlives its stream; connect re-attaches and sees new output
    h = sb.commands.run("sleep 1; echo later; sleep 0.5", background=True)
    h.disconnect()
    h2 = sb.commands.connect(h.pid)
    assert h2.wait().stdout == "later\n"
    # kill: SIGKILL to the tree; the handle reports it
    h = sb.commands.run("sleep 100", background=True)
    assert sb.commands.kill(h.pid) is True
    from e2b import CommandExitException
    with pytest.raises(CommandExitException) as ei:
        h.wait()
    assert ei.value.exit_code == -1 and "killed" in (ei.value.error or "")
    assert h.pid not in [p.pid for p in sb.commands.list()]
    assert sb.commands.kill(999_999) is False


def test_timeout_kills_the_process(e2b_debug):  # type: ignore[no-untyped-def]
    from e2b import TimeoutException
    sb = e2b_debug
    t = time.monotonic()
    with pytest.raises(TimeoutException):
        sb.commands.run("sleep 30", timeout=2)
    assert time.monotonic() - t < 15
    time.sleep(1.0)
    assert not [p for p in sb.commands.list() if "sleep 30" in " ".join(p.args)]


@pytest.mark.anyio
async def test_async_client(envd, monkeypatch):  # type: ignore[no-untyped-def]
    for k in ("E2B_API_KEY", "E2B_API_URL"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("E2B_DEBUG", "true")
    monkeypatch.setenv("E2B_SANDBOX_URL", envd.url)
    monkeypatch.setenv("E2B_API_KEY", "e2b_" + "0" * 40)
    from e2b import AsyncSandbox
    sb = await AsyncSandbox.create()
    r = await sb.commands.run("echo async")
    assert r.stdout == "async\n"
    h = await sb.commands.run("sleep 0.3; echo bg", background=True)
    assert (await h.wait()).stdout == "bg\n"


def _env(payload: bytes, flags: int = 0) -> bytes:
    return struct.pack(">BI", flags, len(payload)) + payload


def _read_envelopes(body: bytes) -> list[tuple[int, bytes]]:
    out = []
    while body:
        flags, n = struct.unpack(">BI", body[:5])
        out.append((flags, body[5:5 + n]))
        body = body[5 + n:]
    return out


def test_wire_json_and_proto(envd):  # type: ignore[no-untyped-def]
    from pilldrops.e2b.envd.proto import process_pb2 as pb
    start = {"process": {"cmd": "/bin/bash", "args": ["-l", "-c", "echo hi"]}, "stdin": False, "unknownField": 1}
    with httpx.Client(base_url=envd.url, timeout=30) as c:
        # server streaming, JSON envelopes, chunked request body
        def chunks():  # type: ignore[no-untyped-def]
            yield _env(json.dumps(start).encode())
        r = c.post("/process.Process/Start", content=chunks(),
                   headers=envd.rpc_headers(**{"Content-Type": "application/connect+json"}))
        assert r.status_code == 200 and r.headers["content-type"] == "application/connect+json"
        msgs = _read_envelopes(r.content)
        assert [f for f, _ in msgs] == [0, 0, 0, 2]
        events = [json.loads(p) for _, p in msgs]
        assert set(events[0]["event"]["start"]) == {"pid"}
        assert base64.b64decode(events[1]["event"]["data"]["stdout"]) == b"hi\n"
        assert events[2]["event"]["end"] == {"exited": True, "status": "exit status 0"}
        assert events[3] == {}
        # the same call in binary protobuf envelopes
        req = pb.StartRequest(process=pb.ProcessConfig(cmd="/bin/sh", args=["-c", "echo bin; exit 2"]), stdin=False)
        r = c.post("/process.Process/Start", content=_env(req.SerializeToString()),
                   headers=envd.rpc_headers(**{"Content-Type": "application/connect+proto"}))
        assert r.headers["content-type"] == "application/connect+proto"
        msgs = _read_envelopes(r.content)
        evs = [pb.StartResponse.FromString(p).event for f, p in msgs if f == 0]
        assert evs[0].WhichOneof("event") == "start" and evs[1].data.stdout == b"bin\n"
        assert (evs[2].end.exit_code, evs[2].end.exited, evs[2].end.error) == (2, True, "exit status 2")
        assert msgs[-1] == (2, b"{}")
        # unary, JSON and proto
        r = c.post("/process.Process/List", json={}, headers=envd.rpc_headers())
        assert r.status_code == 200 and r.json() == {}
        r = c.post("/process.Process/List", content=pb.ListRequest().SerializeToString(),
                   headers=envd.rpc_headers(**{"Content-Type": "application/proto"}))
        assert r.status_code == 200 and r.headers["content-type"] == "application/proto"
        assert list(pb.ListResponse.FromString(r.content).processes) == []
        # errors: unary -> HTTP status + JSON code; stream -> 200 + end-stream error
        r = c.post("/process.Process/SendSignal", json={"process": {"pid": 4242}, "signal": "SIGNAL_SIGKILL"},
                   headers=envd.rpc_headers())
        assert r.status_code == 404 and r.json()["code"] == "not_found"
        r = c.post("/process.Process/Connect", content=_env(b'{"process":{"pid":4242}}'),
                   headers=envd.rpc_headers(**{"Content-Type": "application/connect+json"}))
        (flags, payload), = _read_envelopes(r.content)
        assert r.status_code == 200 and flags == 2 and json.loads(payload)["error"]["code"] == "not_found"
        r = c.post("/process.Process/Start", content=_env(json.dumps({"process": {"cmd": "true", "cwd": "/nope"}}).encode()),
                   headers=envd.rpc_headers(**{"Content-Type": "application/connect+json"}))
        (flags, payload), = _read_envelopes(r.content)
        assert json.loads(payload)["error"] == {"code": "invalid_argument", "message": "cwd '/nope' does not exist"}
        # auth: the token is required for RPCs, not for /health
        h = envd.rpc_headers()
        del h["X-Access-Token"]
        assert c.post("/process.Process/List", json={}, headers=h).status_code == 401
        assert c.post("/process.Process/List", json={}, headers={**h, "X-Access-Token": "wrong"}).status_code == 401
        assert c.get("/health", headers=h).status_code == 204
        # unknown method, and a compressed request
        assert c.post("/process.Process/Nope", json={}, headers=envd.rpc_headers()).status_code == 404
        r = c.post("/process.Process/List", json={}, headers=envd.rpc_headers(**{"Content-Encoding": "gzip"}))
        assert r.status_code == 501 and r.json()["code"] == "unimplemented"
