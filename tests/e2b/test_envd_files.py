"""envd's filesystem service and ``/files`` through the stock ``e2b`` client and on the wire."""

from __future__ import annotations

import gzip
import time

import httpx
import pytest

from tests.e2b.envd_fixtures import *

pytestmark = pytest.mark.integration


def test_read_write_list_mkdir_rename_remove(e2b_debug):  # type: ignore[no-untyped-def]
    from e2b import FileType, NotFoundException
    sb = e2b_debug
    info = sb.files.write("/tmp/e2bt/a.txt", "hello")
    assert info.path == "/tmp/e2bt/a.txt" and info.name == "a.txt"
    assert sb.files.read("/tmp/e2bt/a.txt") == "hello"
    assert sb.files.read("/tmp/e2bt/a.txt", format="bytes") == bytearray(b"hello")
    sb.files.write_files([{"path": "/tmp/e2bt/m1", "data": "one"}, {"path": "/tmp/e2bt/sub/m2", "data": b"two"}])
    assert sb.files.read("/tmp/e2bt/sub/m2") == "two"
    names = sorted(e.name for e in sb.files.list("/tmp/e2bt"))
    assert names == ["a.txt", "m1", "sub"]
    deep = sorted(e.path for e in sb.files.list("/tmp/e2bt", depth=2))
    assert deep == ["/tmp/e2bt/a.txt", "/tmp/e2bt/m1", "/tmp/e2bt/sub", "/tmp/e2bt/sub/m2"]
    st = sb.files.get_info("/tmp/e2bt/a.txt")
    assert st.type == FileType.FILE and st.size == 5 and st.permissions.startswith("-rw")
    assert sb.files.get_info("/tmp/e2bt/sub").type == FileType.DIR
    assert sb.files.exists("/tmp/e2bt/m1") and not sb.files.exists("/tmp/e2bt/nope")
    assert sb.files.make_dir("/tmp/e2bt/new/deep") is True
    assert sb.files.make_dir("/tmp/e2bt/new/deep") is False
    moved = sb.files.rename("/tmp/e2bt/m1", "/tmp/e2bt/new/m1-moved")
    assert moved.path == "/tmp/e2bt/new/m1-moved" and sb.files.read("/tmp/e2bt/new/m1-moved") == "one"
    with pytest.raises(NotFoundException):
        sb.files.rename("/tmp/e2bt/m1", "/tmp/e2bt/x")
    sb.files.remove("/tmp/e2bt/new")
    assert not sb.files.exists("/tmp/e2bt/new")
    sb.files.remove("/tmp/e2bt/never-was")                 # rm -rf: not an error
    with pytest.raises(NotFoundException):
        sb.files.read("/tmp/e2bt/missing")
    with pytest.raises(NotFoundException):
        sb.files.list("/tmp/e2bt/missing")
    # relative paths resolve against the default user's home, the sandbox's workdir: commands see the file
    sb.files.write("rel.txt", "home")
    assert sb.commands.run("cat rel.txt; echo; pwd; echo $HOME").stdout == "home\n/root\n/root\n"
    assert sb.files.read("~/rel.txt") == "home"
    sb.files.write("u.txt", "as user", user="user")          # another user: its own home
    assert sb.commands.run("cat /home/user/u.txt").stdout == "as user"
    # binary, larger than one chunk, and a file-like upload (octet-stream)
    blob = bytes(range(256)) * 20_000
    sb.files.write("/tmp/e2bt/blob", blob)
    assert bytes(sb.files.read("/tmp/e2bt/blob", format="bytes")) == blob
    import io
    sb.files.write("/tmp/e2bt/stream", io.BytesIO(b"from a file object"))
    assert sb.files.read("/tmp/e2bt/stream") == "from a file object"


def test_watch_dir(e2b_debug):  # type: ignore[no-untyped-def]
    from e2b import FilesystemEventType
    sb = e2b_debug
    sb.files.make_dir("/tmp/watched")
    handle = sb.files.watch_dir("/tmp/watched")
    sb.files.write("/tmp/watched/f.txt", "x")
    events = []
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not any(e.type == FilesystemEventType.WRITE for e in events):
        time.sleep(0.3)
        events += handle.get_new_events()
    assert any(e.name == "f.txt" and e.type == FilesystemEventType.CREATE for e in events)
    assert any(e.name == "f.txt" and e.type == FilesystemEventType.WRITE for e in events)
    sb.files.remove("/tmp/watched/f.txt")
    time.sleep(0.8)
    assert any(e.name == "f.txt" and e.type == FilesystemEventType.REMOVE for e in handle.get_new_events())
    handle.stop()


@pytest.mark.anyio
async def test_async_watch_dir_stream(envd, monkeypatch):  # type: ignore[no-untyped-def]
    import anyio
    monkeypatch.setenv("E2B_DEBUG", "true")
    monkeypatch.setenv("E2B_SANDBOX_URL", envd.url)
    monkeypatch.setenv("E2B_API_KEY", "e2b_" + "0" * 40)
    from e2b import AsyncSandbox, FilesystemEventType
    sb = await AsyncSandbox.create()
    await sb.files.make_dir("/tmp/awatch")
    got = []
    handle = await sb.files.watch_dir("/tmp/awatch", on_event=got.append, recursive=True)
    await sb.files.write("/tmp/awatch/sub/g.txt", "y")
    with anyio.fail_after(10):
        while not any(e.name == "sub/g.txt" and e.type == FilesystemEventType.CREATE for e in got):
            await anyio.sleep(0.2)
    await handle.stop()


def test_files_http_auth_gzip_signature(envd):  # type: ignore[no-untyped-def]
    from pilldrops.e2b.envd.files import signature
    hdr = envd.rpc_headers()
    with httpx.Client(base_url=envd.url, timeout=30) as c:
        r = c.post("/files", params={"path": "/tmp/h/g.txt"}, content=gzip.compress(b"zipped" * 1000),
                   headers={**hdr, "Content-Type": "application/octet-stream", "Content-Encoding": "gzip"})
        assert r.status_code == 200 and r.json() == [{"name": "g.txt", "type": "file", "path": "/tmp/h/g.txt"}]
        r = c.get("/files", params={"path": "/tmp/h/g.txt"}, headers=hdr)
        assert r.status_code == 200 and r.content == b"zipped" * 1000
        assert r.headers["content-type"] == "application/octet-stream"
        # multipart filenames are full paths (never basenamed)
        files = [("file", ("/tmp/h/p1", b"1")), ("file", ("/tmp/h/deeper/p2", b"2")), ("other", ("x", b"ignored"))]
        r = c.post("/files", files=files, headers=hdr)
        assert r.status_code == 200 and [w["path"] for w in r.json()] == ["/tmp/h/p1", "/tmp/h/deeper/p2"]
        assert c.get("/files", params={"path": "/tmp/h/deeper/p2"}, headers=hdr).content == b"2"
        # errors: missing 404, a directory 400, bad token 401, no token and no signature 401
        assert c.get("/files", params={"path": "/tmp/h/none"}, headers=hdr).status_code == 404
        r = c.get("/files", params={"path": "/tmp/h"}, headers=hdr)
        assert r.status_code == 400 and r.json()["code"] == 400
        assert c.get("/files", params={"path": "/tmp/h/p1"},
                     headers={**hdr, "X-Access-Token": "nope"}).status_code == 401
        bare = {k: v for k, v in hdr.items() if k != "X-Access-Token"}
        assert c.get("/files", params={"path": "/tmp/h/p1"}, headers=bare).status_code == 401
        # signed URLs, as download_url()/upload_url() make them
        sig = signature("/tmp/h/p1", "read", "", envd.token, None)
        assert c.get("/files", params={"path": "/tmp/h/p1", "signature": sig}, headers=bare).content == b"1"
        exp = str(int(time.time()) + 60)
        sig = signature("/tmp/h/up", "write", "", envd.token, exp)
        r = c.post("/files", params={"path": "/tmp/h/up", "signature": sig, "signature_expiration": exp},
                   files=[("file", ("up", b"signed"))], headers=bare)
        assert r.status_code == 200
        old = str(int(time.time()) - 5)
        sig = signature("/tmp/h/up", "read", "", envd.token, old)
        assert c.get("/files", params={"path": "/tmp/h/up", "signature": sig, "signature_expiration": old},
                     headers=bare).status_code == 401
        wrong = signature("/tmp/h/up", "write", "", envd.token, None)       # a write signature cannot read
        assert c.get("/files", params={"path": "/tmp/h/up", "signature": wrong}, headers=bare).status_code == 401


def test_signed_download_url_from_the_client(e2b_debug, envd):  # type: ignore[no-untyped-def]
    """The stock client signs with the sandbox's token when it has one; in debug mode it has none, so the
    URL is unsigned and needs the header (what envd enforces)."""
    sb = e2b_debug
    sb.files.write("/tmp/dl.txt", "dl")
    url = sb.download_url("/tmp/dl.txt")
    assert httpx.get(url, headers=envd.rpc_headers()).content == b"dl"
    assert httpx.get(url).status_code == 401
