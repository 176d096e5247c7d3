"""Egress policy of a sandbox (issue 14), decided at create.

A sandbox's policy is, field by field: the create's own ``allow_internet_access`` / ``network`` when it sent
them, else the template's ``[network]`` default (as the nodes report it), else none (loopback only). The
deployment can forbid egress (``up/serve --no-egress``: any create asking for it gets ``egress_forbidden``,
reason ``disabled``) or cap it (``--egress-allow CIDR``, repeatable: an ``allow_out`` entry outside the cap
is ``egress_forbidden``, reason ``outside_cap``; internet access is clipped to the cap on the node). Only
container sandboxes get egress; another isolation mode asking for it is ``not_supported``.

Stored with the sandbox as ``{"allow_internet_access", "allow_out", "deny_out"}`` (None: nothing asked).
"""

from __future__ import annotations

import hashlib
import ipaddress
from dataclasses import dataclass
from typing import Any

from pilldrops import errors
from pilldrops.schema.api import (
    CreateSandboxRequest,
    NetworkPolicy,
    PoolSetRequest,
    TemplateNetwork,
    check_cidrs,
)
from pilldrops.schema.node import NodeNetwork, network_key


@dataclass(frozen=True)
class EgressSettings:
    enabled: bool = True
    cap: tuple[str, ...] | None = None      # None: no cap

    @classmethod
    def of(cls, no_egress: bool = False, allow: tuple[str, ...] | list[str] = ()) -> EgressSettings:
        try:
            cap = tuple(check_cidrs(list(allow), "--egress-allow")) if allow else None
        except ValueError as exc:
            raise ValueError(str(exc)) from None
        return cls(enabled=not no_egress, cap=cap)


def template_default(nodes: list[Any], template: str) -> TemplateNetwork | None:
    for n in nodes:
        for t in n.templates or []:
            if t.get("name") == template and isinstance(t.get("network"), dict):
                try:
                    return TemplateNetwork.model_validate(t["network"])
                except ValueError:
                    return None
    return None


def resolve(req: CreateSandboxRequest | PoolSetRequest, nodes: list[Any], isolation: str,
            settings: EgressSettings, stored: TemplateNetwork | None = None) -> dict[str, Any] | None:
    """The policy to store for this create (or warm pool: its members'), checked against the deployment
    (raises the typed errors). ``stored``: the template store's version names its default (issue 19),
    before what nodes report."""
    given = req.model_fields_set
    tpl = (stored or template_default(nodes, req.template)) if {"allow_internet_access", "network"} - given else None
    internet = req.allow_internet_access if "allow_internet_access" in given else bool(tpl and tpl.allow_internet_access)
    net = req.network if "network" in given else (NetworkPolicy(allow_out=tpl.allow_out, deny_out=tpl.deny_out)
                                                  if tpl else None)
    allow, deny = (list(net.allow_out), list(net.deny_out)) if net else ([], [])
    if not (internet or allow or deny):
        return None
    check(internet, allow, isolation, settings)
    return {"allow_internet_access": internet, "allow_out": allow, "deny_out": deny}


def check(internet: bool, allow: list[str], isolation: str, settings: EgressSettings) -> None:
    """Raise the typed error when the deployment forbids this egress (or the isolation mode has none)."""
    if internet or allow:
        if not settings.enabled:
            raise errors.EgressForbidden("this deployment gives sandboxes no network (--no-egress): create it "
                                         "without allow_internet_access / network.allow_out",
                                         details={"reason": "disabled"})
        outside = [c for c in allow if not within(c, settings.cap)]
        if outside:
            raise errors.EgressForbidden(f"network.allow_out {', '.join(outside)} is outside what this deployment "
                                         f"allows (--egress-allow {' '.join(settings.cap or ())})",
                                         details={"reason": "outside_cap", "cidrs": outside,
                                                  "cap": list(settings.cap or ())})
        if isolation != "container":
            raise errors.NotSupported(f"egress is not supported for {isolation} sandboxes (only container): "
                                      "create it without allow_internet_access / network.allow_out",
                                      details={"isolation": isolation, "feature": "egress"})


def permitted(stored: dict[str, Any] | None, settings: EgressSettings) -> bool:
    """Whether the deployment (as started now) allows a stored policy (a warm pool set under other flags)."""
    try:
        check(bool((stored or {}).get("allow_internet_access")), list((stored or {}).get("allow_out") or []),
              "container", settings)
    except errors.EgressForbidden:
        return False
    return True


def within(cidr: str, cap: tuple[str, ...] | None) -> bool:
    if cap is None:
        return True
    net = ipaddress.IPv4Network(cidr)
    return any(net.subnet_of(ipaddress.IPv4Network(c)) for c in cap)


def policy_id(stored: dict[str, Any] | None) -> str:
    """A stored policy's identity as a warm pool's key: "" for loopback only, else a digest of its
    ``network_key`` (the lists sorted: the same policy in another order is the same pool)."""
    key = network_key(stored)
    return hashlib.sha256(key.encode()).hexdigest()[:32] if key else ""


def view(stored: dict[str, Any] | None) -> dict[str, Any]:
    """``SandboxInfo`` / ``HistoryRecord`` fields of a stored policy."""
    if not stored:
        return {"allow_internet_access": False, "network": None}
    return {"allow_internet_access": bool(stored.get("allow_internet_access")),
            "network": NetworkPolicy(allow_out=stored.get("allow_out") or [], deny_out=stored.get("deny_out") or [])}


def node_network(stored: dict[str, Any] | None, settings: EgressSettings) -> NodeNetwork | None:
    """What the node enforces (None: loopback only, no interface at all)."""
    if not stored or not (stored.get("allow_internet_access") or stored.get("allow_out")):
        return None
    return NodeNetwork(allow_internet_access=bool(stored.get("allow_internet_access")),
                       allow_out=stored.get("allow_out") or [], deny_out=stored.get("deny_out") or [],
                       cap=list(settings.cap) if settings.cap is not None else None)
