"""Upload sanitising: what may never reach a sandbox's tar, and what is neutralised."""

from __future__ import annotations

import io
import tarfile

import pytest

from pilldrops.errors import InvalidRequest
from pilldrops.node.archive import sanitize


def make_tar(*members: tuple[tarfile.TarInfo, bytes | None]) -> io.BytesIO:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        for info, data in members:
            if data is not None:
                info.size = len(data)
                tf.addfile(info, io.BytesIO(data))
            else:
                tf.addfile(info)
    buf.seek(0)
    return buf


def info(name: str, kind: bytes = tarfile.REGTYPE, link: str = "", mode: int = 0o644) -> tarfile.TarInfo:
    ti = tarfile.TarInfo(name)
    ti.type, ti.linkname, ti.mode = kind, link, mode
    return ti


def clean(src: io.BytesIO) -> list[tarfile.TarInfo]:
    out = io.BytesIO()
    sanitize(src, out)
    out.seek(0)
    with tarfile.open(fileobj=out) as tf:
        return tf.getmembers()


def test_plain_tree_passes_with_ownership_reset_and_setuid_stripped() -> None:
    members = clean(make_tar((info("d", tarfile.DIRTYPE, mode=0o755), None), (info("d/f", mode=0o4755), b"x"),
                             (info("d/link", tarfile.SYMTYPE, "f"), None), (info("d/hard", tarfile.LNKTYPE, "d/f"), None)))
    assert [m.name for m in members] == ["d", "d/f", "d/link", "d/hard"]
    assert members[1].mode == 0o755 and all(m.uid == 0 and m.gid == 0 for m in members)


@pytest.mark.parametrize("bad", [
    (info("/etc/passwd"), b"x"),
    (info("../escape"), b"x"),
    (info("a/../../escape"), b"x"),
    (info("a/../b"), b"x"),
    (info("up", tarfile.SYMTYPE, "../../etc"), None),
    (info("abs", tarfile.SYMTYPE, "/etc/shadow"), None),
    (info("d/deep", tarfile.SYMTYPE, "../../x"), None),
    (info("hard", tarfile.LNKTYPE, "/etc/passwd"), None),
    (info("hard2", tarfile.LNKTYPE, "../x"), None),
    (info("dev", tarfile.CHRTYPE), None),
    (info("blk", tarfile.BLKTYPE), None),
    (info("fifo", tarfile.FIFOTYPE), None),
])
def test_refused(bad: tuple[tarfile.TarInfo, bytes | None]) -> None:
    with pytest.raises(InvalidRequest) as ei:
        clean(make_tar(bad))
    assert bad[0].name in str(ei.value)


def test_not_a_tar_is_a_clear_400() -> None:
    with pytest.raises(InvalidRequest, match="not a valid tar"):
        clean(io.BytesIO(b"this is not a tar file at all" * 40))


def test_symlink_inside_upload_dir_is_fine() -> None:
    members = clean(make_tar((info("a/b/c", tarfile.SYMTYPE, "../x"), None)))
    assert members[0].linkname == "../x"
