"""The template store's cache key, shared by the control plane (which decides whether a build is needed)
and clients (which may check it): a template version is named by what went into it."""

from __future__ import annotations

import hashlib
import json
from typing import Any

KEY_VERSION = "1"        # bump when a builder's output changes for the same inputs
_NOT_HASHED = ("description", "isolation")    # metadata: changing them does not rebuild the layer


def build_key(spec: dict[str, Any], parent_key: str | None, context_digest: str | None) -> str:
    """sha256 over the spec document (minus its metadata), the parent's key and the context's digest."""
    doc = {k: v for k, v in spec.items() if k not in _NOT_HASHED and v is not None}
    payload = json.dumps({"spec": doc, "parent": parent_key, "context": context_digest, "v": KEY_VERSION},
                         sort_keys=True, separators=(",", ":"))
    return "sha256:" + hashlib.sha256(payload.encode()).hexdigest()
