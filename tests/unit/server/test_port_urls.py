"""Port URLs without a sandbox to reach: token signing and verification, the gateway's stripping of
PillDrops' own query parameter, cookie and headers, and the control plane's URL endpoint and access
decisions (in-process stack on the FakeRuntime, SQLite and PostgreSQL). Reaching a real server is
tests/ports (real crun)."""

from __future__ import annotations

import hmac
from datetime import UTC, datetime

import httpx
import pytest

from pilldrops import errors
from pilldrops._internal.clock import FakeClock
from pilldrops.server.ports import gateway, signing
from pilldrops.server.service.urls import URLService
from pilldrops.server.store.sql import Store
from tests.stack import stack

SECRET = b"s" * 32
NOW = 1_800_000_000


def test_sign_and_verify() -> None:
    token = signing.sign(SECRET, "sb_a", 8080, NOW + 60)
    assert token.startswith("v1.") and len(token) < signing.MAX_TOKEN_CHARS
    assert signing.verify(SECRET, token, "sb_a", 8080, NOW) == NOW + 60
    assert signing.sign(SECRET, "sb_a", 8080, NOW + 60) == token          # deterministic


@pytest.mark.parametrize("sandbox_id,port,secret", [("sb_b", 8080, SECRET), ("sb_a", 8081, SECRET),
                                                    ("sb_a", 8080, b"t" * 32)])
def test_another_sandbox_port_or_secret_is_invalid(sandbox_id: str, port: int, secret: bytes) -> None:
    token = signing.sign(SECRET, "sb_a", 8080, NOW + 60)
    with pytest.raises(errors.URLTokenInvalid):
        signing.verify(secret, token, sandbox_id, port, NOW)


def test_tampering_and_garbage_are_invalid_not_expired() -> None:
    token = signing.sign(SECRET, "sb_a", 8080, NOW - 10)          # expired AND tampered: says invalid
    v, exp, mac = token.split(".")
    for bad in [f"{v}.{int(exp) + 100}.{mac}", f"{v}.{exp}.{mac[:-1]}A" if mac[-1] != "A" else f"{v}.{exp}.{mac[:-1]}B",
                "", "v1", "v2." + token[3:], token + "x", "v1.1." + "A" * 24, "x" * 10_000, f"{v}.-5.{mac}"]:
        with pytest.raises(errors.URLTokenInvalid):
            signing.verify(SECRET, bad, "sb_a", 8080, NOW)


def test_expired() -> None:
    token = signing.sign(SECRET, "sb_a", 8080, NOW)
    assert signing.verify(SECRET, token, "sb_a", 8080, NOW - 1) == NOW
    with pytest.raises(errors.URLTokenExpired) as exc:
        signing.verify(SECRET, token, "sb_a", 8080, NOW)
    assert exc.value.code == "url_token_expired" and exc.value.status == 401


def test_mac_is_compared_in_constant_time(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    real = hmac.compare_digest
    monkeypatch.setattr(signing.hmac, "compare_digest", lambda a, b: calls.append(1) or real(a, b))
    signing.verify(SECRET, signing.sign(SECRET, "sb_a", 1, NOW + 1), "sb_a", 1, NOW)
    assert calls == [1]


def test_short_secret_refused() -> None:
    with pytest.raises(ValueError):
        signing.sign(b"short", "sb_a", 1, NOW)


def test_query_and_cookie_stripping() -> None:
    tokens, rest = gateway._query({"query_string": b"a=1&pd_token=v1.x&b=%20two&pd_token=v1.y"})
    assert tokens == ["v1.x", "v1.y"] and rest == b"a=1&b=%20two"
    ours, headers = gateway._cookies([(b"cookie", b"theirs=1; pilldrops_port=v1.c; other=2"),
                                      (b"cookie", b"pilldrops_port=v1.d"), (b"x-kept", b"1")])
    assert ours == ["v1.c", "v1.d"]
    assert headers == [(b"cookie", b"theirs=1; other=2"), (b"x-kept", b"1")]
    scope = {"headers": [(b"host", b"h:1")], "scheme": "https"}
    fwd = gateway._forwarded(scope, [(b"authorization", b"Bearer pd_secret"), (b"x-api-key", b"k"),
                                     (b"authorization", b"Basic dXNlcjo="), (b"x-access-token", b"t"),
                                     (b"e2b-sandbox-id", b"sbx"), (b"x-forwarded-prefix", b"/forged")], "/ports/sb_a/1")
    assert fwd == [(b"authorization", b"Basic dXNlcjo="), (b"x-forwarded-proto", b"https"),
                   (b"x-forwarded-host", b"h:1"), (b"x-forwarded-prefix", b"/ports/sb_a/1")]


@pytest.mark.anyio
async def test_secret_is_shared_through_the_store(tmp_path, store_url) -> None:
    clock = FakeClock(datetime.fromtimestamp(NOW, UTC))
    store = await Store.open(store_url)
    try:
        one, two = URLService(store, clock), URLService(store, clock)
        assert await one.secret() == await two.secret() and len(await one.secret()) >= 32
    finally:
        await store.close()
    store = await Store.open(store_url)           # a restart keeps it: URLs already handed out stay valid
    try:
        assert await URLService(store, clock).secret() == await one.secret()
    finally:
        await store.close()


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.mark.anyio
async def test_url_endpoint_and_access(tmp_path, store_url) -> None:
    async with stack(tmp_path, db_url=store_url) as st, st.client() as c:
        sb = (await c.post("/v1/sandboxes", json={"template": "tiny", "public_ports": [9000, 9000, 80]})).json()
        assert sb["public_ports"] == [80, 9000] and sb["public"] is False
        r = await c.post(f"/v1/sandboxes/{sb['id']}/urls", json={"port": 8080, "expires_in": 60, "path": "/a?b=1"})
        assert r.status_code == 201, r.text
        out = r.json()
        assert out["url"].startswith(f"http://cp/ports/{sb['id']}/8080/a?b=1&pd_token=v1.")
        assert out["public"] is False and out["expires_at"]
        pub = (await c.post(f"/v1/sandboxes/{sb['id']}/urls", json={"port": 9000})).json()
        assert pub == {"url": f"http://cp/ports/{sb['id']}/9000/", "port": 9000, "expires_at": None, "public": True}
        for bad in ({"port": 0}, {"port": 70000}, {"port": 1, "expires_in": 10**9}, {"port": 1, "path": "nope"}):
            r = await c.post(f"/v1/sandboxes/{sb['id']}/urls", json=bad)
            assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_request", bad
        assert (await c.post("/v1/sandboxes/sb_nosuch/urls", json={"port": 1})).status_code == 404
        other = await st.new_team_key("other")
        async with st.client(key=other) as o:          # another team's sandbox: not found
            assert (await o.post(f"/v1/sandboxes/{sb['id']}/urls", json={"port": 1})).status_code == 404
        # the gateway's answers that need no server in the sandbox
        bare = f"/ports/{sb['id']}/8080/a"
        r = await c.get(bare)
        assert r.status_code == 401 and r.json()["error"]["code"] == "url_token_required"
        r = await c.get("/ports/sb_nosuch/8080/")                         # unknown: same answer, no oracle
        assert r.status_code == 401 and r.json()["error"]["code"] == "url_token_required"
        assert (await c.get("/ports/nope")).status_code == 404
        assert (await c.get(f"/ports/{sb['id']}/99999/")).status_code == 404
        token = out["url"].split("pd_token=")[1]
        await c.delete(f"/v1/sandboxes/{sb['id']}")
        r = await c.get(bare, params={"pd_token": token})
        assert r.status_code == 404 and r.json()["error"]["code"] == "sandbox_not_found"
        assert r.json()["error"]["details"]["end_reason"] == "killed"
        r = await c.post(f"/v1/sandboxes/{sb['id']}/urls", json={"port": 8080})
        assert r.status_code == 409 and r.json()["error"]["code"] == "invalid_state"


@pytest.mark.anyio
async def test_paused_sandbox_is_409_and_public_host_form(tmp_path) -> None:
    async with stack(tmp_path, public_host="https://sb.example.test") as st, st.client() as c:
        sb = (await c.post("/v1/sandboxes", json={"template": "tiny", "public": True})).json()
        out = (await c.post(f"/v1/sandboxes/{sb['id']}/urls", json={"port": 3000})).json()
        assert out["url"] == f"https://3000-{sb['id'].replace('_', '')}.sb.example.test/" and out["public"]
        assert (await c.post(f"/v1/sandboxes/{sb['id']}/pause")).status_code == 200
        r = await c.get(f"/ports/{sb['id']}/3000/")
        assert r.status_code == 409 and r.json()["error"]["code"] == "invalid_state"
        r = await c.get("/", headers={"Host": f"3000-{sb['id'].replace('_', '')}.sb.example.test"})
        assert r.status_code == 502 and r.json()["message"] == "The sandbox was not found"   # E2B's answer


@pytest.mark.anyio
async def test_e2b_sandboxes_are_public_unless_they_say_otherwise(tmp_path) -> None:
    async with stack(tmp_path, templates=("tiny", "base")) as st, httpx.AsyncClient(
            transport=httpx.ASGITransport(app=st.cp.app), base_url="http://cp", headers={"X-API-Key": st.key}) as c:
        public = (await c.post("/v2/sandboxes", json={"templateID": "base"})).json()["sandboxID"]
        private = (await c.post("/v2/sandboxes", json={"templateID": "base",
                                                       "network": {"allowPublicTraffic": False}})).json()["sandboxID"]
        r = await c.get("/x", headers={"E2b-Sandbox-Id": private, "E2b-Sandbox-Port": "8080"})
        assert r.status_code == 401 and r.json()["error"]["code"] == "url_token_required"
        # public: admitted, then the fake runtime has no network to reach: E2B's "unreachable" answer
        r = await c.get("/x", headers={"E2b-Sandbox-Id": public, "E2b-Sandbox-Port": "8080"})
        assert r.status_code == 502 and r.json()["sandboxId"] == public
        assert r.json()["error"]["code"] != "url_token_required"
        async with st.client() as ours:
            info = (await ours.get(f"/v1/sandboxes/sb_{private[2:]}")).json()
            assert info["public"] is False and (await ours.get(f"/v1/sandboxes/sb_{public[2:]}")).json()["public"]
