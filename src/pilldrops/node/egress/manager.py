"""Egress per sandbox: which sandbox holds which /30 of the pool, and the links and rules that go with it.

The allocation is recorded before anything is made, one small JSON file per sandbox in
``<state_dir>/egress/<sandbox id>.json`` (slot + policy), so a restarted agent knows every link and chain it
made: ``recover`` re-attaches (idempotently) the ones of adopted sandboxes, strips those of paused ones (a
paused sandbox keeps its slot, so resume brings it back on the same addresses) and releases the rest; links
and chains of this agent's tag that no record explains are removed.

A warm-pool member of a pool with a policy (``node.pools``) is attached under its member id when it is made;
``rekey`` moves its record to the sandbox that claims it.

Pause: CRIU dumps a network namespace with loopback only, exactly as today: ``detach`` removes the veth and
the rules first, ``attach`` after the restore makes them again with the same slot.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import anyio

from pilldrops.node.egress import netdev, rules
from pilldrops.node.egress.config import EgressConfig
from pilldrops.node.runtime.base import RuntimeFailure
from pilldrops.schema.node import NodeNetwork

log = logging.getLogger("pilldrops.node")


class Egress:
    def __init__(self, cfg: EgressConfig, state_dir: Path) -> None:
        self.cfg = cfg
        self.dir = state_dir / "egress"
        self.dir.mkdir(parents=True, exist_ok=True)
        self._slots: dict[str, int] = {}              # sandbox id -> slot (recorded)
        self._based = False
        self._lock = anyio.Lock()                     # allocation and the base table
        for p in self.dir.glob("*.json"):
            try:
                rec = json.loads(p.read_text())
                self._slots[p.stem] = int(rec["slot"])
            except (OSError, ValueError, KeyError, TypeError):
                p.unlink(missing_ok=True)

    def unavailable(self) -> str | None:
        return netdev.missing_tools()

    def slot_of(self, sandbox_id: str) -> int | None:
        return self._slots.get(sandbox_id)

    # ---- allocation ---------------------------------------------------------------------------------
    def _record(self, sandbox_id: str, slot: int, net: NodeNetwork) -> None:
        path = self.dir / f"{sandbox_id}.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"slot": slot, "network": net.model_dump(mode="json")}))
        os.replace(tmp, path)
        self._slots[sandbox_id] = slot

    def _allocate(self, sandbox_id: str) -> int:
        if sandbox_id in self._slots:
            return self._slots[sandbox_id]
        used = set(self._slots.values())
        for slot in range(self.cfg.slots):
            if slot not in used:
                return slot
        raise RuntimeFailure(f"egress address pool {self.cfg.pool} is exhausted ({self.cfg.slots} sandboxes)")

    async def _ensure_base(self) -> None:
        if self._based:
            return
        why = netdev.missing_tools()
        if why:
            raise RuntimeFailure("egress is not available on this node", detail=why)
        overlaps = await netdev.route_overlaps(str(self.cfg.pool), self.cfg.link_prefix)
        if overlaps:
            raise RuntimeFailure(f"egress pool {self.cfg.pool} overlaps host routes (set PILLDROPS_EGRESS_POOL)",
                                 detail="; ".join(overlaps))
        await netdev.nft(rules.base(self.cfg))
        uplinks = self.cfg.uplinks if self.cfg.uplinks is not None else tuple(await netdev.default_route_devices())
        saved = self.dir / "uplinks.saved"     # the uplinks' forwarding before us (close restores it); not .json:
                                               # those are the slot records
        before = json.loads(saved.read_text()) if saved.exists() else {}
        for dev in uplinks:      # per interface: the host's global ip_forward switch stays as it is
            try:
                before.setdefault(dev, netdev.read_sysctl(f"ipv4/conf/{dev}/forwarding"))
                netdev.sysctl(f"ipv4/conf/{dev}/forwarding", "1")
            except OSError as exc:
                log.warning("cannot turn forwarding on for uplink %s: %s", dev, exc)
        saved.write_text(json.dumps(before))
        self._based = True

    # ---- per sandbox --------------------------------------------------------------------------------
    async def attach(self, sandbox_id: str, pid: int, rootfs: Path | None, net: NodeNetwork) -> int:
        """Give the sandbox whose init is ``pid`` its veth, addresses, rules and resolv.conf; returns its
        slot (the recorded one when it has one: resume keeps its addresses). On failure nothing is left but
        the record of a sandbox that had one before (a paused one keeps its slot)."""
        if netdev.same_netns_as_agent(pid):
            raise RuntimeFailure(f"sandbox {sandbox_id} has no network namespace of its own (pid {pid})")
        async with self._lock:
            await self._ensure_base()
            had = sandbox_id in self._slots
            slot = self._allocate(sandbox_id)
            self._record(sandbox_id, slot, net)
        try:
            await self._make(slot, pid, rootfs, net)
        except BaseException:
            with anyio.CancelScope(shield=True):
                await self._strip(slot)
                if not had:
                    self._forget(sandbox_id)
            raise
        return slot

    async def _make(self, slot: int, pid: int, rootfs: Path | None, net: NodeNetwork) -> None:
        ifname = self.cfg.ifname(slot)
        gateway, address = self.cfg.addresses(slot)
        if netdev.link_exists(ifname):       # a leftover of a sandbox that held this slot: not ours now
            await netdev.del_link(ifname)
        await netdev.add_veth(ifname, pid, gateway, address, route_localnet=self.cfg.resolver_is_loopback)
        await netdev.nft(rules.sandbox(self.cfg, slot, net))
        if rootfs is not None and self.cfg.resolver:
            try:
                await anyio.to_thread.run_sync(netdev.write_resolv_conf, rootfs, gateway)
            except OSError as exc:
                raise RuntimeFailure("cannot write the sandbox's /etc/resolv.conf", detail=str(exc)) from exc

    async def _strip(self, slot: int) -> None:
        """Remove the slot's link and rules (whatever of them exists)."""
        await netdev.del_link(self.cfg.ifname(slot))
        if not await netdev.nft(rules.remove_sandbox(self.cfg, slot), check=False):
            # the element or the chain was already gone (a half-made attach): remove what is there
            await netdev.nft(rules.remove_sandbox(self.cfg, slot, element=False), check=False)

    def forget(self, sandbox_id: str) -> None:
        """Drop the slot of a sandbox that has no link or rules here (it ended or moved while paused)."""
        self._forget(sandbox_id)

    def _forget(self, sandbox_id: str) -> None:
        self._slots.pop(sandbox_id, None)
        (self.dir / f"{sandbox_id}.json").unlink(missing_ok=True)

    async def detach(self, sandbox_id: str) -> None:
        """Remove the link and rules but keep the slot (pause)."""
        slot = self._slots.get(sandbox_id)
        if slot is not None:
            await self._strip(slot)

    async def release(self, sandbox_id: str) -> None:
        """The sandbox is gone: its link, rules and slot go."""
        slot = self._slots.get(sandbox_id)
        if slot is None:
            return
        with anyio.CancelScope(shield=True):
            await self._strip(slot)
            self._forget(sandbox_id)

    def rekey(self, old_id: str, new_id: str) -> None:
        """A claimed warm-pool member (``old_id``, made with its network attached) becomes sandbox ``new_id``:
        its record moves with it in one rename (a crash leaves it under exactly one of the two ids), the
        link and rules stay as they are (they are named by slot)."""
        slot = self._slots.get(old_id)
        if slot is None:
            raise RuntimeFailure(f"warm-pool member {old_id} has no network on this node")
        if old_id != new_id:
            os.replace(self.dir / f"{old_id}.json", self.dir / f"{new_id}.json")
            self._slots[new_id] = self._slots.pop(old_id)

    def policy_of(self, sandbox_id: str) -> NodeNetwork | None:
        try:
            rec = json.loads((self.dir / f"{sandbox_id}.json").read_text())
            return NodeNetwork.model_validate(rec["network"])
        except (OSError, ValueError, KeyError):
            return None

    # ---- agent start ---------------------------------------------------------------------------------
    async def recover(self, running: dict[str, tuple[int, Path | None]], paused: set[str]) -> None:
        """``running``: adopted sandbox id -> (init pid, rootfs); ``paused``: ids kept as images."""
        if not self._slots and not netdev.links(self.cfg.link_prefix) and await netdev.nft_json(self.cfg.table) is None:
            return                                    # this agent never made anything: touch nothing
        for sid in list(self._slots):
            net = self.policy_of(sid)
            if sid in running and net is not None:
                pid, rootfs = running[sid]
                try:
                    async with self._lock:
                        await self._ensure_base()
                    slot = self._slots[sid]
                    if netdev.link_exists(self.cfg.ifname(slot)):
                        await netdev.nft(rules.sandbox(self.cfg, slot, net))    # idempotent
                    else:
                        await self._make(slot, pid, rootfs, net)
                    log.info("re-adopted egress of %s (slot %d)", sid, slot)
                except Exception:
                    log.exception("re-adopting egress of %s failed", sid)
            elif sid in paused:
                await self.detach(sid)
            else:
                await self.release(sid)
        await self._reap_orphans()

    async def _reap_orphans(self) -> None:
        mine = {self.cfg.ifname(s) for s in self._slots.values()}
        for name in netdev.links(self.cfg.link_prefix):
            if name not in mine and name[len(self.cfg.link_prefix):].isalnum():
                log.warning("removing unrecorded egress link %s", name)
                await netdev.del_link(name)
        table = await netdev.nft_json(self.cfg.table)
        chains = {c["chain"]["name"] for c in (table or {}).get("nftables", []) if "chain" in c}
        live = {self.cfg.chain(s) for s in self._slots.values()}
        for chain in sorted(chains):
            if chain.startswith("sb") and chain not in live:
                try:
                    slot = int(chain.removeprefix("sb"), 16)
                except ValueError:
                    continue
                log.warning("removing unrecorded egress chain %s", chain)
                await self._strip(slot)

    async def close(self) -> None:
        """At agent exit: when no sandbox holds a slot any more, the table goes too."""
        if self._slots:
            return
        if await netdev.nft_json(self.cfg.table) is not None:
            await netdev.nft(rules.remove_table(self.cfg), check=False)
        saved = self.dir / "uplinks.saved"
        try:
            before = json.loads(saved.read_text())
        except (OSError, ValueError):
            before = {}
        for dev, value in before.items():       # the host as we found it
            try:
                netdev.sysctl(f"ipv4/conf/{dev}/forwarding", str(value))
            except OSError:
                pass                             # the interface is gone
        saved.unlink(missing_ok=True)
        self._based = False
