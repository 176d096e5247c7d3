"""Layers fetched from the template store are verified before use (issue 19): the digest of their bytes,
their size, and every tar member (no path out of the layer, no device but an overlay whiteout)."""

from __future__ import annotations

import io
import tarfile
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from pilldrops import errors
from pilldrops.node.layers import LayerCache, check_members, file_digest, pack_layer


def _tar(path: Path, members: list[tarfile.TarInfo]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as t:
        for m in members:
            t.addfile(m, io.BytesIO(b"x" * m.size) if m.isfile() else None)
    path.write_bytes(buf.getvalue())
    return buf.getvalue()


def _member(name: str, kind: bytes = tarfile.REGTYPE, link: str = "", size: int = 0) -> tarfile.TarInfo:
    m = tarfile.TarInfo(name)
    m.type, m.linkname, m.size = kind, link, size
    return m


@pytest.mark.parametrize("members,why", [
    ([_member("../etc/passwd", size=1)], "escapes"),
    ([_member("/etc/passwd", size=1)], "escapes"),
    ([_member("a", tarfile.SYMTYPE, "/etc"), _member("a/passwd", size=1)], "under a symlink"),
    ([_member("x", tarfile.SYMTYPE, "../../etc")], "leaves the layer"),
    ([_member("h", tarfile.LNKTYPE, "../x")], "leaves the layer"),
    ([_member("dev/sda", tarfile.BLKTYPE)], "special file"),
    ([_member("fifo", tarfile.FIFOTYPE)], "special file"),
])
def test_unsafe_members_are_refused(tmp_path: Path, members: list[tarfile.TarInfo], why: str) -> None:
    _tar(tmp_path / "l.tar", members)
    with pytest.raises(errors.InvalidRequest, match=why):
        check_members(tmp_path / "l.tar")


def test_whiteouts_and_inner_links_pass(tmp_path: Path) -> None:
    wh = _member("etc/gone", tarfile.CHRTYPE)
    wh.devmajor = wh.devminor = 0
    _tar(tmp_path / "l.tar", [_member("etc", tarfile.DIRTYPE), wh, _member("bin/sh", tarfile.SYMTYPE, "busybox"),
                              _member("abs", tarfile.SYMTYPE, "/bin/busybox")])
    assert check_members(tmp_path / "l.tar") == 4


def _fetcher(data: bytes) -> object:
    async def fetch(digest: str) -> AsyncIterator[bytes]:
        async def chunks() -> AsyncIterator[bytes]:
            for i in range(0, len(data), 7):
                yield data[i:i + 7]
        return chunks()
    return fetch


@pytest.mark.anyio
async def test_fetch_verifies_the_digest_and_size(tmp_path: Path) -> None:
    layer = tmp_path / "built"
    (layer / "bin").mkdir(parents=True)
    (layer / "bin" / "hello").write_text("hi\n")
    digest, size = pack_layer(layer, tmp_path / "blob.tar")
    data = (tmp_path / "blob.tar").read_bytes()
    cache = LayerCache(tmp_path / "cache")
    bad = bytearray(data)
    bad[100] ^= 0xFF
    with pytest.raises(errors.InvalidRequest, match="failed verification"):
        await cache.ensure(digest, size, _fetcher(bytes(bad)))       # type: ignore[arg-type]
    with pytest.raises(errors.InvalidRequest, match="larger than"):
        await cache.ensure(digest, size - 1, _fetcher(data))           # type: ignore[arg-type]
    assert not cache.has(digest) and [p.name for p in (tmp_path / "cache").iterdir()] == []
    path = await cache.ensure(digest, size, _fetcher(data))           # type: ignore[arg-type]
    assert (path / "bin" / "hello").read_text() == "hi\n" and cache.has(digest)
    assert file_digest(tmp_path / "blob.tar") == digest
    assert cache.gc([digest], grace_s=0) == [] and cache.gc([], grace_s=0) == [digest]
    assert not cache.has(digest)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.mark.anyio
async def test_versions_are_remembered_and_unused_ones_collected(tmp_path: Path) -> None:
    from types import SimpleNamespace

    from pilldrops.node.template_cache import TemplateCache
    from pilldrops.schema.node import NodeLayerRef, NodeSandboxSpec, NodeTemplateRef
    blobs = {}
    for i in (1, 2):
        layer = tmp_path / f"built{i}"
        layer.mkdir()
        (layer / "v").write_text(str(i))
        digest, _size = pack_layer(layer, tmp_path / f"b{i}.tar")
        blobs[digest] = (tmp_path / f"b{i}.tar").read_bytes()
    (d1, d2) = list(blobs)

    async def fetch(digest: str) -> AsyncIterator[bytes]:
        async def one() -> AsyncIterator[bytes]:
            yield blobs[digest]
        return one()

    local = SimpleNamespace(list=list, get=lambda name: (_ for _ in ()).throw(KeyError(name)))
    refs = [NodeTemplateRef(name="t", version=v, key=f"k{v}", layers=[NodeLayerRef(digest=d, size=len(blobs[d]))],
                            env={"V": str(v)}) for v, d in ((1, d1), (2, d2))]
    cache = TemplateCache(local, "n", LayerCache(tmp_path / "layers"), fetch=fetch)
    for ref in refs:
        await cache.ensure(ref)
    spec = NodeSandboxSpec(id="sb_1", template="t", vcpu=1, memory_mb=64, end_at="2026-01-01T00:00:00Z",
                           access_token="x", template_ref=refs[0])
    assert cache.runtime_spec(spec).envs["V"] == "1"            # a sandbox of v1 stands on v1's layer
    assert [(i.name, i.version) for i in cache.refresh()] == [("t", 2)]
    again = TemplateCache(local, "n", LayerCache(tmp_path / "layers"), fetch=fetch)   # a restarted agent
    assert again.holds(refs[0]) and again.latest_refs()["t"].version == 2
    again.layers._recent.clear()                                   # past the grace period   # type: ignore[union-attr]
    assert again.gc([refs[0]]) == []                               # v1 still used by a sandbox
    assert again.gc([]) == [d1] and not again.holds(refs[0]) and again.holds(refs[1])
