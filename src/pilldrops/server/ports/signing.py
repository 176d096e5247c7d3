"""Port URL tokens: ``v1.<expires_at>.<mac>``, where ``mac`` is HMAC-SHA256 (truncated to 144 bits) under
the deployment's secret over the sandbox id, the port and the expiry (epoch seconds). The sandbox and port
come from the URL itself, so a token made for one sandbox or port is worthless on another; the MAC is
compared in constant time and checked before the expiry, so a forged token is "invalid", not "expired".

Pure functions, no I/O and no clock (``now`` is given)."""

from __future__ import annotations

import base64
import hashlib
import hmac
import re

from pilldrops import errors

VERSION = "v1"
MAC_BYTES = 18
MAX_TOKEN_CHARS = 96
_TOKEN_RE = re.compile(r"^v1\.(\d{1,12})\.([A-Za-z0-9_-]{24})$")


def _mac(secret: bytes, sandbox_id: str, port: int, expires_at: int) -> str:
    msg = f"pilldrops-port-url\0{VERSION}\0{sandbox_id}\0{port}\0{expires_at}".encode()
    digest = hmac.new(secret, msg, hashlib.sha256).digest()[:MAC_BYTES]
    return base64.urlsafe_b64encode(digest).decode().rstrip("=")


def sign(secret: bytes, sandbox_id: str, port: int, expires_at: int) -> str:
    if len(secret) < 16:
        raise ValueError("the signing secret must be at least 16 bytes")
    return f"{VERSION}.{expires_at}.{_mac(secret, sandbox_id, port, expires_at)}"


def verify(secret: bytes, token: str, sandbox_id: str, port: int, now: float) -> int:
    """The token's expiry (epoch seconds) when it is valid for this sandbox and port now; else
    ``URLTokenInvalid`` or ``URLTokenExpired``."""
    m = _TOKEN_RE.match(token) if len(token) <= MAX_TOKEN_CHARS else None
    if m is None:
        raise errors.URLTokenInvalid("the URL's token is malformed")
    expires_at = int(m.group(1))
    if not hmac.compare_digest(m.group(2).encode(), _mac(secret, sandbox_id, port, expires_at).encode()):
        raise errors.URLTokenInvalid("the URL's token is not valid for this sandbox and port")
    if now >= expires_at:
        raise errors.URLTokenExpired("the URL's token has expired; ask for a new URL (sb.get_url)",
                                     details={"expired_at": expires_at})
    return expires_at
