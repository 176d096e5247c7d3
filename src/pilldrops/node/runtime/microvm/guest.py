"""What a microVM guest boots: the Debian kernel, an initramfs (busybox, virtio modules, pd-vmagent, pd-init)
and one ext4 root disk per template, all built on demand and cached by content hash.

- Kernel: ``scripts/install-microvm`` unpacks Debian's ``linux-image-*-cloud-amd64`` into ``KERNEL_ROOT``
  (``vmlinuz``, ``config``, ``modules/``); the cloud kernel has virtio, virtio_mmio, virtio_blk and
  virtio_console as modules, ext4 and cgroup2 built in.
- Initramfs (newc cpio, gzip, written here: no cpio binary needed): ``/init`` mounts the root disk
  ``/dev/vda`` read-write, puts a tmpfs at ``/.pd`` (``run/`` for pd-init's socket, ``bin/`` for the two
  static binaries) and ``switch_root``s to ``/.pd/bin/pd-vmagent``. A failure prints ``PD-BOOT-FAIL: why``
  on the console and powers off, so a bad guest ends its boot at once instead of timing out.
- Root disk: ``mkfs.ext4 -d`` of the template's layers merged by a read-only overlay mount (whiteouts
  applied), sized content + 25 % + ``disk_mb`` free: the disk limit of every sandbox of that template.
  Sandboxes never write to it: each gets a qcow2 overlay (``qemu-img create -b``).
"""

from __future__ import annotations

import fcntl
import gzip
import hashlib
import io
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from pilldrops.node.isolation.mounts import MS_RDONLY, MountError, mount, umount
from pilldrops.node.runtime.init import build_init

KERNEL_ROOT = Path(os.environ.get("PILLDROPS_MICROVM_ROOT", "/var/lib/pilldrops/microvm/kernel"))
AGENT_SOURCE = Path(__file__).with_name("pd-vmagent.c")
CFLAGS = ["-static", "-Os", "-s", "-Wall", "-Werror"]
MODULES = ("kernel/drivers/virtio/virtio_ring.ko", "kernel/drivers/virtio/virtio.ko",
           "kernel/drivers/virtio/virtio_mmio.ko", "kernel/drivers/block/virtio_blk.ko",
           "kernel/drivers/char/virtio_console.ko")
BUSYBOX = Path("/bin/busybox")
GUEST_FORMAT = "4"              # bump when the initramfs layout or /init changes
IMAGE_FORMAT = "1"

INIT_SCRIPT = """#!/bin/busybox sh
/bin/busybox --install -s /bin
export PATH=/bin
fail() { echo "PD-BOOT-FAIL: $*" > /dev/console; sync; poweroff -f; sleep 5; reboot -f; }
mount -t devtmpfs dev /dev || fail mount /dev
exec </dev/console >/dev/console 2>&1
mount -t proc proc /proc
mount -t sysfs sys /sys
for m in /mods/*.ko; do insmod "$m" || fail "insmod $m"; done
i=0; while [ ! -b /dev/vda ]; do i=$((i+1)); [ $i -gt 500 ] && fail "no root disk /dev/vda"; usleep 10000; done
mkdir -p /newroot
mount -t ext4 -o rw,noatime /dev/vda /newroot || fail "cannot mount the root disk"
for d in .pd dev proc sys tmp etc; do mkdir -p /newroot/$d || fail "mkdir /$d on the root disk"; done
mount -t tmpfs -o mode=0755,size=16m pd /newroot/.pd || fail "tmpfs /.pd"
mkdir -p /newroot/.pd/run /newroot/.pd/bin
# /etc/machine-id is a bind of a tmpfs file: the identity written after every restore skips ext4 (cold under TCG)
[ -L /newroot/etc/machine-id ] && rm -f /newroot/etc/machine-id
[ -f /newroot/etc/machine-id ] || : > /newroot/etc/machine-id || fail "create /etc/machine-id"
: > /newroot/.pd/machine-id && mount --bind /newroot/.pd/machine-id /newroot/etc/machine-id || fail "bind /etc/machine-id"
cp /pd-init /pd-vmagent /newroot/.pd/bin/ || fail "copy the agent"
mount --move /dev /newroot/dev && mount --move /proc /newroot/proc && mount --move /sys /newroot/sys || fail "move mounts"
exec switch_root /newroot /.pd/bin/pd-vmagent
"""

PROBE_INIT = """#!/bin/busybox sh
/bin/busybox echo PD-PROBE-BOOTED > /dev/ttyS0
/bin/busybox poweroff -f
"""


class GuestBuildError(RuntimeError):
    pass


def kernel_release() -> str | None:
    try:
        return (KERNEL_ROOT / ".pilldrops-kernel-ready").read_text().split()[0]
    except (OSError, IndexError):
        return None


def kernel_path() -> Path:
    return KERNEL_ROOT / "vmlinuz"


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


def _cpio(entries: list[tuple[str, int, bytes]]) -> bytes:
    """A newc cpio archive of (path, mode, data) entries; directories have mode 0o040xxx."""
    out = io.BytesIO()
    ino = 1

    def entry(name: str, mode: int, data: bytes) -> None:
        nonlocal ino
        nb = name.encode() + b"\0"
        hdr = "070701" + "".join(f"{v:08x}" for v in (ino, mode, 0, 0, 1, 0, len(data), 0, 0, 0, 0, len(nb), 0))
        out.write(hdr.encode() + nb)
        out.write(b"\0" * ((4 - (110 + len(nb)) % 4) % 4))
        out.write(data)
        out.write(b"\0" * ((4 - len(data) % 4) % 4))
        ino += 1

    for name, mode, data in entries:
        entry(name, mode, data)
    entry("TRAILER!!!", 0, b"")
    return out.getvalue()


def _gcc(source: Path, out: Path) -> None:
    if not shutil.which("gcc"):
        raise GuestBuildError("gcc is not installed: run `scripts/install-system-deps` first")
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    r = subprocess.run(["gcc", *CFLAGS, "-o", str(tmp), str(source)], capture_output=True, text=True, check=False)
    if r.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise GuestBuildError(f"gcc failed building {source.name}: {r.stderr.strip()}")
    os.replace(tmp, out)


def _write_initramfs(out: Path, files: list[tuple[str, int, bytes]]) -> None:
    dirs = [(d, 0o040755, b"") for d in ("bin", "dev", "proc", "sys", "mods", "newroot")]
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    tmp.write_bytes(gzip.compress(_cpio(dirs + files), compresslevel=1))
    os.replace(tmp, out)


def build_initramfs(cache_dir: Path) -> Path:
    """The guest initramfs for this kernel, pd-init and pd-vmagent (rebuilt when any of them changed)."""
    rel = kernel_release()
    if rel is None:
        raise GuestBuildError(f"no guest kernel in {KERNEL_ROOT}: run `scripts/install-microvm` (as root)")
    init = build_init(cache_dir)
    h = hashlib.sha256()
    for part in (GUEST_FORMAT, rel, INIT_SCRIPT, " ".join(CFLAGS)):
        h.update(part.encode())
    h.update(AGENT_SOURCE.read_bytes())
    h.update(init.read_bytes())
    key = h.hexdigest()[:16]
    d = cache_dir / "guest"
    out = d / f"initramfs-{key}.cpio.gz"
    if out.exists():
        return out
    with _locked(d / ".lock"):
        if out.exists():
            return out
        agent = d / f"pd-vmagent-{key}"
        _gcc(AGENT_SOURCE, agent)
        files = [("init", 0o100755, INIT_SCRIPT.encode()), ("bin/busybox", 0o100755, BUSYBOX.read_bytes()),
                 ("pd-init", 0o100755, init.read_bytes()), ("pd-vmagent", 0o100755, agent.read_bytes())]
        for i, m in enumerate(MODULES):
            src = KERNEL_ROOT / "modules" / m
            if not src.exists():
                raise GuestBuildError(f"guest kernel {rel} has no module {m}")
            files.append((f"mods/{i}-{src.name}", 0o100644, src.read_bytes()))
        _write_initramfs(out, files)
        agent.unlink(missing_ok=True)
        for old in d.glob("initramfs-*.cpio.gz"):
            if old != out:
                old.unlink(missing_ok=True)
    return out


def build_probe_initramfs(cache_dir: Path) -> Path:
    """A minimal initramfs that prints PD-PROBE-BOOTED on ttyS0 and powers off (the KVM probe)."""
    out = cache_dir / "guest" / f"probe-{GUEST_FORMAT}.cpio.gz"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        _write_initramfs(out, [("init", 0o100755, PROBE_INIT.encode()),
                               ("bin/busybox", 0o100755, BUSYBOX.read_bytes())])
    return out


def _du_bytes(root: Path) -> int:
    total = 0
    for dirpath, dirs, files in os.walk(root):
        for f in files + dirs:
            try:
                total += os.lstat(os.path.join(dirpath, f)).st_blocks * 512 + 256
            except OSError:
                pass
    return total


def _layer_identity(layer: Path) -> str:
    """A template layer by content: ``<name>/<hash>`` of the template store's content-addressed layout
    (``.../templates/<name>/<hash>/layer`` + ``manifest.json``), else its absolute path. The same template
    in two data dirs (two nodes or test sessions on one host) then shares one root disk and snapshot."""
    p = Path(layer).resolve()
    if p.name == "layer" and (p.parent / "manifest.json").exists():
        return f"{p.parent.parent.name}/{p.parent.name}"
    return str(p)


def image_key(layers: tuple[Path, ...] | list[Path], disk_mb: int) -> str:
    h = hashlib.sha256(f"{IMAGE_FORMAT}|{disk_mb}|".encode())
    for p in layers:
        h.update(_layer_identity(Path(p)).encode() + b"\0")
    return h.hexdigest()[:16]


def build_root_image(cache_dir: Path, layers: tuple[Path, ...] | list[Path], *, disk_mb: int) -> Path:
    """The template's root disk (raw ext4), built once per layer set: never written by a guest."""
    key = image_key(layers, disk_mb)
    d = cache_dir / "images" / key
    out = d / "root.img"
    if out.exists():
        return out
    with _locked(cache_dir / "images" / f".{key}.lock"):
        if out.exists():
            return out
        if not shutil.which("mkfs.ext4"):
            raise GuestBuildError("mkfs.ext4 is not installed: run `scripts/install-microvm` (as root)")
        d.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix="pilldrops-img-", dir=d) as tmp:
            src = Path(tmp) / "merged"
            src.mkdir()
            layers = [Path(p) for p in layers]
            if len(layers) == 1:
                src = layers[0]
                mounted = False
            else:
                opts = b"lowerdir=" + b":".join(str(p).encode() for p in layers)
                try:
                    mount(b"overlay", src, b"overlay", MS_RDONLY, opts)
                except MountError as e:
                    raise GuestBuildError(f"cannot merge the template layers: {e}") from e
                mounted = True
            try:
                size = int(_du_bytes(src) * 1.25) + disk_mb * 1024 * 1024 + 16 * 1024 * 1024
                size = (size + 4095) // 4096 * 4096
                img = Path(tmp) / "root.img"
                with open(img, "wb") as f:
                    f.truncate(size)
                r = subprocess.run(["mkfs.ext4", "-q", "-F", "-L", "pdroot", "-O", "^has_journal", "-m", "0",
                                    "-E", "root_owner=0:0", "-d", str(src), str(img)],
                                   capture_output=True, text=True, check=False)
                if r.returncode != 0:
                    raise GuestBuildError(f"mkfs.ext4 -d failed: {r.stderr.strip()[-2000:]}")
            finally:
                if mounted:
                    umount(src)
            os.replace(img, out)
    return out
