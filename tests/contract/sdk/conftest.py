"""The SDK contract: the same SDK tests against the public ``FakeControlPlane`` and against the real stack
(control plane on SQLite + a node agent on the FakeRuntime, in-process: ``tests/stack.py``), so the fake
cannot drift from the server. Every test takes ``backend`` and uses only the SDK and the REST API."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import pytest

from pilldrops.sdk.testing import FakeControlPlane
from tests.contract.conftest import FakeCase
from tests.stack import stack

TEMPLATES = ("base", "code-interpreter")


@dataclass
class Target:
    kind: str                   # "fake" or "stack"
    opts: dict[str, Any]        # api_url, api_key, transport: for every SDK call
    # let ``seconds`` pass: the fake's clock is moved, the real stack is waited for
    wait: Callable[[float], Awaitable[None]] = anyio.sleep

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

            async def advance(seconds: float) -> None:
                fake.advance(seconds)

            yield Target("fake", fake.client_options(), advance)
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


@pytest.fixture(autouse=True)
def no_leaks(tmp_path: Path) -> Iterator[None]:
    """Replaces ``tests/contract``'s per-runtime leak check, which made every SDK test run once per runtime
    case while watching that case's directory, not the stack's. The stack always runs the FakeRuntime in
    ``tmp_path/fake``: no process, sandbox directory or record of it outlives the test."""
    case = FakeCase(tmp_path)
    before = case.snapshot()
    yield
    case.assert_no_leaks(before)
