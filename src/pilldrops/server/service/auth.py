"""Teams, API keys and who is calling. Keys are stored hashed; a revoked or unknown key is a 401."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

from pilldrops import errors
from pilldrops._internal.clock import Clock, TTLCache
from pilldrops.schema.api import KeyCreated, KeyInfo
from pilldrops.server.domain import keys as keyrules
from pilldrops.server.store.interface import ApiKeyRecord as ApiKey
from pilldrops.server.store.interface import Store
from pilldrops.server.store.interface import TeamRecord as Team

_TOUCH_EVERY = timedelta(seconds=60)
KEY_CACHE_S = 3.0


@dataclass(frozen=True)
class Principal:
    team_id: str
    key_id: str
    admin: bool = False

    def require_admin(self) -> None:
        if not self.admin:
            raise errors.PermissionDenied("this needs the operator's admin key (made by `pilldrops up` or "
                                          "`pilldrops serve` on first start)")


def key_info(k: ApiKey) -> KeyInfo:
    return KeyInfo(id=k.id, name=k.name, team_id=k.team_id, prefix=k.prefix, created_at=k.created_at,
                   revoked_at=k.revoked_at, last_used_at=k.last_used_at)


class AuthService:
    def __init__(self, store: Store, clock: Clock, initial_credits: float = 5.0) -> None:
        self.store = store
        self.clock = clock
        self.initial_credits = initial_credits
        # key lookups, cached briefly (one query less per request); a revocation through this process
        # clears it, one through another control plane takes effect within KEY_CACHE_S
        self._keys: TTLCache[str, ApiKey] = clock.ttl_cache(KEY_CACHE_S)

    async def authenticate(self, secret: str | None) -> Principal:
        if not secret:
            raise errors.AuthenticationError(
                "missing API key: send 'Authorization: Bearer <key>' (see `pilldrops up` or PILLDROPS_API_KEY)")
        digest = keyrules.hash_key(secret)
        key = self._keys.get(digest)
        if key is None:
            key = await self.store.key_by_hash(digest)
            if key is not None:
                self._keys.put(digest, key)
        if key is None or key.revoked_at is not None:
            raise errors.AuthenticationError("invalid or revoked API key")
        now = self.clock.now()
        if key.last_used_at is None or now - key.last_used_at > _TOUCH_EVERY:
            await self.store.touch_key(key.id, now)
            key.last_used_at = now
        return Principal(team_id=key.team_id, key_id=key.id, admin=key.admin)

    async def create_team(self, name: str, credits_usd: float | None = None) -> Team:
        credits = self.initial_credits if credits_usd is None else credits_usd
        return await self.store.create_team(name, self.clock.now(), credits)

    async def create_key(self, team_id: str, name: str, *, admin: bool = False) -> KeyCreated:
        secret = keyrules.generate_key()
        k = await self.store.add_key(team_id, name, keyrules.display_prefix(secret), keyrules.hash_key(secret),
                                     self.clock.now(), admin=admin)
        return KeyCreated(**key_info(k).model_dump(), secret=secret)

    async def list_keys(self, team_id: str) -> list[KeyInfo]:
        return [key_info(k) for k in await self.store.list_keys(team_id)]

    async def revoke_key(self, team_id: str, key_id: str) -> KeyInfo:
        k = await self.store.revoke_key(team_id, key_id, self.clock.now())
        self._keys.clear()
        if k is None:
            raise errors.NotFound(f"no key {key_id!r}")
        return key_info(k)

    async def bootstrap(self, saved_secret: str | None) -> tuple[str, str | None]:
        """First start: make a team and a key. Later starts: reuse the saved key if it is still valid.

        Returns ``(team_id, new_secret_or_None)``; ``None`` means the saved key is still good.
        """
        teams = await self.store.list_teams()
        if saved_secret and teams:
            try:
                principal = await self.authenticate(saved_secret)
                return principal.team_id, None
            except errors.AuthenticationError:
                pass
        team = teams[0] if teams else await self.create_team("default")
        created = await self.create_key(team.id, "pilldrops-up", admin=True)
        return team.id, created.secret
