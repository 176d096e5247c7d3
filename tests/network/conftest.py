"""Network tier (issue 14): a real `pilldrops up` whose sandboxes get egress, and an "outside host" the
suite makes itself: a network namespace ``pdt<suffix>`` joined to the host by the veth ``pdt<suffix>u``,
with HTTP servers on 198.18.N.2 and .3 (RFC 2544 benchmark range), a DNS server on .2 resolving
``outside.pd.test``, and 169.254.169.254 reached through it (a policy-routing rule for the agent's pool
only: the host's own traffic to that address is untouched). No other address is ever used: the agent is
told to forward DNS to the test resolver and to NAT out by the test veth only.

Everything made here carries this session's suffix and is removed at the end; every test checks that no
link, nft chain, map element, netns, process, mount or cgroup of its sandboxes is left (``leakcheck``).
Needs root, crun, ip and nft; skips with the reason otherwise."""

from __future__ import annotations

import ipaddress
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.up import Up, no_leaks_of, running

SFX = f"{os.getpid() & 0xFFFFF:05x}"
NAME = f"net{SFX}"
MATCH = f"pilldrops-{NAME}"
NETNS = f"pdt{SFX}"
UPLINK = f"pdt{SFX}u"
RT_TABLE = 20000 + (os.getpid() % 10000)
OUTSIDE_NAME = "outside.pd.test"


def _sh(*argv: str, check: bool = True, input: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(argv), capture_output=True, text=True, check=check, input=input)


def _routes() -> list[ipaddress.IPv4Network]:
    out = []
    for r in json.loads(_sh("ip", "-j", "-4", "route", "show", "table", "all").stdout or "[]"):
        try:
            if r.get("dst") not in (None, "default"):
                out.append(ipaddress.IPv4Network(r["dst"], strict=False))
        except ValueError:
            pass
    return out


def _free_net(candidates: Iterator[str]) -> ipaddress.IPv4Network:
    taken = _routes()
    for c in candidates:
        net = ipaddress.IPv4Network(c)
        if not any(net.overlaps(t) for t in taken):
            return net
    raise RuntimeError("no free test subnet")


@dataclass
class Outside:
    net: ipaddress.IPv4Network
    pool: ipaddress.IPv4Network
    proc: subprocess.Popen[str]

    @property
    def host_ip(self) -> str:          # the host's end of the test uplink
        return str(self.net.network_address + 1)

    @property
    def ip(self) -> str:               # the outside host (HTTP + DNS)
        return str(self.net.network_address + 2)

    @property
    def ip2(self) -> str:              # a second outside address (HTTP)
        return str(self.net.network_address + 3)


def _why_not_runnable() -> str | None:
    if os.geteuid() != 0:
        return "network tests need root (network namespaces, veth, nftables, crun)"
    for tool in ("crun", "ip", "nft", "nsenter"):
        if not shutil.which(tool):
            return f"{tool} is not installed (run scripts/install-system-deps)"
    return None


def _teardown_outside() -> None:
    _sh("ip", "rule", "del", "pref", str(RT_TABLE), check=False)
    _sh("ip", "route", "flush", "table", str(RT_TABLE), check=False)
    _sh("ip", "link", "del", UPLINK, check=False)
    _sh("ip", "netns", "del", NETNS, check=False)


@pytest.fixture(scope="session")
def outside() -> Iterator[Outside]:
    why = _why_not_runnable()
    if why:
        pytest.skip(why)
    pid = os.getpid()
    net = _free_net(f"198.18.{(pid + i) % 250}.0/24" for i in range(250))
    pool = _free_net(f"10.{224 + (pid + i) % 30}.{(pid // 30 + i) % 256}.0/24" for i in range(500))
    host, ip, ip2 = (str(net.network_address + k) for k in (1, 2, 3))
    _teardown_outside()
    try:
        _sh("ip", "netns", "add", NETNS)
        _sh("ip", "link", "add", UPLINK, "type", "veth", "peer", "name", "eth0", "netns", NETNS)
        _sh("ip", "addr", "add", f"{host}/24", "dev", UPLINK)
        _sh("ip", "link", "set", UPLINK, "up")
        _sh("ip", "-n", NETNS, "-batch", "-", input=(
            f"addr add {ip}/24 dev eth0\naddr add {ip2}/24 dev eth0\naddr add 169.254.169.254/32 dev lo\n"
            f"link set lo up\nlink set eth0 up\nroute add default via {host}\n"))
        # 169.254.169.254 through the outside host, for traffic from the agent's pool only
        _sh("ip", "route", "add", "169.254.169.254/32", "via", ip, "dev", UPLINK, "table", str(RT_TABLE))
        _sh("ip", "rule", "add", "from", str(pool), "lookup", str(RT_TABLE), "pref", str(RT_TABLE))
        proc = subprocess.Popen(
            ["ip", "netns", "exec", NETNS, sys.executable, str(Path(__file__).with_name("outside.py")),
             "--http", f"{ip}:8080", "--http", f"{ip2}:8080", "--http", "169.254.169.254:8080",
             "--dns", f"{ip}:53", "--name", f"{OUTSIDE_NAME}={ip}"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        try:
            yield Outside(net, pool, proc)
        finally:
            assert proc.stdin is not None
            proc.stdin.close()
            proc.kill()
            proc.wait(10)
    finally:
        _teardown_outside()


@dataclass
class Server(Up):
    """The tier's own `up` (tests/up.py; not the session's shared one): egress to the test's outside host."""

    outside: Outside = None     # type: ignore[assignment]

    @property
    def node_port(self) -> int:
        return int(self.api_url.rsplit(":", 1)[1]) + 1


def flags(outside: Outside) -> tuple[str, ...]:
    """The agent and control plane listen on every host address (what sandboxes must not reach), and egress
    is capped at the test's own ranges: even a broken rule could not send a packet elsewhere."""
    return ("-v", "--host", "0.0.0.0", "--egress-allow", str(outside.net), "--egress-allow", "169.254.0.0/16")


@pytest.fixture(scope="session")
def server(outside: Outside, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = Server(tmp_path_factory.mktemp(MATCH, numbered=False), NAME, extra=flags(outside), port_pair=True,
                 net_checked=True, outside=outside,
                 env_extra={"PILLDROPS_EGRESS_POOL": str(outside.pool), "PILLDROPS_EGRESS_DNS": outside.ip,
                            "PILLDROPS_EGRESS_UPLINKS": UPLINK})
    # the warm-up (tests/up.py) also makes the agent's nft table, there for the life of `up`
    with running(srv, warm=[{"template": "tiny", "allow_internet_access": True}]):
        yield srv
    uplink_fw = Path(f"/proc/sys/net/ipv4/conf/{UPLINK}/forwarding").read_text().strip()
    assert uplink_fw == "0", "the agent left forwarding on on the uplink it was given"


@pytest.fixture(autouse=True)
def no_leaks(request: pytest.FixtureRequest) -> Iterator[None]:
    if "server" not in request.fixturenames:
        yield
        return
    with no_leaks_of(request.getfixturevalue("server")):
        yield


@pytest.fixture
def sdk_env(server: Server, monkeypatch: pytest.MonkeyPatch) -> Server:
    monkeypatch.setenv("PILLDROPS_API_URL", server.api_url)
    monkeypatch.setenv("PILLDROPS_API_KEY", server.api_key)
    return server


@pytest.fixture
def api(server: Server) -> Iterator[httpx.Client]:
    with server.client() as c:
        yield c
