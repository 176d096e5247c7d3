"""Template layers as content-addressed artifacts on a node: packing a built layer into a tar blob (its
digest is the sha256 of those bytes), and fetching one from the control plane's template store into a
local cache, verified before use.

Everything fetched is input to check: the download is bounded by the size the control plane recorded, its
sha256 must equal the digest asked for (else it is deleted and refused: a corrupted or substituted layer
never runs), and every tar member is checked before the system tar unpacks it: no absolute path, no
``..``, no link leaving the layer, no device but overlay whiteouts (char 0/0), no fifo. Layers keep their
overlay xattrs (opaque dirs), so a layer unpacked here stacks exactly as on the node that built it.

Cache layout: ``<root>/<hex>/layer`` (the unpacked layer) and ``<root>/<hex>/.complete`` (written last: a
crash mid-unpack leaves no layer that looks usable).
"""

from __future__ import annotations

import hashlib
import logging
import os
import posixpath
import shutil
import subprocess
import tarfile
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from pathlib import Path

import anyio

from pilldrops import errors

log = logging.getLogger("pilldrops.layers")
TAR = ["tar", "--numeric-owner", "--xattrs", "--xattrs-include=trusted.overlay.*", "--xattrs-include=user.*",
       "--xattrs-include=security.capability"]
MAX_MEMBERS = 2_000_000
CHUNK = 1 << 20
DIGEST_PREFIX = "sha256:"

Fetch = Callable[[str], Awaitable[AsyncIterator[bytes]]]     # digest -> the blob's bytes


def hex_of(digest: str) -> str:
    """``sha256:<64 hex>`` -> the hex; anything else is refused (digests name files)."""
    if not digest.startswith(DIGEST_PREFIX):
        raise errors.InvalidRequest(f"not a sha256 digest: {digest[:80]!r}")
    h = digest[len(DIGEST_PREFIX):]
    if len(h) != 64 or any(c not in "0123456789abcdef" for c in h):
        raise errors.InvalidRequest(f"not a sha256 digest: {digest[:80]!r}")
    return h


def pack_layer(layer: Path, out: Path) -> tuple[str, int]:
    """Tar a built layer (sorted names, numeric owners, overlay xattrs) into ``out``; its digest and size."""
    with open(out, "wb") as f:
        proc = subprocess.run([*TAR, "--sort=name", "-c", "-f", "-", "-C", str(layer), "."], stdout=f,
                              stderr=subprocess.PIPE, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"packing layer {layer} failed: {proc.stderr.decode(errors='replace')[-300:]}")
    return file_digest(out), out.stat().st_size


def file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
    return DIGEST_PREFIX + h.hexdigest()


def check_members(blob: Path) -> int:
    """Refuse a layer tar with a member that could reach outside the layer or make a device."""
    count = 0
    links: set[str] = set()        # symlinks seen so far: nothing may be unpacked through one
    try:
        with tarfile.open(blob, mode="r:") as tar:
            for m in tar:
                count += 1
                if count > MAX_MEMBERS:
                    raise errors.PayloadTooLarge(f"layer has more than {MAX_MEMBERS} members")
                name = m.name
                if name.startswith("/") or ".." in name.split("/"):
                    raise errors.InvalidRequest(f"layer member {name!r} escapes the layer")
                name = posixpath.normpath(name)
                parts = name.split("/")
                if any("/".join(parts[:i]) in links for i in range(1, len(parts))):
                    raise errors.InvalidRequest(f"layer member {name!r} lies under a symlink")
                if m.issym():
                    links.add(name)
                if m.issym() or m.islnk():
                    target = m.linkname
                    if m.islnk():
                        if target.startswith("/") or ".." in target.split("/"):
                            raise errors.InvalidRequest(f"hard link {name!r} -> {target!r} leaves the layer")
                    elif not target.startswith("/"):   # absolute symlinks resolve inside the sandbox's root
                        resolved = posixpath.normpath(posixpath.join(posixpath.dirname(name), target))
                        if resolved == ".." or resolved.startswith("../"):
                            raise errors.InvalidRequest(f"symlink {name!r} -> {target!r} leaves the layer")
                elif m.ischr():
                    if (m.devmajor, m.devminor) != (0, 0):      # only overlay whiteouts
                        raise errors.InvalidRequest(f"layer member {name!r} is a device")
                elif not (m.isfile() or m.isdir()):
                    raise errors.InvalidRequest(f"layer member {name!r} is a fifo, block device or other "
                                                "special file")
    except tarfile.TarError as exc:
        raise errors.InvalidRequest(f"layer is not a valid tar: {exc}") from exc
    return count


class LayerCache:
    """Unpacked layers by digest under ``root``. ``ensure`` fetches what is missing (one fetch per digest
    at a time), ``gc`` drops what nothing uses."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self._locks: dict[str, anyio.Lock] = {}
        self._recent: dict[str, float] = {}      # digest -> when it was last ensured (kept from gc a while)

    def path(self, digest: str) -> Path:
        return self.root / hex_of(digest) / "layer"

    def has(self, digest: str) -> bool:
        return (self.root / hex_of(digest) / ".complete").exists()

    def digests(self) -> list[str]:
        try:
            return [DIGEST_PREFIX + d.name for d in self.root.iterdir() if (d / ".complete").exists()]
        except OSError:
            return []

    def adopt(self, digest: str, layer: Path) -> Path:
        """A layer built on this node (already verified: we packed it) moves into the cache."""
        final = self.root / hex_of(digest)
        if (final / ".complete").exists():
            return final / "layer"
        final.mkdir(parents=True, exist_ok=True)
        if (final / "layer").exists():
            shutil.rmtree(final / "layer")
        os.rename(layer, final / "layer")
        (final / ".complete").write_text(digest + "\n")
        self._recent[digest] = time.monotonic()
        return final / "layer"

    async def ensure(self, digest: str, size: int, fetch: Fetch) -> Path:
        hex_of(digest)
        self._recent[digest] = time.monotonic()
        if self.has(digest):
            return self.path(digest)
        lock = self._locks.setdefault(digest, anyio.Lock())
        async with lock:
            if not self.has(digest):
                await self._fetch(digest, size, fetch)
        self._recent[digest] = time.monotonic()
        return self.path(digest)

    async def _fetch(self, digest: str, size: int, fetch: Fetch) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = self.root / f".tmp-{hex_of(digest)[:16]}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        blob = tmp / "blob.tar"
        try:
            h, got = hashlib.sha256(), 0
            async with await anyio.open_file(blob, "wb") as f:
                async for chunk in await fetch(digest):
                    got += len(chunk)
                    if got > size:
                        raise errors.InvalidRequest(f"layer {digest} is larger than the {size} bytes the "
                                                    "template store recorded; refused")
                    h.update(chunk)
                    await f.write(chunk)
            actual = DIGEST_PREFIX + h.hexdigest()
            if actual != digest:
                raise errors.InvalidRequest(f"layer {digest} failed verification: its content hashes to "
                                            f"{actual}; refused (corrupted or substituted in the template "
                                            "store)", details={"digest": digest, "actual": actual})
            await anyio.to_thread.run_sync(check_members, blob)
            (tmp / "layer").mkdir()
            proc = await anyio.run_process([*TAR, "-x", "-p", "-f", str(blob), "-C", str(tmp / "layer")],
                                           check=False)
            if proc.returncode != 0:
                raise errors.ServerError(f"unpacking layer {digest} failed: "
                                         f"{proc.stderr.decode(errors='replace')[-300:]}")
            blob.unlink()
            final = self.root / hex_of(digest)
            if final.exists():
                shutil.rmtree(final)
            os.rename(tmp, final)
            (final / ".complete").write_text(digest + "\n")
            log.info("fetched layer %s (%d bytes)", digest, got)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)

    def gc(self, keep: Iterable[str], grace_s: float = 120.0) -> list[str]:
        """Drop cached layers not in ``keep`` (and not ensured in the last ``grace_s``); returns them."""
        keep_set = set(keep)
        now = time.monotonic()
        dropped = []
        for digest in self.digests():
            if digest in keep_set or now - self._recent.get(digest, -1e18) < grace_s:
                continue
            shutil.rmtree(self.root / hex_of(digest), ignore_errors=True)
            dropped.append(digest)
        return dropped
