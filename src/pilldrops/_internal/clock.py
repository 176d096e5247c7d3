"""The control plane's clock, injectable so tests can move time without sleeping, and the one TTL cache
every service uses (``clock.ttl_cache(seconds)``): entries age on the clock's monotonic time."""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable
from datetime import UTC, datetime, timedelta
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class TTLCache(Generic[K, V]):
    """Values kept for ``ttl_s`` seconds of ``clock`` time after they were put (not after they were read).

    A miss and an expired entry look the same (``get`` returns None); ``adjust`` changes a live entry's
    value without renewing it (e.g. a cached balance minus what this process charged since)."""

    def __init__(self, ttl_s: float, clock: Callable[[], float]) -> None:
        self.ttl_s = ttl_s
        self._clock = clock
        self._items: dict[K, tuple[float, V]] = {}

    def get(self, key: K) -> V | None:
        hit = self._items.get(key)
        if hit is None or self._clock() - hit[0] >= self.ttl_s:
            return None
        return hit[1]

    def put(self, key: K, value: V) -> V:
        self._items[key] = (self._clock(), value)
        return value

    def adjust(self, key: K, change: Callable[[V], V]) -> None:
        hit = self._items.get(key)
        if hit is not None:
            self._items[key] = (hit[0], change(hit[1]))

    def pop(self, key: K) -> None:
        self._items.pop(key, None)

    def clear(self) -> None:
        self._items.clear()


class Clock:
    def now(self) -> datetime:
        return datetime.now(UTC)

    def monotonic(self) -> float:
        return time.monotonic()

    def ttl_cache(self, ttl_s: float) -> TTLCache[K, V]:
        return TTLCache(ttl_s, self.monotonic)


class FakeClock(Clock):
    """``now`` moves only with ``advance``; ``monotonic`` is real time plus everything advanced, so caches
    expire as real time passes (as with ``Clock``) and also when a test moves time on."""

    def __init__(self, start: datetime | None = None) -> None:
        self._now = start or datetime(2026, 1, 1, tzinfo=UTC)
        self._advanced = 0.0

    def now(self) -> datetime:
        return self._now

    def monotonic(self) -> float:
        return time.monotonic() + self._advanced

    def advance(self, seconds: float) -> None:
        self._now += timedelta(seconds=seconds)
        self._advanced += seconds
