"""The template store (issue 19) without nodes: placement of a store template (every node can fetch it,
holders first), versions and their garbage collection on both stores, blobs refused unless their bytes
hash to their digest, and the build cache key."""

from __future__ import annotations

import hashlib
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from pathlib import Path
from types import SimpleNamespace

import pytest

from pilldrops import errors
from pilldrops._internal.clock import Clock
from pilldrops.schema.node import NodeLayerRef, NodeTemplateRef
from pilldrops.schema.templates import build_key
from pilldrops.server.artifacts import BlobStore
from pilldrops.server.scheduler import Request
from pilldrops.server.service import placement
from pilldrops.server.service.templates import TemplateService
from pilldrops.server.store.sql import Store

NOW = datetime(2026, 1, 1, tzinfo=UTC)
D1, D2 = "sha256:" + "1" * 64, "sha256:" + "2" * 64


def node(nid: str, templates: list[dict[str, object]]) -> SimpleNamespace:
    return SimpleNamespace(id=nid, name=nid, url=f"http://{nid}", capacity_vcpu=4, capacity_memory_mb=4096,
                           state="ready", draining=False, templates=templates, last_heartbeat_at=NOW,
                           pool_status=[])


REF = NodeTemplateRef(name="tiny", version=2, key="k", layers=[NodeLayerRef(digest=D1, size=10)])


def test_a_store_template_places_on_any_node_and_prefers_holders() -> None:
    nodes = [node("a", []), node("b", [{"name": "tiny", "version": 2}]), node("c", [{"name": "tiny", "version": 1}])]
    with pytest.raises(errors.TemplateNotFound):       # not in the store and built nowhere: the old error
        placement.for_create(Request("other", 1, 512), nodes, {}, [], NOW)
    assert placement.for_create(Request("tiny", 1, 512), nodes, {}, [], NOW, REF).id == "b"
    # b is full: a node without it (which fetches) rather than none; an older version does not count
    assert placement.for_create(Request("tiny", 4, 512), nodes, {"b": (1.0, 0)}, [], NOW, REF).id in ("a", "c")
    assert placement.holders(REF, nodes) == {"b"}


def test_build_key_names_what_went_in() -> None:
    spec = {"name": "x", "from": "tiny", "steps": [{"run": "true"}], "description": "d"}
    k = build_key(spec, "p", None)
    assert k == build_key({**spec, "description": "other", "isolation": None}, "p", None)   # metadata only
    assert k != build_key(spec, "q", None) != build_key(spec, "p", D1)
    assert k != build_key({**spec, "steps": [{"run": "false"}]}, "p", None)


async def _body(data: bytes) -> AsyncIterator[bytes]:
    yield data[:3]
    yield data[3:]


@pytest.mark.anyio
async def test_blobs_are_kept_only_under_their_own_digest(tmp_path: Path) -> None:
    blobs = BlobStore(tmp_path)
    data = b"layer bytes"
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    with pytest.raises(errors.InvalidRequest, match="hashes to"):
        await blobs.put("layers", D1, _body(data), 1 << 20)
    with pytest.raises(errors.PayloadTooLarge):
        await blobs.put("layers", digest, _body(data), 4)
    assert blobs.digests("layers") == [] and not any((tmp_path / "layers").iterdir())
    assert await blobs.put("layers", digest, _body(data), 1 << 20) == len(data)
    assert b"".join([c async for c in await blobs.read("layers", digest)]) == data
    with pytest.raises(errors.InvalidRequest):
        blobs.path("layers", "sha256:../../etc/passwd")


@pytest.mark.anyio
async def test_versions_and_gc(store_url: str, tmp_path: Path) -> None:
    store = await Store.open(store_url)
    try:
        blobs = BlobStore(tmp_path / "blobs")
        for d in (D1, D2):
            (tmp_path / "blobs" / "layers").mkdir(parents=True, exist_ok=True)
            (tmp_path / "blobs" / "layers" / d[7:]).write_bytes(b"x")
        svc = TemplateService(store, blobs, SimpleNamespace(), Clock())    # type: ignore[arg-type]
        common = {"env": {}, "workdir": "/", "size_bytes": 1, "description": "", "isolation": None, "parent": None,
                      "builder": "n", "build_seconds": 0.1, "built_at": NOW}
        v1 = await store.add_template_version(name="tiny", key="k1", layers=[{"digest": D1, "size": 1}], **common)
        v2 = await store.add_template_version(name="tiny", key="k2", layers=[{"digest": D2, "size": 1}], **common)
        assert (v1.version, v2.version) == (1, 2)
        assert (await svc.current("tiny")).version == 2                 # type: ignore[union-attr]
        assert (await svc.version("tiny", 1)).layers[0].digest == D1    # type: ignore[union-attr]
        # v1 is still run by a sandbox that has not ended: kept, with its layer
        team = await store.create_team("t", NOW)
        from pilldrops.server.store.interface import NewSandbox
        new = NewSandbox(id="sb_1", team_id=team.id, template="tiny", vcpu=1, memory_mb=128, timeout=60,
                         state="running", access_token="x", created_at=NOW, end_at=NOW, template_version=1)
        await store.upsert_node(name="n", url="http://n", capacity_vcpu=4, capacity_memory_mb=4096, templates=[],
                                now=NOW)
        await store.place_and_insert(new, lambda nodes, allocs: nodes[0])
        assert await svc.gc(min_age_s=0) == ([], [])
        await store.update_sandbox("sb_1", state="stopped", ended_at=NOW)
        assert await svc.gc(min_age_s=0) == ([("tiny", 1)], [D1])
        assert [r.version for r in await store.template_versions("tiny")] == [2]
        assert blobs.digests("layers") == [D2]
    finally:
        await store.close()


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def test_a_spec_document_keeps_the_templates_defaults(tmp_path: Path) -> None:
    """Reviewer finding 2 (the client's half): what a remote build sends carries disk_mb and [network]."""
    from pilldrops.node.templates import parse_spec, spec_document, spec_from_dict
    f = tmp_path / "web.toml"
    f.write_text('name = "web"\nfrom = "tiny"\ndisk_mb = 2048\n[network]\nallow_internet_access = true\n'
                 'deny_out = ["10.0.0.0/8"]\n')
    spec = parse_spec(f)
    doc = spec_document(spec)
    back = spec_from_dict(doc, f)
    assert (back.disk_mb, back.network) == (2048, spec.network) and spec.network["deny_out"] == ["10.0.0.0/8"]


@pytest.mark.anyio
async def test_a_store_template_keeps_its_disk_and_network_defaults(tmp_path: Path) -> None:
    """Reviewer finding 2 (the store's half): a built version records the spec's disk_mb and [network]; a
    create of it that names neither gets them (and ``template list`` shows them)."""
    import io
    import tarfile

    from tests.stack import stack
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        info = tarfile.TarInfo("etc")
        info.type = tarfile.DIRTYPE
        tar.addfile(info)
    blob = buf.getvalue()
    digest = "sha256:" + hashlib.sha256(blob).hexdigest()
    async with stack(tmp_path, template_store=tmp_path / "tstore") as s, s.client() as c:
        svc = s.cp.services.templates
        await svc.put_layer(digest, _body(blob))
        spec = {"name": "web", "from": "tiny", "steps": [], "disk_mb": 2048,
                "network": {"allow_internet_access": False, "allow_out": [], "deny_out": ["10.0.0.0/8"]}}
        row = await svc._record("web", spec, None, build_key(spec, None, None), SimpleNamespace(name="node-a"),
                                {"layer": {"digest": digest, "size": len(blob)}})
        ref = await svc.current("web")
        assert (ref.disk_mb, ref.network.deny_out) == (2048, ["10.0.0.0/8"]), row
        r = await c.post("/v1/sandboxes", json={"template": "web"})
        assert r.status_code == 201, r.text
        body = r.json()
        assert body["disk_mb"] == 2048 and body["network"] == {"allow_out": [], "deny_out": ["10.0.0.0/8"]}
        listed = {t["name"]: t for t in (await c.get("/v1/templates")).json()["items"]}
        assert listed["web"]["disk_mb"] == 2048 and listed["web"]["network"]["deny_out"] == ["10.0.0.0/8"]
