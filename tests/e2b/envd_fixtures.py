"""Fixtures of the envd tests (``test_envd_*.py``): the envd app served over real HTTP in front of a sandbox of
a real ``pilldrops up`` (the Debian ``base`` template, for the ``/bin/bash`` E2B commands use).

- ``envd_up``: the session's ``pilldrops up``: the E2B tier's ``pd_up`` (tests/up.py, leak-checked);
- ``envd``: a fresh sandbox (through our REST API) with ``make_envd_app()`` served by uvicorn on a free port
  behind the smallest router there is: every request is for this sandbox (``scope["state"]["e2b_sandbox"]``
  as the E2B router sets it). The stock client reaches it in E2B debug mode (``E2B_DEBUG=true``,
  ``E2B_SANDBOX_URL``): no control-plane call, every envd call over HTTP. Debug-mode requests carry no
  access token, so the stand-in adds the sandbox's for ``E2b-Sandbox-Id: debug_sandbox_id`` only; raw
  wire tests send the real id and their own token.
- ``e2b_debug``: a stock ``e2b.Sandbox`` on ``envd`` (debug mode).
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest


def _import_stock_client() -> None:
    """``tests/e2b`` would shadow the stock ``e2b`` package when ``tests/`` is on sys.path."""
    tests_dir = str(Path(__file__).resolve().parent.parent)
    saved = list(sys.path)
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != tests_dir]
    try:
        import e2b  # noqa: F401
    finally:
        sys.path[:] = saved


_import_stock_client()

from tests.e2e.fleet import free_port
from tests.up import Up, no_leaks_of


@pytest.fixture(scope="session")
def envd_up(pd_up: Up) -> Up:
    """The E2B tier's `pilldrops up` (tests/e2b/conftest.py: the session's shared one, ``base`` seeded)."""
    return pd_up


@pytest.fixture
def envd_no_leaks(envd_up: Up) -> Iterator[None]:
    with no_leaks_of(envd_up):
        yield


# -- the envd app in front of one sandbox ------------------------------------------------------------------

@dataclass
class _Link:
    """Until the E2B router's ``pilldrops.e2b.context.NodeLink`` is there: the same calls to the sandbox's
    node data-plane routes."""

    url: str
    sandbox_id: str
    access_token: str
    http: httpx.AsyncClient

    def _args(self, path: str, headers: dict[str, str] | None) -> tuple[str, dict[str, str]]:
        return f"{self.url}/v1/sandboxes/{self.sandbox_id}{path}", {**(headers or {}),
                                                                     "x-access-token": self.access_token}

    async def request(self, method: str, path: str, *, params: Any = None, headers: Any = None, content: Any = None,
                      json: Any = None, timeout: float | None = 60.0) -> httpx.Response:
        url, hdrs = self._args(path, headers)
        return await self.http.request(method, url, params=params, headers=hdrs, content=content, json=json,
                                       timeout=httpx.Timeout(timeout, connect=5))

    @contextlib.asynccontextmanager
    async def stream(self, method: str, path: str, *, params: Any = None, headers: Any = None, content: Any = None,
                     timeout: float | None = None) -> AsyncIterator[httpx.Response]:
        url, hdrs = self._args(path, headers)
        req = self.http.build_request(method, url, params=params, headers=hdrs, content=content,
                                      timeout=httpx.Timeout(timeout, connect=5))
        resp = await self.http.send(req, stream=True)
        try:
            yield resp
        finally:
            await resp.aclose()


@dataclass(frozen=True)
class _Ref:
    id: str
    e2b_id: str
    team_id: str
    template: str
    access_token: str
    envs: dict[str, str]
    workdir: str | None
    node: Any


@dataclass
class Envd:
    url: str                      # the envd app's base URL
    sandbox_id: str
    token: str
    api: httpx.Client
    requests: list[dict[str, str]] = field(default_factory=list)

    def rpc_headers(self, **extra: str) -> dict[str, str]:
        return {"E2b-Sandbox-Id": self.sandbox_id, "E2b-Sandbox-Port": "49983", "X-Access-Token": self.token,
                **extra}


def _serve(app: Any) -> tuple[str, Any, threading.Thread]:
    import uvicorn
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                           lifespan="off", access_log=False))
    th = threading.Thread(target=server.run, daemon=True)
    th.start()
    deadline = time.monotonic() + 10
    while not server.started:
        if time.monotonic() > deadline:
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.01)
    return f"http://127.0.0.1:{port}", server, th


@pytest.fixture
def envd(envd_up: Up, envd_no_leaks: None) -> Iterator[Envd]:
    from pilldrops.e2b.envd.app import make_envd_app
    api = httpx.Client(base_url=envd_up.api_url, headers={"Authorization": f"Bearer {envd_up.api_key}"},
                       timeout=60)
    info = api.post("/v1/sandboxes", json={"template": "base", "timeout": 600}).raise_for_status().json()
    envd_app = make_envd_app(None)
    seen: list[dict[str, str]] = []
    made: list[Any] = []

    def ref() -> Any:
        """The router's own SandboxRef and NodeLink when they are there, made in the serving loop."""
        if not made:
            try:
                from pilldrops.e2b.context import NodeLink, SandboxRef
            except ImportError:
                NodeLink, SandboxRef = _Link, _Ref
            link = NodeLink(info["envd_url"], info["id"], info["access_token"],
                            httpx.AsyncClient(timeout=httpx.Timeout(60, connect=5)))
            made.append(SandboxRef(id=info["id"], e2b_id=info["id"].replace("_", ""), team_id="", template="base",
                                   access_token=info["access_token"], envs={}, workdir=None, node=link))
        return made[0]

    async def router(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            headers = {k.decode().lower(): v.decode() for k, v in scope["headers"]}
            seen.append({"path": scope["path"], **headers})
            if headers.get("e2b-sandbox-id") == "debug_sandbox_id" and "x-access-token" not in headers:
                scope["headers"] = [*scope["headers"], (b"x-access-token", info["access_token"].encode())]
            scope["state"] = {**(scope.get("state") or {}), "e2b_sandbox": ref()}
        await envd_app(scope, receive, send)

    url, server, th = _serve(router)
    try:
        yield Envd(url, info["id"], info["access_token"], api, seen)
    finally:
        server.should_exit = True
        th.join(10)
        api.delete(f"/v1/sandboxes/{info['id']}")
        api.close()


@pytest.fixture
def e2b_debug(envd: Envd, monkeypatch: pytest.MonkeyPatch) -> Any:
    for k in [k for k in os.environ if k.startswith(("E2B_", "PILLDROPS_"))]:
        monkeypatch.delenv(k)
    monkeypatch.setenv("E2B_DEBUG", "true")
    monkeypatch.setenv("E2B_SANDBOX_URL", envd.url)
    monkeypatch.setenv("E2B_API_KEY", "e2b_" + "0" * 40)
    from e2b import Sandbox
    return Sandbox.create()


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"
