"""Colour-free helpers: retry decision, backoff, run decoding, tar packing and safe extraction."""

from __future__ import annotations

import base64
import io
import json
import os
import random
import tarfile
import threading
from pathlib import Path

import httpx
import pytest

from pilldrops import Sandbox
from pilldrops.errors import (
    CapacityUnavailable,
    Conflict,
    FileNotFound,
    InvalidRequest,
    NodeUnavailable,
    RateLimited,
    RequestTimeout,
    ServerError,
    TransportError,
)
from pilldrops.sdk import _base
from pilldrops.sdk._sync import client as sync_client
from pilldrops.sdk.testing import FakeControlPlane


def _line(**event: object) -> str:
    return json.dumps(event)


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


# ---------------------------------------------------------------------------------------------- retries

def test_should_retry_matrix() -> None:
    for exc in (RateLimited(), ServerError(), NodeUnavailable(), CapacityUnavailable(), TransportError()):
        assert _base.should_retry(exc, idempotent=True)
        assert not _base.should_retry(exc, idempotent=False)
    for exc in (InvalidRequest(), Conflict(), FileNotFound()):
        assert not _base.should_retry(exc, idempotent=True)
    not_sent = TransportError()
    not_sent.__cause__ = httpx.ConnectError("refused")
    assert _base.should_retry(not_sent, idempotent=False)


def test_backoff_is_exponential_jittered_and_capped() -> None:
    rng = random.Random(0)
    for attempt in range(8):
        d = _base.backoff_delay(attempt, rng=rng)
        full = min(4.0, 0.25 * 2 ** attempt)
        assert full / 2 <= d <= full
    assert _base.backoff_delay(0, retry_after=3.0) == 3.0
    assert _base.backoff_delay(0, retry_after=1e6) == 60.0


def test_parse_retry_after() -> None:
    assert _base.parse_retry_after("2") == 2.0
    assert _base.parse_retry_after(None) is None and _base.parse_retry_after("soon") is None
    assert _base.parse_retry_after("Thu, 01 Jan 1970 00:00:10 GMT", now=0) == 10.0


def test_map_transport_errors() -> None:
    with pytest.raises(RequestTimeout), _base.map_transport_errors():
        raise httpx.PoolTimeout("pool")
    with pytest.raises(TransportError) as info, _base.map_transport_errors():
        raise httpx.RemoteProtocolError("eof")
    assert isinstance(info.value.__cause__, httpx.RemoteProtocolError)
    with pytest.raises(ValueError):  # non-httpx errors pass untouched  # noqa: SIM117 - the order of the two contexts is what is tested
        with _base.map_transport_errors():
            raise ValueError("mine")
    with pytest.raises(TransportError) as refused:  # noqa: SIM117 - the order of the two contexts is what is tested
        with _base.map_transport_errors("http://h:1/v1/x?path=/secret"):
            raise httpx.ConnectError("refused")
    # nothing listening: the message names the URL (never its query) and what usually fixes it
    assert str(refused.value) == ("cannot reach PillDrops at http://h:1/v1/x — is `pilldrops up` running? "
                                  "(or set PILLDROPS_API_URL) [ConnectError: refused]")
    with pytest.raises(RequestTimeout, match="request to http://h:1/v1/x timed out"):  # noqa: SIM117 - the order of the two contexts is what is tested
        with _base.map_transport_errors("http://h:1/v1/x"):
            raise httpx.ReadTimeout("slow")


def test_check_remote_path() -> None:
    assert _base.check_remote_path("/a/b") == "/a/b"
    with pytest.raises(InvalidRequest, match=r"remote path 'a/b' is not absolute.*must be absolute"):
        _base.check_remote_path("a/b", "remote path")


# ---------------------------------------------------------------------------------------------- run

def test_run_decoder_split_utf8_and_callbacks() -> None:
    chunks: list[str] = []
    dec = _base.RunDecoder(cmd="x", on_stdout=chunks.append)
    data = "añ€😀".encode()
    dec.feed(_line(type="start", pid=7))
    for i in range(len(data)):
        dec.feed(_line(type="stdout", data=_b64(data[i:i + 1])))
    dec.feed("")
    dec.feed(_line(type="exit", exit_code=0, duration=1.5, truncated=False, timed_out=False))
    r = dec.result()
    assert "".join(chunks) == "añ€😀" == r.stdout and r.duration == 1.5 and dec.pid == 7


def test_run_decoder_trailing_partial_char_is_replaced() -> None:
    out: list[str] = []
    dec = _base.RunDecoder(on_stdout=out.append)
    dec.feed(_line(type="stdout", data=_b64("€".encode()[:2])))
    dec.feed(_line(type="exit", exit_code=0))
    assert dec.result().stdout == "\ufffd" and "".join(out) == "\ufffd"


def test_run_decoder_client_side_cap() -> None:
    dec = _base.RunDecoder(max_output_bytes=3)
    dec.feed(_line(type="stderr", data=_b64(b"abcdef")))
    dec.feed(_line(type="exit", exit_code=1))
    r = dec.result()
    assert r.stderr == "abc" and r.truncated and r.exit_code == 1


@pytest.mark.parametrize("code,cls", [("node_unavailable", NodeUnavailable), ("file_not_found", FileNotFound),
                                      ("capacity_unavailable", CapacityUnavailable)])
def test_run_decoder_error_event(code: str, cls: type[Exception]) -> None:
    dec = _base.RunDecoder()
    with pytest.raises(cls, match="went away"):
        dec.feed(_line(type="error", code=code, message="went away"))


def test_run_decoder_missing_exit_and_garbage() -> None:
    dec = _base.RunDecoder()
    dec.feed(_line(type="stdout", data=_b64(b"x")))
    with pytest.raises(TransportError):
        dec.result()
    with pytest.raises(ServerError):
        _base.RunDecoder().feed("not json")


def test_run_decoder_bytes_split_anywhere() -> None:
    """The run body's raw chunks, split at any byte (lines across chunks, several lines in one): the same
    result as feeding whole lines; a last line without a newline is fed at the end."""
    body = (_line(type="start", pid=3) + "\n" + _line(type="stdout", data=_b64("añ€".encode())) + "\n" +
            _line(type="stderr", data=_b64(b"e")) + "\n" +
            _line(type="exit", exit_code=2, duration=0.5, truncated=False, timed_out=False)).encode()
    rng = random.Random(7)
    for _ in range(50):
        cuts = sorted(rng.sample(range(1, len(body)), rng.randint(0, 8)))
        dec = _base.RunDecoder()
        for a, b in zip([0, *cuts], [*cuts, len(body)], strict=True):
            assert dec.feed_bytes(body[a:b])
        dec.end_bytes()
        r = dec.result()
        assert (r.exit_code, r.stdout, r.stderr, r.duration, dec.pid) == (2, "añ€", "e", 0.5, 3)


def test_run_decoder_bytes_bounds() -> None:
    """A line longer than MAX_EVENT_LINE is refused before it is buffered whole; after the exit event at
    most AFTER_EXIT_MAX bytes are read before the caller is told to stop."""
    dec = _base.RunDecoder()
    dec.feed_bytes(b'{"type":"stdout","data":"' + b"A" * 1000)
    with pytest.raises(ServerError, match="longer than"):
        for _ in range(_base.MAX_EVENT_LINE // 65536 + 2):
            dec.feed_bytes(b"A" * 65536)
    dec = _base.RunDecoder()
    assert dec.feed_bytes((_line(type="exit", exit_code=0) + "\n").encode() + b"x" * 100)
    assert dec.feed_bytes(b"y" * (_base.AFTER_EXIT_MAX - 200))
    assert not dec.feed_bytes(b"z" * 200)
    assert dec.result().exit_code == 0


@pytest.mark.parametrize("line", [
    _line(type="exit", exit_code="0"), _line(type="exit", exit_code=True), _line(type="stdout", data=5),
    _line(type="start", pid=1.5), _line(type="nope"), "[1, 2]", "null", '{"type": "exit", "exit_code": 0',
])
def test_run_decoder_plain_parse_falls_back_to_the_model(line: str) -> None:
    """An event the plain parse does not take (a field of another type, an unknown type, not an object) is
    validated by RunEvent as before: coerced where the model coerces, else a ServerError."""
    dec = _base.RunDecoder()
    try:
        want = _base.RunEvent.model_validate_json(line).model_dump()
    except ValueError:
        with pytest.raises(ServerError, match="malformed run event"):
            dec.feed(line)
        return
    dec.feed(line)
    assert dec.done == (want["type"] == "exit") and (not dec.done or dec.result().exit_code == want["exit_code"])


def test_run_result_check_returncode() -> None:
    ok = _base.RunResult(exit_code=0)
    assert ok.check_returncode() is ok
    bad = _base.RunResult(exit_code=124, timed_out=True, cmd="sleep 9")
    with pytest.raises(Exception, match="timed out") as info:
        bad.check_returncode()
    assert info.value.result is bad  # type: ignore[attr-defined]


# ---------------------------------------------------------------------------------------------- tar

def _members(plan: _base.UploadPlan) -> dict[str, tarfile.TarInfo]:
    with tarfile.open(plan.tar_path) as tar:
        return {m.name: m for m in tar.getmembers()}


def test_pack_directory(tmp_path: Path) -> None:
    (tmp_path / "d" / "sub").mkdir(parents=True)
    (tmp_path / "d" / "a").write_text("a")
    (tmp_path / "d" / "sub" / "b").write_text("b")
    os.symlink("/etc/passwd", tmp_path / "d" / "abs-link")
    plan = _base.pack_upload(tmp_path / "d", "/env/")
    try:
        members = _members(plan)
        assert plan.dest == "/env" and plan.entries == 4
        assert sorted(members) == ["a", "abs-link", "sub", "sub/b"]
        assert members["abs-link"].issym() and members["abs-link"].linkname == "/etc/passwd"
        assert all(m.uid == 0 and m.uname == "" for m in members.values())
    finally:
        plan.cleanup()
    assert not os.path.exists(plan.tar_path)


def test_pack_file_and_symlink_file(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("A")
    plan = _base.pack_upload(tmp_path / "a.txt", "/x/b.txt")
    assert (plan.dest, list(_members(plan))) == ("/x", ["b.txt"])
    plan.cleanup()
    os.symlink("a.txt", tmp_path / "ln")
    plan = _base.pack_upload(tmp_path / "ln", "/x/")
    assert (plan.dest, _members(plan)["ln"].issym()) == ("/x", True)
    plan.cleanup()


def _evil_tar(path: Path, *members: tuple[str, bytes | None, str | None]) -> str:
    with tarfile.open(path, "w") as tar:
        for name, data, link in members:
            ti = tarfile.TarInfo(name)
            if link is not None:
                ti.type, ti.linkname = tarfile.SYMTYPE, link
                tar.addfile(ti)
            else:
                ti.size = len(data or b"")
                tar.addfile(ti, io.BytesIO(data or b""))
    return str(path)


@pytest.mark.parametrize("members", [
    [("../escape", b"x", None)],
    [("out/../../escape", b"x", None)],
    [("out", None, "/etc"), ("out/passwd", b"x", None)],
    [("out/link", None, "../../../etc/passwd")],
])
def test_extract_refuses_unsafe_members(tmp_path: Path, members: list[tuple[str, bytes | None, str | None]]) -> None:
    tar = _evil_tar(tmp_path / "evil.tar", *members)
    dest = tmp_path / "dl" / "out"
    with pytest.raises(InvalidRequest, match="unsafe"):
        _base.extract_download(tar, "/out", dest)
    assert not (tmp_path / "escape").exists() and not (tmp_path / "dl" / "escape").exists()
    assert [p.name for p in (tmp_path / "dl").iterdir()] == []  # work dir cleaned up


def test_extract_keeps_absolute_names_inside(tmp_path: Path) -> None:
    tar = _evil_tar(tmp_path / "abs.tar", ("/out", b"x", None))
    got = _base.extract_download(tar, "/out", tmp_path / "dl" / "out")
    assert got == tmp_path / "dl" / "out" and got.read_bytes() == b"x"


def test_extract_file_into_existing_directory(tmp_path: Path) -> None:
    tar = _evil_tar(tmp_path / "ok.tar", ("r.txt", b"hi", None))
    (tmp_path / "dir").mkdir()
    assert _base.extract_download(tar, "/w/r.txt", tmp_path / "dir") == tmp_path / "dir" / "r.txt"
    assert (tmp_path / "dir" / "r.txt").read_bytes() == b"hi"


# ---------------------------------------------------------------------------------------------- threads

def test_64_threads_share_one_client() -> None:
    fake = FakeControlPlane()
    opts = fake.client_options()
    clients: set[int] = set()
    errors: list[BaseException] = []
    barrier = threading.Barrier(64)

    def rollout(i: int) -> None:
        try:
            barrier.wait()
            with Sandbox.create(template="code-interpreter", metadata={"i": str(i)}, **opts) as sb:
                clients.add(id(sb._client._http))
                assert float(sb.run(f"echo {i}").stdout) == i
        except BaseException as exc:  # noqa: BLE001 - surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=rollout, args=(i,)) for i in range(64)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[:3]
    assert len(clients) == 1 and len(fake.sandboxes) == 64
    assert all(s.info.state.value == "stopped" for s in fake.sandboxes.values())
    pool = sync_client._CLIENTS.get(sync_client.APIClient.from_options(**opts).config)
    assert id(pool) in clients


def test_iso_param_is_utc_with_z() -> None:
    from datetime import UTC, date, datetime, timedelta, timezone

    assert _base.iso_param(None, "since") is None
    assert _base.iso_param(datetime(2025, 1, 2, 3, 4, 5), "since") == "2025-01-02T03:04:05Z"  # naive = UTC
    plus2 = datetime(2025, 1, 2, 3, 0, tzinfo=timezone(timedelta(hours=2)))
    assert _base.iso_param(plus2, "since") == "2025-01-02T01:00:00Z"
    assert _base.iso_param(date(2025, 1, 2), "since") == "2025-01-02T00:00:00Z"
    assert _base.iso_param("2025-01-02", "since") == "2025-01-02T00:00:00Z"
    assert _base.iso_param("2025-01-02T03:04:05.5Z", "since") == "2025-01-02T03:04:05.500000Z"
    assert _base.iso_param(datetime(2025, 1, 2, tzinfo=UTC), "until") == "2025-01-02T00:00:00Z"
    with pytest.raises(InvalidRequest, match="until"):
        _base.iso_param("next week", "until")


def test_history_params() -> None:
    params = _base.history_params("2025-01-01", None, ["running", "paused"], "base", {"run": "7"}, 50, "c1")
    assert params == [("since", "2025-01-01T00:00:00Z"), ("template", "base"), ("state", "running"),
                      ("state", "paused"), ("metadata.run", "7"), ("limit", "50"), ("cursor", "c1")]
    assert _base.history_params(None, None, None, None, None, 100, None) == [("limit", "100")]
