"""Users and paths as envd resolves them (E2B spec: ``Authorization: Basic base64("<user>:")`` on RPCs,
``?username=`` on ``/files``).

PillDrops sandboxes run everything as root; a user name is accepted (``root``, ``user`` and any other
well-formed name) only to resolve paths: ``~`` and relative paths are joined to its home (``/root`` for
root, ``/home/<name>`` otherwise), an empty path is the default workdir, an absolute path is used as is.
No request changes who a process runs as. Without a user (the default user, ``None`` here) the home is the
sandbox's workdir (the template's: ``/home/user`` for code-interpreter, ``/root`` for base), as upstream's
default user's home is its default workdir: a file written to a relative path is where a command's
relative path finds it.
"""

from __future__ import annotations

import base64
import binascii
import posixpath
import re

from pilldrops.e2b.envd.connect import ConnectError

_NAME = re.compile(r"^[a-z_][a-z0-9_.-]{0,31}$")


def check_user(name: str | None) -> str | None:
    if not name:
        return None
    if not _NAME.match(name):
        raise ConnectError("unauthenticated", f"invalid username: '{name}'")
    return name


def user_from_header(authorization: str | None) -> str | None:
    if not authorization or not authorization.lower().startswith("basic "):
        return None
    try:
        raw = base64.b64decode(authorization[6:].strip(), validate=True).decode()
    except (binascii.Error, UnicodeDecodeError):
        raise ConnectError("unauthenticated", "malformed Authorization header") from None
    return check_user(raw.split(":", 1)[0])


def home(user: str | None, workdir: str) -> str:
    if user is None:
        return workdir
    return "/root" if user == "root" else f"/home/{user}"


def resolve(path: str | None, user: str | None, workdir: str) -> str:
    """E2B's ExpandAndResolve: "" -> workdir, "~"/"~/x" -> home, relative -> home/x, absolute as is."""
    if path is None or path == "":
        return workdir
    if "\0" in path:
        raise ConnectError("invalid_argument", "path contains a NUL byte")
    if path == "~" or path.startswith("~/"):
        path = home(user, workdir) + path[1:]
    elif not path.startswith("/"):
        path = posixpath.join(home(user, workdir), path)
    norm = posixpath.normpath(path)
    return "/" + norm.lstrip("/") if norm != "/" else "/"
