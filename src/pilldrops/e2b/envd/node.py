"""envd's calls to the sandbox's node data plane (through the router's ``NodeLink``): answers checked, a
node's typed error body re-raised as the same PillDrops error, NDJSON streams read line by line."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx

from pilldrops import errors


def _raise_for(resp: httpx.Response, body: bytes) -> None:
    if resp.status_code < 300:
        return
    try:
        decoded: Any = json.loads(body)
    except ValueError:
        decoded = None
    raise errors.from_wire(resp.status_code, decoded)


async def call(ref: Any, method: str, path: str, **kw: Any) -> Any:
    """The node's JSON answer (None for an empty one)."""
    resp = await ref.node.request(method, path, **kw)
    _raise_for(resp, resp.content)
    return resp.json() if resp.content else None


async def raw(ref: Any, method: str, path: str, **kw: Any) -> httpx.Response:
    resp = await ref.node.request(method, path, **kw)
    _raise_for(resp, resp.content)
    return resp


@asynccontextmanager
async def lines(ref: Any, method: str, path: str, **kw: Any) -> AsyncIterator[AsyncIterator[dict[str, Any]]]:
    """An NDJSON stream from the node, as decoded objects; a non-2xx answer raises before any line."""
    async with ref.node.stream(method, path, **kw) as resp:
        if resp.status_code >= 300:
            _raise_for(resp, await resp.aread())

        async def it() -> AsyncIterator[dict[str, Any]]:
            try:
                async for ln in resp.aiter_lines():
                    if ln.strip():
                        yield json.loads(ln)
            except httpx.HTTPError as exc:
                raise errors.NodeUnavailable(f"the node's stream broke: {exc!r}") from exc
        yield it()
