"""Sandbox behaviour against the in-memory FakeControlPlane. Written async; the sync twin is generated."""

from __future__ import annotations

import os
import tarfile
from pathlib import Path
from typing import Any

import httpx
import pytest

from pilldrops import (
    AsyncSandbox,
    AuthenticationError,
    CapacityUnavailable,
    CommandFailed,
    FileNotFound,
    InvalidRequest,
    InvalidState,
    PillDropsError,
    RequestTimeout,
    SandboxNotFound,
    SandboxState,
    ServerError,
    TransportError,
)
from pilldrops.sdk.testing import FakeControlPlane, FakeResult

SB = r"/v1/sandboxes/[^/]+"


@pytest.mark.anyio
async def test_create_run_kill(fake: FakeControlPlane, opts: dict[str, Any]) -> None:
    sb = await AsyncSandbox.create("code-interpreter", vcpu=2, memory_mb=1024, timeout=600,
                                   metadata={"run": "1"}, envs={"A": "1"}, **opts)
    assert sb.id.startswith("sb_") and sb.info.state == SandboxState.running
    assert sb.info.template == "code-interpreter" and sb.info.vcpu == 2 and sb.info.memory_mb == 1024
    r = await sb.run("echo hello && printenv A")
    assert (r.exit_code, r.stdout, r.stderr, r.truncated, r.timed_out) == (0, "hello\n1\n", "", False, False)
    assert r.stdout_bytes == b"hello\n1\n" and r.duration >= 0
    info = await sb.kill()
    assert info.state == SandboxState.stopped and info.end_reason is not None
    assert fake.sandboxes[sb.id].info.state == SandboxState.stopped
    assert (await sb.kill()).state == SandboxState.stopped  # idempotent


@pytest.mark.anyio
async def test_data_plane_is_direct_with_access_token(fake: FakeControlPlane, opts: dict[str, Any]) -> None:
    sb = await AsyncSandbox.create(**opts)
    await sb.run("true")
    (req,) = fake.requests_to("POST", SB + "/run")
    assert req.url.host == httpx.URL(fake.node_url).host
    assert req.headers["x-access-token"] == fake.sandboxes[sb.id].access_token
    assert "authorization" not in req.headers  # the API key never goes to a node


@pytest.mark.anyio
async def test_reprs_never_show_the_access_token(fake: FakeControlPlane, opts: dict[str, Any]) -> None:
    sb = await AsyncSandbox.create(**opts)
    token = fake.sandboxes[sb.id].access_token
    assert sb.info.access_token == token
    for text in (repr(sb), str(sb), repr(sb.info), str(sb.info), f"{sb.info!r}", repr([sb.info])):
        assert token not in text and "access_token" not in text
    assert sb.id in repr(sb.info)
    assert sb.info.model_dump()["access_token"] == token  # still there for the SDK itself


@pytest.mark.anyio
async def test_relative_remote_paths_are_refused_before_any_request(fake: FakeControlPlane, opts: dict[str, Any],
                                                                    tmp_path: Path) -> None:
    sb = await AsyncSandbox.create(**opts)
    (tmp_path / "f").write_text("x")
    before = len(fake.requests)
    calls = [
        ("env/f", lambda: sb.upload(tmp_path / "f", "env/f")),
        ("out.txt", lambda: sb.download("out.txt", tmp_path / "out")),
        ("notes.txt", lambda: sb.files.read("notes.txt")),
        ("./notes.txt", lambda: sb.files.read_bytes("./notes.txt")),
        ("tmp/x", lambda: sb.files.write("tmp/x", "hi")),
        ("home", lambda: sb.files.list("home")),
        ("x/y", lambda: sb.files.exists("x/y")),
        ("", lambda: sb.files.list("")),
    ]
    for path, call in calls:
        with pytest.raises(InvalidRequest, match="must be absolute") as info:
            await call()
        assert repr(path) in str(info.value)
    assert len(fake.requests) == before
    assert await sb.files.exists("/home/user")


@pytest.mark.anyio
async def test_transport_errors_name_the_url(fake: FakeControlPlane, opts: dict[str, Any]) -> None:
    fake.fail_next("POST", r"^/v1/sandboxes$", exc=httpx.ConnectError("connection refused"), times=4)
    with pytest.raises(TransportError) as info:
        await AsyncSandbox.create(capacity_wait=0, **opts)     # no waiting for a restart either
    assert f"{fake.api_url}/v1/sandboxes" in str(info.value) and "connection refused" in str(info.value)
    sb = await AsyncSandbox.create(**opts)
    fake.fail_next("POST", SB + "/run", exc=httpx.ConnectError("no route to host"), times=4)
    with pytest.raises(TransportError, match=f"{fake.node_url}/v1/sandboxes/{sb.id}/run"):
        await sb.run("true")


@pytest.mark.anyio
async def test_unknown_state_lists_the_valid_ones(fake: FakeControlPlane, opts: dict[str, Any]) -> None:
    with pytest.raises(InvalidRequest, match="'bogus'.*running.*stopped"):
        await AsyncSandbox.list(state="bogus", **opts)
    with pytest.raises(InvalidRequest, match="valid states"):
        await AsyncSandbox.history(state=["running", "nope"], **opts)
    assert not fake.requests


@pytest.mark.anyio
async def test_data_plane_falls_back_to_control_plane_proxy(opts: dict[str, Any]) -> None:
    fake = FakeControlPlane(data_plane=False)
    sb = await AsyncSandbox.create(**fake.client_options())
    assert sb.info.envd_url is None
    assert (await sb.run("echo via proxy")).stdout == "via proxy\n"
    (req,) = fake.requests_to("POST", SB + "/run")
    assert req.url.host == httpx.URL(fake.api_url).host
    assert req.headers["authorization"] == f"Bearer {fake.api_key}"


@pytest.mark.anyio
async def test_context_manager_kills_on_success_and_on_exception(fake: FakeControlPlane,
                                                                 opts: dict[str, Any]) -> None:
    async with await AsyncSandbox.create(**opts) as sb:
        first = sb.id
    assert fake.sandboxes[first].info.state == SandboxState.stopped
    with pytest.raises(ZeroDivisionError):
        async with await AsyncSandbox.create(**opts) as sb:
            second = sb.id
            raise ZeroDivisionError
    assert fake.sandboxes[second].info.state == SandboxState.stopped


@pytest.mark.anyio
async def test_failing_kill_does_not_hide_the_body_error(fake: FakeControlPlane, opts: dict[str, Any]) -> None:
    with pytest.raises(KeyError):
        async with await AsyncSandbox.create(**opts):
            fake.fail_next("DELETE", SB, status=500, times=10)
            raise KeyError("body")
    fake2 = FakeControlPlane()
    with pytest.raises(ServerError):  # without a body error, the kill failure is raised
        async with await AsyncSandbox.create(**fake2.client_options()):
            fake2.fail_next("DELETE", SB, status=500, times=10)


@pytest.mark.anyio
async def test_retried_create_reuses_idempotency_key(fake: FakeControlPlane, opts: dict[str, Any],
                                                     delays: list[float]) -> None:
    # The first attempt is processed but its answer is lost (503): the retry must not make a second one.
    fake.fail_next("POST", r"^/v1/sandboxes$", status=503, after=True)
    sb = await AsyncSandbox.create(**opts)
    attempts = fake.requests_to("POST", "/v1/sandboxes")
    assert len(attempts) == 2 and len(delays) == 1
    keys = {r.headers["idempotency-key"] for r in attempts}
    assert len(keys) == 1 and keys.pop()
    assert list(fake.sandboxes) == [sb.id]
    other = await AsyncSandbox.create(**opts)  # a new logical create gets a new key
    assert other.id != sb.id
    assert fake.requests_to("POST", "/v1/sandboxes")[-1].headers["idempotency-key"] not in keys


@pytest.mark.anyio
async def test_retry_honours_retry_after(fake: FakeControlPlane, opts: dict[str, Any],
                                         delays: list[float]) -> None:
    fake.fail_next("POST", r"^/v1/sandboxes$", status=429, retry_after=2)
    await AsyncSandbox.create(**opts)
    assert delays == [2.0]


@pytest.mark.anyio
async def test_create_waits_for_capacity_with_one_idempotency_key(fake: FakeControlPlane, opts: dict[str, Any],
                                                                  delays: list[float]) -> None:
    # A burst: far more capacity refusals than the ordinary 3 retries; Retry-After is honoured.
    fake.fail_next("POST", r"^/v1/sandboxes$", status=503, code="capacity_unavailable", times=10,
                   retry_after=5)
    sb = await AsyncSandbox.create(**opts)
    attempts = fake.requests_to("POST", "/v1/sandboxes")
    assert len(attempts) == 11 and delays == [5.0] * 10
    assert len({r.headers["idempotency-key"] for r in attempts}) == 1
    assert list(fake.sandboxes) == [sb.id]


@pytest.mark.anyio
async def test_create_capacity_wait_bounds_the_total_wait(fake: FakeControlPlane, opts: dict[str, Any],
                                                          delays: list[float]) -> None:
    fake.fail_next("POST", r"^/v1/sandboxes$", status=503, code="capacity_unavailable", times=1000,
                   retry_after=4)
    with pytest.raises(CapacityUnavailable):
        await AsyncSandbox.create(capacity_wait=10, **opts)
    assert delays == [4.0, 4.0, 2.0]  # the last wait is cut to fit; then one last try
    assert len(fake.requests_to("POST", "/v1/sandboxes")) == 4
    assert not fake.sandboxes


@pytest.mark.anyio
async def test_create_backs_off_on_rate_limits_without_retry_after(fake: FakeControlPlane, opts: dict[str, Any],
                                                                   delays: list[float]) -> None:
    fake.fail_next("POST", r"^/v1/sandboxes$", status=429, times=8)
    await AsyncSandbox.create(**opts)
    assert len(delays) == 8 and all(0 < d <= 10 for d in delays)
    assert max(delays) > 4  # exponential, beyond the ordinary cap


@pytest.mark.anyio
async def test_create_capacity_wait_zero_fails_fast(fake: FakeControlPlane, opts: dict[str, Any],
                                                    delays: list[float]) -> None:
    fake.fail_next("POST", r"^/v1/sandboxes$", status=503, code="capacity_unavailable", times=1000)
    with pytest.raises(CapacityUnavailable):
        await AsyncSandbox.create(capacity_wait=0, **opts)
    assert len(fake.requests_to("POST", "/v1/sandboxes")) == 1 and delays == []
    with pytest.raises(InvalidRequest, match="capacity_wait"):
        await AsyncSandbox.create(capacity_wait=-1, **opts)


@pytest.mark.anyio
async def test_other_calls_keep_the_ordinary_retry_policy_on_capacity_errors(
        fake: FakeControlPlane, opts: dict[str, Any]) -> None:
    sb = await AsyncSandbox.create(**opts)
    fake.fail_next("GET", SB, status=503, code="capacity_unavailable", times=100)
    with pytest.raises(CapacityUnavailable):
        await sb.get_info()
    assert len(fake.requests_to("GET", SB)) == 4  # 1 try + 3 retries
    # a plain 503 without the capacity code on create is an ordinary failure too
    fake.fail_next("POST", r"^/v1/sandboxes$", status=503, code="internal", times=100)
    with pytest.raises(PillDropsError):
        await AsyncSandbox.create(**opts)
    assert len(fake.requests_to("POST", "/v1/sandboxes")) == 1 + 4


@pytest.mark.anyio
async def test_idempotent_calls_retry_and_give_up(fake: FakeControlPlane, opts: dict[str, Any]) -> None:
    sb = await AsyncSandbox.create(**opts)
    fake.fail_next("GET", SB, status=502, times=2)
    assert (await sb.get_info()).id == sb.id
    assert len(fake.requests_to("GET", SB)) == 3
    fake.fail_next("GET", SB, status=503, times=100)
    with pytest.raises(CapacityUnavailable):
        await sb.get_info()
    assert len(fake.requests_to("GET", SB)) == 3 + 4  # 1 try + 3 retries


@pytest.mark.anyio
async def test_non_idempotent_calls_are_not_retried(fake: FakeControlPlane, opts: dict[str, Any],
                                                    tmp_path: Path) -> None:
    sb = await AsyncSandbox.create(**opts)
    fake.fail_next("POST", SB + "/run", status=503)
    with pytest.raises(CapacityUnavailable):
        await sb.run("echo once")
    assert len(fake.requests_to("POST", SB + "/run")) == 1
    (tmp_path / "f").write_text("x")
    fake.fail_next("PUT", SB + "/archive", status=500)
    with pytest.raises(ServerError):
        await sb.upload(tmp_path / "f", "/f")
    assert len(fake.requests_to("PUT", SB + "/archive")) == 1
    fake.fail_next("POST", SB + "/run", exc=httpx.ReadError("reset"))
    with pytest.raises(TransportError):
        await sb.run("echo once")
    assert len(fake.requests_to("POST", SB + "/run")) == 2


@pytest.mark.anyio
async def test_unsent_requests_are_retried_even_for_run(fake: FakeControlPlane, opts: dict[str, Any]) -> None:
    sb = await AsyncSandbox.create(**opts)
    fake.fail_next("POST", SB + "/run", exc=httpx.ConnectError("refused"))
    assert (await sb.run("echo ok")).stdout == "ok\n"


@pytest.mark.anyio
async def test_transport_errors_are_mapped(fake: FakeControlPlane, opts: dict[str, Any]) -> None:
    fake.fail_next(None, "", exc=httpx.ConnectError("connection refused"), times=100)
    with pytest.raises(TransportError) as info:
        await AsyncSandbox.list(**opts)
    assert not isinstance(info.value, httpx.HTTPError)
    assert isinstance(info.value.__cause__, httpx.ConnectError)
    assert len(fake.requests) == 4
    fake2 = FakeControlPlane()
    fake2.fail_next(None, "", exc=httpx.ReadTimeout("slow"), times=100)
    with pytest.raises(RequestTimeout) as timeout:
        await AsyncSandbox.list(**fake2.client_options())
    assert isinstance(timeout.value, TimeoutError)


@pytest.mark.anyio
async def test_http_errors_are_typed(fake: FakeControlPlane, opts: dict[str, Any]) -> None:
    with pytest.raises(SandboxNotFound) as nf:
        await AsyncSandbox.connect("sb_missing", **opts)
    assert nf.value.request_id and nf.value.code == "sandbox_not_found"
    with pytest.raises(AuthenticationError):
        await AsyncSandbox.create(api_url=fake.api_url, api_key="wrong", transport=fake.transport)
    fake.fail_next("GET", "", status=500, body=b"<html>oops</html>", content_type="text/html", times=100)
    with pytest.raises(ServerError) as se:
        await AsyncSandbox.list(**opts)
    assert "500" in str(se.value)
    with pytest.raises(InvalidRequest):
        await AsyncSandbox.create(vcpu=-1, **opts)  # validated locally, before any request


@pytest.mark.anyio
async def test_no_api_key_tells_how_to_get_one() -> None:
    with pytest.raises(AuthenticationError, match="pilldrops up.*PILLDROPS_API_KEY"):
        await AsyncSandbox.create()


@pytest.mark.anyio
async def test_run_output_decoding() -> None:
    fake = FakeControlPlane(chunk_size=1)  # every byte its own chunk: multi-byte characters get split
    fake.on_command("binary", lambda c: FakeResult(stdout=b"\xff\x00ok", stderr="é€😀"))
    sb = await AsyncSandbox.create(**fake.client_options())
    out: list[str] = []
    err: list[str] = []
    r = await sb.run("echo héllo wörld €", on_stdout=out.append, on_stderr=err.append)
    assert r.stdout == "héllo wörld €\n" and "".join(out) == r.stdout and "\ufffd" not in r.stdout
    r = await sb.run("binary", on_stdout=out.append, on_stderr=err.append)
    assert r.stdout_bytes == b"\xff\x00ok" and r.stdout == "\ufffd\x00ok"
    assert r.stderr == "é€😀" and "".join(err) == "é€😀"


@pytest.mark.anyio
async def test_run_truncation_exit_codes_and_timeouts(fake: FakeControlPlane, opts: dict[str, Any]) -> None:
    sb = await AsyncSandbox.create(**opts)
    r = await sb.run("echo 0123456789", max_output_bytes=4)
    assert r.truncated and r.stdout == "0123"
    r = await sb.run("echo partial; exit 3")
    assert r.exit_code == 3 and r.stdout == "partial\n" and not r.ok
    r = await sb.run("sleep 10", timeout=1)
    assert r.timed_out and r.exit_code == 124
    r = await sb.run(["echo", "a b"], cwd="/tmp", stdin="in")
    assert r.stdout == "a b\n"
    assert (await sb.run("cat", stdin="fed")).stdout == "fed"


@pytest.mark.anyio
async def test_check_raises_command_failed(fake: FakeControlPlane, opts: dict[str, Any]) -> None:
    sb = await AsyncSandbox.create(**opts)
    with pytest.raises(CommandFailed) as info:
        await sb.run("echo boom >&2; exit 2", check=True)
    assert info.value.result.exit_code == 2 and info.value.result.stderr == "boom\n"
    assert "boom" in str(info.value)
    assert (await sb.run("true", check=True)).exit_code == 0


@pytest.mark.anyio
async def test_upload_directory_layout_keeps_symlinks(fake: FakeControlPlane, opts: dict[str, Any],
                                                      tmp_path: Path) -> None:
    env = tmp_path / "env"
    (env / "sub").mkdir(parents=True)
    (env / "episode.py").write_text("print(1)")
    (env / "sub" / "data.bin").write_bytes(b"\x00\x01")
    os.symlink("episode.py", env / "link.py")
    sb = await AsyncSandbox.create(**opts)
    assert await sb.upload(env, "/env") == 4
    (req,) = fake.requests_to("PUT", SB + "/archive")
    assert req.url.params["path"] == "/env"
    names = sorted(m.name for m in tarfile.open(fileobj=__import__("io").BytesIO(req.content)).getmembers())
    assert names == ["episode.py", "link.py", "sub", "sub/data.bin"]
    fs = fake.sandboxes[sb.id]
    assert fs.files["/env/episode.py"] == b"print(1)" and fs.files["/env/sub/data.bin"] == b"\x00\x01"
    assert fs.links["/env/link.py"] == "episode.py" and "/env/link.py" not in fs.files
    assert (await sb.run("cat /env/episode.py")).stdout == "print(1)"


@pytest.mark.anyio
async def test_upload_single_file(fake: FakeControlPlane, opts: dict[str, Any], tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("A")
    sb = await AsyncSandbox.create(**opts)
    assert await sb.upload(tmp_path / "a.txt", "/x/b.txt") == 1
    assert fake.requests_to("PUT", SB + "/archive")[-1].url.params["path"] == "/x"
    await sb.upload(str(tmp_path / "a.txt"), "/y/")
    assert fake.sandboxes[sb.id].files == {"/x/b.txt": b"A", "/y/a.txt": b"A"}
    with pytest.raises(FileNotFoundError):
        await sb.upload(tmp_path / "missing", "/z")


@pytest.mark.anyio
async def test_download_round_trip(fake: FakeControlPlane, opts: dict[str, Any], tmp_path: Path) -> None:
    sb = await AsyncSandbox.create(**opts)
    await sb.files.write("/out/result.json", '{"r": 1}')
    await sb.files.write("/out/deep/x.bin", b"\xff")
    fake.sandboxes[sb.id].links["/out/link"] = "result.json"
    got = await sb.download("/out", tmp_path / "local")
    assert got == tmp_path / "local"
    assert (got / "result.json").read_text() == '{"r": 1}' and (got / "deep" / "x.bin").read_bytes() == b"\xff"
    assert os.readlink(got / "link") == "result.json"
    single = await sb.download("/out/result.json", tmp_path / "r.json")
    assert single.read_text() == '{"r": 1}'
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".pilldrops")]
    with pytest.raises(FileNotFound):
        await sb.download("/nope", tmp_path / "nope")


@pytest.mark.anyio
async def test_files(fake: FakeControlPlane, opts: dict[str, Any]) -> None:
    sb = await AsyncSandbox.create(**opts)
    info = await sb.files.write("/data/a.txt", "héllo")
    assert info.path == "/data/a.txt" and info.size == len("héllo".encode())
    assert await sb.files.read("/data/a.txt") == "héllo"
    assert await sb.files.read_bytes("/data/a.txt") == "héllo".encode()
    assert [f.name for f in await sb.files.list("/data")] == ["a.txt"]
    assert await sb.files.exists("/data/a.txt") and await sb.files.exists("/data")
    assert not await sb.files.exists("/data/b.txt") and not await sb.files.exists("/nope/b")
    with pytest.raises(FileNotFound):
        await sb.files.read("/data/b.txt")


@pytest.mark.anyio
async def test_list_follows_cursors_and_filters(fake: FakeControlPlane, opts: dict[str, Any]) -> None:
    made = [await AsyncSandbox.create(metadata={"i": str(i), "even": str(i % 2 == 0)}, **opts)
            for i in range(5)]
    await made[0].kill()
    everything = await AsyncSandbox.list(page_size=2, include_ended=True, **opts)
    assert [s.id for s in everything] == [s.id for s in reversed(made)]
    assert len(fake.requests_to("GET", "/v1/sandboxes")) == 3
    live = await AsyncSandbox.list(**opts)                 # by default the ones that have not ended
    assert [s.id for s in live] == [s.id for s in reversed(made[1:])]
    running = await AsyncSandbox.list(state="running", **opts)
    assert {s.id for s in running} == {s.id for s in made[1:]}
    assert {s.id for s in await AsyncSandbox.list(state=[SandboxState.stopped], **opts)} == {made[0].id}
    even = await AsyncSandbox.list(metadata={"even": "True"}, include_ended=True, **opts)
    assert {s.id for s in even} == {made[0].id, made[2].id, made[4].id}
    assert all(s.access_token is None for s in everything)


@pytest.mark.anyio
async def test_connect_info_timeout_and_kill_by_id(fake: FakeControlPlane, opts: dict[str, Any]) -> None:
    sb = await AsyncSandbox.create(**opts)
    again = await AsyncSandbox.connect(sb.id, **opts)
    assert again.info.access_token == fake.sandboxes[sb.id].access_token
    assert await again.is_running()
    before = sb.info.end_at
    fake.advance(10)
    info = await sb.set_timeout(3600)
    assert info.end_at is not None and before is not None and info.end_at > before
    assert sb.info.access_token is not None  # refreshes keep the data-plane token
    assert (await AsyncSandbox.get_info_by_id(sb.id, **opts)).id == sb.id
    assert (await AsyncSandbox.kill_by_id(sb.id, **opts)).state == SandboxState.stopped
    assert not await sb.is_running()
    with pytest.raises(InvalidState):
        await AsyncSandbox.connect(sb.id, **opts)
    with pytest.raises(InvalidRequest):
        await sb.set_timeout(0)


@pytest.mark.anyio
async def test_sandboxes_share_one_client(fake: FakeControlPlane, opts: dict[str, Any]) -> None:
    a = await AsyncSandbox.create(**opts)
    b = await AsyncSandbox.connect(a.id, **opts)
    assert a._client._http is b._client._http
    other = FakeControlPlane()
    c = await AsyncSandbox.create(**other.client_options())
    assert c._client._http is not a._client._http


@pytest.mark.anyio
async def test_using_an_ended_sandbox_says_it_is_stopped(fake: FakeControlPlane, opts: dict[str, Any]) -> None:
    sb = await AsyncSandbox.create(**opts)
    await sb.kill()
    sent = len(fake.requests)
    with pytest.raises(InvalidState, match=rf"sandbox {sb.id} is stopped \(killed at \d{{4}}-") as info:
        await sb.run("true")
    assert info.value.details["end_reason"] == "killed"
    assert len(fake.requests) == sent       # known locally: no request
    for call in (lambda: sb.files.read("/x"), lambda: sb.upload(__file__, "/x"),
                 lambda: sb.download("/x", "/tmp/never")):
        with pytest.raises(InvalidState, match="is stopped"):
            await call()


@pytest.mark.anyio
async def test_a_sandbox_killed_elsewhere_is_explained(fake: FakeControlPlane, opts: dict[str, Any]) -> None:
    sb = await AsyncSandbox.create(**opts)
    await AsyncSandbox.kill_by_id(sb.id, **opts)       # another process killed it
    with pytest.raises(InvalidState, match=rf"sandbox {sb.id} is stopped \(killed at "):
        await sb.run("true")
    with pytest.raises(InvalidState, match="is stopped"):
        await sb.files.write("/x", "y")


@pytest.mark.anyio
async def test_auth_errors_name_where_the_key_came_from(fake: FakeControlPlane, opts: dict[str, Any],
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    opts = {k: v for k, v in opts.items() if k != "api_key"}
    monkeypatch.setenv("E2B_API_KEY", "e2b_stale")
    with pytest.raises(AuthenticationError, match=r"from \$E2B_API_KEY"):
        await AsyncSandbox.create(**opts)
    monkeypatch.setenv("PILLDROPS_API_KEY", "pd_wrong")
    with pytest.raises(AuthenticationError, match=r"from \$PILLDROPS_API_KEY"):
        await AsyncSandbox.create(**opts)
    with pytest.raises(AuthenticationError, match=r"from the explicit api_key \(--api-key"):
        await AsyncSandbox.create(api_key="pd_explicit_wrong", **opts)


@pytest.mark.anyio
async def test_create_rides_out_a_control_plane_restart(fake: FakeControlPlane, opts: dict[str, Any],
                                                        delays: list[float]) -> None:
    """Found by bench/chaos.py: a create whose control plane was SIGKILLed gave up after its 3 ordinary
    retries (< 2 s) while the restart took ~5 s; the node had made the sandbox, which then ran and was billed
    with nobody holding it. The create now keeps retrying its one key through the outage and gets that
    sandbox."""
    fake.fail_next("POST", r"^/v1/sandboxes$", status=500, after=True)      # made, then the answer was lost
    fake.fail_next("POST", r"^/v1/sandboxes$", exc=httpx.ConnectError("refused"), times=12)   # restarting
    sb = await AsyncSandbox.create(**opts)
    attempts = fake.requests_to("POST", "/v1/sandboxes")
    assert len(attempts) == 14 and len({r.headers["idempotency-key"] for r in attempts}) == 1
    assert list(fake.sandboxes) == [sb.id]            # the first attempt's sandbox, and no second one
    assert sum(delays) < 30


@pytest.mark.anyio
async def test_create_and_kill_give_up_on_an_outage_after_30_s(fake: FakeControlPlane, opts: dict[str, Any],
                                                               delays: list[float]) -> None:
    fake.fail_next("POST", r"^/v1/sandboxes$", exc=httpx.ConnectError("refused"), times=1000)
    with pytest.raises(TransportError):
        await AsyncSandbox.create(**opts)
    assert 29 <= sum(delays) <= 30.01 and len(fake.requests_to("POST", "/v1/sandboxes")) < 80
    delays.clear()
    fake2 = FakeControlPlane()
    sb = await AsyncSandbox.create(**fake2.client_options())
    fake2.fail_next("DELETE", SB, status=502, code="node_unavailable", times=8)    # its node restarting
    assert (await sb.kill()).state == "stopped" and len(fake2.requests_to("DELETE", SB)) == 9
    fake2.fail_next("POST", r"^/v1/sandboxes$", exc=httpx.ConnectError("refused"), times=1000)
    delays.clear()
    with pytest.raises(TransportError):
        await AsyncSandbox.create(capacity_wait=5, **fake2.client_options())
    assert 4 <= sum(delays) <= 5.01           # bounded by capacity_wait too


@pytest.mark.anyio
async def test_kill_many_by_ids_and_by_metadata_in_one_request(fake: FakeControlPlane, opts: dict[str, Any]) -> None:
    made = [await AsyncSandbox.create(metadata={"run": "a" if i < 3 else "b"}, **opts) for i in range(5)]
    res = await AsyncSandbox.kill_many([made[0].id, made[1].id, made[0].id, "sb_nope"], **opts)
    assert len(fake.requests_to("POST", "/v1/sandboxes/kill")) == 1
    assert [it.id for it in res.items] == [made[0].id, made[1].id, "sb_nope"] and (res.killed, res.failed) == (2, 1)
    assert res.items[0].sandbox is not None and res.items[0].sandbox.state == SandboxState.stopped
    assert res.items[2].sandbox is None and res.items[2].error is not None
    assert res.items[2].error.code == "sandbox_not_found"
    res = await AsyncSandbox.kill_many(metadata={"run": "a"}, **opts)      # the live one left of run=a
    assert [it.id for it in res.items] == [made[2].id] and res.killed == 1
    assert {s.id for s in await AsyncSandbox.list(**opts)} == {made[3].id, made[4].id}
    with pytest.raises(ValueError):
        await AsyncSandbox.kill_many(**opts)
    with pytest.raises(ValueError):
        await AsyncSandbox.kill_many([made[3].id], metadata={"run": "b"}, **opts)
    await AsyncSandbox._drop_made(made[3]._client, [made[3], made[4]])    # a failed batch's teardown
    assert len(fake.requests_to("POST", "/v1/sandboxes/kill")) == 3 and not fake.requests_to("DELETE", ".*")
    assert made[3].info.state == made[4].info.state == SandboxState.stopped


@pytest.mark.anyio
async def test_kill_many_by_metadata_stops_when_a_round_ends_nothing_new() -> None:
    """The server ends at most 1,000 matches a call, so the SDK asks again while a round was full; a server
    that keeps answering the same rows (ones it cannot end) must not make that loop forever."""
    calls: list[int] = []
    items = [{"id": f"sb_{i:04d}", "sandbox": None, "error": None} for i in range(1000)]

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(1)
        assert len(calls) < 10, "kill_many looped"
        return httpx.Response(200, json={"items": items, "killed": 1000, "failed": 0})

    res = await AsyncSandbox.kill_many(metadata={"run": "a"}, api_key="pd_test", api_url="http://cp.test",
                                       transport=httpx.MockTransport(handler))
    assert len(calls) == 2 and res.killed == 2000
