"""The node's egress settings. Everything this agent creates carries its ``tag`` (4 hex digits of the agent's
instance id): links ``pd<tag><slot>``, the nftables table ``inet pd_<tag>``. Several agents (or test sessions)
on one host therefore never touch each other's links or rules, and nothing else of the host is touched.

Environment (read by ``from_env``; ``pilldrops up`` / ``node`` pass their flags the same way):

- ``PILLDROPS_EGRESS_POOL``: the IPv4 range the agent takes a /30 from per sandbox (default 10.213.0.0/16);
  it must not overlap a route of the host.
- ``PILLDROPS_EGRESS_DNS``: resolver(s) sandboxes' DNS is forwarded to (default: the host's own from
  /etc/resolv.conf; ``none``: no DNS). A loopback resolver (systemd-resolved's 127.0.0.53) works too.
- ``PILLDROPS_EGRESS_UPLINKS``: interfaces the NATed traffic leaves by, on which the agent turns IPv4
  forwarding on (per interface, never the global switch); default: the devices of the default routes.
"""

from __future__ import annotations

import ipaddress
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

DEFAULT_POOL = "10.213.0.0/16"
_TAG_RE = re.compile(r"^[a-z0-9]{2,6}$")


def host_resolvers(path: Path = Path("/etc/resolv.conf")) -> list[str]:
    """The host's IPv4 nameservers."""
    out = []
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return out
    for line in lines:
        parts = line.split()
        if len(parts) >= 2 and parts[0] == "nameserver":
            try:
                if ipaddress.ip_address(parts[1]).version == 4:
                    out.append(parts[1])
            except ValueError:
                continue
    return out


@dataclass(frozen=True)
class EgressConfig:
    tag: str
    pool: ipaddress.IPv4Network = field(default_factory=lambda: ipaddress.IPv4Network(DEFAULT_POOL))
    dns: tuple[str, ...] = ()                 # the first one is used; () = no DNS for sandboxes
    uplinks: tuple[str, ...] | None = None    # None: the default routes' devices

    def __post_init__(self) -> None:
        if not _TAG_RE.match(self.tag):
            raise ValueError(f"egress tag must be 2-6 of [a-z0-9], not {self.tag!r}")
        if self.pool.prefixlen > 29:
            raise ValueError(f"egress pool {self.pool} is too small (at least a /29)")

    @classmethod
    def from_env(cls, instance: str, env: dict[str, str] | None = None) -> EgressConfig:
        env = dict(os.environ if env is None else env)
        pool = ipaddress.IPv4Network(env.get("PILLDROPS_EGRESS_POOL") or DEFAULT_POOL, strict=True)
        raw_dns = env.get("PILLDROPS_EGRESS_DNS")
        if raw_dns is None:
            dns = tuple(host_resolvers())
        elif raw_dns.strip().lower() in ("", "none"):
            dns = ()
        else:
            dns = tuple(str(ipaddress.IPv4Address(d.strip())) for d in raw_dns.split(",") if d.strip())
        raw_up = env.get("PILLDROPS_EGRESS_UPLINKS")
        uplinks = tuple(u.strip() for u in raw_up.split(",") if u.strip()) if raw_up is not None else None
        tag = re.sub(r"[^a-z0-9]", "", instance.lower())[:4] or "0000"
        return cls(tag=tag, pool=pool, dns=dns, uplinks=uplinks)

    # ---- names and addresses ------------------------------------------------------------------------
    @property
    def table(self) -> str:
        return f"pd_{self.tag}"

    @property
    def link_prefix(self) -> str:
        return f"pd{self.tag}"

    @property
    def slots(self) -> int:
        return self.pool.num_addresses // 4

    def ifname(self, slot: int) -> str:
        return f"{self.link_prefix}{slot:x}"

    def chain(self, slot: int) -> str:
        return f"sb{slot:x}"

    def addresses(self, slot: int) -> tuple[str, str]:
        """(host end = the sandbox's gateway, sandbox end) of slot ``slot``'s /30."""
        if not 0 <= slot < self.slots:
            raise ValueError(f"slot {slot} outside the pool {self.pool}")
        base = int(self.pool.network_address) + 4 * slot
        return str(ipaddress.IPv4Address(base + 1)), str(ipaddress.IPv4Address(base + 2))

    @property
    def resolver(self) -> str | None:
        return self.dns[0] if self.dns else None

    @property
    def resolver_is_loopback(self) -> bool:
        return self.resolver is not None and ipaddress.IPv4Address(self.resolver).is_loopback
