"""envd's ``filesystem.Filesystem`` service, over the node's ``/fs`` routes (docs/api.md).

Watching is by polling, not inotify: a watcher lists the directory (to ``MAX_WATCH_DEPTH`` levels when
recursive) every ``POLL_S`` seconds inside the sandbox and reports the difference as events: a new path is
CREATE (plus WRITE when it already has content, as inotify would report the write), a changed size or
mtime WRITE, a changed mode CHMOD, a missing path REMOVE. Changes within one poll coalesce, and a rename
shows as REMOVE + CREATE. A watched tree may hold at most ``MAX_WATCH_ENTRIES`` entries. ``CreateWatcher``
watchers live in this control-plane process, at most ``MAX_WATCHERS`` per sandbox and ``MAX_WATCHERS_TOTAL``
in all, and are dropped after ``WATCHER_IDLE_S`` without a ``GetWatcherEvents``.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import anyio

from pilldrops import errors
from pilldrops.e2b.envd import node
from pilldrops.e2b.envd.connect import SERVER_STREAM, UNARY, ConnectError, Method
from pilldrops.e2b.envd.process import Ctx
from pilldrops.e2b.envd.proto import filesystem_pb2 as pb
from pilldrops.e2b.envd.users import resolve

POLL_S = 0.5
MAX_WATCH_DEPTH = 16
MAX_WATCHERS = 16                  # per sandbox
MAX_WATCHERS_TOTAL = 256           # in this control-plane process
MAX_WATCH_ENTRIES = 10_000         # a watched tree larger than this is refused (each poll lists it whole)
WATCHER_IDLE_S = 600.0
MAX_PENDING_EVENTS = 10_000
_TYPES = {"file": pb.FILE_TYPE_FILE, "dir": pb.FILE_TYPE_DIRECTORY, "symlink": pb.FILE_TYPE_SYMLINK}


def entry_info(e: dict[str, Any]) -> pb.EntryInfo:
    out = pb.EntryInfo(name=e["name"], type=_TYPES.get(e["type"], pb.FILE_TYPE_UNSPECIFIED), path=e["path"],
                       size=int(e["size"]), mode=int(e["mode"]), permissions=e.get("permissions", ""),
                       owner=e.get("owner", ""), group=e.get("group", ""))
    out.modified_time.FromNanoseconds(int(float(e["mtime"]) * 1e9))
    if e.get("symlink_target") is not None:
        out.symlink_target = e["symlink_target"]
    return out


def _path(ctx: Ctx, p: str) -> str:
    return resolve(p, ctx.user, ctx.workdir)


async def stat(ctx: Ctx, req: pb.StatRequest) -> pb.StatResponse:
    path = _path(ctx, req.path)
    try:
        return pb.StatResponse(entry=entry_info(await node.call(ctx.ref, "GET", "/fs/stat", params={"path": path})))
    except errors.NotFound:
        raise ConnectError("not_found", f"path '{path}' does not exist") from None


async def list_dir(ctx: Ctx, req: pb.ListDirRequest) -> pb.ListDirResponse:
    path = _path(ctx, req.path)
    depth = max(1, req.depth)
    try:
        listing = await node.call(ctx.ref, "GET", "/fs/list", params={"path": path, "depth": min(depth, 64)})
    except errors.NotFound:
        raise ConnectError("not_found", f"path '{path}' does not exist") from None
    return pb.ListDirResponse(entries=[entry_info(e) for e in listing["items"]])


async def make_dir(ctx: Ctx, req: pb.MakeDirRequest) -> pb.MakeDirResponse:
    path = _path(ctx, req.path)
    made = await node.call(ctx.ref, "POST", "/fs/mkdir", json={"path": path})
    if not made["created"]:
        raise ConnectError("already_exists", f"directory '{path}' already exists")
    return pb.MakeDirResponse(entry=entry_info(made["entry"]))


async def move(ctx: Ctx, req: pb.MoveRequest) -> pb.MoveResponse:
    src, dst = _path(ctx, req.source), _path(ctx, req.destination)
    try:
        moved = await node.call(ctx.ref, "POST", "/fs/move", json={"source": src, "destination": dst})
    except errors.NotFound:
        raise ConnectError("not_found", f"path '{src}' does not exist") from None
    return pb.MoveResponse(entry=entry_info(moved))


async def remove(ctx: Ctx, req: pb.RemoveRequest) -> pb.RemoveResponse:
    await node.call(ctx.ref, "POST", "/fs/remove", json={"path": _path(ctx, req.path)})
    return pb.RemoveResponse()


# -- watching --------------------------------------------------------------------------------------------

Snapshot = dict[str, tuple[str, int, float, int]]          # path -> (type, size, mtime, mode)


@dataclass(eq=False)
class Watcher:
    ctx: Ctx
    path: str
    recursive: bool
    include_entry: bool
    seen: Snapshot = field(default_factory=dict)
    entries: dict[str, dict[str, Any]] = field(default_factory=dict)
    used: float = field(default_factory=time.monotonic)

    async def snapshot(self) -> Snapshot:
        try:
            listing = await node.call(self.ctx.ref, "GET", "/fs/list",
                                      params={"path": self.path, "depth": MAX_WATCH_DEPTH if self.recursive else 1})
        except errors.NotFound:
            raise ConnectError("not_found", f"path '{self.path}' does not exist") from None
        except errors.InvalidRequest:
            raise ConnectError("invalid_argument", f"path '{self.path}' is not a directory") from None
        if len(listing["items"]) > MAX_WATCH_ENTRIES or listing.get("truncated"):
            raise ConnectError("resource_exhausted", f"'{self.path}' holds more than {MAX_WATCH_ENTRIES} entries "
                                                     "to watch")
        self.entries = {e["path"]: e for e in listing["items"]}
        return {e["path"]: (e["type"], int(e["size"]), float(e["mtime"]), int(e["mode"])) for e in listing["items"]}

    async def start(self) -> None:
        self.seen = await self.snapshot()

    async def poll(self) -> list[pb.FilesystemEvent]:
        now = await self.snapshot()
        events: list[pb.FilesystemEvent] = []

        def ev(path: str, kind: int) -> None:
            name = path[len(self.path):].lstrip("/") if path.startswith(self.path) else path
            e = pb.FilesystemEvent(name=name, type=kind)
            if self.include_entry and path in self.entries and kind != pb.EVENT_TYPE_REMOVE:
                e.entry.CopyFrom(entry_info(self.entries[path]))
            events.append(e)

        for path, (typ, size, mtime, mode) in now.items():
            old = self.seen.get(path)
            if old is None:
                ev(path, pb.EVENT_TYPE_CREATE)
                if typ == "file" and size > 0:
                    ev(path, pb.EVENT_TYPE_WRITE)
            elif old[1:3] != (size, mtime) and typ != "dir":
                ev(path, pb.EVENT_TYPE_WRITE)
            elif old[3] != mode:
                ev(path, pb.EVENT_TYPE_CHMOD)
        for path in self.seen.keys() - now.keys():
            ev(path, pb.EVENT_TYPE_REMOVE)
        self.seen = now
        return events


_watchers: dict[str, tuple[str, Watcher]] = {}       # watcher id -> (sandbox id, watcher)


def _reap() -> None:
    now = time.monotonic()
    for wid, (_, w) in list(_watchers.items()):
        if now - w.used > WATCHER_IDLE_S:
            del _watchers[wid]


async def watch_dir(ctx: Ctx, req: pb.WatchDirRequest) -> AsyncIterator[pb.WatchDirResponse]:
    w = Watcher(ctx, _path(ctx, req.path), req.recursive, req.include_entry)
    await w.start()
    yield pb.WatchDirResponse(start=pb.WatchDirResponse.StartEvent())
    keepalive = ctx.keepalive_s()
    quiet_since = time.monotonic()
    while True:
        await anyio.sleep(POLL_S)
        events = await w.poll()
        for e in events:
            yield pb.WatchDirResponse(filesystem=e)
        if events:
            quiet_since = time.monotonic()
        elif time.monotonic() - quiet_since >= keepalive:
            quiet_since = time.monotonic()
            yield pb.WatchDirResponse(keepalive=pb.WatchDirResponse.KeepAlive())


async def create_watcher(ctx: Ctx, req: pb.CreateWatcherRequest) -> pb.CreateWatcherResponse:
    _reap()
    if sum(1 for sid, _ in _watchers.values() if sid == ctx.ref.id) >= MAX_WATCHERS:
        raise ConnectError("resource_exhausted", f"at most {MAX_WATCHERS} watchers per sandbox")
    if len(_watchers) >= MAX_WATCHERS_TOTAL:
        raise ConnectError("resource_exhausted", "too many watchers on this server; stop some")
    w = Watcher(ctx, _path(ctx, req.path), req.recursive, req.include_entry)
    await w.start()
    wid = secrets.token_hex(8)
    _watchers[wid] = (ctx.ref.id, w)
    return pb.CreateWatcherResponse(watcher_id=wid)


def _watcher(ctx: Ctx, wid: str) -> Watcher:
    found = _watchers.get(wid)
    if found is None or found[0] != ctx.ref.id:
        raise ConnectError("not_found", f"watcher with id {wid} not found")
    found[1].used = time.monotonic()
    found[1].ctx = ctx                  # polls go through the newest request's link to the node
    return found[1]


async def get_watcher_events(ctx: Ctx, req: pb.GetWatcherEventsRequest) -> pb.GetWatcherEventsResponse:
    w = _watcher(ctx, req.watcher_id)
    events = await w.poll()
    return pb.GetWatcherEventsResponse(events=events[:MAX_PENDING_EVENTS])


async def remove_watcher(ctx: Ctx, req: pb.RemoveWatcherRequest) -> pb.RemoveWatcherResponse:
    _watcher(ctx, req.watcher_id)
    del _watchers[req.watcher_id]
    return pb.RemoveWatcherResponse()


METHODS: dict[str, Method] = {
    "Stat": Method(UNARY, pb.StatRequest, stat),
    "ListDir": Method(UNARY, pb.ListDirRequest, list_dir),
    "MakeDir": Method(UNARY, pb.MakeDirRequest, make_dir),
    "Move": Method(UNARY, pb.MoveRequest, move),
    "Remove": Method(UNARY, pb.RemoveRequest, remove),
    "WatchDir": Method(SERVER_STREAM, pb.WatchDirRequest, watch_dir),
    "CreateWatcher": Method(UNARY, pb.CreateWatcherRequest, create_watcher),
    "GetWatcherEvents": Method(UNARY, pb.GetWatcherEventsRequest, get_watcher_events),
    "RemoveWatcher": Method(UNARY, pb.RemoveWatcherRequest, remove_watcher),
}
