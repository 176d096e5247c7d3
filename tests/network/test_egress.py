"""Egress per sandbox against the suite's own outside host (``conftest``): defaults, allow/deny, DNS,
what is never reachable, and that nothing is left after kill, agent SIGKILL + restart, pause/resume."""

from __future__ import annotations

import ipaddress
import json
import os
import signal
import socket
import subprocess
import threading
from collections.abc import Iterator

import pytest

from pilldrops import EgressForbidden, InvalidRequest, Sandbox
from tests.network.conftest import OUTSIDE_NAME, UPLINK, Server

pytestmark = pytest.mark.usefixtures("sdk_env")


def fetch(sb: Sandbox, url: str, timeout: int = 3) -> str | None:
    """The body of an HTTP GET of ``http://HOST:PORT/`` made inside the sandbox (busybox nc), or None."""
    hostport = url.split("//", 1)[1].strip("/")
    host, port = hostport.rsplit(":", 1)
    r = sb.run(["sh", "-c", f"printf 'GET / HTTP/1.0\\r\\n\\r\\n' | nc -w {timeout} {host} {port}"],
               timeout=timeout + 10)
    if r.exit_code != 0 or " 200 " not in r.stdout.split("\n", 1)[0]:
        return None
    return r.stdout.split("\r\n\r\n", 1)[-1].strip()


def open_ports(sb: Sandbox, targets: list[tuple[str, int]]) -> set[str]:
    """Which of ``targets`` a TCP connection from inside the sandbox reaches (all tried at once)."""
    probes = " ".join(f"{h}:{p}" for h, p in targets)
    script = (f'for t in {probes}; do ( h="${{t%:*}}"; p="${{t#*:}}"; '
              'if echo x | nc -w 2 "$h" "$p" >/dev/null 2>&1; then echo "OPEN $t"; fi ) & done; wait')
    r = sb.run(["sh", "-c", script], timeout=30)
    return {line.split()[1] for line in r.stdout.splitlines() if line.startswith("OPEN ")}


def sandbox_ip(sb: Sandbox) -> str | None:
    r = sb.run("ip -4 -o addr show dev eth0")
    for word in r.stdout.split():
        if "/" in word and word[0].isdigit():
            return word.split("/")[0]
    return None


def crun_pid(srv: Server, sid: str) -> int:
    st = subprocess.run(["crun", "--root", str(srv.crun_root), "state", sid], capture_output=True, check=True)
    return int(json.loads(st.stdout)["pid"])


@pytest.fixture
def host_listener() -> Iterator[int]:
    """A TCP service on every address of the host (0.0.0.0): what a sandbox must never reach."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("0.0.0.0", 0))
    s.listen(64)
    stop = threading.Event()

    def accept() -> None:
        s.settimeout(0.2)
        while not stop.is_set():
            try:
                c, _ = s.accept()
                c.close()
            except OSError:
                continue
    t = threading.Thread(target=accept, daemon=True)
    t.start()
    yield s.getsockname()[1]
    stop.set()
    t.join(5)
    s.close()


def host_addresses() -> list[str]:
    out = subprocess.run(["ip", "-j", "-4", "addr"], capture_output=True, text=True, check=True).stdout
    return sorted({a["local"] for i in json.loads(out) for a in i.get("addr_info", [])})


# ---- policy ------------------------------------------------------------------------------------------

def test_default_sandbox_has_loopback_only(server: Server) -> None:
    with Sandbox.create("tiny") as sb:
        info = sb.get_info()
        assert info.allow_internet_access is False and info.network is None
        links = sb.run("ls /sys/class/net").stdout.split()
        assert links == ["lo"]
        assert fetch(sb, f"http://{server.outside.ip}:8080/", timeout=1) is None


def test_internet_reaches_outside_by_address_and_name(server: Server) -> None:
    with Sandbox.create("tiny", allow_internet_access=True) as sb:
        assert sb.get_info().allow_internet_access is True
        assert fetch(sb, f"http://{server.outside.ip}:8080/") == f"ok {server.outside.ip}"
        assert fetch(sb, f"http://{server.outside.ip2}:8080/") == f"ok {server.outside.ip2}"
        resolv = sb.run("cat /etc/resolv.conf").stdout
        assert "nameserver" in resolv
        assert fetch(sb, f"http://{OUTSIDE_NAME}:8080/") == f"ok {server.outside.ip}"


def test_allow_out_without_internet(server: Server) -> None:
    with Sandbox.create("tiny", network={"allow_out": [server.outside.ip]}) as sb:
        info = sb.get_info()
        assert info.allow_internet_access is False
        assert info.network is not None and info.network.allow_out == [f"{server.outside.ip}/32"]
        assert fetch(sb, f"http://{server.outside.ip}:8080/") == f"ok {server.outside.ip}"
        assert fetch(sb, f"http://{server.outside.ip2}:8080/", timeout=1) is None


def test_deny_out_holds(server: Server) -> None:
    with Sandbox.create("tiny", allow_internet_access=True, network={"deny_out": [server.outside.ip2]}) as sb:
        assert fetch(sb, f"http://{server.outside.ip}:8080/") == f"ok {server.outside.ip}"
        assert fetch(sb, f"http://{server.outside.ip2}:8080/", timeout=1) is None


def test_allow_wins_over_deny(server: Server) -> None:
    net = {"allow_out": [server.outside.ip], "deny_out": [str(server.outside.net)]}
    with Sandbox.create("tiny", allow_internet_access=True, network=net) as sb:
        assert fetch(sb, f"http://{server.outside.ip}:8080/") == f"ok {server.outside.ip}"
        assert fetch(sb, f"http://{server.outside.ip2}:8080/", timeout=1) is None


# ---- never reachable ---------------------------------------------------------------------------------

def test_node_itself_is_unreachable(server: Server, host_listener: int) -> None:
    """The agent, the control plane (`up --host 0.0.0.0`: every host address) and any host service."""
    with Sandbox.create("tiny", allow_internet_access=True) as sb:
        addrs = host_addresses()
        assert server.outside.host_ip in addrs
        ports = [host_listener, server.node_port, server.node_port - 1]
        with socket.create_connection((server.outside.host_ip, host_listener), timeout=2):
            pass                              # the host reaches its own service: the probe is real
        assert fetch(sb, f"http://{server.outside.ip}:8080/") is not None    # egress works meanwhile
        reached = open_ports(sb, [(a, p) for a in addrs if not a.startswith("127.") for p in ports])
        assert reached == set()


def test_other_sandboxes_are_unreachable(server: Server) -> None:
    with Sandbox.create("tiny", allow_internet_access=True) as a, \
            Sandbox.create("tiny", allow_internet_access=True) as b:
        assert b.run("httpd -p 9000 -h /").exit_code == 0
        b_ip = sandbox_ip(b)
        assert b_ip is not None and b_ip != sandbox_ip(a)
        assert open_ports(b, [("127.0.0.1", 9000)]) == {"127.0.0.1:9000"}     # it does serve
        assert open_ports(a, [(b_ip, 9000)]) == set()
        assert fetch(a, f"http://{server.outside.ip}:8080/") is not None


def test_link_local_and_metadata_unreachable(server: Server) -> None:
    """169.254.169.254 is routed to the outside host for the pool (conftest), which serves it; even a
    policy that allows it explicitly never reaches it."""
    with Sandbox.create("tiny", allow_internet_access=True, network={"allow_out": ["169.254.0.0/16"]}) as sb:
        ip = sandbox_ip(sb)
        route = subprocess.run(["ip", "-4", "route", "get", "169.254.169.254", "from", str(ip), "iif",
                                _host_link_of(server, ip)], capture_output=True, text=True, check=True).stdout
        assert UPLINK in route, route              # without the rules it would be reached
        assert fetch(sb, "http://169.254.169.254:8080/", timeout=1) is None
        assert fetch(sb, f"http://{server.outside.ip}:8080/") is not None


def _host_link_of(server: Server, ip: str | None) -> str:
    """The node's end of the sandbox's veth: the link holding the address just below the sandbox's."""
    assert ip is not None
    gateway = str(ipaddress.IPv4Address(ip) - 1)
    out = json.loads(subprocess.run(["ip", "-j", "-4", "addr"], capture_output=True, text=True, check=True).stdout)
    for link in out:
        if any(a["local"] == gateway for a in link.get("addr_info", [])):
            assert link["ifname"].startswith(f"pd{server.tag}"), link["ifname"]
            return str(link["ifname"])
    raise AssertionError(f"no host link for {ip}")


# ---- lifecycle: nothing left ------------------------------------------------------------------------

def test_allow_out_outside_the_cap_is_refused(server: Server) -> None:
    """The test deployment caps egress at the test ranges (`--egress-allow`, conftest)."""
    with pytest.raises(EgressForbidden) as exc:
        Sandbox.create("tiny", network={"allow_out": ["10.0.0.0/8"]})
    assert exc.value.code == "egress_forbidden" and exc.value.details["reason"] == "outside_cap"
    with pytest.raises(InvalidRequest):
        Sandbox.create("tiny", network={"allow_out": ["not-a-cidr"]})


def test_kill_removes_link_and_rules(server: Server) -> None:
    before = server.snapshot()
    sb = Sandbox.create("tiny", allow_internet_access=True)
    during = server.snapshot()["items"] - before["items"]     # type: ignore[operator]
    assert any(i.startswith("link:") for i in during) and any(i.startswith("nftchain:") for i in during)
    sb.kill()
    # (the autouse leak check asserts that everything of it is gone)


def test_agent_sigkill_restart_readopts_then_reaps(server: Server) -> None:
    kept = Sandbox.create("tiny", allow_internet_access=True)
    dead = Sandbox.create("tiny", allow_internet_access=True)
    try:
        assert server.stop(signal.SIGKILL) != 0
        os.kill(crun_pid(server, dead.id), signal.SIGKILL)      # dies while the agent is down
        server.start()
        kept = Sandbox.connect(kept.id)
        assert fetch(kept, f"http://{server.outside.ip}:8080/") == f"ok {server.outside.ip}"
        left = server.snapshot()["items"]
        chains = [i for i in left if i.startswith("nftchain:")]   # type: ignore[union-attr]
        assert len(chains) == 1, left                             # the dead one's chain was removed
    finally:
        Sandbox.kill_by_id(kept.id)
        Sandbox.kill_by_id(dead.id)


def test_pause_resume_keeps_policy(server: Server) -> None:
    with Sandbox.create("tiny", network={"allow_out": [server.outside.ip]}) as sb:
        ip = sandbox_ip(sb)
        sb.pause()
        items = server.snapshot()["items"]
        assert not [i for i in items if i.startswith(("link:", "nftchain:", "nftelem:"))], items  # type: ignore[union-attr]
        sb.resume()
        assert sandbox_ip(sb) == ip                       # the same addresses
        assert fetch(sb, f"http://{server.outside.ip}:8080/") == f"ok {server.outside.ip}"
        assert fetch(sb, f"http://{server.outside.ip2}:8080/", timeout=1) is None
