from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from pilldrops.sdk._async import client as async_client
from pilldrops.sdk._sync import client as sync_client
from pilldrops.sdk.testing import FakeControlPlane


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(autouse=True)
def _isolated_config(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    for var in ("PILLDROPS_API_URL", "PILLDROPS_API_KEY", "E2B_API_KEY"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))


@pytest.fixture(autouse=True)
def delays(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[float]]:
    """No real sleeping between retries; the backoff each retry asked for is recorded."""
    asked: list[float] = []
    for mod in (async_client, sync_client):
        real = mod.backoff_delay

        def fake_delay(attempt: int, retry_after: float | None = None, _real: Any = real) -> float:
            asked.append(_real(attempt, retry_after))
            return 0.0

        monkeypatch.setattr(mod, "backoff_delay", fake_delay)
    yield asked


@pytest.fixture
def fake() -> FakeControlPlane:
    return FakeControlPlane()


@pytest.fixture
def opts(fake: FakeControlPlane) -> dict[str, Any]:
    return fake.client_options()
