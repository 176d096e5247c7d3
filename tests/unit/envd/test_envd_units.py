"""envd's pieces without a sandbox: Connect envelopes and codecs, the streaming multipart reader, users and
paths, signed URLs, and the watcher's diff."""

from __future__ import annotations

import json
import struct
from typing import Any

import anyio
import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pilldrops import errors
from pilldrops.e2b.envd import connect as C
from pilldrops.e2b.envd import filesystem as F
from pilldrops.e2b.envd.files import HTTPError, authorize, signature
from pilldrops.e2b.envd.multipart import MultipartReader, boundary_of
from pilldrops.e2b.envd.proto import filesystem_pb2 as fpb
from pilldrops.e2b.envd.proto import process_pb2 as pb
from pilldrops.e2b.envd.users import ConnectError, resolve, user_from_header

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def receiver(chunks: list[bytes]):  # type: ignore[no-untyped-def]
    msgs = [{"type": "http.request", "body": c, "more_body": i < len(chunks) - 1} for i, c in enumerate(chunks)]

    async def receive() -> dict[str, Any]:
        return msgs.pop(0) if msgs else {"type": "http.disconnect"}
    return receive


def split(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts})
    return [data[a:b] for a, b in zip([0, *points], [*points, len(data)], strict=True)] or [b""]


@settings(max_examples=50, deadline=None)
@given(cuts=st.lists(st.integers(min_value=0, max_value=10_000), max_size=8))
def test_envelopes_in_any_split(cuts: list[int]) -> None:
    payloads = [b'{"a":1}', b"", b"x" * 300]
    data = b"".join(C.envelope(p) for p in payloads) + C.envelope(b"{}", C.END_STREAM) + C.envelope(b"late")

    async def main() -> list[bytes]:
        return [p async for p in C.Body(receiver(split(data, cuts))).envelopes()]
    assert anyio.run(main) == payloads


async def test_envelope_bounds() -> None:
    huge = struct.pack(">BI", 0, C.MAX_MESSAGE + 1)
    with pytest.raises(C.ConnectError, match="resource_exhausted"):
        [p async for p in C.Body(receiver([huge])).envelopes()]
    with pytest.raises(C.ConnectError, match="truncated"):
        [p async for p in C.Body(receiver([C.envelope(b"abc")[:6]])).envelopes()]
    with pytest.raises(C.ConnectError, match="unimplemented"):
        [p async for p in C.Body(receiver([C.envelope(b"abc", C.COMPRESSED)])).envelopes()]


def test_codecs_json_both_spellings_unknown_fields_and_proto() -> None:
    j = C.codec_for("application/connect+json; charset=utf-8")
    assert j is not None and j.stream and j.content_type == "application/connect+json"
    a = j.decode(b'{"process":{"cmd":"ls","cwd":"/"},"stdin":false,"newField":{"x":1}}', pb.StartRequest)
    b = j.decode(b'{"process":{"cmd":"ls","cwd":"/"},"stdin":false}', pb.StartRequest)
    assert a == b and a.HasField("stdin") and not a.stdin
    w = j.decode(b'{"watcher_id":"w1"}', fpb.GetWatcherEventsRequest)
    assert w.watcher_id == "w1"
    ev = pb.StartResponse(event=pb.ProcessEvent(data=pb.ProcessEvent.DataEvent(stdout=b"hi\n")))
    assert json.loads(j.encode(ev)) == {"event": {"data": {"stdout": "aGkK"}}}
    e = fpb.EntryInfo(name="a", size=5, type=fpb.FILE_TYPE_FILE)
    assert json.loads(j.encode(e)) == {"name": "a", "size": "5", "type": "FILE_TYPE_FILE"}
    p = C.codec_for("application/proto")
    assert p is not None and p.decode(ev.SerializeToString(), pb.StartResponse) == ev
    with pytest.raises(C.ConnectError, match="invalid_argument"):
        j.decode(b"{not json", pb.StartRequest)
    assert C.codec_for("text/plain") is None


def test_error_mapping() -> None:
    assert C.from_pilldrops(errors.FileNotFound("x")).code == "not_found"
    assert C.from_pilldrops(errors.InvalidRequest("x")).code == "invalid_argument"
    assert C.from_pilldrops(errors.NodeUnavailable("x")).code == "unavailable"
    assert C.HTTP_STATUS["unauthenticated"] == 401 and C.HTTP_STATUS["not_found"] == 404


async def _parts(body: bytes, boundary: bytes, cuts: list[int]) -> list[tuple[str | None, str | None, bytes]]:
    async def gen():  # type: ignore[no-untyped-def]
        for c in split(body, cuts):
            yield c
    r = MultipartReader(gen(), boundary)
    out = []
    while (part := await r.next_part()) is not None:
        out.append((part.name, part.filename, b"".join([c async for c in part.chunks()])))
    return out


@settings(max_examples=50, deadline=None)
@given(cuts=st.lists(st.integers(min_value=0, max_value=2000), max_size=10),
       data=st.binary(max_size=300))
def test_multipart_in_any_split(cuts: list[int], data: bytes) -> None:
    req = httpx.Request("POST", "http://x/files", files=[
        ("file", ("/tmp/a dir/one", data)), ("other", ("x", b"skip")), ("file", ("rel/two", b"2\r\n--"))])
    body = req.read()
    boundary = boundary_of(req.headers["content-type"])
    got = anyio.run(_parts, body, boundary, cuts)
    assert got == [("file", "/tmp/a dir/one", data), ("other", "x", b"skip"), ("file", "rel/two", b"2\r\n--")]


async def test_multipart_bounds() -> None:
    with pytest.raises(errors.InvalidRequest):
        boundary_of("multipart/form-data")
    with pytest.raises(errors.InvalidRequest, match="too large"):
        await _parts(b"--b\r\n" + b"X-A: " + b"a" * 20_000, b"b", [])
    with pytest.raises(errors.InvalidRequest, match="truncated"):
        await _parts(b'--b\r\nContent-Disposition: form-data; name="file"\r\n\r\nabc', b"b", [])


def test_users_and_paths() -> None:
    assert user_from_header(None) is None
    assert user_from_header("Basic dXNlcjo=") == "user"           # "user:"
    with pytest.raises(ConnectError, match="invalid username"):
        user_from_header("Basic " + __import__("base64").b64encode(b"../x:").decode())
    assert resolve("", "root", "/work") == "/work"
    assert resolve("a.txt", None, "/home/user") == "/home/user/a.txt" and resolve("~", None, "/w") == "/w"
    assert resolve("~", "user", "/w") == "/home/user" and resolve("~/a", "root", "/w") == "/root/a"
    assert resolve("a/../b", "user", "/w") == "/home/user/b" and resolve("/x//y/", "root", "/w") == "/x/y"


def test_signatures() -> None:
    sig = signature("/tmp/a", "read", "", "tok", None)
    assert sig.startswith("v1_") and "=" not in sig
    authorize({"path": "/tmp/a", "signature": sig}, {}, "tok", "read")
    for query, headers in [({"path": "/tmp/a", "signature": sig}, {"x-access-token": "bad"}),
                           ({"path": "/tmp/b", "signature": sig}, {}),
                           ({"path": "/tmp/a"}, {})]:
        with pytest.raises(HTTPError):
            authorize(query, headers, "tok", "read")
    with pytest.raises(HTTPError):
        authorize({"path": "/tmp/a", "signature": sig}, {}, "tok", "write")
    authorize({}, {"x-access-token": "tok"}, "tok", "write")


class _Node:
    def __init__(self) -> None:
        self.items: list[dict[str, Any]] = []

    async def request(self, method: str, path: str, **kw: Any) -> httpx.Response:
        return httpx.Response(200, json={"items": self.items, "truncated": False})


def _e(path: str, size: int = 0, mtime: float = 1.0, typ: str = "file", mode: int = 0o644) -> dict[str, Any]:
    return {"name": path.rsplit("/", 1)[-1], "path": path, "type": typ, "size": size, "mode": mode, "mtime": mtime}


async def test_watcher_diff() -> None:
    nd = _Node()
    ref = type("Ref", (), {"node": nd, "id": "sb", "workdir": "/"})()
    w = F.Watcher(ctx=type("Ctx", (), {"ref": ref})(), path="/w", recursive=True, include_entry=True)  # type: ignore[arg-type]
    nd.items = [_e("/w/old", 1)]
    await w.start()
    nd.items = [_e("/w/old", 2, 2.0), _e("/w/new", 3), _e("/w/d", typ="dir"), _e("/w/d/empty")]
    evs = [(e.name, e.type) for e in await w.poll()]
    assert evs == [("old", fpb.EVENT_TYPE_WRITE), ("new", fpb.EVENT_TYPE_CREATE), ("new", fpb.EVENT_TYPE_WRITE),
                   ("d", fpb.EVENT_TYPE_CREATE), ("d/empty", fpb.EVENT_TYPE_CREATE)]
    nd.items = [_e("/w/old", 2, 2.0, mode=0o600), _e("/w/d", typ="dir"), _e("/w/d/empty")]
    got = await w.poll()
    assert [(e.name, e.type) for e in got] == [("old", fpb.EVENT_TYPE_CHMOD), ("new", fpb.EVENT_TYPE_REMOVE)]
    assert got[0].HasField("entry") and not got[1].HasField("entry")
    assert await w.poll() == []
