"""HTTP client for the node API (``/node/v1/...``, node token) and data-plane proxying.

Infrastructure errors stay here: anything that is not an answer from the node becomes ``NodeUnavailable``;
a typed error body from the node is re-raised as the same PillDrops error.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx

from pilldrops import errors
from pilldrops.schema.node import (
    NodeBuildRequest,
    NodeDeadline,
    NodeKilled,
    NodeKilledMany,
    NodeKillMany,
    NodePoolSpec,
    NodeResume,
    NodeSandboxSpec,
    NodeSandboxStatus,
    NodeTemplateRef,
)

# a pooled connection the node is about to close must not be reused (a node closes idle ones after 20 s,
# serving.KEEP_ALIVE_S; an older one after 5 s): the request then dies with ReadError('') and the create fails
KEEPALIVE_EXPIRY_S = 2.0
# what a reused connection the server closed meanwhile looks like (the request never reached the node app)
_STALE = (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError)
_JSON = {"content-type": "application/json"}


class NodeClient:
    def __init__(self, node_token: str, *, timeout: float = 60.0,
                 transport: httpx.AsyncBaseTransport | None = None) -> None:
        self._token = node_token
        self._http = httpx.AsyncClient(
            transport=transport,
            timeout=httpx.Timeout(timeout, connect=5.0),
            limits=httpx.Limits(max_connections=512, max_keepalive_connections=128,
                                keepalive_expiry=KEEPALIVE_EXPIRY_S),
            headers={"Authorization": f"Bearer {node_token}"},
        )

    async def aclose(self) -> None:
        await self._http.aclose()

    @property
    def http(self) -> httpx.AsyncClient:
        """The pooled client, with the node token set (for data-plane relays: ``pilldrops.e2b``)."""
        return self._http

    async def _call(self, method: str, url: str, *, retry_stale: bool = False, **kw: Any) -> Any:
        """``retry_stale``: the call is safe to repeat (the node's create and kill are idempotent per id), so a
        connection found closed under it is retried once on a fresh one."""
        resp = await self._send(method, url, retry_stale=retry_stale, **kw)
        return resp.json() if resp.content else None

    async def _send(self, method: str, url: str, *, retry_stale: bool = False, **kw: Any) -> httpx.Response:
        """The node's answer to one call (``_call``), or its error as the same typed PillDrops error."""
        try:
            try:
                resp = await self._http.request(method, url, **kw)
            except _STALE:
                if not retry_stale:
                    raise
                resp = await self._http.request(method, url, **kw)
        except httpx.HTTPError as exc:
            raise errors.NodeUnavailable(f"node at {url} did not answer: {exc!r}") from exc
        if resp.status_code in (401, 403):
            raise errors.NodeUnavailable(f"node at {url} refused the node token (HTTP {resp.status_code}); "
                                         "check the node's --node-token")
        if resp.status_code >= 400:
            try:
                body = resp.json()
            except ValueError:
                body = None
            raise errors.from_wire(resp.status_code, body)
        return resp

    async def create(self, node_url: str, spec: NodeSandboxSpec) -> NodeSandboxStatus:
        # the answer's bytes straight into the model (pydantic-core's own JSON parser): no dict in between
        resp = await self._send("POST", f"{node_url}/node/v1/sandboxes", content=spec.model_dump_json(),
                                headers=_JSON, retry_stale=True)
        return NodeSandboxStatus.model_validate_json(resp.content)

    async def kill(self, node_url: str, sandbox_id: str) -> NodeSandboxStatus | None:
        try:
            resp = await self._send("DELETE", f"{node_url}/node/v1/sandboxes/{sandbox_id}", retry_stale=True)
        except errors.NotFound:
            return None
        return NodeSandboxStatus.model_validate_json(resp.content)      # as ``create``: no dict in between

    async def kill_many(self, node_url: str, sandbox_ids: list[str]) -> dict[str, NodeKilled]:
        """Kill many sandboxes of one node in ONE call: per id its final status (none: not on that node) or
        its error. A node from before batch kills (no such route: 404/405) gets one ``kill`` per id."""
        body = NodeKillMany(ids=sandbox_ids).model_dump_json()
        try:
            data = await self._call("POST", f"{node_url}/node/v1/sandboxes/kill", content=body,
                                    headers={"content-type": "application/json"}, retry_stale=True,
                                    timeout=httpx.Timeout(60.0 + 0.5 * len(sandbox_ids), connect=5.0))
        except (errors.NotFound, errors.InvalidRequest):    # an older node: the route is not there
            return {sid: NodeKilled(id=sid, status=await self.kill(node_url, sid)) for sid in sandbox_ids}
        return {item.id: item for item in NodeKilledMany.model_validate(data).items}

    async def set_deadline(self, node_url: str, sandbox_id: str, deadline: NodeDeadline) -> NodeSandboxStatus:
        data = await self._call("PUT", f"{node_url}/node/v1/sandboxes/{sandbox_id}/deadline",
                                content=deadline.model_dump_json(),
                                headers={"content-type": "application/json"})
        return NodeSandboxStatus.model_validate(data)

    async def pause(self, node_url: str, sandbox_id: str) -> NodeSandboxStatus:
        data = await self._call("POST", f"{node_url}/node/v1/sandboxes/{sandbox_id}/pause",
                                timeout=httpx.Timeout(600.0, connect=5.0))
        return NodeSandboxStatus.model_validate(data)

    async def resume(self, node_url: str, sandbox_id: str, body: NodeResume) -> NodeSandboxStatus:
        data = await self._call("POST", f"{node_url}/node/v1/sandboxes/{sandbox_id}/resume",
                                content=body.model_dump_json(), headers={"content-type": "application/json"},
                                timeout=httpx.Timeout(600.0, connect=5.0))
        return NodeSandboxStatus.model_validate(data)

    async def set_pools(self, node_url: str, pools: list[NodePoolSpec]) -> None:
        await self._call("PUT", f"{node_url}/node/v1/pools", content="[" + ",".join(
            p.model_dump_json() for p in pools) + "]", headers={"content-type": "application/json"})

    async def forget(self, node_url: str, sandbox_id: str) -> None:
        """Drop a checkpoint that moved to another node (no end is recorded: the sandbox lives on)."""
        try:
            await self._call("DELETE", f"{node_url}/node/v1/sandboxes/{sandbox_id}/checkpoint")
        except errors.NotFound:
            return

    async def hold_template(self, node_url: str, ref: NodeTemplateRef) -> None:
        """Have that node hold a template-store version (it fetches what it lacks)."""
        await self._call("POST", f"{node_url}/node/v1/templates/refs", content=ref.model_dump_json(),
                         headers={"content-type": "application/json"}, timeout=httpx.Timeout(600.0, connect=5.0))

    @asynccontextmanager
    async def stream_build(self, node_url: str, body: NodeBuildRequest) -> AsyncIterator[AsyncIterator[str]]:
        """Run a template build on that node; yields its NDJSON event lines as they come (no read timeout:
        a Debian build takes minutes)."""
        url = f"{node_url}/node/v1/templates/builds"
        req = self._http.build_request("POST", url, content=body.model_dump_json(),
                                       headers={"content-type": "application/json"},
                                       timeout=httpx.Timeout(None, connect=5.0))
        try:
            resp = await self._http.send(req, stream=True)
        except httpx.HTTPError as exc:
            raise errors.NodeUnavailable(f"node at {url} did not answer: {exc!r}") from exc
        try:
            if resp.status_code >= 400:
                await resp.aread()
                try:
                    data = resp.json()
                except ValueError:
                    data = None
                raise errors.from_wire(resp.status_code, data)
            yield resp.aiter_lines()
        finally:
            await resp.aclose()

    @asynccontextmanager
    async def proxy(self, method: str, url: str, *, headers: dict[str, str], params: Any,
                    body: AsyncIterator[bytes] | None) -> AsyncIterator[httpx.Response]:
        """Forward a data-plane request to the node and yield the streamed answer (not yet read)."""
        req = self._http.build_request(method, url, headers=headers, params=params, content=body,
                                       timeout=httpx.Timeout(None, connect=5.0, pool=30.0))
        try:
            resp = await self._http.send(req, stream=True)
        except httpx.HTTPError as exc:
            raise errors.NodeUnavailable(f"node at {url} did not answer: {exc!r}") from exc
        try:
            yield resp
        finally:
            await resp.aclose()
