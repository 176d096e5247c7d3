"""The SDK contract: the same SDK tests against the public ``FakeControlPlane`` and against the real stack
(control plane on SQLite + a node agent on the FakeRuntime, in-process: ``tests/stack.py``), so the fake
cannot drift from the server. Every test takes ``backend`` and uses only the SDK and the REST API."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from pilldrops.sdk.testing import FakeControlPlane
from tests.stack import stack

TEMPLATES = ("base", "code-interpreter")


@dataclass
class Target:
    kind: str                   # "fake" or "stack"
    opts: dict[str, Any]        # api_url, api_key, transport: for every SDK call

    @property
    def api_url(self) -> str:
        return str(self.opts["api_url"])


class Backend:
    def __init__(self, kind: str, tmp_path: Path) -> None:
        self.kind = kind
        self.tmp_path = tmp_path

    @asynccontextmanager
    async def open(self) -> AsyncIterator[Target]:
        if self.kind == "fake":
            fake = FakeControlPlane(templates=TEMPLATES)
            yield Target("fake", fake.client_options())
            return
        async with stack(self.tmp_path, templates=TEMPLATES) as s:
            yield Target("stack", {"api_url": "http://cp", "api_key": s.key, "transport": s.transport})


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(autouse=True)
def _isolated_config(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for var in ("PILLDROPS_API_URL", "PILLDROPS_API_KEY", "E2B_API_KEY"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))


@pytest.fixture(params=["fake", "stack"])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Backend:
    return Backend(request.param, tmp_path)
