"""Sanitising tar streams before they enter a sandbox (upload).

Every member is checked on the node before the sandbox's own ``tar`` unpacks it inside the sandbox root
(so even a path that passed would resolve inside the sandbox, never on the host). Refused, with the
member named: absolute paths, ``..`` components, symlinks or hard links whose target leaves the upload
directory, device nodes and fifos. Neutralised: setuid/setgid/sticky bits, group/other write bits are
kept as given but ownership becomes root:root (the sandbox's root).
"""

from __future__ import annotations

import posixpath
import tarfile
from typing import IO

from pilldrops import errors

MAX_MEMBERS = 1_000_000


def _clean_name(name: str) -> str:
    if name.startswith("/"):
        raise errors.InvalidRequest(f"archive member {name!r} has an absolute path")
    norm = posixpath.normpath(name)
    if ".." in name.split("/"):   # refused even when it would stay inside: tar implementations differ
        raise errors.InvalidRequest(f"archive member {name!r} escapes the upload directory")
    return norm


def _check_link(member: tarfile.TarInfo, name: str) -> None:
    target = member.linkname
    if posixpath.isabs(target):
        raise errors.InvalidRequest(f"link {name!r} points to an absolute path {target!r}")
    base = posixpath.dirname(name) if member.issym() else ""
    resolved = posixpath.normpath(posixpath.join(base, target))
    if resolved == ".." or resolved.startswith("../"):
        raise errors.InvalidRequest(f"link {name!r} -> {target!r} points outside the upload directory")


def sanitize(src: IO[bytes], dst: IO[bytes], *, max_bytes: int | None = None) -> int:
    """Copy the tar stream ``src`` to ``dst`` keeping only safe members; returns the member count.

    ``max_bytes``: what is left on the sandbox's disk. The members' sizes (as unpacked: a sparse member
    at its full size, a compressed stream decompressed) are added up as they come, and the upload is
    refused (``DiskQuotaExceeded``) as soon as they pass it, before the rest is read or anything written."""
    count = total = 0
    try:
        with tarfile.open(fileobj=src, mode="r|*") as tin, tarfile.open(fileobj=dst, mode="w|",
                                                                         format=tarfile.PAX_FORMAT) as tout:
            for member in tin:
                count += 1
                if count > MAX_MEMBERS:
                    raise errors.PayloadTooLarge(f"archive has more than {MAX_MEMBERS} members")
                name = _clean_name(member.name)
                if not (member.isfile() or member.isdir() or member.issym() or member.islnk()):
                    raise errors.InvalidRequest(f"archive member {member.name!r} is a device, fifo or "
                                                "other special file")
                if member.issym() or member.islnk():
                    _check_link(member, name)
                    if member.islnk():
                        member.linkname = _clean_name(member.linkname)
                member.name = name
                member.mode &= 0o777            # drop setuid, setgid, sticky
                member.uid = member.gid = 0
                member.uname = member.gname = "root"
                member.pax_headers = {}
                if member.isfile():
                    total += member.size
                    if max_bytes is not None and total > max_bytes:
                        raise errors.DiskQuotaExceeded(
                            f"the archive unpacks to more than the {max_bytes} bytes left on the sandbox's disk "
                            f"(at {member.name!r})", details={"free_bytes": max_bytes, "member": member.name})
                    tout.addfile(member, tin.extractfile(member))
                else:
                    tout.addfile(member)
    except tarfile.TarError as exc:
        raise errors.InvalidRequest(f"not a valid tar stream: {exc}") from exc
    return count
