"""The template store's blobs: content-addressed template layers and build contexts in a directory the
deployment configures (``serve --template-store DIR``; default ``<data dir>/template-store``). Several
control-plane processes of one fleet must name the same directory (a shared filesystem); the rows that say
which layers make which template version are in the database.

Layout: ``<root>/layers/<hex>`` and ``<root>/contexts/<hex>``, where ``sha256:<hex>`` is the digest of the
file's bytes. A blob is written to a temp file while it is hashed, and renamed into place only when its
digest is the one claimed and its size within the bound, so a reader never sees half a blob and a wrong
one never lands.
"""

from __future__ import annotations

import hashlib
import os
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import anyio

from pilldrops import errors

KINDS = ("layers", "contexts")
CHUNK = 1 << 20


def hex_of(digest: str) -> str:
    if not digest.startswith("sha256:"):
        raise errors.InvalidRequest(f"not a sha256 digest: {digest[:80]!r}")
    h = digest[7:]
    if len(h) != 64 or any(c not in "0123456789abcdef" for c in h):
        raise errors.InvalidRequest(f"not a sha256 digest: {digest[:80]!r}")
    return h


class BlobStore:
    def __init__(self, root: Path) -> None:
        self.root = Path(root)

    def path(self, kind: str, digest: str) -> Path:
        assert kind in KINDS
        return self.root / kind / hex_of(digest)

    def has(self, kind: str, digest: str) -> bool:
        return self.path(kind, digest).is_file()

    def size(self, kind: str, digest: str) -> int:
        return self.path(kind, digest).stat().st_size

    def digests(self, kind: str) -> list[str]:
        try:
            return ["sha256:" + p.name for p in (self.root / kind).iterdir() if len(p.name) == 64]
        except OSError:
            return []

    def delete(self, kind: str, digest: str) -> None:
        self.path(kind, digest).unlink(missing_ok=True)

    async def put(self, kind: str, digest: str, body: AsyncIterator[bytes], max_bytes: int) -> int:
        """Store ``body`` as ``digest``: refused (nothing kept) when larger than ``max_bytes`` or when its
        bytes hash to anything else. Returns the size. Storing a digest already held is a no-op."""
        final = self.path(kind, digest)
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = final.parent / f".tmp-{uuid.uuid4().hex}"
        h, size = hashlib.sha256(), 0
        try:
            async with await anyio.open_file(tmp, "wb") as f:
                async for chunk in body:
                    size += len(chunk)
                    if size > max_bytes:
                        raise errors.PayloadTooLarge(f"{kind[:-1]} is larger than {max_bytes} bytes",
                                                     details={"max_bytes": max_bytes})
                    h.update(chunk)
                    await f.write(chunk)
            actual = "sha256:" + h.hexdigest()
            if actual != digest:
                raise errors.InvalidRequest(f"{kind[:-1]} content hashes to {actual}, not {digest}",
                                            details={"digest": digest, "actual": actual})
            os.replace(tmp, final)
            return size
        finally:
            tmp.unlink(missing_ok=True)

    async def read(self, kind: str, digest: str) -> AsyncIterator[bytes]:
        """The blob's bytes as served (never re-verified here: the fetching node verifies the digest)."""
        path = self.path(kind, digest)
        if not path.is_file():
            raise errors.NotFound(f"no {kind[:-1]} {digest} in the template store")
        f = await anyio.open_file(path, "rb")

        async def chunks() -> AsyncIterator[bytes]:
            try:
                while chunk := await f.read(CHUNK):
                    yield chunk
            finally:
                await f.aclose()
        return chunks()
