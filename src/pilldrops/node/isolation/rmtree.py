"""Remove a directory tree a sandbox made, however deep (issue 16 item 4).

``shutil.rmtree`` recurses once per level (Python 3.11), so a tree 1,100 levels deep raises
``RecursionError`` and the sandbox's directory stays. ``remove_tree`` walks with an explicit stack of names
and one open directory fd at a time (``openat`` with ``O_NOFOLLOW``, ``unlinkat``): no recursion, no path
longer than one name, never a symlink followed, and as many fds as levels never held (a 1,100-deep tree
would pass RLIMIT_NOFILE's 1,024). It runs on trees no process writes any more (the sandbox is dead).
"""

from __future__ import annotations

import contextlib
import os
import stat
from pathlib import Path

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def _clear(fd: int) -> list[str]:
    """Unlink every non-directory in the directory ``fd``; the names of its subdirectories."""
    subdirs = []
    with os.scandir(fd) as it:
        for e in it:
            try:
                is_dir = e.is_dir(follow_symlinks=False)
            except OSError:
                is_dir = False
            if is_dir:
                subdirs.append(e.name)
            else:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(e.name, dir_fd=fd)
    return subdirs


def remove_tree(path: str | Path) -> None:
    """Remove ``path`` and everything below it (a missing path is fine; a file or symlink is unlinked).
    Raises ``OSError`` when something cannot be removed."""
    path = Path(path)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISDIR(st.st_mode):
        path.unlink()
        return
    fd = os.open(path, _DIR_FLAGS)
    stack: list[tuple[str, list[str]]] = [("", _clear(fd))]     # (name in its parent, subdirs left)
    try:
        while stack:
            name, pending = stack[-1]
            if pending:
                child = pending.pop()
                try:
                    cfd = os.open(child, _DIR_FLAGS, dir_fd=fd)
                except FileNotFoundError:
                    continue
                except OSError:            # became a symlink or a file: unlink it as one
                    os.unlink(child, dir_fd=fd)
                    continue
                os.close(fd)
                fd = cfd
                stack.append((child, _clear(fd)))
                continue
            stack.pop()
            if not stack:
                break
            parent = os.open("..", _DIR_FLAGS, dir_fd=fd)
            os.close(fd)
            fd = parent
            os.rmdir(name, dir_fd=fd)
    finally:
        os.close(fd)
    os.rmdir(path)


def remove_tree_quietly(path: str | Path | None) -> None:
    """``remove_tree`` for best-effort cleanup (``shutil.rmtree(path, ignore_errors=True)``, at any depth)."""
    if path:
        with contextlib.suppress(OSError):
            remove_tree(path)
