"""Egress (issue 14): the node's settings, addresses and the nftables rulesets (pure text)."""

from __future__ import annotations

import ipaddress

import pytest

from pilldrops.node.egress import rules
from pilldrops.node.egress.config import EgressConfig, host_resolvers
from pilldrops.schema.node import NodeNetwork

CFG = EgressConfig(tag="ab12", pool=ipaddress.IPv4Network("10.99.0.0/24"), dns=("198.18.0.53",), uplinks=("up0",))


def test_names_and_addresses() -> None:
    assert CFG.table == "pd_ab12" and CFG.ifname(0) == "pdab120" and CFG.ifname(63) == "pdab123f"
    assert CFG.slots == 64
    assert CFG.addresses(0) == ("10.99.0.1", "10.99.0.2")
    assert CFG.addresses(1) == ("10.99.0.5", "10.99.0.6")
    assert all(len(CFG.ifname(s)) <= 15 for s in range(CFG.slots))
    with pytest.raises(ValueError):
        CFG.addresses(64)


def test_from_env(tmp_path) -> None:
    cfg = EgressConfig.from_env("E89B4D3B-ffff", {"PILLDROPS_EGRESS_POOL": "10.5.0.0/16",
                                                  "PILLDROPS_EGRESS_DNS": "127.0.0.53",
                                                  "PILLDROPS_EGRESS_UPLINKS": "eth1, eth2"})
    assert cfg.tag == "e89b" and str(cfg.pool) == "10.5.0.0/16" and cfg.uplinks == ("eth1", "eth2")
    assert cfg.resolver == "127.0.0.53" and cfg.resolver_is_loopback
    assert EgressConfig.from_env("abcd", {"PILLDROPS_EGRESS_DNS": "none"}).dns == ()
    assert EgressConfig.from_env("abcd", {}).uplinks is None          # the default routes' devices
    with pytest.raises(ValueError):
        EgressConfig.from_env("abcd", {"PILLDROPS_EGRESS_POOL": "10.5.0.1/16"})   # host bits set
    with pytest.raises(ValueError):
        EgressConfig(tag="ab12", pool=ipaddress.IPv4Network("10.0.0.0/30"))       # too small
    conf = tmp_path / "resolv.conf"
    conf.write_text("# x\nnameserver 10.255.255.53\nnameserver fd00::1\nsearch lan\n")
    assert host_resolvers(conf) == ["10.255.255.53"]


def test_base_table_is_scoped_to_the_agent() -> None:
    text = rules.base(CFG)
    for line in text.splitlines():
        assert " inet pd_ab12 " in f" {line} ", line            # nothing outside our own table
    assert 'iifname "pdab12*" drop' in text                      # nothing to the node itself
    assert 'oifname "pdab12*" drop' in text                      # nothing new into a sandbox
    assert "dnat ip to 198.18.0.53:53" in text
    assert 'masquerade' in text and "ip saddr 10.99.0.0/24" in text
    no_dns = rules.base(EgressConfig(tag="ab12", pool=CFG.pool))
    assert "dnat" not in no_dns.replace("ct status dnat", "")


def _chain(net: NodeNetwork) -> list[str]:
    return [ln.split(" sb1 ", 1)[1] for ln in rules.sandbox(CFG, 1, net).splitlines() if ln.startswith("add rule")]


def test_sandbox_chain_order_allow_beats_deny_and_never_first() -> None:
    chain = _chain(NodeNetwork(allow_internet_access=True, allow_out=["198.18.1.2/32"],
                               deny_out=["198.18.1.0/24"]))
    assert chain == [
        "meta nfproto ipv6 drop",
        "ip saddr != 10.99.0.6 drop",
        "meta l4proto { tcp, udp } th dport 53 ct status dnat accept",
        "ip daddr { 169.254.0.0/16, 10.99.0.0/24 } drop",           # link-local and every other sandbox
        "ip daddr { 198.18.1.2/32 } accept",
        "ip daddr { 198.18.1.0/24 } drop",
        "accept",
    ]
    assert 'add element inet pd_ab12 egress { "pdab121" : jump sb1 }' in rules.sandbox(CFG, 1, NodeNetwork())


def test_sandbox_chain_without_internet_ends_in_drop_and_cap_comes_before_allow() -> None:
    chain = _chain(NodeNetwork(allow_out=["198.18.1.2/32"], cap=["198.18.0.0/15"]))
    assert chain[-1] == "drop"
    assert chain.index("ip daddr != { 198.18.0.0/15 } drop") < chain.index("ip daddr { 198.18.1.2/32 } accept")
    assert _chain(NodeNetwork(allow_internet_access=True, cap=[]))[-2:] == ["drop", "accept"]   # empty cap


def test_remove_sandbox() -> None:
    text = rules.remove_sandbox(CFG, 1)
    assert text.splitlines() == ['delete element inet pd_ab12 egress { "pdab121" }', "flush chain inet pd_ab12 sb1",
                                 "delete chain inet pd_ab12 sb1"]
    assert "element" not in rules.remove_sandbox(CFG, 1, element=False)


def test_resolv_conf_is_written_inside_the_root_only(tmp_path) -> None:
    from pilldrops.node.egress.netdev import write_resolv_conf
    outside = tmp_path / "host-file"
    outside.write_text("host\n")
    root = tmp_path / "root"
    (root / "etc").mkdir(parents=True)
    (root / "etc" / "resolv.conf").symlink_to(outside)          # a planted link to a host file
    write_resolv_conf(root, "10.99.0.1")
    assert outside.read_text() == "host\n"
    assert (root / "etc" / "resolv.conf").read_text().endswith("nameserver 10.99.0.1\n")
    evil = tmp_path / "evil"
    (evil / "x").mkdir(parents=True)
    (evil / "etc").symlink_to(tmp_path / "hostetc")             # /etc itself a link out of the root
    (tmp_path / "hostetc").mkdir()
    with pytest.raises(OSError):                                # resolved inside the root: dangling, refused
        write_resolv_conf(evil, "10.99.0.1")
    assert not (tmp_path / "hostetc" / "resolv.conf").exists()
