"""What the SDK relies on, checked against both backends (``backend``: the FakeControlPlane and the real
stack). A test here that passes on one and fails on the other is a drift of the fake from the server.

Commands are kept to what both sandboxes run the same way (the real stack's FakeRuntime runs argv as host
processes, the fake simulates a tiny shell): no absolute paths in commands; files go through the files API.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest

from pilldrops import (
    AsyncSandbox,
    AuthenticationError,
    CommandFailed,
    InvalidState,
    NotFound,
    SandboxNotFound,
    SandboxState,
    TemplateNotFound,
)
from pilldrops.schema.api import PoolInfo
from pilldrops.sdk._async.client import AsyncAPIClient
from tests.contract.sdk.conftest import TEMPLATES, Backend, Target

pytestmark = pytest.mark.anyio


async def _pools(t: Target, method: str, body: dict[str, Any] | None = None) -> Any:
    """``/v1/pools`` through the SDK's client (as the CLI's ``pilldrops pools`` calls it)."""
    client = AsyncAPIClient.from_options(t.opts["api_url"], t.opts["api_key"], transport=t.opts["transport"])
    return (await client.request(method, "/v1/pools", json=body, idempotent=True)).json()


async def _raw(t: Target, method: str, path: str, **kw: Any) -> httpx.Response:
    """One REST call without the SDK's retries (status codes and bodies as the server sends them)."""
    async with httpx.AsyncClient(transport=t.opts["transport"], base_url=t.api_url,
                                 headers={"Authorization": f"Bearer {t.opts['api_key']}"}) as c:
        return await c.request(method, path, **kw)


# ---- create, run, kill -------------------------------------------------------------------------------------

async def test_create_run_kill(backend: Backend) -> None:
    async with backend.open() as t:
        sb = await AsyncSandbox.create("code-interpreter", vcpu=2, memory_mb=1024, timeout=600,
                                       metadata={"run": "1"}, envs={"A": "1"}, **t.opts)
        info = sb.info
        assert sb.id.startswith("sb_") and info.state == SandboxState.running
        assert (info.template, info.vcpu, info.memory_mb, info.timeout) == ("code-interpreter", 2, 1024, 600)
        assert info.metadata == {"run": "1"} and info.envd_url and info.access_token
        assert info.started_at is not None and info.end_at is not None and info.end_at > info.started_at
        r = await sb.run("echo hello && printenv A")
        assert (r.exit_code, r.stdout, r.stderr, r.truncated, r.timed_out) == (0, "hello\n1\n", "", False, False)
        final = await sb.kill()
        assert final.state == SandboxState.stopped and final.ended_at is not None
        assert final.end_reason is not None and final.end_reason.value == "killed"
        assert (await sb.kill()).state == SandboxState.stopped       # idempotent
        assert not await sb.is_running()


async def test_run_exit_codes_stderr_stdin_and_check(backend: Backend) -> None:
    async with backend.open() as t, await AsyncSandbox.create(**t.opts) as sb:
        r = await sb.run("echo partial; exit 3")
        assert (r.exit_code, r.stdout, r.ok) == (3, "partial\n", False)
        r = await sb.run("echo boom >&2; exit 2")
        assert (r.exit_code, r.stderr) == (2, "boom\n")
        assert (await sb.run("cat", stdin="fed")).stdout == "fed"
        assert (await sb.run(["echo", "a b"])).stdout == "a b\n"
        with pytest.raises(CommandFailed) as info:
            await sb.run("echo no >&2; exit 4", check=True)
        assert info.value.result.exit_code == 4
    assert sb.info.state == SandboxState.stopped                 # the block killed it


async def test_files_and_archives_round_trip(backend: Backend, tmp_path: Path) -> None:
    env = tmp_path / "env"
    (env / "sub").mkdir(parents=True)
    (env / "episode.py").write_text("print(1)")
    (env / "sub" / "data.bin").write_bytes(b"\x00\x01")
    async with backend.open() as t, await AsyncSandbox.create(**t.opts) as sb:
        info = await sb.files.write("/data/a.txt", "héllo")
        assert info.path == "/data/a.txt" and info.size == len("héllo".encode()) and info.type == "file"
        assert await sb.files.read("/data/a.txt") == "héllo"
        assert [f.name for f in await sb.files.list("/data")] == ["a.txt"]
        assert await sb.files.exists("/data/a.txt") and await sb.files.exists("/data")
        assert not await sb.files.exists("/data/b.txt")
        assert await sb.upload(env, "/env") == 3
        assert await sb.files.read_bytes("/env/sub/data.bin") == b"\x00\x01"
        got = await sb.download("/env", tmp_path / "back")
        assert (got / "episode.py").read_text() == "print(1)" and (got / "sub" / "data.bin").read_bytes() == b"\x00\x01"


# ---- reads, timeout, errors --------------------------------------------------------------------------------

async def test_list_filters_connect_and_timeout(backend: Backend) -> None:
    async with backend.open() as t:
        made = [await AsyncSandbox.create(metadata={"i": str(i), "even": str(i % 2 == 0)}, **t.opts)
                for i in range(3)]
        await made[0].kill()
        everything = await AsyncSandbox.list(page_size=2, include_ended=True, **t.opts)
        assert [s.id for s in everything] == [s.id for s in reversed(made)]   # newest first, across pages
        assert [s.id for s in await AsyncSandbox.list(**t.opts)] == [made[2].id, made[1].id]   # live only
        assert all(s.access_token is None for s in everything)               # never in listings
        assert {s.id for s in await AsyncSandbox.list(state="running", **t.opts)} == {made[1].id, made[2].id}
        assert {s.id for s in await AsyncSandbox.list(metadata={"even": "True"}, include_ended=True, **t.opts)} == {made[0].id,
                                                                                                made[2].id}
        again = await AsyncSandbox.connect(made[1].id, **t.opts)
        assert again.info.access_token == made[1].info.access_token and again.info.envd_url
        before = again.info.end_at
        info = await again.set_timeout(3600)
        assert info.timeout == 3600 and info.end_at is not None and before is not None and info.end_at > before
        assert (await AsyncSandbox.get_info_by_id(made[1].id, **t.opts)).timeout == 3600
        assert (await AsyncSandbox.kill_by_id(made[1].id, **t.opts)).state == SandboxState.stopped
        with pytest.raises(InvalidState) as stopped:
            await AsyncSandbox.connect(made[1].id, **t.opts)
        assert (stopped.value.status, stopped.value.code) == (409, "invalid_state")
        for sb in made[2:]:
            await sb.kill()


async def test_typed_errors(backend: Backend) -> None:
    async with backend.open() as t:
        with pytest.raises(SandboxNotFound) as nf:
            await AsyncSandbox.connect("sb_missing", **t.opts)
        assert nf.value.status == 404 and nf.value.request_id
        with pytest.raises(TemplateNotFound) as tnf:
            await AsyncSandbox.create("no-such-template", **t.opts)
        assert tnf.value.status == 404
        with pytest.raises(AuthenticationError):
            await AsyncSandbox.create(api_url=t.api_url, api_key="wrong", transport=t.opts["transport"])
        resp = await _raw(t, "POST", "/v1/sandboxes", json={"template": "base", "vcpu": -1})
        assert resp.status_code == 400 and resp.json()["error"]["code"] == "invalid_request"
        assert set(resp.json()["error"]) >= {"code", "message", "details", "request_id"}


async def test_idempotent_create_replays_and_refuses_another_body(backend: Backend) -> None:
    async with backend.open() as t:
        key = {"Idempotency-Key": uuid.uuid4().hex}
        first = await _raw(t, "POST", "/v1/sandboxes", json={"template": "base"}, headers=key)
        again = await _raw(t, "POST", "/v1/sandboxes", json={"template": "base"}, headers=key)
        assert (first.status_code, again.status_code) == (201, 200)
        assert first.json()["id"] == again.json()["id"] and again.json()["access_token"]
        other = await _raw(t, "POST", "/v1/sandboxes", json={"template": "base", "vcpu": 2}, headers=key)
        assert other.status_code == 409 and other.json()["error"]["code"] == "conflict"
        await AsyncSandbox.kill_by_id(first.json()["id"], **t.opts)


async def test_templates_and_history(backend: Backend) -> None:
    async with backend.open() as t:
        names = {x["name"] for x in (await _raw(t, "GET", "/v1/templates")).json()["items"]}
        assert set(TEMPLATES) <= names
        sb = await AsyncSandbox.create("base", metadata={"run": "h"}, **t.opts)
        await sb.kill()
        (rec,) = await AsyncSandbox.history(metadata={"run": "h"}, **t.opts)
        assert (rec.id, rec.state, rec.template) == (sb.id, SandboxState.stopped, "base")
        assert rec.ended_at is not None and rec.pauses == []


# ---- pause / resume ----------------------------------------------------------------------------------------

async def test_pause_resume(backend: Backend) -> None:
    async with backend.open() as t:
        sb = await AsyncSandbox.create(timeout=600, **t.opts)
        await sb.files.write("/work/state.txt", "kept")
        paused = await sb.pause()
        assert paused.state == SandboxState.paused and sb.info is paused
        assert paused.paused_at is not None and (paused.checkpoint_bytes or 0) > 0
        assert paused.timeout_left is not None and 0 < paused.timeout_left <= 600
        with pytest.raises(InvalidState) as again:
            await sb.pause()
        assert again.value.status == 409 and "already paused" in again.value.message
        with pytest.raises(InvalidState):
            await AsyncSandbox.connect(sb.id, **t.opts)
        assert {s.id for s in await AsyncSandbox.list(state="paused", **t.opts)} == {sb.id}
        later = await sb.set_timeout(300)          # paused time does not count: the time left after resume
        assert (later.state, later.timeout, later.timeout_left) == (SandboxState.paused, 300, 300)
        resumed = await sb.resume()
        assert resumed.state == SandboxState.running and resumed.paused_at is None and resumed.timeout == 300
        assert resumed.end_at is not None and 299 <= (resumed.end_at - resumed.created_at).total_seconds()
        assert resumed.envd_url and resumed.access_token and resumed.timeout_left is None
        assert await sb.files.read("/work/state.txt") == "kept"
        assert (await sb.run("echo back")).stdout == "back\n"
        with pytest.raises(InvalidState) as running:
            await sb.resume()
        assert "already running" in running.value.message
        final = await sb.kill()
        (rec,) = [r for r in await AsyncSandbox.history(**t.opts) if r.id == sb.id]
        assert final.state == SandboxState.stopped and len(rec.pauses) == 1 and rec.pauses[0].resumed_at
        assert rec.pauses[0].checkpoint_bytes == paused.checkpoint_bytes and final.checkpoint_bytes is None


async def test_kill_a_paused_sandbox_and_resume_by_id(backend: Backend) -> None:
    async with backend.open() as t:
        a = await AsyncSandbox.create(**t.opts)
        b = await AsyncSandbox.create(**t.opts)
        assert (await AsyncSandbox.pause(a.id, **t.opts)).state == SandboxState.paused
        await AsyncSandbox.pause(b.id, **t.opts)
        back = await AsyncSandbox.resume(b.id, **t.opts)
        assert isinstance(back, AsyncSandbox) and back.info.state == SandboxState.running
        assert (await back.run("true")).exit_code == 0
        final = await a.kill()
        assert final.state == SandboxState.stopped and final.paused_at is None
        with pytest.raises(InvalidState):
            await AsyncSandbox.resume(a.id, **t.opts)
        await back.kill()


async def test_killed_while_paused_past_its_deadline_keeps_its_running_time(backend: Backend) -> None:
    """Paused time does not count against the timeout: a sandbox killed while paused, after its pre-pause
    deadline has passed, is billed the running time it had before the pause (plus storage), not less."""
    async with backend.open() as t:
        sb = await AsyncSandbox.create(timeout=1, **t.opts)
        await t.wait(0.5)
        paused = await sb.pause()
        assert paused.vcpu_s > 0.3
        await t.wait(1.5)                      # past the end_at it had when it was paused
        final = await sb.kill()
        assert final.state == SandboxState.stopped and final.paused_at is None
        assert final.vcpu_s == pytest.approx(paused.vcpu_s, abs=0.2)
        assert final.gb_s == pytest.approx(paused.gb_s, abs=0.1)


# ---- batch -------------------------------------------------------------------------------------------------

async def test_create_many(backend: Backend) -> None:
    async with backend.open() as t:
        sbs = await AsyncSandbox.create_many(3, "base", metadata={"batch": "1"}, **t.opts)
        assert len({s.id for s in sbs}) == 3
        assert all(s.info.state == SandboxState.running and s.info.access_token for s in sbs)
        assert [(await s.run("echo ok")).stdout for s in sbs] == ["ok\n"] * 3
        assert len(await AsyncSandbox.list(metadata={"batch": "1"}, **t.opts)) == 3
        for s in sbs:
            await s.kill()
        per_item = await AsyncSandbox.create_many(2, "base", metadata=lambda i: {"episode": str(i)}, **t.opts)
        assert [s.info.metadata for s in per_item] == [{"episode": "0"}, {"episode": "1"}]
        for s in per_item:
            await s.kill()
        failed = await AsyncSandbox.create_many(2, "no-such-template", return_exceptions=True, **t.opts)
        assert [type(e) for e in failed] == [TemplateNotFound, TemplateNotFound]
        resp = await _raw(t, "POST", "/v1/sandboxes/batch", json={"template": "no-such-template", "count": 2})
        body = resp.json()
        assert resp.status_code == 200 and (body["created"], body["failed"]) == (0, 2)
        assert [(i["index"], i["sandbox"], i["error"]["code"]) for i in body["items"]] == [
            (0, None, "template_not_found"), (1, None, "template_not_found")]


# ---- pools -------------------------------------------------------------------------------------------------

async def test_pools_set_list_remove(backend: Backend) -> None:
    async with backend.open() as t:
        shape = {"template": "base", "vcpu": 1, "memory_mb": 256}
        info = PoolInfo.model_validate(await _pools(t, "PUT", {**shape, "size": 2}))
        assert (info.template, info.vcpu, info.memory_mb, info.size) == ("base", 1, 256, 2)
        listed = [PoolInfo.model_validate(p) for p in (await _pools(t, "GET"))["items"]]
        assert [(p.template, p.vcpu, p.memory_mb, p.size) for p in listed] == [("base", 1, 256, 2)]
        await _pools(t, "PUT", {**shape, "size": 0})
        assert (await _pools(t, "GET"))["items"] == []
        with pytest.raises(NotFound) as gone:
            await _pools(t, "PUT", {**shape, "size": 0})
        assert gone.value.status == 404
        with pytest.raises(TemplateNotFound):
            await _pools(t, "PUT", {"template": "nope", "size": 1})
