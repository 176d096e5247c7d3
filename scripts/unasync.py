#!/usr/bin/env python3
"""Generate the synchronous SDK (and its tests) from the async source, in the httpcore style.

    python scripts/unasync.py           # rewrite src/pilldrops/sdk/_sync and tests/unit/sdk/_sync
    python scripts/unasync.py --check   # exit 1 with a diff when a generated file is stale

Only ``_async/`` is edited by hand; everything colour-free lives in ``sdk/_base.py``. Colour-specific
helpers there come in pairs named ``AsyncX`` / ``X`` so the generic rename below picks the right one.
"""

from __future__ import annotations

import argparse
import difflib
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DIRS = [
    ("src/pilldrops/sdk/_async", "src/pilldrops/sdk/_sync"),
    ("tests/unit/sdk/_async", "tests/unit/sdk/_sync"),
]
HEADER = "# DO NOT EDIT — generated from _async by scripts/unasync.py\n"

SUBS: list[tuple[str, str]] = [
    # keywords
    (r"\basync def\b", "def"),
    (r"\basync with\b", "with"),
    (r"\basync for\b", "for"),
    (r"\bawait\s+", ""),
    # dunder protocols
    (r"\b__aenter__\b", "__enter__"),
    (r"\b__aexit__\b", "__exit__"),
    (r"\b__aiter__\b", "__iter__"),
    (r"\b__anext__\b", "__next__"),
    (r"\bStopAsyncIteration\b", "StopIteration"),
    # library names
    (r"\basynccontextmanager\b", "contextmanager"),
    (r"\bhttpx\.AsyncClient\b", "httpx.Client"),
    (r"\bhttpx\.AsyncBaseTransport\b", "httpx.BaseTransport"),
    (r"\bhttpx\.AsyncHTTPTransport\b", "httpx.HTTPTransport"),
    (r"\b(?:anyio|asyncio)\.sleep\b", "time.sleep"),
    (r"^import (?:anyio|asyncio)$", "import time"),
    (r"\baclose\b", "close"),
    (r"\baread\b", "read"),
    (r"\baiter_(\w+)\b", r"iter_\1"),
    # our own twins: AsyncSandbox -> Sandbox, AsyncAPIClient -> APIClient, AsyncIterator -> Iterator, ...
    (r"\bAsync([A-Z]\w*)", r"\1"),
    (r"\b_async\b", "_sync"),
    (r"\basync_(\w+)", r"sync_\1"),
    # tests: the anyio marker and fixture only make sense for coroutines
    (r"^[ \t]*@pytest\.mark\.anyio\n", ""),
    (r"^pytestmark = pytest\.mark\.anyio\n", ""),
]
_COMPILED = [(re.compile(p, re.MULTILINE), r) for p, r in SUBS]


def unasync_text(text: str) -> str:
    for pattern, repl in _COMPILED:
        text = pattern.sub(repl, text)
    return HEADER + text


def plan() -> dict[Path, str]:
    """Every generated path and the text it must hold."""
    out: dict[Path, str] = {}
    for src_dir, dst_dir in DIRS:
        src, dst = ROOT / src_dir, ROOT / dst_dir
        if not src.is_dir():
            continue
        for path in sorted(src.rglob("*.py")):
            out[dst / path.relative_to(src)] = unasync_text(path.read_text())
    return out


def stale_files() -> list[Path]:
    """Generated-dir files with no async source (a deleted source leaves them behind)."""
    wanted = plan()
    extra = []
    for _, dst_dir in DIRS:
        dst = ROOT / dst_dir
        if dst.is_dir():
            extra += [p for p in sorted(dst.rglob("*.py")) if p not in wanted]
    return extra


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only check; exit 1 with a diff if stale")
    args = parser.parse_args(argv)
    wanted, extra, failed = plan(), stale_files(), False
    for path, text in wanted.items():
        current = path.read_text() if path.exists() else ""
        if current == text:
            continue
        if args.check:
            failed = True
            rel = path.relative_to(ROOT)
            sys.stdout.writelines(difflib.unified_diff(
                current.splitlines(keepends=True), text.splitlines(keepends=True),
                fromfile=f"{rel} (on disk)", tofile=f"{rel} (generated)"))
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            print(f"wrote {path.relative_to(ROOT)}")
    for path in extra:
        if args.check:
            failed = True
            print(f"{path.relative_to(ROOT)}: generated file without an _async source")
        else:
            path.unlink()
            print(f"removed {path.relative_to(ROOT)}")
    if failed:
        print("generated sync code is stale: run `python scripts/unasync.py`", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
