"""Ports by URL (issue 14): signed, expiring URLs to a port inside a sandbox, and the access decision for
every request that arrives on one.

A URL is ``{api}/ports/{sandbox_id}/{port}{path}?pd_token=...`` on the control plane's own port, or, when
the operator configured a wildcard host (``--public-host``), ``{scheme}://{port}-{id}.{public_host}{path}?
pd_token=...``. The token (``server.ports.signing``) is made with the deployment's secret, kept in the
store so that every control-plane process of a fleet signs and verifies alike. A sandbox's public ports
(``public_ports`` / ``public`` at create) are served without one.
"""

from __future__ import annotations

import math
import secrets
from datetime import UTC, datetime
from urllib.parse import urlsplit

from pilldrops import errors
from pilldrops._internal.clock import Clock
from pilldrops.schema.api import PortURL, PortURLRequest, SandboxState
from pilldrops.server.domain.states import ENDED
from pilldrops.server.ports import signing
from pilldrops.server.store.interface import SandboxRecord, Store

S = SandboxState
SECRET_NAME = "port_url_signing_key"
TOKEN_PARAM = "pd_token"
PATH_PREFIX = "/ports/"
NOT_YET = {S.pausing.value, S.paused.value, S.resuming.value}


def host_id(sandbox_id: str) -> str:
    """The id as it appears in a host name (``sb_abc`` -> ``sbabc``: no ``_`` in DNS labels)."""
    return sandbox_id.replace("_", "", 1) if sandbox_id.startswith("sb_") else sandbox_id


def is_public(row: SandboxRecord, port: int) -> bool:
    return bool(row.public) or port in (row.public_ports or [])


class URLService:
    def __init__(self, store: Store, clock: Clock, public_host: str | None = None) -> None:
        self.store = store
        self.clock = clock
        self.public_host = public_host.rstrip("/") if public_host else None
        self._secret: bytes | None = None

    async def secret(self) -> bytes:
        if self._secret is None:
            value = await self.store.shared_secret(SECRET_NAME, secrets.token_urlsafe(32), self.clock.now())
            self._secret = value.encode()
        return self._secret

    # ---- making URLs ---------------------------------------------------------------------------------

    async def create(self, row: SandboxRecord, req: PortURLRequest, base_url: str) -> PortURL:
        """A URL for ``req.port`` of the team's sandbox ``row``; ``base_url`` is the API's address as the
        caller reached it."""
        if S(row.state) in ENDED:
            raise errors.InvalidState(f"sandbox {row.id} is {row.state}; an ended sandbox serves no port",
                                      current=row.state, target=S.running.value)
        public = is_public(row, req.port)
        expires_at = None if public else math.floor(self.clock.now().timestamp()) + req.expires_in
        path, _, query = req.path.partition("?")
        params = [query] if query else []
        if expires_at is not None:
            params.append(f"{TOKEN_PARAM}={signing.sign(await self.secret(), row.id, req.port, expires_at)}")
        qs = ("?" + "&".join(params)) if params else ""
        if self.public_host:
            scheme = urlsplit(self.public_host).scheme if "://" in self.public_host else urlsplit(base_url).scheme
            host = self.public_host.split("://", 1)[-1]
            url = f"{scheme}://{req.port}-{host_id(row.id)}.{host}{path}{qs}"
        else:
            url = f"{base_url.rstrip('/')}{PATH_PREFIX}{row.id}/{req.port}{path}{qs}"
        return PortURL(url=url, port=req.port, public=public,
                       expires_at=datetime.fromtimestamp(expires_at, UTC) if expires_at is not None else None)

    # ---- serving them --------------------------------------------------------------------------------

    async def authorize(self, sandbox_id: str, port: int, tokens: list[str], *, reveal_missing: bool = False
                        ) -> tuple[SandboxRecord, int | None]:
        """The running sandbox behind a request for ``port``, and the expiry of the token that admitted it
        (None: a public port). Without a valid token nobody learns whether a sandbox exists (an unknown one
        is refused like a private one), unless ``reveal_missing`` (the E2B surface, whose envd port tells
        anyway); then an ended sandbox is 404 and a paused one 409."""
        secret = await self.secret()
        now = self.clock.now().timestamp()
        first_error: errors.PillDropsError | None = None
        expires_at: int | None = None
        for token in tokens[:8]:
            try:
                expires_at = signing.verify(secret, token, sandbox_id, port, now)
                break
            except errors.AuthenticationError as exc:
                first_error = first_error or exc
        row = await self.store.get_sandbox(sandbox_id)
        if row is None and reveal_missing:
            raise errors.SandboxNotFound(f"sandbox {sandbox_id!r} not found", details={"sandbox_id": sandbox_id})
        if expires_at is None and (row is None or not is_public(row, port)):
            raise first_error or errors.URLTokenRequired(
                f"this URL needs its token (?{TOKEN_PARAM}=...); get one with sb.get_url({port}) or "
                f"`pilldrops sandbox url {sandbox_id} {port}`")
        if row is None:
            raise errors.SandboxNotFound(f"sandbox {sandbox_id!r} not found", details={"sandbox_id": sandbox_id})
        if S(row.state) in ENDED:
            when = f" at {row.ended_at:%Y-%m-%d %H:%M:%S} UTC" if row.ended_at else ""
            raise errors.SandboxNotFound(f"sandbox {sandbox_id} has ended ({row.end_reason or row.state}{when})",
                                         details={"sandbox_id": sandbox_id, "state": row.state,
                                                  "end_reason": row.end_reason})
        if row.state != S.running.value:
            hint = "; resume it first" if row.state in NOT_YET else ""
            raise errors.InvalidState(f"sandbox {sandbox_id} is {row.state}, not running{hint}",
                                      current=row.state, target=S.running.value)
        return row, expires_at
