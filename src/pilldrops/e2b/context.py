"""What the router hands to the sandbox-side apps (envd, code interpreter, ports): the sandbox a request
was resolved to, and a link to its node's data plane."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx

from pilldrops import errors

ENVD_VERSION = "0.5.7"
ID_PREFIX = "sb_"
STATE_KEY = "e2b_sandbox"


def to_e2b_id(sandbox_id: str) -> str:
    """``sb_abc…`` -> ``sbabc…``: E2B ids are ``[a-z0-9]+`` (its hostnames are split on ``-`` and ``.``)."""
    return sandbox_id.replace("_", "", 1) if sandbox_id.startswith(ID_PREFIX) else sandbox_id


def from_e2b_id(e2b_id: str) -> str:
    """Either form in, the PillDrops id out."""
    if e2b_id.startswith(ID_PREFIX) or not e2b_id.startswith("sb"):
        return e2b_id
    return ID_PREFIX + e2b_id[2:]


@dataclass
class NodeLink:
    """Calls to one sandbox's routes on its node's data plane (``{url}/v1/sandboxes/{id}...``), with the
    node token (the client's default header) and the sandbox's access token."""

    url: str
    sandbox_id: str
    access_token: str
    http: httpx.AsyncClient = field(repr=False)     # the control plane's pooled node client (node token set)

    def _url(self, path: str) -> str:
        return f"{self.url}/v1/sandboxes/{self.sandbox_id}{path}"

    def _headers(self, headers: dict[str, str] | None) -> dict[str, str]:
        return {**(headers or {}), "x-access-token": self.access_token}

    async def request(self, method: str, path: str, *, params: Any = None, headers: dict[str, str] | None = None,
                      content: Any = None, json: Any = None, timeout: float | None = 60.0) -> httpx.Response:
        try:
            return await self.http.request(method, self._url(path), params=params, headers=self._headers(headers),
                                           content=content, json=json,
                                           timeout=httpx.Timeout(timeout, connect=5.0))
        except httpx.HTTPError as exc:
            raise errors.NodeUnavailable(f"node at {self.url} did not answer: {exc!r}") from exc

    @asynccontextmanager
    async def stream(self, method: str, path: str, *, params: Any = None, headers: dict[str, str] | None = None,
                     content: Any = None) -> AsyncIterator[httpx.Response]:
        """The answer not yet read (no overall timeout: streams last as long as they need)."""
        req = self.http.build_request(method, self._url(path), params=params, headers=self._headers(headers),
                                      content=content, timeout=httpx.Timeout(None, connect=5.0, pool=30.0))
        try:
            resp = await self.http.send(req, stream=True)
        except httpx.HTTPError as exc:
            raise errors.NodeUnavailable(f"node at {self.url} did not answer: {exc!r}") from exc
        try:
            yield resp
        finally:
            await resp.aclose()


@dataclass(frozen=True)
class SandboxRef:
    id: str
    e2b_id: str
    team_id: str
    template: str
    access_token: str
    envs: dict[str, str]
    workdir: str | None
    node: NodeLink
