"""Times the user types: ISO 8601 (``2025-01-31``, ``2025-01-31T12:00Z``) or relative to now (``90s``,
``30m``, ``1h``, ``2d``, ``1w``, optionally followed by ``ago``). Shared by the SDK and the CLI."""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta

_RELATIVE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(s|sec|m|min|h|d|w)\s*(?:ago)?\s*$", re.IGNORECASE)
_UNIT_S = {"s": 1, "sec": 1, "m": 60, "min": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
FORMS = "an ISO 8601 date or time (2025-01-31, 2025-01-31T12:00:00Z) or a time ago (90s, 30m, 1h, 2d, 1w)"


def parse_time(value: str, *, now: datetime | None = None) -> datetime:
    """The datetime ``value`` names; a naive ISO time is UTC. Raises ``ValueError`` naming both forms."""
    m = _RELATIVE.match(value)
    if m:
        now = now or datetime.now(UTC)
        return now - timedelta(seconds=float(m.group(1)) * _UNIT_S[m.group(2).lower()])
    try:
        parsed = datetime.fromisoformat(value.strip())
    except ValueError:
        raise ValueError(f"expected {FORMS}, got {value!r}") from None
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)
