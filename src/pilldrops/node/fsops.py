"""Filesystem operations in a sandbox (``/v1/sandboxes/{id}/fs/...``, docs/api.md): stat, a listing to a
depth, mkdir, move, remove. Each is one shell script run by the sandbox's own tools (busybox or coreutils)
inside its own root, like the rest of the data plane: no path is ever resolved on the host.

Output is attacker input: a listing is read up to ``MAX_LISTING_BYTES`` and at most ``MAX_ENTRIES`` entries are
returned (``truncated`` says so). Entries whose name holds a newline cannot be represented and are skipped.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated

from fastapi import APIRouter, Header, Query

from pilldrops import errors
from pilldrops.node.dataplane import DataPlane, Target, _check_path
from pilldrops.schema.fs import FileEntry, FileListing, MoveRequest, PathRequest

MAX_LISTING_BYTES = 16 * 1024 * 1024
MAX_ENTRIES = 100_000
MAX_DEPTH = 64
_NOT_FOUND, _NOT_DIR, _EXISTS = 44, 45, 46
_FMT = "%F|%s|%a|%Y|%U|%G|%A|%n"
_LINKS = ('find "$1" -mindepth 1 -maxdepth "$2" -type l -exec sh -c '
          '\'for f; do printf "L\\037%s\\037%s\\n" "$f" "$(readlink "$f")"; done\' sh {} +')
_STAT = ('[ -e "$1" ] || [ -L "$1" ] || exit 44; stat -c "$3" -- "$1" && '
         '{ [ -L "$1" ] || exit 0; printf "L\\037%s\\037%s\\n" "$1" "$(readlink "$1")"; }')
_LIST = ('[ -d "$1" ] || { [ -e "$1" ] && exit 45; exit 44; }; case "$1" in */) ;; *) set -- "$1/" "$2" "$3";; esac; '
         'find "$1" -mindepth 1 -maxdepth "$2" -exec stat -c "$3" -- {} + && ' + _LINKS)
_MKDIR = '[ -d "$1" ] && exit 46; [ -e "$1" ] && exit 45; mkdir -p -- "$1" && stat -c "$3" -- "$1"'
_MOVE = ('[ -e "$1" ] || [ -L "$1" ] || exit 44; mkdir -p -- "$(dirname -- "$2")" && mv -f -- "$1" "$2" && '
         'stat -c "$3" -- "$2"')
_REMOVE = 'rm -rf -- "$1"'


def parse_entries(out: bytes, limit: int = MAX_ENTRIES) -> tuple[list[FileEntry], bool]:
    """``stat -c _FMT`` lines, then ``L<US>path<US>target`` lines for symlinks."""
    entries: dict[str, FileEntry] = {}
    links: dict[str, str] = {}
    truncated = False
    for raw in out.decode(errors="replace").splitlines():
        if raw.startswith("L\x1f"):
            parts = raw.split("\x1f", 2)
            if len(parts) == 3:
                links[_norm(parts[1])] = parts[2]
            continue
        parts = raw.split("|", 7)
        if len(parts) != 8 or not parts[1].isdigit() or not parts[3].isdigit():
            continue
        if len(entries) >= limit:
            truncated = True
            continue
        kind, size, mode, mtime, owner, group, perms, name = parts
        full = _norm(name)
        ftype = ("file" if kind.startswith("regular") else "dir" if kind == "directory"
                 else "symlink" if kind == "symbolic link" else "other")
        entries[full] = FileEntry(name=full.rsplit("/", 1)[-1] or "/", path=full, type=ftype, size=int(size),
                                  mode=int(mode, 8), mtime=float(mtime), owner=owner, group=group,
                                  permissions=perms)
    for path, target in links.items():
        if path in entries:
            entries[path].symlink_target = target
    return list(entries.values()), truncated


def _norm(p: str) -> str:
    while "//" in p:
        p = p.replace("//", "/")
    return p[:-1] if len(p) > 1 and p.endswith("/") else p


class FileOps:
    def __init__(self, plane: DataPlane) -> None:
        self.plane = plane

    async def _run(self, t: Target, script: str, *args: str, limit: int = 1024 * 1024) -> tuple[bytes, str, int]:
        out, err, code = await self.plane._sh(t, script, *args, limit=limit)
        return out, err.decode(errors="replace").strip(), code

    async def stat(self, t: Target, path: str) -> FileEntry:
        _check_path(path)
        out, err, code = await self._run(t, _STAT, path, "0", _FMT)
        if code == _NOT_FOUND:
            raise errors.FileNotFound(f"{path} does not exist in the sandbox")
        entries, _ = parse_entries(out)
        if code != 0 or not entries:
            raise errors.ServerError(f"stat of {path} failed: {err}")
        return entries[0]

    async def list(self, t: Target, path: str, depth: int = 1) -> FileListing:
        _check_path(path)
        depth = max(1, min(int(depth), MAX_DEPTH))
        out, err, code = await self._run(t, _LIST, path, str(depth), _FMT, limit=MAX_LISTING_BYTES)
        if code == _NOT_FOUND:
            raise errors.FileNotFound(f"{path} does not exist in the sandbox")
        if code == _NOT_DIR:
            raise errors.InvalidRequest(f"{path} is not a directory")
        entries, truncated = parse_entries(out)
        if code != 0 and not entries:
            raise errors.ServerError(f"listing {path} failed: {err}")
        return FileListing(items=entries, truncated=truncated)

    async def mkdir(self, t: Target, path: str) -> tuple[FileEntry | None, bool]:
        """(the new directory, True), or (None, False) when it already was one."""
        _check_path(path)
        out, err, code = await self._run(t, _MKDIR, path, "0", _FMT)
        if code == _EXISTS:
            return None, False
        if code == _NOT_DIR:
            raise errors.InvalidRequest(f"{path} exists and is not a directory")
        entries, _ = parse_entries(out)
        if code != 0 or not entries:
            raise errors.InvalidRequest(f"mkdir {path} failed: {err}")
        return entries[0], True

    async def move(self, t: Target, source: str, destination: str) -> FileEntry:
        _check_path(source)
        _check_path(destination)
        out, err, code = await self._run(t, _MOVE, source, destination, _FMT)
        if code == _NOT_FOUND:
            raise errors.FileNotFound(f"{source} does not exist in the sandbox")
        entries, _ = parse_entries(out)
        if code != 0 or not entries:
            raise errors.InvalidRequest(f"moving {source} to {destination} failed: {err}")
        return entries[0]

    async def remove(self, t: Target, path: str) -> None:
        _check_path(path)
        if path.rstrip("/") == "":
            raise errors.InvalidRequest("refusing to remove /")
        _, err, code = await self._run(t, _REMOVE, path)
        if code != 0:
            raise errors.InvalidRequest(f"removing {path} failed: {err}")


Token = Annotated[str | None, Header(alias="x-access-token")]
Path_ = Annotated[str, Query(alias="path", min_length=1, max_length=4096)]


def fs_routes(ops: FileOps, target: Callable[[str, str | None], Target]) -> APIRouter:
    r = APIRouter(prefix="/v1/sandboxes/{sandbox_id}/fs")

    @r.get("/stat", response_model=FileEntry)
    async def stat(sandbox_id: str, path: Path_, x_access_token: Token = None) -> FileEntry:
        return await ops.stat(target(sandbox_id, x_access_token), path)

    @r.get("/list", response_model=FileListing)
    async def list_(sandbox_id: str, path: Path_, depth: Annotated[int, Query(ge=1, le=MAX_DEPTH)] = 1,
                    x_access_token: Token = None) -> FileListing:
        return await ops.list(target(sandbox_id, x_access_token), path, depth)

    @r.post("/mkdir")
    async def mkdir(sandbox_id: str, body: PathRequest, x_access_token: Token = None) -> dict[str, object]:
        entry, created = await ops.mkdir(target(sandbox_id, x_access_token), body.path)
        return {"created": created, "entry": entry.model_dump() if entry else None}

    @r.post("/move", response_model=FileEntry)
    async def move(sandbox_id: str, body: MoveRequest, x_access_token: Token = None) -> FileEntry:
        return await ops.move(target(sandbox_id, x_access_token), body.source, body.destination)

    @r.post("/remove")
    async def remove(sandbox_id: str, body: PathRequest, x_access_token: Token = None) -> dict[str, bool]:
        await ops.remove(target(sandbox_id, x_access_token), body.path)
        return {"ok": True}

    return r
