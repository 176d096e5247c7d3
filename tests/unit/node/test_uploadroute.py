"""The file write and archive upload as a raw ASGI handler (``node/uploadroute.py``, issue 15) answer as the
FastAPI routes do: the same bytes, the same typed errors, the same gate (first), ``path`` check and token
check, the same bounds; a client that goes away mid-body leaves no command behind."""

from __future__ import annotations

import io
import json
import tarfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

from pilldrops.node import dataplane
from pilldrops.node.api import create_node_app
from pilldrops.node.dataplane import DataPlane
from pilldrops.node.uploadroute import UploadRoute
from pilldrops.schema.api import FileInfo
from tests.stack import TOKEN, stack
from tests.unit.rawroutes import strip, without

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"      # the node agent runs on asyncio (serving.run_served)


def _tar(*members: tuple[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def _evil() -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        info = tarfile.TarInfo("../escape.txt")
        info.size = 1
        tf.addfile(info, io.BytesIO(b"x"))
    return buf.getvalue()


def _scope(path: str, query: bytes, headers: list[tuple[bytes, bytes]]) -> dict[str, Any]:
    return {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
            "method": "PUT", "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": query,
            "root_path": "", "server": ("node", 80), "client": ("c", 1), "headers": [(b"host", b"node"), *headers]}


class _Spy:
    """Which requests the raw route answered (the other app has none in front)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.paths: list[str] = []
        real = UploadRoute.answer

        async def spy(route, scope, receive):  # type: ignore[no-untyped-def]
            self.paths.append(scope["path"])
            return await real(route, scope, receive)

        monkeypatch.setattr(UploadRoute, "answer", spy)


async def test_writes_and_uploads_match_the_fastapi_routes(tmp_path: Path, monkeypatch) -> None:
    async with stack(tmp_path) as st, st.client() as c:
        spy = _Spy(monkeypatch)
        sb = (await c.post("/v1/sandboxes", json={"template": "tiny"})).json()
        base = f"/v1/sandboxes/{sb['id']}"
        auth = {"x-access-token": sb["access_token"]}
        fast = httpx.AsyncClient(transport=st.transport, base_url="http://node")
        plain = httpx.AsyncClient(transport=httpx.ASGITransport(app=without(create_node_app(st.agent, TOKEN),
                                                                            UploadRoute)), base_url="http://node")
        w = tmp_path / "w"          # the fake runtime's commands see the host's paths
        async with fast, plain:
            # a write through each route (the SDK's headers; JSON-looking bytes are bytes all the same)
            for i, (cl, ctype) in enumerate(((fast, "application/octet-stream"), (plain, "application/octet-stream"),
                                             (fast, "application/json"), (plain, "application/json"))):
                body = b'{"h\xc3\xa9llo": ' + str(i).encode() + b"}\n" + bytes(range(256)) * 300
                r = await cl.put(f"{base}/files", params={"path": f"{w}/d{i % 2}/f.bin"}, content=body,
                                 headers={**auth, "content-type": ctype})
                assert r.status_code == 200 and r.headers["content-type"] == "application/json", r.text
                assert r.headers["x-request-id"].startswith("req_")
                info = r.json()
                assert list(info) == ["name", "path", "type", "size", "mode", "mtime"]
                assert (info["name"], info["path"], info["type"], info["size"]) == \
                    ("f.bin", f"{w}/d{i % 2}/f.bin", "file", len(body))
                assert (w / f"d{i % 2}" / "f.bin").read_bytes() == body
            # an upload through each: the same count, the same files
            tar = _tar(("a.txt", b"alpha"), ("sub/b.txt", b"beta"), ("c.txt", b""))
            ra = await fast.put(f"{base}/archive", params={"path": f"{w}/up1"}, content=tar,
                                headers={**auth, "content-type": "application/x-tar"})
            rb = await plain.put(f"{base}/archive", params={"path": f"{w}/up2"}, content=tar,
                                 headers={**auth, "content-type": "application/x-tar"})
            assert ra.status_code == rb.status_code == 200 and ra.content == rb.content == b'{"entries":3}'
            assert ra.headers["content-type"] == rb.headers["content-type"] == "application/json"
            assert ra.headers["x-request-id"].startswith("req_")
            for d in ("up1", "up2"):
                assert (w / d / "sub" / "b.txt").read_bytes() == b"beta" and (w / d / "a.txt").read_bytes() == b"alpha"
            assert spy.paths == [f"{base}/files", f"{base}/files", f"{base}/archive"]
            # every failure: the same status and typed body through either route
            big = "/" + "x" * 4096
            longest = f"{w}/" + "\u00e9" * (4095 - len(str(w)))        # 4,096 characters: a name too long
            cases: list[tuple[str, dict[str, Any], bytes, dict[str, str]]] = []
            for tail, good in (("files", b"data"), ("archive", tar)):
                cases += [
                    (tail, {}, good, auth),                                    # no path
                    (tail, {"path": ""}, good, auth),                          # empty
                    (tail, {"path": big}, good, auth),                         # 4,097 characters
                    (tail, {"path": longest}, good, auth),                     # past the check, not the sandbox's
                    (tail, {"path": "relative/x"}, good, auth),                # not absolute (the data plane's)
                    (tail, {"path": "/a\x00b"}, good, auth),
                    (tail, {"path": [f"{w}/ok", "relative"]}, good, auth),      # the last one counts
                    (tail, {"path": f"{w}/x"}, good, {}),                      # no token
                    (tail, {"path": f"{w}/x"}, good, {"x-access-token": "wrong"}),
                    (tail, {"path": f"{w}/x", "access_token": sb["access_token"]}, good, {}),   # header only
                    (tail, {}, good, {}),                                      # the parameters before the token
                ]
            cases += [("archive", {"path": f"{w}/bad"}, b"not a tar at all" * 64, auth),
                      ("archive", {"path": f"{w}/bad"}, _evil(), auth),
                      ("files", {"path": f"{w}/d0/f.bin/under-a-file"}, b"x", auth)]   # the command fails
            for tail, params, body, headers in cases:
                ea = await fast.put(f"{base}/{tail}", params=params, content=body, headers=headers)
                eb = await plain.put(f"{base}/{tail}", params=params, content=body, headers=headers)
                assert ea.status_code == eb.status_code and ea.status_code in (400, 404), (tail, params, ea.text, eb.text)
                assert ea.headers["x-request-id"] == ea.json()["error"]["request_id"]
                assert strip(ea.json()) == strip(eb.json()), (tail, params, ea.text, eb.text)
            assert len(spy.paths) == 3 + len(cases)
            for params, want in (({}, {"msg": "Field required", "type": "missing"}),
                                 ({"path": ""}, {"msg": "String should have at least 1 character",
                                                 "type": "string_too_short"})):
                err = (await fast.put(f"{base}/files", params=params, content=b"x", headers=auth)).json()["error"]
                assert err["code"] == "invalid_request" and err["details"] == [{"loc": ["query", "path"], **want}]
                assert err["message"] == f"invalid request: query.path: {want['msg']}"
            assert not (w / "x").exists() and not (w / "bad").exists() and not (tmp_path / "escape.txt").exists()
            for u in ("/v1/sandboxes/sb_nope/files", "/v1/sandboxes/sb_nope/archive"):
                ea = await fast.put(u, params={"path": f"{w}/x"}, content=b"x", headers=auth)
                eb = await plain.put(u, params={"path": f"{w}/x"}, content=b"x", headers=auth)
                assert ea.status_code == eb.status_code == 404 and ea.json()["error"]["code"] == "sandbox_not_found"
                assert strip(ea.json()) == strip(eb.json())
            # what is not these two routes still reaches FastAPI, answered the same through either app: a
            # trailing slash, a sub-path, another method, the reads
            answered = len(spy.paths)
            for method, path in (("PUT", f"{base}/files/"), ("PUT", f"{base}/files/list"), ("PUT", f"{base}/archive/x"),
                                 ("POST", f"{base}/files"), ("PATCH", f"{base}/archive"), ("PUT", f"{base}/fs/stat"),
                                 ("GET", f"{base}/files"), ("GET", f"{base}/archive"), ("PUT", f"{base}/run")):
                ra = await fast.request(method, path, params={"path": f"{w}/d0/f.bin"}, headers=auth,
                                        content=b"x" if method != "GET" else None)
                rb = await plain.request(method, path, params={"path": f"{w}/d0/f.bin"}, headers=auth,
                                         content=b"x" if method != "GET" else None)
                assert ra.status_code == rb.status_code, (method, path, ra.text, rb.text)
                if ra.status_code >= 400:
                    assert strip(ra.json()) == strip(rb.json()), (method, path, ra.text, rb.text)
                else:
                    assert ra.content == rb.content
            assert len(spy.paths) == answered
            # the node's schema still documents both
            spec = (await fast.get("/openapi.json")).json()
            for tail in ("files", "archive"):
                assert spec["paths"][f"/v1/sandboxes/{{sandbox_id}}/{tail}"]["put"]["responses"]["200"]
            # a restarted agent that has not re-adopted yet: the same gate, before anything else
            monkeypatch.setattr(type(st.agent), "recovered", property(lambda self: False), raising=False)
            for tail in ("files", "archive"):
                for params, headers in (({"path": f"{w}/x"}, auth), ({}, {})):
                    ra = await fast.put(f"{base}/{tail}", params=params, content=b"x", headers=headers)
                    rb = await plain.put(f"{base}/{tail}", params=params, content=b"x", headers=headers)
                    assert ra.status_code == rb.status_code == 502, (ra.text, rb.text)
                    assert strip(ra.json()) == strip(rb.json()) and ra.json()["error"]["code"] == "node_unavailable"


async def test_the_answers_are_the_fastapi_routes_bytes(tmp_path: Path, monkeypatch) -> None:
    """The data plane's answers (stubbed: values a sandbox could make, unicode, a far mtime) serialised byte for
    byte as the response model and FastAPI's JSON do; the body reaches the data plane whole either way."""
    got: list[bytes] = []
    odd = FileInfo(name="\u00e9t\u00e9 \"q\" \\ \u2713", path="/d/\u00e9t\u00e9 \"q\" \\ \u2713", type="other",
                   size=2**62, mode=0o7777, mtime=1e17 + 0.5)

    async def write_file(self, t, path, body):  # type: ignore[no-untyped-def]
        got.append(b"".join([c async for c in body]))
        return odd

    async def put_archive(self, t, dest, body, *, declared=None):  # type: ignore[no-untyped-def]
        got.append(b"".join([c async for c in body]))
        return 123456

    monkeypatch.setattr(DataPlane, "write_file", write_file)
    monkeypatch.setattr(DataPlane, "put_archive", put_archive)
    async with stack(tmp_path) as st, st.client() as c:
        spy = _Spy(monkeypatch)
        sb = (await c.post("/v1/sandboxes", json={"template": "tiny"})).json()
        auth = {"x-access-token": sb["access_token"]}
        fast = httpx.AsyncClient(transport=st.transport, base_url="http://node")
        plain = httpx.AsyncClient(transport=httpx.ASGITransport(app=without(create_node_app(st.agent, TOKEN),
                                                                            UploadRoute)), base_url="http://node")

        async def chunks() -> AsyncIterator[bytes]:
            for i in range(5):
                yield bytes([i]) * 1000

        async with fast, plain:
            for tail in ("files", "archive"):
                out = []
                for cl in (fast, plain):
                    for content in (b"abc" * 5000, chunks()):
                        r = await cl.put(f"/v1/sandboxes/{sb['id']}/{tail}", params={"path": "/d/x"},
                                         content=content, headers=auth)
                        assert r.status_code == 200, r.text
                        out.append(r.content)
                assert len(set(out)) == 1, out
                assert json.loads(out[0]) == (odd.model_dump() if tail == "files" else {"entries": 123456})
        assert got == [b"abc" * 5000, b"".join(bytes([i]) * 1000 for i in range(5))] * 4
        assert len(spy.paths) == 4


async def test_an_upload_past_the_bound_is_refused_before_it_is_buffered(tmp_path: Path, monkeypatch) -> None:
    """``MAX_UPLOAD_BYTES`` (1 KiB here): refused by the declared length before any of it is read, and by what
    arrives without one, through either route the same way; a caller without the token never gets that far."""
    monkeypatch.setattr(dataplane, "MAX_UPLOAD_BYTES", 1024)
    async with stack(tmp_path) as st, st.client() as c:
        sb = (await c.post("/v1/sandboxes", json={"template": "tiny"})).json()
        url = f"/v1/sandboxes/{sb['id']}/archive"
        auth = {"x-access-token": sb["access_token"]}
        apps = (create_node_app(st.agent, TOKEN), without(create_node_app(st.agent, TOKEN), UploadRoute))
        tar = _tar(("big.bin", b"x" * 4096))

        async def chunks() -> AsyncIterator[bytes]:
            for i in range(0, len(tar), 512):
                yield tar[i:i + 512]

        answers = []
        for app in apps:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://node") as cl:
                for content in (tar, chunks()):
                    r = await cl.put(url, params={"path": str(tmp_path / "up")}, content=content, headers=auth)
                    assert r.status_code == 413 and r.json()["error"]["code"] == "payload_too_large", r.text
                    answers.append(strip(r.json()))
                r = await cl.put(url, params={"path": str(tmp_path / "up")}, content=tar,
                                 headers={"x-access-token": "wrong"})
                assert r.status_code == 404 and r.json()["error"]["code"] == "sandbox_not_found"
        assert all(a == answers[0] for a in answers) and not (tmp_path / "up").exists()
        # by the declared length: not one part of the body is asked for (the raw route's own, direct)
        asked = 0

        async def receive() -> dict[str, Any]:
            nonlocal asked
            asked += 1
            return {"type": "http.request", "body": tar, "more_body": False}

        sent: list[dict[str, Any]] = []

        async def send(msg: dict[str, Any]) -> None:
            sent.append(msg)

        headers = [(b"x-access-token", sb["access_token"].encode()), (b"content-length", str(len(tar)).encode())]
        await apps[0](_scope(url, b"path=/up", headers), receive, send)
        assert asked == 0 and sent[0]["status"] == 413
        assert json.loads(sent[1]["body"])["error"]["code"] == "payload_too_large"


@pytest.mark.parametrize("tail", ["files", "archive"])
async def test_a_client_that_goes_away_mid_body_gets_nothing_and_leaves_no_command(tmp_path: Path, tail: str) -> None:
    async with stack(tmp_path) as st, st.client() as c:
        sb = (await c.post("/v1/sandboxes", json={"template": "tiny"})).json()
        app = create_node_app(st.agent, TOKEN)
        path = str(tmp_path / "w" / "f")
        parts = [{"type": "http.request", "body": b"x" * 4096, "more_body": True},
                 {"type": "http.request", "body": b"y" * 4096, "more_body": True}]
        given = 0

        async def receive() -> dict[str, Any]:
            nonlocal given
            given += 1
            if parts:
                return parts.pop(0)
            await anyio.sleep(0.05)
            return {"type": "http.disconnect"}          # the client hung up before the body's end

        sent: list[dict[str, Any]] = []

        async def send(msg: dict[str, Any]) -> None:
            sent.append(msg)

        target = st.agent.get(sb["id"]).target
        headers = [(b"x-access-token", sb["access_token"].encode())]
        with anyio.fail_after(10):       # the command of a write that lost its body is killed: nothing waits
            await app(_scope(f"/v1/sandboxes/{sb['id']}/{tail}", f"path={path}".encode(), headers), receive, send)
        assert sent == [] and given == 3 and not target.active
        # and the sandbox takes the next one
        async with httpx.AsyncClient(transport=st.transport, base_url="http://node") as cl:
            r = await cl.put(f"/v1/sandboxes/{sb['id']}/files", params={"path": path}, content=b"whole",
                             headers={"x-access-token": sb["access_token"]})
            assert r.status_code == 200 and Path(path).read_bytes() == b"whole"


async def test_a_write_whose_body_fails_is_that_failure_not_a_short_file(tmp_path: Path) -> None:
    """``DataPlane.write_file`` with a body that fails mid-way (the client went away, under either route)
    raises that failure and kills its command, rather than answering for the part it got."""
    class Cut(Exception):
        pass

    async def body() -> AsyncIterator[bytes]:
        yield b"part" * 1000
        await anyio.sleep(0.05)
        raise Cut

    async with stack(tmp_path) as st, st.client() as c:
        sb = (await c.post("/v1/sandboxes", json={"template": "tiny"})).json()
        target = st.agent.get(sb["id"]).target
        plane = DataPlane(st.runtime)
        with anyio.fail_after(10), pytest.raises(Cut):
            await plane.write_file(target, str(tmp_path / "cut"), body())
        assert not target.active
        info = await plane.write_file(target, str(tmp_path / "ok"), _one(b"fine"))
        assert info.size == 4


async def _one(data: bytes) -> AsyncIterator[bytes]:
    yield data
