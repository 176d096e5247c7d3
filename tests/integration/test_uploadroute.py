"""The raw file-write and archive-upload route (``node/uploadroute.py``) on real crun, where the streaming
matters: a body of many parts reaches the sandbox's file whole, an archive is unpacked, and a client that
goes away mid-body leaves no command waiting for the rest of its stdin (through pd-init's socket, which
never closes a command's stdin on its own, and through ``crun exec``)."""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
from typing import Any

import anyio
import pytest

from pilldrops.node.dataplane import DataPlane, Target
from pilldrops.node.runtime.base import SandboxSpec
from pilldrops.node.uploadroute import UploadRoute

pytestmark = [pytest.mark.integration, pytest.mark.anyio]

TOKEN = "tok-upload"
PART = 64 * 1024


class _Call:
    """One request straight to the route (what uvicorn would call), its body given part by part."""

    def __init__(self, route: UploadRoute, sid: str, tail: str, path: str, parts: list[bytes],
                 hang_up_after: int | None = None) -> None:
        self.route, self.parts, self.hang_up_after = route, parts, hang_up_after
        self.scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "PUT",
                      "scheme": "http", "path": f"/v1/sandboxes/{sid}/{tail}", "raw_path": b"", "root_path": "",
                      "query_string": f"path={path}".encode(), "server": ("node", 80), "client": ("c", 1),
                      "headers": [(b"host", b"node"), (b"x-access-token", TOKEN.encode())]}
        self.given = 0
        self.sent: list[dict[str, Any]] = []

    async def receive(self) -> dict[str, Any]:
        if self.hang_up_after is not None and self.given >= self.hang_up_after:
            await anyio.sleep(0.1)
            return {"type": "http.disconnect"}
        self.given += 1
        return {"type": "http.request", "body": self.parts[self.given - 1], "more_body": self.given < len(self.parts)}

    async def send(self, msg: dict[str, Any]) -> None:
        self.sent.append(msg)

    async def __call__(self) -> tuple[int | None, Any]:
        with anyio.fail_after(60):
            await self.route(self.scope, self.receive, self.send)
        if not self.sent:
            return None, None
        return self.sent[0]["status"], json.loads(self.sent[1]["body"])


async def _elsewhere(scope: Any, receive: Any, send: Any) -> None:
    raise AssertionError(f"{scope['path']} should have been answered by the route")


async def _admit(_: Any) -> None:
    return None


@pytest.mark.parametrize("mode", ["supervisor", "crun"])
async def test_streamed_writes_and_uploads_on_crun(runtime, tiny, monkeypatch, mode: str) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("PILLDROPS_EXEC", mode)
    h = await runtime.create(SandboxSpec(id=f"upr-{mode}", layers=tiny.layers, workdir=tiny.workdir))
    try:
        t = Target(id=h.id, handle=h, workdir=tiny.workdir)
        plane = DataPlane(runtime)

        def target(sid: str, token: str | None) -> Target:
            assert sid == h.id and token == TOKEN
            return t

        route = UploadRoute(_elsewhere, plane=plane, target=target, admit=_admit)
        # 24 MiB in 384 parts of 64 KiB, each part its own: the file holds them all, in order
        parts = [bytes([i % 251]) * PART for i in range(384)]
        call = _Call(route, h.id, "files", "/root/big/f.bin", parts)
        status, info = await call()
        assert status == 200 and call.given == len(parts), info
        assert (info["path"], info["type"], info["size"]) == ("/root/big/f.bin", "file", 384 * PART)
        out, _, code = await plane._sh(t, 'sha256sum "$1"', "/root/big/f.bin")
        assert code == 0 and out.split()[0].decode() == hashlib.sha256(b"".join(parts)).hexdigest()
        # archives in parts that cut their headers anywhere: a small one (its tar gets it as bytes) and one
        # past dataplane._WHOLE (streamed to its tar)
        for big in (2000, 9000):
            buf = io.BytesIO()
            with tarfile.open(fileobj=buf, mode="w") as tf:
                for name, data in (("env/a.txt", b"alpha"), ("env/sub/b.bin", bytes(range(256)) * big)):
                    ti = tarfile.TarInfo(name)
                    ti.size = len(data)
                    tf.addfile(ti, io.BytesIO(data))
            tar = buf.getvalue()
            call = _Call(route, h.id, "archive", f"/root/up{big}", [tar[i:i + 1000] for i in range(0, len(tar), 1000)])
            assert await call() == (200, {"entries": 2})
            assert await plane.read_file(t, f"/root/up{big}/env/sub/b.bin") == bytes(range(256)) * big
        # the client goes away mid-body: nothing is answered, the write's command is killed (it would wait
        # for the rest of its stdin for ever), the archive's is never started; the sandbox takes the next
        for tail, after in (("files", 3), ("files", 1), ("archive", 3)):    # 1: before its command started
            call = _Call(route, h.id, tail, f"/root/cut-{tail}", parts, hang_up_after=after)
            assert await call() == (None, None) and call.given == after
            assert not t.active
        assert await plane.read_file(t, "/root/big/f.bin") == b"".join(parts)
        for data in (b"whole", b""):
            status, info = await _Call(route, h.id, "files", "/root/after", [data])()
            assert status == 200 and info == {"name": "after", "path": "/root/after", "type": "file",
                                              "size": len(data), **await _stat(plane, t, "/root/after")}
            assert await plane.read_file(t, "/root/after") == data
    finally:
        await runtime.destroy(h)


async def _stat(plane: DataPlane, t: Target, path: str) -> dict[str, Any]:
    """The mode and mtime the write's own stat reports (the answer's other fields are checked as given)."""
    out, _, code = await plane._sh(t, 'stat -c "%a|%Y" "$1"', path)
    assert code == 0
    mode, mtime = out.decode().strip().split("|")
    return {"mode": int(mode, 8), "mtime": float(mtime)}
