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
    """No real sleeping between retries; the delay each retry would have slept is recorded."""
    slept: list[float] = []

    async def fake_async_sleep(seconds: float) -> None:
        slept.append(seconds)

    def fake_sleep(seconds: float) -> None:
        slept.append(seconds)

    monkeypatch.setattr(async_client, "_sleep", fake_async_sleep)
    monkeypatch.setattr(sync_client, "_sleep", fake_sleep)
    yield slept


@pytest.fixture
def fake() -> FakeControlPlane:
    return FakeControlPlane()


@pytest.fixture
def opts(fake: FakeControlPlane) -> dict[str, Any]:
    return fake.client_options()
