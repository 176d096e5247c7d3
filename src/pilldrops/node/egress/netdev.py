"""The kernel side of egress: veth pairs (``ip``), per-interface sysctls, nftables (``nft -f``), and the
sandbox's /etc/resolv.conf. Every command names only this agent's own links and table."""

from __future__ import annotations

import ctypes
import errno
import json
import os
import shutil
import subprocess
from pathlib import Path

import anyio

from pilldrops.node.runtime.base import RuntimeFailure

_SYS_NET = Path("/sys/class/net")
_PROC_NET = Path("/proc/sys/net")


def missing_tools() -> str | None:
    """Why egress cannot work on this host (None: it can)."""
    lacking = [t for t in ("ip", "nft", "nsenter") if shutil.which(t) is None]
    if lacking:
        return f"{', '.join(lacking)} not installed (scripts/install-system-deps installs nftables, iproute2)"
    return None


async def run(argv: list[str], stdin: str | None = None, *, check: bool = True) -> subprocess.CompletedProcess[bytes]:
    r = await anyio.run_process(argv, input=stdin.encode() if stdin is not None else None, check=False)
    if check and r.returncode != 0:
        raise RuntimeFailure(f"{argv[0]} failed (exit {r.returncode})",
                             detail=(r.stderr.decode(errors="replace").strip() + "\n" + (stdin or ""))[-2000:])
    return r


async def nft(script: str, *, check: bool = True) -> bool:
    return (await run(["nft", "-f", "-"], script, check=check)).returncode == 0


async def nft_json(table: str) -> dict | None:  # type: ignore[type-arg]
    """The table as nft's JSON, or None (no such table, or no nft on this host: then nothing was made)."""
    if shutil.which("nft") is None:
        return None
    r = await run(["nft", "-j", "list", "table", "inet", table], check=False)
    if r.returncode != 0:
        return None
    return json.loads(r.stdout or b"{}")


def links(prefix: str) -> list[str]:
    try:
        return sorted(n for n in os.listdir(_SYS_NET) if n.startswith(prefix))
    except OSError:
        return []


def link_exists(name: str) -> bool:
    return (_SYS_NET / name).exists()


def same_netns_as_agent(pid: int) -> bool:
    """True when ``pid`` shares the agent's network namespace (or is gone): a veth must never be made
    for it, since its "inside" would be the host."""
    try:
        return os.stat(f"/proc/{pid}/ns/net").st_ino == os.stat("/proc/self/ns/net").st_ino
    except OSError:
        return True


def sysctl(path: str, value: str) -> None:
    """Write ``/proc/sys/net/<path>`` (this host's network namespace: the agent's own)."""
    with open(_PROC_NET / path, "w") as f:
        f.write(value)


def read_sysctl(path: str) -> str:
    return (_PROC_NET / path).read_text().strip()


async def default_route_devices() -> list[str]:
    r = await run(["ip", "-j", "-4", "route", "show", "default"], check=False)
    try:
        routes = json.loads(r.stdout or b"[]")
    except ValueError:
        return []
    return sorted({str(x["dev"]) for x in routes if x.get("dev")})


async def route_overlaps(cidr: str, own_prefix: str) -> list[str]:
    """Host routes (not ours) overlapping ``cidr``: the pool would shadow or be shadowed by them."""
    import ipaddress
    pool = ipaddress.IPv4Network(cidr)
    r = await run(["ip", "-j", "-4", "route", "show", "table", "all"], check=False)
    try:
        routes = json.loads(r.stdout or b"[]")
    except ValueError:
        return []
    out = []
    for x in routes:
        dst, dev = x.get("dst", ""), str(x.get("dev", ""))
        if dst in ("default", "") or dev.startswith(own_prefix) or x.get("type") in ("local", "broadcast"):
            continue
        try:
            if ipaddress.IPv4Network(dst, strict=False).overlaps(pool):
                out.append(f"{dst} dev {dev}")
        except ValueError:
            continue
    return out


async def add_veth(ifname: str, pid: int, gateway: str, address: str, *, route_localnet: bool) -> None:
    """A veth pair: ``ifname`` on the host with the gateway address, its peer ``eth0`` inside the network
    namespace of ``pid`` with ``address`` and a default route via the gateway."""
    await run(["ip", "-batch", "-"],
              f"link add {ifname} type veth peer name eth0 netns {pid}\n"
              f"addr add {gateway}/30 dev {ifname}\nlink set {ifname} up\n")
    try:
        # before the inside end is configured nothing can cross; IPv6 is also dropped by the rules
        sysctl(f"ipv6/conf/{ifname}/disable_ipv6", "1")
        sysctl(f"ipv4/conf/{ifname}/forwarding", "1")
        if route_localnet:      # DNS DNAT'ed to a loopback resolver arrives on this link
            sysctl(f"ipv4/conf/{ifname}/route_localnet", "1")
        await run(["nsenter", f"--net=/proc/{pid}/ns/net", "ip", "-batch", "-"],
                  f"addr add {address}/30 dev eth0\nlink set eth0 up\nroute add default via {gateway}\n")
    except BaseException:
        with anyio.CancelScope(shield=True):
            await del_link(ifname)
        raise


async def del_link(ifname: str) -> None:
    """Delete a veth (its peer inside the sandbox goes with it); no error when it is gone already."""
    if link_exists(ifname):
        await run(["ip", "link", "del", ifname], check=False)


# ---- the sandbox's /etc/resolv.conf, written inside its own root --------------------------------------

_SYS_openat2 = 437
_RESOLVE_NO_MAGICLINKS, _RESOLVE_IN_ROOT = 0x02, 0x10
_libc = ctypes.CDLL(None, use_errno=True)


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


def _openat2(dirfd: int, path: str, flags: int, mode: int = 0) -> int:
    how = _OpenHow(flags, mode, _RESOLVE_IN_ROOT | _RESOLVE_NO_MAGICLINKS)
    fd = _libc.syscall(_SYS_openat2, dirfd, path.encode(), ctypes.byref(how), ctypes.sizeof(how))
    if fd < 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e), path)
    return int(fd)


def write_resolv_conf(rootfs: Path, nameserver: str) -> None:
    """``/etc/resolv.conf`` inside ``rootfs`` (a sandbox's root: attacker-made). Every path is resolved
    inside that root (openat2 RESOLVE_IN_ROOT): a planted symlink can never make the agent write a host
    file. A symlink at resolv.conf itself is replaced by the file."""
    root = os.open(rootfs, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        try:
            etc = _openat2(root, "etc", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except FileNotFoundError:
            os.mkdir("etc", 0o755, dir_fd=root)     # FileExistsError: a dangling link there (refused)
            etc = _openat2(root, "etc", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC
            try:
                fd = os.open("resolv.conf", flags, 0o644, dir_fd=etc)
            except OSError as e:
                if e.errno != errno.ELOOP:
                    raise
                os.unlink("resolv.conf", dir_fd=etc)        # a symlink: replaced (never followed)
                fd = os.open("resolv.conf", flags, 0o644, dir_fd=etc)
            with os.fdopen(fd, "w") as f:
                f.write(f"# written by PillDrops: DNS through the node's resolver\nnameserver {nameserver}\n")
        finally:
            os.close(etc)
    finally:
        os.close(root)
