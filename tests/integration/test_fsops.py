"""The data plane's filesystem operations (node/fsops.py) on real crun with the busybox `tiny` template (the
Debian `base` one is covered through envd in tests/e2b): stat, listings to a depth, symlinks, mkdir, move,
remove, and names the listing format must survive."""

from __future__ import annotations

import pytest

from pilldrops import errors
from pilldrops.node.dataplane import DataPlane, Target
from pilldrops.node.fsops import FileOps, parse_entries
from pilldrops.node.runtime.base import SandboxSpec

pytestmark = [pytest.mark.integration, pytest.mark.anyio]


def test_parse_entries_bounds_and_odd_names() -> None:
    out = (b"regular file|3|644|10|root|root|-rw-r--r--|/d/a|b\n"
           b"symbolic link|4|777|11|root|root|lrwxrwxrwx|/d/l\n"
           b"L\x1f/d/l\x1f/target|x\n"
           b"garbage line\n"
           b"directory|4096|755|12|root|root|drwxr-xr-x|/d//sub/\n")
    entries, truncated = parse_entries(out)
    assert [(e.path, e.type) for e in entries] == [("/d/a|b", "file"), ("/d/l", "symlink"), ("/d/sub", "dir")]
    assert entries[0].name == "a|b" and entries[1].symlink_target == "/target|x" and not truncated
    assert parse_entries(out, limit=1) == (entries[:1], True)


async def test_fsops_on_busybox(runtime, tiny, monkeypatch):  # type: ignore[no-untyped-def]
    monkeypatch.setenv("PILLDROPS_EXEC", "supervisor")
    h = await runtime.create(SandboxSpec(id="fsops", layers=tiny.layers, workdir=tiny.workdir))
    try:
        t = Target(id="fsops", handle=h, workdir=tiny.workdir)
        plane = DataPlane(runtime)
        ops = FileOps(plane)
        await plane._sh(t, 'mkdir -p /w/a/b/c && echo hi > /w/a/f && ln -s /w/a/f /w/link && '
                           'printf x > "/w/odd|name"')
        st = await ops.stat(t, "/w/a/f")
        assert (st.type, st.size, st.owner, st.permissions) == ("file", 3, "root", "-rw-r--r--")
        assert (await ops.stat(t, "/w/link")).symlink_target == "/w/a/f"
        one = await ops.list(t, "/w", 1)
        assert sorted(e.name for e in one.items) == ["a", "link", "odd|name"]
        deep = await ops.list(t, "/w", 3)
        assert sorted(e.path for e in deep.items) == ["/w/a", "/w/a/b", "/w/a/b/c", "/w/a/f", "/w/link",
                                                       "/w/odd|name"]
        assert all(e.path != "/w/a/b/c" for e in (await ops.list(t, "/w/", 2)).items)
        with pytest.raises(errors.FileNotFound):
            await ops.list(t, "/nope")
        with pytest.raises(errors.InvalidRequest):
            await ops.list(t, "/w/a/f")
        made, created = await ops.mkdir(t, "/w/new/deep")
        assert created and made is not None and made.type == "dir"
        assert await ops.mkdir(t, "/w/new/deep") == (None, False)
        with pytest.raises(errors.InvalidRequest):
            await ops.mkdir(t, "/w/a/f")
        moved = await ops.move(t, "/w/a/f", "/w/elsewhere/g")
        assert moved.path == "/w/elsewhere/g" and moved.size == 3
        with pytest.raises(errors.FileNotFound):
            await ops.move(t, "/w/a/f", "/w/x")
        await ops.remove(t, "/w/a")
        await ops.remove(t, "/w/never")
        with pytest.raises(errors.FileNotFound):
            await ops.stat(t, "/w/a")
        with pytest.raises(errors.InvalidRequest):
            await ops.remove(t, "/")
    finally:
        await runtime.destroy(h)
