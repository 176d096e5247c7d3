"""The nftables rulesets of sandbox egress, as ``nft -f`` text. Pure: no I/O.

One table per agent, ``inet pd_<tag>`` (``config``), never anything outside it::

    input        (filter, hook input):    from a sandbox link: only DNS that our DNAT sent to a loopback
                                          resolver; everything else to the node itself is dropped (any host
                                          address: agent, control plane, sshd, ...)
    forward      (filter, hook forward):  established/related pass; from a sandbox link: its own chain via
                                          the ``egress`` verdict map (no entry: drop); to a sandbox link:
                                          nothing new (no sandbox is reachable from outside or from another)
    prerouting   (nat, dstnat):           DNS to the sandbox's gateway goes to the node's resolver
    postrouting  (nat, srcnat):           the pool is masqueraded behind the uplink's address

    sb<slot>     per sandbox: IPv6 drop, spoofed source drop, DNAT'ed DNS accept, never-reachable drop
                 (169.254.0.0/16, the whole pool = every other sandbox), outside the deployment's cap drop,
                 allow_out accept, deny_out drop, then accept (internet) or drop.

Allow wins over deny because the allow rule comes first. A drop in any base chain is final in nftables, so
another table accepting cannot open what these rules close; an accept here does not override another
table's drop (a host firewall that drops forwarding also stops egress: open it for the pool).
"""

from __future__ import annotations

from pilldrops.node.egress.config import EgressConfig
from pilldrops.schema.node import NodeNetwork

NEVER = ("169.254.0.0/16",)        # link-local: cloud metadata services (169.254.169.254) and friends
FILTER_PRIORITY = "filter - 5"     # before a host firewall's filter chains (ours only ever drop or pass)


def _set(items: list[str] | tuple[str, ...]) -> str:
    return "{ " + ", ".join(items) + " }"


def base(cfg: EgressConfig) -> str:
    """The table with its base chains (idempotent: re-running it resets the base chains, keeps the
    per-sandbox chains and the verdict map)."""
    t, links = cfg.table, f'"{cfg.link_prefix}*"'
    lines = [
        f"add table inet {t}",
        f"add map inet {t} egress {{ type ifname : verdict; }}",
        f"add chain inet {t} input {{ type filter hook input priority {FILTER_PRIORITY}; policy accept; }}",
        f"add chain inet {t} forward {{ type filter hook forward priority {FILTER_PRIORITY}; policy accept; }}",
        f"add chain inet {t} prerouting {{ type nat hook prerouting priority dstnat; policy accept; }}",
        f"add chain inet {t} postrouting {{ type nat hook postrouting priority srcnat; policy accept; }}",
        *(f"flush chain inet {t} {c}" for c in ("input", "forward", "prerouting", "postrouting")),
        f"add rule inet {t} input iifname {links} meta l4proto {{ tcp, udp }} th dport 53 ct status dnat accept",
        f"add rule inet {t} input iifname {links} drop",
        f"add rule inet {t} forward ct state established,related accept",
        f"add rule inet {t} forward iifname {links} iifname vmap @egress",
        f"add rule inet {t} forward iifname {links} drop",
        f"add rule inet {t} forward oifname {links} drop",
        f"add rule inet {t} postrouting ip saddr {cfg.pool} oifname != {links} masquerade",
    ]
    if cfg.resolver:
        lines.append(f"add rule inet {t} prerouting iifname {links} ip daddr {cfg.pool} "
                     f"meta l4proto {{ tcp, udp }} th dport 53 dnat ip to {cfg.resolver}:53")
    return "\n".join(lines) + "\n"


def sandbox(cfg: EgressConfig, slot: int, net: NodeNetwork) -> str:
    """The sandbox's chain and its entry in the verdict map (idempotent: the chain is flushed first)."""
    t, c, ifname = cfg.table, cfg.chain(slot), cfg.ifname(slot)
    _, sb_ip = cfg.addresses(slot)
    lines = [
        f"add chain inet {t} {c}",
        f"flush chain inet {t} {c}",
        f"add rule inet {t} {c} meta nfproto ipv6 drop",
        f"add rule inet {t} {c} ip saddr != {sb_ip} drop",
    ]
    if cfg.resolver:
        lines.append(f"add rule inet {t} {c} meta l4proto {{ tcp, udp }} th dport 53 ct status dnat accept")
    lines.append(f"add rule inet {t} {c} ip daddr {_set([*NEVER, str(cfg.pool)])} drop")
    if net.cap is not None:
        lines.append(f"add rule inet {t} {c} ip daddr != {_set(net.cap)} drop" if net.cap
                     else f"add rule inet {t} {c} drop")
    if net.allow_out:
        lines.append(f"add rule inet {t} {c} ip daddr {_set(net.allow_out)} accept")
    if net.deny_out:
        lines.append(f"add rule inet {t} {c} ip daddr {_set(net.deny_out)} drop")
    lines.append(f"add rule inet {t} {c} {'accept' if net.allow_internet_access else 'drop'}")
    lines.append(f'add element inet {t} egress {{ "{ifname}" : jump {c} }}')
    return "\n".join(lines) + "\n"


def remove_sandbox(cfg: EgressConfig, slot: int, *, element: bool = True) -> str:
    t, c = cfg.table, cfg.chain(slot)
    lines = [f'delete element inet {t} egress {{ "{cfg.ifname(slot)}" }}'] if element else []
    lines += [f"flush chain inet {t} {c}", f"delete chain inet {t} {c}"]
    return "\n".join(lines) + "\n"


def remove_table(cfg: EgressConfig) -> str:
    return f"delete table inet {cfg.table}\n"
