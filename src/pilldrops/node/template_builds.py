"""Remote template builds on this node (issue 19): the control plane picked this node to build a spec
document once for the whole fleet.

The parent's layers come from the template store (verified by digest, like any fetched layer), the build
context is fetched by digest (its bytes must hash to it, its size is bounded, and it is unpacked with
tarfile's ``data`` filter: no absolute paths, no ``..``, no links out, no devices), and every ``copy`` source
must stay inside the context. The layer is built exactly as a local build (``TemplateStore._build_into``:
an overlay over the parent's layers, steps in a chroot), packed into a tar whose sha256 is its digest,
uploaded to the control plane, and kept in this node's layer cache (the builder never fetches it back).
The answer is an NDJSON stream: ``log`` events, then ``done`` or ``error``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import tarfile
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread

from pilldrops import errors
from pilldrops.node.isolation.mounts import umount_all_under
from pilldrops.node.layers import pack_layer
from pilldrops.node.template_cache import TemplateCache
from pilldrops.node.templates import (
    TemplateBuildError,
    TemplateSpecError,
    TemplateStore,
    _tree_size,
    spec_from_dict,
)
from pilldrops.schema.node import NodeBuildRequest

log = logging.getLogger("pilldrops.node.builds")
MAX_CONTEXT_BYTES = 1 << 30
MAX_LINE = 4096
BlobFetch = Callable[[str, str], Awaitable[AsyncIterator[bytes]]]      # (kind, digest) -> bytes
LayerUpload = Callable[[str, Path], Awaitable[None]]                   # (digest, file) -> stored


def _event(kind: str, **fields: Any) -> bytes:
    return (json.dumps({"type": kind, **fields}, default=str) + "\n").encode()


class RemoteBuilds:
    def __init__(self, store: TemplateStore, cache: TemplateCache, fetch: BlobFetch, upload: LayerUpload,
                 work: Path) -> None:
        self.store = store
        self.cache = cache
        self.fetch = fetch
        self.upload = upload
        self.work = Path(work)
        self._one = anyio.Lock()       # one build at a time on a node: builds are CPU- and disk-heavy

    async def run(self, req: NodeBuildRequest) -> AsyncIterator[bytes]:
        send, receive = anyio.create_memory_object_stream[bytes](256)

        async def produce() -> None:
            async with send:
                try:
                    async with self._one:
                        await self._build(req, send)
                except errors.PillDropsError as exc:
                    await send.send(_event("error", error=exc.to_body()["error"]))
                except (TemplateBuildError, TemplateSpecError) as exc:
                    await send.send(_event("error", error=errors.TemplateBuildFailed(str(exc)).to_body()["error"]))
                except Exception as exc:
                    log.exception("template build failed")
                    await send.send(_event("error", error=errors.ServerError(
                        f"template build failed on the node: {exc!r}").to_body()["error"]))

        async def stream() -> AsyncIterator[bytes]:
            async with anyio.create_task_group() as tg:
                tg.start_soon(produce)
                async with receive:
                    async for chunk in receive:
                        yield chunk
        return stream()

    async def _build(self, req: NodeBuildRequest, send: Any) -> None:
        t0 = time.monotonic()
        self.work.mkdir(parents=True, exist_ok=True)
        tmp = self.work / f"build-{uuid.uuid4().hex[:12]}"
        tmp.mkdir()
        try:
            ctx = tmp / "context"
            ctx.mkdir()
            if req.context:
                await send.send(_event("log", line=f"fetching build context {req.context[:19]}"))
                await self._fetch_context(req, tmp / "context.tar", ctx)
            spec = spec_from_dict(req.spec, ctx / "template.json")
            for st in spec.steps:
                if st.kind == "copy":
                    src = (ctx / st.value["src"]).resolve()
                    if not src.is_relative_to(ctx.resolve()):
                        raise TemplateSpecError(f"copy src {st.value['src']!r} is outside the build context")
            parent = None
            if req.parent is not None:
                if req.parent.name != spec.base:
                    raise TemplateSpecError(f"parent {req.parent.name!r} is not the spec's from {spec.base!r}")
                await send.send(_event("log", line=f"parent {req.parent.name} v{req.parent.version}: "
                                                   f"{len(req.parent.layers)} layer(s)"))
                await self.cache.ensure(req.parent)
                parent = self.cache.stored(req.parent)
            elif not spec.is_builder:
                raise errors.TemplateNotFound(f"template {spec.base!r} (the 'from' of {spec.name!r}) is not in the "
                                              f"template store: build it first (`pilldrops template build "
                                              f"{spec.base}`)", details={"template": spec.base})
            out = tmp / "out"
            await send.send(_event("log", line=f"[{spec.name}] from {spec.base}: {len(spec.steps)} step(s)"))
            result = await self._steps(spec, parent, out, send)
            if result is not None:     # a builder that resolves USER against the built rootfs says so itself
                env, workdir = dict(result.env), result.workdir
                user, home = getattr(result, "user", None), getattr(result, "home", None)
            else:
                env, workdir = TemplateStore._resolve_env(spec, parent)   # type: ignore[arg-type]
                user = home = None
            size = _tree_size(out / "layer")
            await send.send(_event("log", line=f"packing layer ({size / 2**20:.1f} MiB)"))
            digest, blob_size = await anyio.to_thread.run_sync(pack_layer, out / "layer", tmp / "layer.tar")
            await send.send(_event("log", line=f"uploading layer {digest[:19]} ({blob_size / 2**20:.1f} MiB)"))
            await self.upload(digest, tmp / "layer.tar")
            if self.cache.layers is not None:
                self.cache.layers.adopt(digest, out / "layer")
            await send.send(_event("done", layer={"digest": digest, "size": blob_size}, env=env, workdir=workdir,
                                   user=user, home=home, size_bytes=size,
                                   build_seconds=round(time.monotonic() - t0, 3)))
        finally:
            umount_all_under(tmp)
            shutil.rmtree(tmp, ignore_errors=True)

    async def _fetch_context(self, req: NodeBuildRequest, blob: Path, into: Path) -> None:
        assert req.context
        limit = min(req.context_size or MAX_CONTEXT_BYTES, MAX_CONTEXT_BYTES)
        h, got = hashlib.sha256(), 0
        async with await anyio.open_file(blob, "wb") as f:
            async for chunk in await self.fetch("contexts", req.context):
                got += len(chunk)
                if got > limit:
                    raise errors.PayloadTooLarge(f"build context is larger than {limit} bytes")
                h.update(chunk)
                await f.write(chunk)
        if "sha256:" + h.hexdigest() != req.context:
            raise errors.InvalidRequest(f"build context {req.context} failed verification; refused")

        def unpack() -> None:
            try:
                with tarfile.open(blob, mode="r:*") as tar:
                    tar.extractall(into, filter="data")
            except (tarfile.TarError, OSError) as exc:
                raise errors.InvalidRequest(f"build context is not a safe tar: {exc}") from exc
        await anyio.to_thread.run_sync(unpack)

    async def _steps(self, spec: Any, parent: Any, out: Path, send: Any) -> Any:
        """The build itself, in a worker thread; its output lines go to the stream as they come. Returns
        what the builder returns (``(env, workdir, user, home)`` where it resolves a USER; else None)."""
        portal_send = send.send

        def progress(line: str) -> None:
            anyio.from_thread.run(portal_send, _event("log", line=line[:MAX_LINE]))

        def build() -> Any:
            return self.store._build_into(spec, parent, out, progress)

        return await anyio.to_thread.run_sync(build)
