"""Checkpoint transfer: pause a running sandbox into an image on this node's disk, resume it from that image
or from one fetched from the node that paused it (a move), serve an image to another node, and drop one.

States (``states.py``): running → pausing → paused (or back to running when the checkpoint fails and the
sandbox still runs); paused → resuming → running (or back to paused when the restore fails; a fetched copy
is dropped instead, the source node's image stays the sandbox's).
"""

from __future__ import annotations

import dataclasses
import logging
import subprocess
import time
from collections.abc import AsyncIterator, Callable
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any, Protocol

import anyio
import httpx

from pilldrops import errors
from pilldrops.node.dataplane import Target
from pilldrops.node.egress import Egress
from pilldrops.node.isolation.rmtree import remove_tree_quietly
from pilldrops.node.journal import Journal
from pilldrops.node.registry import Image, Sandbox, Sandboxes, usage_point
from pilldrops.node.runtime.base import Handle, Runtime, RuntimeFailure, kept_layer
from pilldrops.node.states import NodeState
from pilldrops.node.template_cache import TemplateCache
from pilldrops.schema.api import EndReason
from pilldrops.schema.node import NodeResume, NodeSandboxStatus

log = logging.getLogger("pilldrops.node")
_TAR = ["tar", "--numeric-owner", "--xattrs", "--xattrs-include=*"]


class RecordEnd(Protocol):
    def __call__(self, sandbox_id: str, reason: EndReason, started_at: datetime | None = None,
                 started_mono: float | None = None, run_s: float | None = None) -> NodeSandboxStatus: ...


def drop_image(path: str | Path | None) -> None:
    if path:
        remove_tree_quietly(path)


def image_size(image: Path) -> int:
    """Bytes the image really holds on disk (a sandbox's disk image is sparse: its apparent size is its
    ``disk_mb``, not what was written), as ``CrunRuntime.checkpoint`` counts them: paused storage bills this."""
    return sum(f.lstat().st_blocks * 512 for f in image.rglob("*") if f.is_file() and not f.is_symlink())


def layer_size(layer: Path | None) -> int:
    """Bytes a writable layer kept outside its image really holds (a sparse disk.img, or an upper tree)."""
    if layer is None or layer.is_symlink() or not layer.exists():
        return 0
    if layer.is_file():
        return layer.lstat().st_blocks * 512
    return image_size(layer)


def _json_or_none(resp: httpx.Response) -> Any:
    try:
        return resp.json()
    except ValueError:
        return None


class Checkpoints:
    def __init__(self, sandboxes: Sandboxes, journal: Journal, runtime: Runtime, templates: TemplateCache,
                 directory: Path, *, node_name: str, http: httpx.AsyncClient, create_slots: anyio.Semaphore,
                 record_end: RecordEnd, now: Callable[[], datetime], egress: Egress | None = None,
                 keep_ends: bool = False) -> None:
        self.sandboxes = sandboxes
        self.journal = journal
        self.runtime = runtime
        self.templates = templates
        self.dir = directory
        self.node_name = node_name
        self._http = http
        self._create_slots = create_slots
        self._record_end = record_end
        self.now = now
        self.egress = egress
        self.keep_ends = keep_ends     # a control plane hears of ends: entries stay until it has them

    def _paused(self, sandbox_id: str) -> Sandbox | None:
        """The sandbox whose image is here (paused, or resuming from it)."""
        sb = self.sandboxes.get(sandbox_id)
        ok = sb is not None and sb.image is not None and sb.state in (NodeState.paused, NodeState.resuming)
        return sb if ok else None

    # ---- pause ----------------------------------------------------------------------------------------

    async def pause(self, sb: Sandbox) -> NodeSandboxStatus:
        """Checkpoint a running sandbox to this node's disk: its processes and cgroup are gone afterwards.
        Commands in flight end first (their runs report ``paused``). On failure it keeps running."""
        sid = sb.id
        async with sb.op:
            if not self.sandboxes.is_current(sb, NodeState.running):
                raise errors.InvalidState(f"sandbox {sid} ended before it could be paused",
                                          current="stopped", target="paused")
            assert sb.target is not None and sb.started_mono is not None
            target = sb.target
            self.sandboxes.move(sb, NodeState.pausing)
            path = self.dir / sid
            try:
                size = await self._checkpoint(sb, path)
            except BaseException:   # whatever failed or cancelled it before the image was taken: it runs on
                if self.sandboxes.is_current(sb, NodeState.pausing):
                    target.pausing, sb.image = False, None
                    self.sandboxes.move(sb, NodeState.running)
                    self.journal.write(sb.journal_entry())
                    drop_image(path)
                raise
            assert sb.image is not None
            sb.image.size = size
            # it held its resources until the image was written: running time counts up to now, so the
            # control plane's paused interval (from its answer on) joins it without a gap (issue 16 item 10)
            sb.image.run_s = max(sb.image.run_s, usage_point(sb.started_mono)[0])
            sb.target, sb.started_mono = None, None
            self.sandboxes.move(sb, NodeState.paused)
            self.journal.write(sb.journal_entry())
        log.info("paused sandbox %s (%d bytes)", sid, size)
        return sb.status()

    async def _checkpoint(self, sb: Sandbox, path: Path) -> int:
        """The pausing part of ``pause``: end commands, write the image; its size."""
        sid, target = sb.id, sb.target
        assert target is not None and sb.started_mono is not None
        await target.end_commands()
        run_s, _ = usage_point(sb.started_mono)
        left = max(0.0, (sb.end_at - self.now()).total_seconds())   # the same instant as run_s
        remove_tree_quietly(path)
        path.mkdir(parents=True)
        sb.image = Image(path, run_s, runtime_id=target.handle.id, timeout_left=left)
        self.journal.write(sb.journal_entry())                      # phase "pausing"
        net = sb.spec.network if self.egress is not None else None
        try:
            if net is not None:      # CRIU dumps the namespace with loopback only; resume re-attaches (same slot)
                await self.egress.detach(sid)    # type: ignore[union-attr]
            size = await self.runtime.checkpoint(target.handle, path)
        except Exception as exc:  # whatever failed, find out what is left
            target.pausing = False
            state = await self._state_quietly(target.handle)
            if state not in ("stopped", "gone"):     # the runtime's contract: it keeps running
                if net is not None and target.handle.pid is not None:
                    await self._reattach(sid, target.handle, net)
                sb.image = None
                self.sandboxes.move(sb, NodeState.running)
                self.journal.write(sb.journal_entry())
                drop_image(path)
                raise errors.ServerError(f"pausing {sid} failed (it keeps running): {exc}") from exc
            # its processes are gone (the dump happened, then something after it failed): what the image
            # holds is all there is, so keep it as a paused sandbox (restore validates it) if it has any
            log.exception("pausing %s failed after its processes were gone", sid)
            if not any(path.iterdir()):
                self._journal_end(sb, EndReason.exited)
                self.sandboxes.move(sb, NodeState.gone)
                if self.egress is not None:
                    self.egress.forget(sid)          # detached before the dump: only its slot record is left
                drop_image(path)
                self._record_end(sid, EndReason.exited, started_at=sb.started_at, run_s=run_s)
                raise errors.ServerError(f"pausing {sid} failed and it is gone: {exc}") from exc
            # a layer the runtime could not move into the image is kept beside it: stored (and billed) too
            size = image_size(path) + layer_size(kept_layer(self.runtime, target.handle.id))
        return size

    async def _reattach(self, sandbox_id: str, handle: Handle, net: Any) -> None:
        """Egress back after a restore (or a failed dump): the same slot, so the same addresses. A failure
        leaves the sandbox running on loopback only (logged): it cannot fail the resume any more."""
        assert self.egress is not None and handle.pid is not None
        try:
            await self.egress.attach(sandbox_id, handle.pid, Path(handle.bundle) / "rootfs" if handle.bundle
                                     else None, net)
        except Exception:
            log.exception("egress of %s could not be re-attached", sandbox_id)

    async def _state_quietly(self, handle: Handle) -> str:
        try:
            return (await self.runtime.state(handle)).status
        except Exception:
            log.exception("state of %s", handle.id)
            return "unknown"

    # ---- resume ---------------------------------------------------------------------------------------

    async def resume(self, sandbox_id: str, body: NodeResume) -> NodeSandboxStatus:
        """Restore a paused sandbox here, from this node's checkpoint or one fetched from ``source_url``.
        Running time counts from this request on (the control plane's paused interval ends when it asked)."""
        begun = time.monotonic()
        sb = self.sandboxes.get(sandbox_id)
        # a move (source_url) always takes the source's copy: one left here from an earlier pause is stale
        if sb is not None and sb.state is NodeState.paused and body.source_url:
            self.sandboxes.move(sb, NodeState.gone)
            self.journal.remove(sandbox_id)
            drop_image(sb.image.path if sb.image else None)
            sb = None
        if sb is None:
            if not body.source_url:
                raise errors.SandboxNotFound(f"no checkpoint of {sandbox_id} on node {self.node_name}")
            sb = self.sandboxes.add(Sandbox(body.spec, NodeState.resuming))
            fetched = True
        else:
            self.sandboxes.move(sb, NodeState.resuming)
            fetched = False
        try:
            if fetched:
                sb.image = await self._fetch(sandbox_id, body)
            image = sb.image
            assert image is not None
            spec = body.spec.model_copy(update={"end_at": self.now() + timedelta(seconds=body.timeout_s)})
            rt_spec = self.templates.runtime_spec(spec)
            if image.runtime_id and image.runtime_id != rt_spec.id:   # a claimed pool member keeps its name
                rt_spec = dataclasses.replace(rt_spec, id=image.runtime_id,
                                              hostname=image.runtime_id.replace("_", "-"))
            self.journal.write(sb.journal_entry())                 # phase "resuming"
            try:
                async with self._create_slots:
                    handle = await self.runtime.restore(rt_spec, image.path)
            except RuntimeFailure as exc:
                raise errors.ServerError(f"resuming {sandbox_id} failed (it stays paused): {exc}") from exc
        except BaseException:
            if fetched:     # a copy: the source node's checkpoint stays the sandbox's, this one goes
                self.sandboxes.move(sb, NodeState.gone)
                self.journal.remove(sandbox_id)
                drop_image(sb.image.path if sb.image else None)
            else:
                self.sandboxes.move(sb, NodeState.paused)
                self.journal.write(sb.journal_entry())
            raise
        # the restore consumed the image (crun moves its writable layer into the container), so nothing may
        # fail from here on: the target comes from what was resolved before (not a template lookup now)
        if spec.network is not None and self.egress is not None and handle.pid is not None:
            await self._reattach(sandbox_id, handle, spec.network)
        target = Target(id=spec.id, handle=handle, env=dict(rt_spec.envs), workdir=rt_spec.workdir,
                        user=rt_spec.user)
        sb.spec, sb.target, sb.image = spec, target, None
        sb.started_at = sb.started_at or self.now()
        sb.started_mono = begun - max(image.run_s, body.run_s)
        self.sandboxes.move(sb, NodeState.running)
        self.journal.write(sb.journal_entry())
        drop_image(image.path)
        log.info("resumed sandbox %s", sandbox_id)
        return sb.status()

    async def _fetch(self, sandbox_id: str, body: NodeResume) -> Image:
        """Copy a checkpoint from the node that paused it (same node token), as a tar stream with xattrs
        (the writable layer's overlay whiteouts and opaque dirs) and holes (a sandbox's sparse disk.img is sent
        as the blocks it holds: the sender packs with --sparse)."""
        path = self.dir / sandbox_id
        remove_tree_quietly(path)
        path.mkdir(parents=True)
        ok = False
        try:
            tar = await anyio.open_process([*_TAR, "-x", "-f", "-", "-C", str(path)], stdin=subprocess.PIPE,
                                           stderr=subprocess.PIPE)
            async with tar:
                assert tar.stdin is not None
                url = f"{body.source_url}/node/v1/sandboxes/{sandbox_id}/checkpoint"
                async with self._http.stream("GET", url, timeout=httpx.Timeout(None, connect=5.0)) as resp:
                    if resp.status_code >= 400:
                        await resp.aread()
                        raise errors.from_wire(resp.status_code, _json_or_none(resp))
                    runtime_id = resp.headers.get("x-pilldrops-runtime-id") or sandbox_id
                    async for chunk in resp.aiter_bytes():
                        await tar.stdin.send(chunk)
                await tar.stdin.aclose()
                code = await tar.wait()
            if code != 0:
                raise errors.ServerError(f"unpacking the checkpoint of {sandbox_id} failed (tar exit {code})")
            ok = True
            return Image(path, body.run_s, image_size(path), runtime_id)
        except httpx.HTTPError as exc:
            raise errors.NodeUnavailable(f"fetching the checkpoint of {sandbox_id} failed: {exc!r}") from exc
        finally:
            if not ok:
                drop_image(path)

    # ---- serving and dropping images --------------------------------------------------------------------

    def runtime_id_of(self, sandbox_id: str) -> str:
        sb = self._paused(sandbox_id)
        return sb.runtime_id if sb else sandbox_id

    async def export(self, sandbox_id: str) -> AsyncIterator[bytes]:
        """The checkpoint as a tar stream (for another node resuming it). The copy here stays until the
        control plane says the move is done (``forget``)."""
        sb = self._paused(sandbox_id)
        if sb is None or sb.image is None:
            raise errors.SandboxNotFound(f"no checkpoint of {sandbox_id} on node {self.node_name}")
        if kept_layer(self.runtime, sb.runtime_id) is not None:
            raise errors.NotSupported(
                f"the checkpoint of {sandbox_id} cannot move to another node: its writable layer could not be "
                f"moved into the image and is kept on node {self.node_name} (resume it there)",
                details={"layer_kept": True, "node": self.node_name})
        proc = await anyio.open_process([*_TAR, "--sparse", "-c", "-f", "-", "-C", str(sb.image.path), "."],
                                        stdin=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

        async def stream() -> AsyncIterator[bytes]:
            async with proc:
                assert proc.stdout is not None
                try:
                    async for chunk in proc.stdout:
                        yield chunk
                    if await proc.wait() != 0:   # abort the response: the receiver sees a broken transfer
                        raise RuntimeError(f"packing the checkpoint of {sandbox_id} failed (tar exit "
                                           f"{proc.returncode})")
                finally:
                    if proc.returncode is None:
                        proc.kill()
        return stream()

    async def _drop(self, sb: Sandbox) -> None:
        """Drop the image of ``sb`` (it is gone from this node), and a writable layer a checkpoint kept
        beside it (with its sandbox dir and any mount of it: the runtime's destroy)."""
        drop_image(sb.image.path if sb.image else None)
        if sb.image is not None and kept_layer(self.runtime, sb.runtime_id) is not None:
            try:
                await self.runtime.destroy(Handle(id=sb.runtime_id))
            except Exception:  # logged; an unrecorded sandbox dir is reaped at the next start
                log.exception("removing the kept writable layer of %s failed", sb.id)

    async def forget(self, sandbox_id: str) -> None:
        """Drop a checkpoint that now lives on another node. No end is recorded: the sandbox lives on."""
        sb = self.sandboxes.get(sandbox_id)
        if sb is None or sb.state is not NodeState.paused:
            raise errors.SandboxNotFound(f"no checkpoint of {sandbox_id} on node {self.node_name}")
        self.sandboxes.move(sb, NodeState.gone)
        self.journal.remove(sandbox_id)
        await self._drop(sb)
        if self.egress is not None:
            self.egress.forget(sandbox_id)      # paused: only its slot's record is left here
        log.info("dropped checkpoint of %s (moved to another node)", sandbox_id)

    def _journal_end(self, sb: Sandbox, reason: EndReason) -> None:
        """Journal that ``sb`` (paused, or pausing with its processes gone) ends. With a control plane the
        entry stays, with its end, until the end is delivered (``ControlPlaneClient``'s ``delivered``): an
        agent that dies first reports it again after its restart (``recovery``), billed running time
        included; without one it goes now."""
        if not self.keep_ends:
            self.journal.remove(sb.id)
            return
        entry = sb.journal_entry()
        entry.end_reason = reason.value
        self.journal.write(entry)

    async def end_paused(self, sb: Sandbox, reason: EndReason) -> NodeSandboxStatus:
        """A paused sandbox ends (killed, or its paused retention ran out): its image goes (with a layer
        kept beside it); its journal entry stays, with the end, until the control plane has the end (see
        ``_journal_end``)."""
        self._journal_end(sb, reason)
        self.sandboxes.move(sb, NodeState.gone)
        await self._drop(sb)
        if self.egress is not None:
            self.egress.forget(sb.id)           # paused: only its slot's record is left here
        run_s = sb.image.run_s if sb.image else 0.0
        return self._record_end(sb.id, reason, started_at=sb.started_at, run_s=run_s)
