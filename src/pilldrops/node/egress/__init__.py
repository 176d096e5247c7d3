"""Sandbox egress (issue 14): a veth pair per sandbox that asks for network, NAT through the node and
per-sandbox nftables rules in this agent's own table. Sandboxes that ask for nothing keep the loopback-only
network namespace crun gives them (no interface, no rule: creates stay as cheap as before).

- ``config``: the node's settings (address pool, DNS resolver, uplinks, the agent's name tag);
- ``rules``: the nftables rulesets, pure text (unit-tested);
- ``netdev``: the kernel side (``ip``, ``nft``, sysctls, the sandbox's resolv.conf);
- ``manager``: allocation, attach/detach/release, recovery after an agent restart.
"""

from pilldrops.node.egress.config import EgressConfig
from pilldrops.node.egress.manager import Egress

__all__ = ["Egress", "EgressConfig"]
