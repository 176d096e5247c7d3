"""Ports by URL against a real `pilldrops up` (crun): ``sb.get_url(port)`` reaches a server inside the
sandbox (its own loopback only) through the control plane and the node's port tunnel, HTTP (GET, POST,
chunked uploads, streamed answers) and WebSocket; without its token, with a bad, expired or another
sandbox's or port's token it is refused with a typed error; a public port needs none; the browser's cookie
carries on after the first request; the token and PillDrops' own headers never reach the sandbox; a killed
sandbox is a clear 404, a closed port a 502."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest
from websockets.exceptions import InvalidStatus
from websockets.sync.client import connect as ws_connect

from pilldrops import Sandbox
from tests.ports.conftest import Up

pytestmark = pytest.mark.integration
SERVER = (Path(__file__).parent / "sandbox_server.py").read_bytes()


def _wait_listening(sb: Sandbox, port: int) -> None:
    probe = (f"busybox wget -q -O /dev/null http://127.0.0.1:{port}/" if sb.info.template == "tiny" else
             f"python3 -c \"import socket; socket.create_connection(('127.0.0.1', {port}))\"")
    deadline = time.monotonic() + 20
    while sb.run(probe).exit_code:
        assert time.monotonic() < deadline, f"nothing listens on {port} in the sandbox"
        time.sleep(0.2)


@pytest.fixture(scope="module")
def py(pd_up: Up) -> Iterator[Sandbox]:
    """A code-interpreter sandbox running sandbox_server.py on 8080 (not public)."""
    sb = Sandbox.create("code-interpreter", api_key=pd_up.api_key, api_url=pd_up.api_url, timeout=600)
    try:
        sb.files.write("/srv/server.py", SERVER)
        assert sb.run("setsid -f python3 /srv/server.py 8080 >/dev/null 2>&1 </dev/null").exit_code == 0
        _wait_listening(sb, 8080)
        yield sb
    finally:
        sb.kill()


@pytest.fixture(scope="module")
def tiny(pd_up: Up) -> Iterator[Sandbox]:
    """A tiny sandbox with busybox httpd on 8081 (public) and 8082 (not)."""
    sb = Sandbox.create("tiny", api_key=pd_up.api_key, api_url=pd_up.api_url, public_ports=[8081], timeout=600)
    try:
        sb.files.write("/srv/index.html", b"busybox says hi")
        assert sb.run("busybox httpd -p 127.0.0.1:8081 -h /srv && busybox httpd -p 127.0.0.1:8082 -h /srv"
                      ).exit_code == 0
        _wait_listening(sb, 8081)
        _wait_listening(sb, 8082)
        yield sb
    finally:
        sb.kill()


def _with_path(url: str, path: str) -> str:
    """``url`` (…/ports/{id}/{port}/?pd_token=…) pointing at ``path`` inside the sandbox instead."""
    head, _, query = url.partition("?")
    return head.rstrip("/") + path + (("?" + query) if query else "")


def _code(r: httpx.Response) -> str:
    return r.json()["error"]["code"]


def test_http_through_the_url(py: Sandbox) -> None:
    url = py.get_url(8080)
    assert "/ports/" + py.id + "/8080/" in url and "pd_token=" in url
    r = httpx.get(_with_path(url, "/hello"), timeout=30)
    assert r.status_code == 200 and r.text == "hello from inside"
    assert r.headers["content-length"] == str(len("hello from inside"))
    r = httpx.post(_with_path(url, "/echo"), content=b"x" * 300_000, timeout=30)
    assert r.status_code == 200 and r.content == b"x" * 300_000

    def chunks() -> Iterator[bytes]:            # a chunked upload (no Content-Length) streams through
        for i in range(50):
            yield b"%05d" % i * 1000

    r = httpx.put(_with_path(url, "/echo"), content=chunks(), timeout=30)
    assert r.status_code == 200 and r.content == b"".join(b"%05d" % i * 1000 for i in range(50))
    with httpx.stream("GET", _with_path(url, "/stream"), timeout=30) as s:
        assert s.status_code == 200
        assert b"".join(s.iter_raw()) == b"chunk0\nchunk1\nchunk2\n"
    r = httpx.get(_with_path(url, "/missing"), timeout=30)
    assert r.status_code == 404 and r.text == "not here"        # the sandbox's own answer, relayed
    info = py.get_url_info(8080, expires_in=120)
    assert info.expires_at is not None and not info.public
    r = httpx.get(py.get_url(8080, path="/headers?a=1&b=two"), timeout=30)
    assert r.json()["path"] == "/headers?a=1&b=two"


def test_websocket_through_the_url(py: Sandbox) -> None:
    url = py.get_url(8080, path="/ws?room=1").replace("http", "ws", 1)
    with ws_connect(url, open_timeout=20) as ws:
        ws.send("hi")
        assert ws.recv(timeout=10) == "/ws?room=1 hi"         # the token is not in the path it saw
        ws.send(b"\x00\x01" * 100)
        assert ws.recv(timeout=10) == b"/ws?room=1 " + b"\x00\x01" * 100
    bare = url.split("?")[0]
    with pytest.raises(InvalidStatus) as exc:                  # no token: refused before the handshake
        ws_connect(bare, open_timeout=20).close()
    assert exc.value.response.status_code == 401


def test_refused_without_a_valid_token(py: Sandbox, tiny: Sandbox, pd_up: Up) -> None:
    url = py.get_url(8080, path="/hello")
    bare = url.split("?")[0]
    r = httpx.get(bare, timeout=30)
    assert r.status_code == 401 and _code(r) == "url_token_required"
    token = url.split("pd_token=")[1]
    forged = token[:-4] + ("AAAA" if not token.endswith("AAAA") else "BBBB")
    r = httpx.get(bare, params={"pd_token": forged}, timeout=30)
    assert r.status_code == 401 and _code(r) == "url_token_invalid"
    r = httpx.get(bare, params={"pd_token": "garbage"}, timeout=30)
    assert r.status_code == 401 and _code(r) == "url_token_invalid"
    other_port = py.get_url(8081, path="/hello").split("pd_token=")[1]
    r = httpx.get(bare, params={"pd_token": other_port}, timeout=30)
    assert r.status_code == 401 and _code(r) == "url_token_invalid"
    other_sandbox = tiny.get_url(8080, path="/hello").split("pd_token=")[1]
    r = httpx.get(bare, params={"pd_token": other_sandbox}, timeout=30)
    assert r.status_code == 401 and _code(r) == "url_token_invalid"
    short = py.get_url(8080, expires_in=3, path="/hello")      # whole seconds: valid for 2 s at least
    assert httpx.get(short, timeout=30).status_code == 200
    time.sleep(max(0.0, int(short.split("pd_token=")[1].split(".")[1]) + 0.2 - time.time()))   # past its expiry
    r = httpx.get(short, timeout=30)
    assert r.status_code == 401 and _code(r) == "url_token_expired"
    # the E2B header form (on the API's port) reaches the same gateway: a sandbox made by our API is not
    # public there either
    r = httpx.get(f"{pd_up.api_url}/hello", timeout=30,
                  headers={"E2b-Sandbox-Id": py.id.replace("_", ""), "E2b-Sandbox-Port": "8080"})
    assert r.status_code == 401 and _code(r) == "url_token_required"
    for base in (pd_up.api_url, pd_up.ports_url):              # host form, same token, on either listener
        r = httpx.get(f"{base}/hello", params={"pd_token": token}, timeout=30,
                      headers={"Host": f"8080-{py.id.replace('_', '')}.sandbox.localhost"})
        assert r.status_code == 200 and r.text == "hello from inside"
    r = httpx.get(f"{pd_up.ports_url}/hello", timeout=30, headers={"Host": f"8080-{py.id.replace('_', '')}.sb.test"})
    assert r.status_code == 401 and _code(r) == "url_token_required"


def test_browser_keeps_working_after_the_first_request(py: Sandbox) -> None:
    url = py.get_url(8080, path="/page/")
    with httpx.Client(timeout=30) as browser:
        r = browser.get(url, headers={"Sec-Fetch-Mode": "navigate"})    # a navigation: cookie + clean redirect
        assert r.status_code == 303 and "pd_token" not in r.headers["location"]
        cookie = r.headers["set-cookie"]
        assert f"Path=/ports/{py.id}/8080/" in cookie and "HttpOnly" in cookie and "SameSite=Lax" in cookie
        r = browser.get(str(r.url.join(r.headers["location"])))     # no token any more: the cookie carries it
        assert r.status_code == 200 and 'href="sub.txt"' in r.text
        r = browser.get(str(r.url.join("sub.txt")))   # a relative link of the page
        assert r.status_code == 200 and r.text == "sub resource"
        ws = url.split("?")[0].replace("http", "ws", 1).replace("/page/", "/ws")
        cookie_header = "; ".join(f"{c.name}={c.value}" for c in browser.cookies.jar)
        with ws_connect(ws, additional_headers={"Cookie": cookie_header}, open_timeout=20) as conn:
            conn.send("via cookie")
            assert conn.recv(timeout=10) == "/ws via cookie"
    base = url.split("/page/")[0]
    assert httpx.get(base + "/page/sub.txt", timeout=30).status_code == 401        # a cookie-less client
    r = httpx.get(base, timeout=30)                                                  # no trailing slash
    assert r.status_code == 308 and r.headers["location"].endswith(f"/ports/{py.id}/8080/")


def test_nothing_of_pilldrops_reaches_the_sandbox(py: Sandbox, pd_up: Up) -> None:
    url = py.get_url(8080, path="/headers?keep=1")
    first = httpx.get(url, timeout=30)
    cookie = first.headers["set-cookie"].split(";")[0]
    r = httpx.get(url, timeout=30, headers={
        "Cookie": f"theirs=1; {cookie}", "Authorization": f"Bearer {pd_up.api_key}", "X-API-Key": pd_up.api_key,
        "X-Access-Token": "secret", "X-Custom": "kept"})
    seen = r.json()
    headers = {k.lower(): v for k, v in seen["headers"].items()}
    assert seen["path"] == "/headers?keep=1"
    assert headers["cookie"] == "theirs=1" and headers["x-custom"] == "kept"
    for ours in ("authorization", "x-api-key", "x-access-token"):
        assert ours not in headers
    assert pd_up.api_key not in r.text and "pd_token" not in r.text
    assert headers["x-forwarded-prefix"] == f"/ports/{py.id}/8080"


def test_public_port_needs_no_token(tiny: Sandbox) -> None:
    assert tiny.info.public_ports == [8081]
    url = tiny.get_url(8081)
    assert "pd_token" not in url and tiny.get_url_info(8081).public
    r = httpx.get(url, timeout=30)
    assert r.status_code == 200 and r.text == "busybox says hi"
    closed = tiny.get_url(8082).split("?")[0]          # another port of the same sandbox is not public
    r = httpx.get(closed, timeout=30)
    assert r.status_code == 401 and _code(r) == "url_token_required"
    assert httpx.get(tiny.get_url(8082), timeout=30).text == "busybox says hi"


def test_closed_port_and_killed_sandbox(pd_up: Up) -> None:
    with Sandbox.create("tiny", api_key=pd_up.api_key, api_url=pd_up.api_url) as sb:
        sb.files.write("/srv/index.html", b"up")
        assert sb.run("busybox httpd -p 127.0.0.1:8090 -h /srv").exit_code == 0
        _wait_listening(sb, 8090)
        url = sb.get_url(8090)
        assert httpx.get(url, timeout=30).text == "up"
        r = httpx.get(sb.get_url(8091), timeout=30)
        assert r.status_code == 502 and _code(r) == "port_not_open"
    t0 = time.monotonic()
    r = httpx.get(url, timeout=30)
    assert r.status_code == 404 and _code(r) == "sandbox_not_found"
    assert r.json()["error"]["details"]["end_reason"] == "killed"
    assert time.monotonic() - t0 < 10                   # a clear answer, never a hang


def test_cli_url(tiny: Sandbox, pd_up: Up) -> None:
    from click.testing import CliRunner

    from pilldrops.cli.main import cli
    env = {"PILLDROPS_API_URL": pd_up.api_url, "PILLDROPS_API_KEY": pd_up.api_key}
    out = CliRunner().invoke(cli, ["sandbox", "url", tiny.id, "8082", "--expires-in", "60"], env=env)
    assert out.exit_code == 0, out.output
    assert httpx.get(out.output.strip(), timeout=30).text == "busybox says hi"


def _origin(url: str) -> tuple[str, str | None, int | None]:
    u = urlsplit(url)
    return u.scheme, u.hostname, u.port


def test_sandbox_pages_have_an_origin_of_their_own(py: Sandbox, pd_up: Up) -> None:
    """The URL's origin is the port-URL listener's, never the API's and dashboard's; the API's listener
    refuses port URLs (HTTP and WebSocket) naming the right one; the port-URL listener serves no API and no
    dashboard."""
    url = py.get_url(8080, path="/hello")
    assert _origin(url) == _origin(pd_up.ports_url) != _origin(pd_up.api_url)
    dashboard = httpx.get(pd_up.api_url + "/", timeout=30)
    assert dashboard.status_code == 200 and "text/html" in dashboard.headers["content-type"]
    assert dashboard.headers["cross-origin-opener-policy"] == "same-origin"
    assert httpx.get(url, timeout=30).text == "hello from inside"
    misdirected = pd_up.api_url + urlsplit(url).path + "?" + urlsplit(url).query
    r = httpx.get(misdirected, timeout=30)
    assert r.status_code == 421 and _code(r) == "port_url_misdirected"
    assert r.json()["error"]["details"]["url"] == url.split("?")[0] and "pd_token" not in r.text
    with pytest.raises(InvalidStatus) as exc:
        ws_connect(misdirected.replace("http", "ws", 1).replace("/hello", "/ws"), open_timeout=20).close()
    assert exc.value.response.status_code == 421
    for path in ("/", "/v1/whoami", "/dashboard/app.js", "/v2/sandboxes"):
        r = httpx.get(pd_up.ports_url + path, headers={"Authorization": f"Bearer {pd_up.api_key}"}, timeout=30)
        assert r.status_code == 404 and _code(r) == "not_found", path


def test_origin_wide_headers_of_a_sandbox_are_policed(py: Sandbox) -> None:
    url = py.get_url(8080, path="/hostile")
    prefix = f"/ports/{py.id}/8080"
    r = httpx.get(url, timeout=30)
    assert r.status_code == 200 and r.text == "ok"
    cookies = r.headers.get_list("set-cookie")
    ours = [c for c in cookies if c.startswith("pilldrops_port=") and f"Path={prefix}/" in c]
    theirs = [c for c in cookies if c not in ours]
    assert len(ours) == 1 and "HttpOnly" in ours[0]           # the gateway's cookie from the token, only
    assert theirs == [f"mine=1; Path={prefix}/", "plain=2"]   # moved under the prefix, Domain dropped
    assert "service-worker-allowed" not in r.headers and "clear-site-data" not in r.headers
