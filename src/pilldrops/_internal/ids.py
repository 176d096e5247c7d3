"""Prefixed, opaque, random ids (``sb_…``, ``node_…``, ``key_…``, ``team_…``, ``req_…``) and secrets."""

from __future__ import annotations

import secrets
import string

_ALPHABET = string.ascii_lowercase + string.digits


def new_id(prefix: str, n: int = 16) -> str:
    return f"{prefix}_{''.join(secrets.choice(_ALPHABET) for _ in range(n))}"


def new_secret(prefix: str, nbytes: int = 24) -> str:
    return f"{prefix}_{secrets.token_urlsafe(nbytes)}"


def same_secret(a: str, b: str) -> bool:
    """Constant-time comparison of two secrets."""
    import hmac
    return hmac.compare_digest(a.encode(), b.encode())
