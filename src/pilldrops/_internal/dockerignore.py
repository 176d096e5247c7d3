"""``.dockerignore`` as Docker reads it, and the build context a client sends for a remote Dockerfile build.

Shared by the Dockerfile parser (``node/dockerfile.py``) and the SDK (``Template.build``), which imports no
node code. Rules: one pattern a line, ``#`` comments, ``!`` exceptions, ``*``/``?``/``[...]`` within one path
component, ``**`` across them; the last matching pattern wins and a pattern matching a folder matches
everything in it.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

Rules = list[tuple[bool, "re.Pattern[str]"]]
PACKED_DOCKERFILE = "Dockerfile"     # a remote build's tarball: the Dockerfile ...
PACKED_CONTEXT = "context"           # ... and its build context under this folder


def ignore_rules(context: Path) -> list[tuple[bool, re.Pattern[str]]]:
    f = context / ".dockerignore"
    if not f.is_file() or f.is_symlink():
        return []
    rules = []
    for raw in f.read_text(errors="replace").splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        negate = line.startswith("!")
        pat = os.path.normpath(line[1:].strip() if negate else line).lstrip("/")
        if pat in (".", ""):
            continue
        rules.append((negate, re.compile(_glob_regex(pat))))
    return rules


def _glob_regex(pat: str) -> str:
    out, i = ["^"], 0
    while i < len(pat):
        c = pat[i]
        if pat.startswith("**", i):
            out.append(".*")
            i += 2
            if i < len(pat) and pat[i] == "/":
                out[-1] = "(?:.*/)?"
                i += 1
            continue
        if c == "*":
            out.append("[^/]*")
        elif c == "?":
            out.append("[^/]")
        elif c == "[":
            j = pat.find("]", i + 1)
            if j < 0:
                out.append(re.escape(c))
            else:
                body = pat[i + 1:j]
                out.append("[" + ("^" + body[1:] if body.startswith("!") else body).replace("\\", "\\\\") + "]")
                i = j
        elif c == "\\" and i + 1 < len(pat):
            out.append(re.escape(pat[i + 1]))
            i += 1
        else:
            out.append(re.escape(c))
        i += 1
    return "".join(out) + "$"


def ignored(rel: str, rules: list[tuple[bool, re.Pattern[str]]]) -> bool:
    """Docker's rule: the last matching pattern wins; a pattern matching a parent dir matches its contents."""
    if not rules:
        return False
    parts = rel.split("/")
    prefixes = ["/".join(parts[:k]) for k in range(1, len(parts) + 1)]
    excluded = False
    for negate, rx in rules:
        if any(rx.match(p) for p in prefixes):
            excluded = not negate
    return excluded
