"""Resolved client settings (URL, key, timeouts) and the test hook that swaps the HTTP transport."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from pilldrops._internal.config import resolve_api_key_source, resolve_api_url
from pilldrops.errors import AuthenticationError

DEFAULT_REQUEST_TIMEOUT_S = 60.0
DEFAULT_MAX_RETRIES = 3
# One pool serves a thousand concurrent sandboxes from one process: keep it wide.
MAX_CONNECTIONS = 256
MAX_KEEPALIVE_CONNECTIONS = 64

NO_KEY_MESSAGE = (
    "no PillDrops API key found: run `pilldrops up` (it saves one to the config file) "
    "or set PILLDROPS_API_KEY"
)


@dataclass(frozen=True)
class ClientConfig:
    """Everything needed to reach the control plane.

    ``request_timeout`` is in seconds and bounds every non-streaming call; ``transport`` is an optional
    ``httpx`` transport (``httpx.MockTransport(FakeControlPlane())`` in tests).
    """

    api_url: str
    api_key: str
    request_timeout: float = DEFAULT_REQUEST_TIMEOUT_S
    max_retries: int = DEFAULT_MAX_RETRIES
    transport: Any = None
    api_key_source: str = "the explicit api_key (--api-key / api_key=)"   # named in auth errors ("key from $E2B_API_KEY")

    @property
    def pool_key(self) -> tuple[str, str, int]:
        """Clients (and their connection pools) are shared per (api_url, api_key, transport)."""
        return (self.api_url, self.api_key, id(self.transport))


_override_lock = threading.Lock()
_transport_override: Any = None


def set_transport_override(transport: Any) -> Any:
    """Make every client built without an explicit ``transport=`` use ``transport``. Returns the old one.

    For tests (the CLI tests install a ``FakeControlPlane`` this way); pass ``None`` to undo.
    """
    global _transport_override
    with _override_lock:
        old, _transport_override = _transport_override, transport
    return old


@contextmanager
def transport_override(transport: Any) -> Iterator[Any]:
    """Context-manager form of :func:`set_transport_override`."""
    old = set_transport_override(transport)
    try:
        yield transport
    finally:
        set_transport_override(old)


def resolve(api_url: str | None = None, api_key: str | None = None, *,
            request_timeout: float | None = None, transport: Any = None,
            max_retries: int | None = None) -> ClientConfig:
    """Resolve URL (explicit > PILLDROPS_API_URL > config file > default) and key (explicit >
    PILLDROPS_API_KEY > config file > E2B_API_KEY).

    Raises :class:`AuthenticationError` when no key can be found anywhere.
    """
    key, source = resolve_api_key_source(api_key)
    if not key:
        raise AuthenticationError(NO_KEY_MESSAGE)
    return ClientConfig(
        api_url=resolve_api_url(api_url),
        api_key=key,
        request_timeout=DEFAULT_REQUEST_TIMEOUT_S if request_timeout is None else float(request_timeout),
        max_retries=DEFAULT_MAX_RETRIES if max_retries is None else max_retries,
        transport=transport if transport is not None else _transport_override,
        api_key_source=source,
    )
