"""Prefixed, opaque, random ids (``sb_…``, ``node_…``, ``key_…``, ``team_…``, ``req_…``) and secrets."""

from __future__ import annotations

import secrets
import string

_ALPHABET = string.ascii_lowercase + string.digits
# random bytes to characters: 252 = 7 × 36, so each byte below 252 is one character, all 36 equally likely;
# the 4 bytes above are dropped (as ``secrets.choice``'s rejection does, without a syscall per character)
_TO_CHAR = bytes(_ALPHABET.encode()[b % len(_ALPHABET)] for b in range(256))
_DROPPED = bytes(range(256 - 256 % len(_ALPHABET), 256))


def new_id(prefix: str, n: int = 16) -> str:
    """``{prefix}_`` and ``n`` characters of ``[a-z0-9]``, each uniform and independent (from the OS's CSPRNG).
    Made on every request (its request id) and every create: one ``os.urandom`` call, not one per character."""
    while True:
        chars = secrets.token_bytes(n + 8).translate(_TO_CHAR, _DROPPED)
        if len(chars) >= n:       # fewer only if more than 8 of the n + 8 bytes were dropped (p < 1e-10)
            return f"{prefix}_{chars[:n].decode()}"


def new_secret(prefix: str, nbytes: int = 24) -> str:
    return f"{prefix}_{secrets.token_urlsafe(nbytes)}"


def same_secret(a: str, b: str) -> bool:
    """Constant-time comparison of two secrets."""
    import hmac
    return hmac.compare_digest(a.encode(), b.encode())
