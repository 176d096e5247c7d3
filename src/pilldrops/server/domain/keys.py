"""API keys: high-entropy random secrets, stored only as a SHA-256 digest plus a short display prefix."""

from __future__ import annotations

import hashlib

from pilldrops._internal.ids import new_secret

KEY_PREFIX = "pd"


def generate_key() -> str:
    return new_secret(KEY_PREFIX, 30)


def hash_key(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def display_prefix(secret: str) -> str:
    return secret[:10]

