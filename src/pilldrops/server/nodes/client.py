"""HTTP client for the node API (``/node/v1/...``, node token) and data-plane proxying.

Infrastructure errors stay here: anything that is not an answer from the node becomes ``NodeUnavailable``;
a typed error body from the node is re-raised as the same PillDrops error.

The node API's JSON calls (create, kill, deadlines, pools, pause/resume: one request, one small answer) go
through an exchange (``_Exchange``): on real sockets aiohttp's client (``AiohttpExchange``), which costs ~0.35 ms
of CPU a call against httpx's ~1.1-1.5 ms here (bench/RESULTS.md, issue 15 session 9): every cold create and
every kill makes one. In-process deployments (tests: an ASGI transport) keep httpx (``HttpxExchange``).
Streams (template builds) and data-plane relays use the httpx client (``http``) either way.
"""

from __future__ import annotations

import asyncio
import urllib.parse
import urllib.request
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any, Protocol

import aiohttp
import httpx
import orjson

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
CONNECT_TIMEOUT_S = 5.0
MAX_CONNECTIONS = 512
# the largest answer a JSON call of the node API reads (a batch kill of 1,000 ids answers ~0.5 MiB)
MAX_ANSWER_BYTES = 64 << 20
# what a reused connection the server closed meanwhile looks like (the request never reached the node app)
_STALE = (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError)
_AIO_STALE = (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError)
_JSON = "application/json"


class _Exchange(Protocol):
    """One request to a node and its whole answer: ``(status, body)``; a transport failure raises
    ``errors.NodeUnavailable``. ``retry_stale``: the call is safe to repeat, so a pooled connection found
    closed under it is retried once on a fresh one."""

    async def request(self, method: str, url: str, *, body: bytes | None, timeout: float,
                      retry_stale: bool) -> tuple[int, bytes]: ...

    async def aclose(self) -> None: ...


class HttpxExchange:
    """The node API's JSON calls over an httpx client (in-process transports: tests, ``tests/stack.py``)."""

    def __init__(self, http: httpx.AsyncClient) -> None:
        self._http = http

    async def request(self, method: str, url: str, *, body: bytes | None, timeout: float,
                      retry_stale: bool) -> tuple[int, bytes]:
        kw: dict[str, Any] = {"timeout": httpx.Timeout(timeout, connect=CONNECT_TIMEOUT_S)}
        if body is not None:
            kw.update(content=body, headers={"content-type": _JSON})
        try:
            try:
                resp = await self._http.request(method, url, **kw)
            except _STALE:
                if not retry_stale:
                    raise
                resp = await self._http.request(method, url, **kw)
        except httpx.HTTPError as exc:
            raise errors.NodeUnavailable(f"node at {url} did not answer: {exc!r}") from exc
        return resp.status_code, resp.content

    async def aclose(self) -> None:
        """The httpx client is the ``NodeClient``'s (it closes it)."""


class AiohttpExchange:
    """The node API's JSON calls over aiohttp (real sockets). Its session is made on first use, in the
    running event loop (asyncio only: the control plane's servers run on uvloop)."""

    def __init__(self, node_token: str) -> None:
        self._headers = {"Authorization": f"Bearer {node_token}"}
        self._session: aiohttp.ClientSession | None = None
        # proxies from the environment (HTTP_PROXY, NO_PROXY, ...) are honoured, as by the httpx client before,
        # read once as httpx does: aiohttp's ``trust_env`` reads them on every request (~0.8 ms of CPU here)
        self._env_proxies = urllib.request.getproxies_environment()
        self._proxy: dict[tuple[str, str], str | None] = {}

    def _open(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            connector = aiohttp.TCPConnector(limit=MAX_CONNECTIONS, limit_per_host=0,
                                             keepalive_timeout=KEEPALIVE_EXPIRY_S)
            self._session = aiohttp.ClientSession(connector=connector, headers=self._headers,
                                                  auto_decompress=False,
                                                  skip_auto_headers=("User-Agent", "Accept-Encoding"))
        return self._session

    def _proxy_for(self, url: str) -> str | None:
        parts = urllib.parse.urlsplit(url)
        key = (parts.scheme, parts.netloc)
        if key not in self._proxy:
            host = parts.netloc.rpartition("@")[2]          # host[:port], as the proxy bypass rules read it
            proxy = self._env_proxies.get(parts.scheme) or self._env_proxies.get("all")
            bypass = proxy is not None and urllib.request.proxy_bypass_environment(host, self._env_proxies)
            self._proxy[key] = None if bypass else proxy
        return self._proxy[key]

    async def _once(self, method: str, url: str, body: bytes | None, timeout: float) -> tuple[int, bytes]:
        headers = {"Content-Type": _JSON} if body is not None else None
        # as httpx's Timeout(timeout, connect=5): waiting for a pooled connection at most ``timeout``, the
        # connect (DNS included) at most CONNECT_TIMEOUT_S, each read at most ``timeout``
        t = aiohttp.ClientTimeout(total=None, connect=timeout, sock_connect=CONNECT_TIMEOUT_S, sock_read=timeout)
        # no redirects followed (as httpx's default): a node's 3xx is an error, never a second request
        async with self._open().request(method, url, data=body, headers=headers, timeout=t,
                                        proxy=self._proxy_for(url), allow_redirects=False) as resp:
            size = resp.content_length
            if size is not None:
                if size > MAX_ANSWER_BYTES:
                    raise errors.NodeUnavailable(f"node at {url} answered {size} bytes (at most "
                                                 f"{MAX_ANSWER_BYTES} are read)")
                return resp.status, await resp.content.readexactly(size)
            data = bytearray()              # chunked: the whole body, as it arrives, bounded
            async for chunk in resp.content.iter_any():
                data += chunk
                if len(data) > MAX_ANSWER_BYTES:
                    raise errors.NodeUnavailable(f"node at {url} answered more than {MAX_ANSWER_BYTES} bytes")
            return resp.status, bytes(data)

    async def request(self, method: str, url: str, *, body: bytes | None, timeout: float,
                      retry_stale: bool) -> tuple[int, bytes]:
        try:
            try:
                return await self._once(method, url, body, timeout)
            except _AIO_STALE as exc:
                # a refused connect or a failed lookup is no stale connection: not sent again
                if not retry_stale or isinstance(exc, aiohttp.ClientConnectorError):
                    raise
                return await self._once(method, url, body, timeout)
        except (TimeoutError, aiohttp.ClientError, OSError, ValueError, asyncio.IncompleteReadError) as exc:
            raise errors.NodeUnavailable(f"node at {url} did not answer: {exc!r}") from exc

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


class NodeClient:
    def __init__(self, node_token: str, *, timeout: float = 60.0,
                 transport: httpx.AsyncBaseTransport | None = None) -> None:
        self._token = node_token
        self._timeout = timeout
        self._http = httpx.AsyncClient(
            transport=transport,
            timeout=httpx.Timeout(timeout, connect=CONNECT_TIMEOUT_S),
            limits=httpx.Limits(max_connections=MAX_CONNECTIONS, max_keepalive_connections=128,
                                keepalive_expiry=KEEPALIVE_EXPIRY_S),
            headers={"Authorization": f"Bearer {node_token}"},
        )
        self._json: _Exchange = HttpxExchange(self._http) if transport is not None else AiohttpExchange(node_token)

    async def aclose(self) -> None:
        await self._json.aclose()
        await self._http.aclose()

    @property
    def http(self) -> httpx.AsyncClient:
        """The pooled client, with the node token set (for data-plane relays: ``pilldrops.e2b``)."""
        return self._http

    async def _call(self, method: str, url: str, *, body: bytes | str | None = None, retry_stale: bool = False,
                    timeout: float | None = None) -> Any:
        """The node's JSON answer to one call (None when empty), or its error as the same typed PillDrops
        error. ``retry_stale``: the call is safe to repeat (the node's create and kill are idempotent per id),
        so a connection found closed under it is retried once on a fresh one."""
        content = await self._send(method, url, body=body, retry_stale=retry_stale, timeout=timeout)
        return _loads(url, content) if content else None

    async def _send(self, method: str, url: str, *, body: bytes | str | None = None, retry_stale: bool = False,
                    timeout: float | None = None) -> bytes:
        """The body of the node's 2xx answer to one call (``_call``), or its error as the same typed error."""
        data = body.encode() if isinstance(body, str) else body
        status, content = await self._json.request(method, url, body=data, retry_stale=retry_stale,
                                                   timeout=self._timeout if timeout is None else timeout)
        if status in (401, 403):
            raise errors.NodeUnavailable(f"node at {url} refused the node token (HTTP {status}); "
                                         "check the node's --node-token")
        if status >= 400:
            try:
                err = _loads(url, content)
            except errors.NodeUnavailable:
                err = None
            raise errors.from_wire(status, err)
        return content

    async def create(self, node_url: str, spec: NodeSandboxSpec) -> NodeSandboxStatus:
        # the answer's bytes straight into the model (pydantic-core's own JSON parser): no dict in between
        content = await self._send("POST", f"{node_url}/node/v1/sandboxes", body=spec.model_dump_json(),
                                   retry_stale=True)
        return _status(node_url, "create", content)

    async def kill(self, node_url: str, sandbox_id: str) -> NodeSandboxStatus | None:
        try:
            content = await self._send("DELETE", f"{node_url}/node/v1/sandboxes/{sandbox_id}", retry_stale=True)
        except errors.NotFound:
            return None
        return _status(node_url, "kill", content)

    async def kill_many(self, node_url: str, sandbox_ids: list[str]) -> dict[str, NodeKilled]:
        """Kill many sandboxes of one node in ONE call: per id its final status (none: not on that node) or
        its error. A node from before batch kills (no such route: 404/405) gets one ``kill`` per id."""
        body = NodeKillMany(ids=sandbox_ids).model_dump_json()
        try:
            data = await self._call("POST", f"{node_url}/node/v1/sandboxes/kill", body=body, retry_stale=True,
                                    timeout=60.0 + 0.5 * len(sandbox_ids))
        except (errors.NotFound, errors.InvalidRequest):    # an older node: the route is not there
            return {sid: NodeKilled(id=sid, status=await self.kill(node_url, sid)) for sid in sandbox_ids}
        return {item.id: item for item in NodeKilledMany.model_validate(data).items}

    async def set_deadline(self, node_url: str, sandbox_id: str, deadline: NodeDeadline) -> NodeSandboxStatus:
        data = await self._call("PUT", f"{node_url}/node/v1/sandboxes/{sandbox_id}/deadline",
                                body=deadline.model_dump_json())
        return NodeSandboxStatus.model_validate(data)

    async def pause(self, node_url: str, sandbox_id: str) -> NodeSandboxStatus:
        data = await self._call("POST", f"{node_url}/node/v1/sandboxes/{sandbox_id}/pause", timeout=600.0)
        return NodeSandboxStatus.model_validate(data)

    async def resume(self, node_url: str, sandbox_id: str, body: NodeResume) -> NodeSandboxStatus:
        data = await self._call("POST", f"{node_url}/node/v1/sandboxes/{sandbox_id}/resume",
                                body=body.model_dump_json(), timeout=600.0)
        return NodeSandboxStatus.model_validate(data)

    async def set_pools(self, node_url: str, pools: list[NodePoolSpec]) -> None:
        await self._call("PUT", f"{node_url}/node/v1/pools", body="[" + ",".join(
            p.model_dump_json() for p in pools) + "]")

    async def forget(self, node_url: str, sandbox_id: str) -> None:
        """Drop a checkpoint that moved to another node (no end is recorded: the sandbox lives on)."""
        try:
            await self._call("DELETE", f"{node_url}/node/v1/sandboxes/{sandbox_id}/checkpoint")
        except errors.NotFound:
            return

    async def hold_template(self, node_url: str, ref: NodeTemplateRef) -> None:
        """Have that node hold a template-store version (it fetches what it lacks)."""
        await self._call("POST", f"{node_url}/node/v1/templates/refs", body=ref.model_dump_json(), timeout=600.0)

    @asynccontextmanager
    async def stream_build(self, node_url: str, body: NodeBuildRequest) -> AsyncIterator[AsyncIterator[str]]:
        """Run a template build on that node; yields its NDJSON event lines as they come (no read timeout:
        a Debian build takes minutes)."""
        url = f"{node_url}/node/v1/templates/builds"
        req = self._http.build_request("POST", url, content=body.model_dump_json(),
                                       headers={"content-type": "application/json"},
                                       timeout=httpx.Timeout(None, connect=CONNECT_TIMEOUT_S))
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
                                       timeout=httpx.Timeout(None, connect=CONNECT_TIMEOUT_S, pool=30.0))
        try:
            resp = await self._http.send(req, stream=True)
        except httpx.HTTPError as exc:
            raise errors.NodeUnavailable(f"node at {url} did not answer: {exc!r}") from exc
        try:
            yield resp
        finally:
            await resp.aclose()


def _status(node_url: str, what: str, content: bytes) -> NodeSandboxStatus:
    """A create's or kill's answer, its bytes straight into the model (pydantic-core's own JSON parser)."""
    try:
        return NodeSandboxStatus.model_validate_json(content)
    except ValueError as exc:
        raise errors.NodeUnavailable(f"node at {node_url} answered a {what} with no status: {exc}") from exc


def _loads(url: str, content: bytes) -> Any:
    try:
        return orjson.loads(content)
    except orjson.JSONDecodeError as exc:
        raise errors.NodeUnavailable(f"node at {url} answered something that is not JSON: {content[:200]!r}") from exc
