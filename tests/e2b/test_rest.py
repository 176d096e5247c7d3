"""The E2B control plane, driven by the stock `e2b` SDK (sync and async) and checked on the wire: lifecycle,
list filters, timeouts, pause/resume through connect, errors in E2B's shape, idempotency, and that what E2B
made shows up in `pilldrops history` with its cost."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import httpx
import pytest

from tests.e2b.conftest import Up

pytestmark = pytest.mark.integration


def test_lifecycle_sync(e2b_env: Up) -> None:
    from e2b import Sandbox, SandboxQuery, SandboxState
    sb = Sandbox.create(metadata={"run": "lifecycle"}, timeout=120)
    try:
        assert sb.sandbox_id.isalnum() and sb.sandbox_id.islower()          # E2B's [a-z0-9]+ ids
        info = sb.get_info()
        assert info.template_id == "base" and info.state == SandboxState.RUNNING
        assert info.metadata == {"run": "lifecycle"} and info.cpu_count == 1 and info.memory_mb == 512
        assert 100 < (info.end_at - info.started_at).total_seconds() <= 121
        listed = Sandbox.list(query=SandboxQuery(metadata={"run": "lifecycle"})).next_items()
        assert [s.sandbox_id for s in listed] == [sb.sandbox_id]
        assert Sandbox.list(query=SandboxQuery(metadata={"run": "other"})).next_items() == []
        sb.set_timeout(30)
        assert (sb.get_info().end_at - info.started_at).total_seconds() < 100
        same = Sandbox.connect(sb.sandbox_id, timeout=600)      # extends to at least 600 s from now
        assert same.sandbox_id == sb.sandbox_id
        assert (same.get_info().end_at - info.started_at).total_seconds() > 500
    finally:
        assert sb.kill() is True
    assert sb.is_running() is False                              # envd's /health: 502 "not found", at once
    assert Sandbox.kill(sb.sandbox_id) is False                  # already gone: False, as on E2B
    from e2b.exceptions import NotFoundException
    with pytest.raises(NotFoundException):
        Sandbox.get_info(sb.sandbox_id)
    with pytest.raises(NotFoundException):
        Sandbox.connect(sb.sandbox_id)


@pytest.mark.anyio
async def test_lifecycle_async(e2b_env: Up) -> None:
    from e2b import AsyncSandbox
    sb = await AsyncSandbox.create(metadata={"run": "async"})
    try:
        info = await sb.get_info()
        assert info.sandbox_id == sb.sandbox_id and info.metadata == {"run": "async"}
        assert 290 < (info.end_at - info.started_at).total_seconds() <= 301     # E2B's default: 300 s
        paginator = AsyncSandbox.list()
        assert sb.sandbox_id in [s.sandbox_id for s in await paginator.next_items()]
    finally:
        assert await sb.kill() is True
    assert await AsyncSandbox.kill(sb.sandbox_id) is False


def test_code_interpreter_template_alias(e2b_http: httpx.Client) -> None:
    r = e2b_http.post("/v2/sandboxes", json={"templateID": "code-interpreter-v1", "unknownField": {"x": 1}})
    assert r.status_code == 201, r.text
    body = r.json()
    try:
        assert body["templateID"] == "code-interpreter-v1" and body["envdAccessToken"]
        got = e2b_http.get(f"/sandboxes/{body['sandboxID']}").json()
        assert got["templateID"] == "code-interpreter" and got["state"] == "running"
    finally:
        assert e2b_http.delete(f"/sandboxes/{body['sandboxID']}").status_code == 204


def test_legacy_endpoints_and_statuses(e2b_http: httpx.Client) -> None:
    """What older SDKs call: POST /sandboxes (201), /connect (200), /refreshes and /timeout (204), v1 list,
    /resume of a running one (409), metrics (not collected: 501)."""
    r = e2b_http.post("/sandboxes", json={"templateID": "base", "timeout": 60, "secure": True,
                                          "allow_internet_access": True, "metadata": {}, "envVars": {}})
    assert r.status_code == 201, r.text
    sid = r.json()["sandboxID"]
    assert {"templateID", "sandboxID", "clientID", "envdVersion"} <= set(r.json())
    try:
        assert e2b_http.post(f"/sandboxes/{sid}/connect", json={"timeout": 60}).status_code == 200
        assert e2b_http.post(f"/sandboxes/{sid}/refreshes", json={"duration": 90}).status_code == 204
        assert e2b_http.post(f"/sandboxes/{sid}/timeout", json={"timeout": 120}).status_code == 204
        assert sid in [s["sandboxID"] for s in e2b_http.get("/sandboxes").json()]
        listed = e2b_http.get("/v2/sandboxes", params={"state": "running", "limit": 1000}).json()
        item = next(s for s in listed if s["sandboxID"] == sid)
        assert {"templateID", "sandboxID", "clientID", "startedAt", "endAt", "envdVersion", "cpuCount",
                "memoryMB", "diskSizeMB", "state"} <= set(item)
        r = e2b_http.post(f"/sandboxes/{sid}/resume", json={"timeout": 60})
        assert r.status_code == 409 and r.json()["code"] == 409
        r = e2b_http.get(f"/sandboxes/{sid}/metrics")
        assert r.status_code == 501 and "message" in r.json()
    finally:
        assert e2b_http.delete(f"/sandboxes/{sid}").status_code == 204
    assert e2b_http.delete(f"/sandboxes/{sid}").status_code == 404


def test_errors_in_e2b_shape(pd_up: Up, e2b_http: httpx.Client) -> None:
    """E2B clients read ``code`` (the status) and ``message``; ours read ``error.code``: both are there."""
    r = httpx.post(f"{pd_up.api_url}/v2/sandboxes", json={"templateID": "base"}, headers={"X-API-Key": "nope"})
    assert r.status_code == 401
    body = r.json()
    assert body["code"] == 401 and body["message"] == "Invalid API key" and body["error"]["code"] == "unauthenticated"
    r = e2b_http.get("/sandboxes/sbnosuchsandbox00000")
    assert r.status_code == 404 and r.json()["code"] == 404 and r.json()["error"]["code"] == "sandbox_not_found"
    r = e2b_http.post("/v2/sandboxes", json={"templateID": "no-such-template"})
    assert r.status_code == 404 and "no-such-template" in r.json()["message"]
    r = e2b_http.post("/v2/sandboxes", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["code"] == 400
    r = e2b_http.post("/v2/sandboxes", json={"templateID": "base", "timeout": 10**9})
    assert r.status_code == 400 and "timeout" in r.json()["message"]
    # our own /v1 errors are untouched
    r = httpx.get(f"{pd_up.api_url}/v1/sandboxes/nope", headers={"Authorization": f"Bearer {pd_up.api_key}"})
    assert r.status_code == 404 and "code" not in r.json() and r.json()["error"]["code"] == "sandbox_not_found"


def test_sdk_errors(e2b_env: Up) -> None:
    from e2b import Sandbox
    from e2b.exceptions import AuthenticationException, NotFoundException, SandboxException
    with pytest.raises(AuthenticationException):
        Sandbox.create(api_key="e2b_0123456789abcdef")
    with pytest.raises(NotFoundException):
        Sandbox.connect("sbnosuchsandbox00000")
    with pytest.raises(SandboxException, match="no-such-template"):
        Sandbox.create(template="no-such-template")


def test_idempotent_create(e2b_http: httpx.Client) -> None:
    h = {"Idempotency-Key": f"e2b-idem-{time.time_ns()}"}
    a = e2b_http.post("/v2/sandboxes", json={"templateID": "base"}, headers=h)
    b = e2b_http.post("/v2/sandboxes", json={"templateID": "base"}, headers=h)
    try:
        assert a.status_code == b.status_code == 201
        assert a.json()["sandboxID"] == b.json()["sandboxID"]
    finally:
        e2b_http.delete(f"/sandboxes/{a.json()['sandboxID']}")


def test_pause_and_resume_through_connect(e2b_env: Up, e2b_http: httpx.Client) -> None:
    from e2b import Sandbox, SandboxQuery, SandboxState
    sb = Sandbox.create(metadata={"run": "pause"})
    try:
        r = e2b_http.post(f"/sandboxes/{sb.sandbox_id}/pause", json={})
        if r.status_code == 501:
            pytest.skip(f"checkpoints are not supported on this host: {r.json()['message']}")
        assert r.status_code == 204, r.text
        assert sb.get_info().state == SandboxState.PAUSED
        paused = Sandbox.list(query=SandboxQuery(state=[SandboxState.PAUSED], metadata={"run": "pause"}))
        assert [s.sandbox_id for s in paused.next_items()] == [sb.sandbox_id]
        assert e2b_http.post(f"/sandboxes/{sb.sandbox_id}/pause", json={}).status_code == 409
        r = e2b_http.post(f"/v2/sandboxes/{sb.sandbox_id}/connect", json={"timeout": 120})
        assert r.status_code == 201, r.text                    # 201: it was resumed
        assert sb.get_info().state == SandboxState.RUNNING
        assert Sandbox.connect(sb.sandbox_id).sandbox_id == sb.sandbox_id     # running: 200
        sb.pause()                                              # the SDK's own pause and resume
        assert sb.get_info().state == SandboxState.PAUSED
        sb.connect()
        assert sb.get_info().state == SandboxState.RUNNING
    finally:
        sb.kill()


def test_history_shows_e2b_sandboxes_with_cost(e2b_env: Up) -> None:
    from e2b import Sandbox
    sb = Sandbox.create(metadata={"run": "history"})
    time.sleep(1.5)
    sb.kill()
    out = subprocess.run([sys.executable, "-m", "pilldrops", "history", "--json", "-m", "run=history"],
                         capture_output=True, text=True, timeout=60, check=False,
                         env={"PATH": "/usr/bin:/bin", "XDG_CONFIG_HOME": str(e2b_env.config_home)})
    assert out.returncode == 0, out.stderr
    records = json.loads(out.stdout)
    rec = next(r for r in records if r["id"].replace("_", "", 1) == sb.sandbox_id)
    assert rec["template"] == "base" and rec["end_reason"] == "killed" and rec["metadata"] == {"run": "history"}
    assert rec["vcpu_s"] >= 1.0 and rec["cost_usd"] > 0


def test_hex_key_for_old_sdks(pd_up: Up) -> None:
    """Python e2b 2.25 to 2.45 accept only ``e2b_<hex>`` keys: the hex of a PillDrops key works as that key."""
    from pilldrops.e2b.rest import decode_key, encode_key
    hexed = encode_key(pd_up.api_key)
    assert hexed.startswith("e2b_") and all(c in "0123456789abcdef" for c in hexed[4:])
    assert decode_key(hexed) == pd_up.api_key and decode_key("e2b_zz") == "e2b_zz"
    assert decode_key("e2b_" + b"not-a-pd-key".hex()) == "e2b_" + b"not-a-pd-key".hex()
    ok = httpx.get(f"{pd_up.api_url}/v2/sandboxes", headers={"X-API-Key": hexed})
    assert ok.status_code == 200
    bad = httpx.get(f"{pd_up.api_url}/v2/sandboxes", headers={"X-API-Key": encode_key("pd_wrong")})
    assert bad.status_code == 401


def test_sandbox_timeout_ends_it(e2b_env: Up) -> None:
    """The E2B ``timeout`` is the sandbox's life: past it the node ends it, E2B calls say "not found", and
    history records ``timeout``."""
    from e2b import Sandbox
    from e2b.exceptions import NotFoundException
    sb = Sandbox.create(timeout=2, metadata={"run": "expire"})
    deadline = time.monotonic() + 30
    while True:
        try:
            sb.get_info()
        except NotFoundException:
            break
        assert time.monotonic() < deadline, "the sandbox outlived its timeout by 28 s"
        time.sleep(0.5)
    assert sb.is_running() is False
    out = subprocess.run([sys.executable, "-m", "pilldrops", "history", "--json", "-m", "run=expire"],
                         capture_output=True, text=True, timeout=60, check=False,
                         env={"PATH": "/usr/bin:/bin", "XDG_CONFIG_HOME": str(e2b_env.config_home)})
    rec = json.loads(out.stdout)[0]
    assert rec["end_reason"] == "timeout" and 1.5 <= rec["vcpu_s"] <= 6
