"""What a Dockerfile template's build does to the root being built, outside its ``RUN`` steps: paths resolved
with chroot semantics (a symlink a build step planted never sends a copy to the host), users and groups from
the image's own /etc/passwd and /etc/group, and ``COPY``/``ADD`` of exactly the entries the Dockerfile named."""

from __future__ import annotations

import bz2
import gzip
import lzma
import os
import posixpath
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path, PurePosixPath
from typing import Any


def tree_entries(src: Path) -> list[str]:
    """The entries of a TOML spec's copy of ``src``: [""] for a file (or link), else everything under it."""
    if src.is_symlink() or not src.is_dir():
        return [""]
    out = []
    for dirpath, dirs, files in os.walk(src):
        base = Path(dirpath).relative_to(src).as_posix()
        for n in sorted(dirs):
            p = Path(dirpath) / n
            rel = n if base == "." else f"{base}/{n}"
            out.append(rel if p.is_symlink() else rel + "/")
        out += [n if base == "." else f"{base}/{n}" for n in sorted(files)]
    return out


def copy_entries(src: Path, v: dict[str, Any], context: Path, root: Path, dest: str,
                 run: Callable[[list[str]], None], *, links: bool = False) -> None:
    """A ``COPY``/``ADD`` step (``v``: src, entries, chown, chmod, extract) of ``src`` (in ``context``) to
    ``dest`` (absolute, inside ``root``); every target is resolved inside ``root``. ``run`` runs a command
    (``chroot`` into root). ``links``: symlinks among the entries are copied as symlinks (a TOML spec's own
    files); otherwise a symlink anywhere in a source is refused (a Dockerfile's context may come from afar)."""
    for e in v["entries"] if not links else ():
        _no_links(context, posixpath.join(v["src"], e.rstrip("/")) if e else v["src"])
    owner = _owner(root, v["chown"]) if v.get("chown") else None
    mode = int(v["chmod"], 8) if v.get("chmod") else None
    if v.get("extract"):            # ADD of a local archive: unpacked by tar inside the chroot, as root
        inside = f"/.pilldrops-add-{uuid.uuid4().hex[:8]}.tar"
        _decompressed_copy(src, root / inside.lstrip("/"))
        try:
            run(["chroot", str(root), "/bin/sh", "-c", 'mkdir -p "$1" && tar -xf "$2" -C "$1"', "sh", dest, inside])
        finally:
            (root / inside.lstrip("/")).unlink(missing_ok=True)
        return
    top = in_root(root, dest)
    if v["entries"] != [""]:        # a folder: its contents go into dest
        made = not top.exists()
        top.mkdir(parents=True, exist_ok=True)
        if made and owner:
            os.chown(top, *owner)
    for e in v["entries"]:
        if e == "":
            target = in_root(root, posixpath.join(dest, src.name)) if top.is_dir() else top
        else:
            target = in_root(root, posixpath.join(dest, e.rstrip("/")))
        if e.endswith("/"):
            target.mkdir(parents=True, exist_ok=True)
            shutil.copystat(src / e, target)
        else:
            source = src / e if e else src
            target.parent.mkdir(parents=True, exist_ok=True)
            if target.is_dir():
                raise ValueError(f"cannot copy {v['src']}/{e} over the folder {target.relative_to(root)}")
            if source.is_symlink() and target.exists():
                target.unlink()                 # a TOML spec's symlink replaces what is there
            shutil.copy2(source, target, follow_symlinks=False)
            if source.is_symlink():
                continue
        if owner:
            os.chown(target, *owner)
        if mode is not None:
            os.chmod(target, mode)


def _decompressed_copy(src: Path, dest: Path) -> None:
    """``src`` (a tar, maybe gzip/bzip2/xz-compressed) as a plain tar at ``dest``: any tar can unpack it."""
    with open(src, "rb") as f:
        magic = f.read(6)
    opener: Any = (gzip.open if magic[:2] == b"\x1f\x8b" else bz2.open if magic[:3] == b"BZh"
                   else lzma.open if magic == b"\xfd7zXZ\x00" else open)
    with opener(src, "rb") as fin, open(dest, "wb") as fout:
        shutil.copyfileobj(fin, fout, 1024 * 1024)


def in_root(root: Path, path: str) -> Path:
    """``path`` inside ``root`` with chroot semantics: symlinks (absolute ones too) and ``..`` resolve within
    ``root``, so nothing a build step made can point a copy at the host."""
    parts = [p for p in path.split("/") if p not in ("", ".")]
    done: list[str] = []
    links = 0
    while parts:
        p = parts.pop(0)
        if p == "..":
            if done:
                done.pop()
            continue
        cand = root.joinpath(*done, p)
        if cand.is_symlink():
            links += 1
            if links > 40:
                raise ValueError(f"too many levels of symlinks in {path}")
            target = os.readlink(cand)
            if target.startswith("/"):
                done = []
            parts = [x for x in target.split("/") if x not in ("", ".")] + parts
            continue
        done.append(p)
    return root.joinpath(*done)


def _no_links(base: Path, rel: str) -> None:
    cur = base
    for part in PurePosixPath(rel).parts:
        if part in ("..", "/"):
            raise ValueError(f"copy source {rel!r} leaves the build context")
        cur = cur / part
        if cur.is_symlink():
            raise ValueError(f"copy source {rel!r}: {cur.relative_to(base)} is a symlink (refused)")


def _db(root: Path, name: str) -> list[list[str]]:
    try:
        text = in_root(root, f"/etc/{name}").read_text(errors="replace")
    except OSError:
        return []
    return [ln.split(":") for ln in text.splitlines() if ln and not ln.startswith("#")]


def resolve_user(root: Path, spec: str) -> tuple[str | None, str | None]:
    """A Dockerfile ``USER`` (``name``, ``uid``, ``name:group``, ``uid:gid``) as ``("uid:gid", home)`` from the
    image's /etc/passwd and /etc/group; root gives ``(None, None)``."""
    name, _, group = spec.partition(":")
    passwd = _db(root, "passwd")
    entry = next((e for e in passwd if len(e) >= 7 and (e[0] == name or (name.isdigit() and e[2] == name))), None)
    if entry is None and not name.isdigit():
        raise ValueError(f"USER {spec}: no user {name!r} in the image's /etc/passwd")
    uid = int(name) if name.isdigit() else int(entry[2])  # type: ignore[index]
    gid = int(entry[3]) if entry is not None else 0
    home = entry[5] if entry is not None else "/"
    if group:
        gid = _gid(root, group, spec)
    if uid == 0 and gid == 0:
        return None, None
    return f"{uid}:{gid}", home


def _gid(root: Path, group: str, what: str) -> int:
    if group.isdigit():
        return int(group)
    g = next((e for e in _db(root, "group") if len(e) >= 3 and e[0] == group), None)
    if g is None:
        raise ValueError(f"{what}: no group {group!r} in the image's /etc/group")
    return int(g[2])


def _owner(root: Path, chown: str) -> tuple[int, int]:
    user, _, group = chown.partition(":")
    if user.isdigit():
        uid = int(user)
        gid = int(user) if not group else _gid(root, group, f"--chown={chown}")
        return uid, gid
    resolved, _ = resolve_user(root, user)
    uid, gid = (int(x) for x in (resolved or "0:0").split(":"))
    return uid, (_gid(root, group, f"--chown={chown}") if group else gid)


def mkdirs_owned(root: Path, path: str, user: str | None) -> None:
    target = in_root(root, path)
    made = not target.exists()
    target.mkdir(parents=True, exist_ok=True)
    if made and user:
        uid, gid = (int(x) for x in user.split(":"))
        os.chown(target, uid, gid)


