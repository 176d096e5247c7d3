"""Pure helpers for building a template through the control plane (issue 19), shared by the CLI and the
SDK: the build context is a tar of exactly the files a spec document's ``copy`` steps name (so the upload
is small and its digest changes only when they do), packed deterministically (sorted, mtime 0, owner 0).

The wire: ``PUT /v1/templates/contexts/{digest}`` with the tar, then ``POST /v1/templates/builds``
``{"spec": document, "context": digest}``, whose answer is NDJSON events (``status``/``log``, then ``done``
or ``error``).
"""

from __future__ import annotations

import copy
import hashlib
import io
import os
import tarfile
from pathlib import Path
from typing import Any

MAX_CONTEXT_BYTES = 256 << 20


class ContextTooLarge(ValueError):
    pass


def _add(tar: tarfile.TarFile, path: Path, arcname: str) -> None:
    def clean(info: tarfile.TarInfo) -> tarfile.TarInfo:
        info.mtime = 0
        info.uid = info.gid = 0
        info.uname = info.gname = ""
        return info
    if path.is_dir() and not path.is_symlink():
        tar.add(str(path), arcname=arcname, recursive=False, filter=clean)
        for child in sorted(os.listdir(path)):
            _add(tar, path / child, f"{arcname}/{child}")
    else:
        tar.add(str(path), arcname=arcname, recursive=False, filter=clean)


def pack_context(root: Path, document: dict[str, Any],
                 max_bytes: int = MAX_CONTEXT_BYTES) -> tuple[bytes | None, dict[str, Any]]:
    """The context tar for ``document`` (None when nothing is copied) and the document as sent: a ``copy``
    source outside ``root`` (a TOML spec may reach ``../shared``) is packed under ``_outside/<i>/`` and its
    ``src`` rewritten to match, so the node never needs a path outside the context."""
    doc = copy.deepcopy(document)
    root = Path(root).resolve()
    steps = [s for s in doc.get("steps") or [] if isinstance(s, dict) and "copy" in s]
    if not steps:
        return None, doc
    buf = io.BytesIO()
    seen: set[str] = set()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for i, step in enumerate(steps):
            src = str(step["copy"]["src"])
            path = (root / src).resolve() if not os.path.isabs(src) else Path(src)
            if not path.exists():
                raise FileNotFoundError(f"copy source missing: {path} (copy src is relative to {root})")
            if path.is_relative_to(root) and path != root:
                arc = path.relative_to(root).as_posix()
            else:
                arc = f"_outside/{i}/{path.name or 'root'}"
            step["copy"]["src"] = arc
            if arc in seen:
                continue
            seen.add(arc)
            _add(tar, path, arc)
            if buf.tell() > max_bytes:
                raise ContextTooLarge(f"build context is larger than {max_bytes >> 20} MiB")
    data = buf.getvalue()
    if len(data) > max_bytes:
        raise ContextTooLarge(f"build context is larger than {max_bytes >> 20} MiB")
    return data, doc


def context_digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()
