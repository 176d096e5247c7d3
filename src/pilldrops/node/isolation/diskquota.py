"""Per-sandbox disk quota: the writable layer on a loop-mounted ext4 image of its own (issue 16 part 2).

Per sandbox (``make``): ``<sandbox dir>/disk.img``, a sparse file of about ``disk_mb`` MiB (a
copy of a pre-formatted "golden" image of that size: 230 KiB of real blocks for 10 GiB, made once per
size with mkfs.ext4 and kept in ``<state_dir>/disk-golden/``), attached to a free loop device with
LOOP_CONFIGURE (autoclear, direct I/O: no second copy in the page cache) and mounted (mount(2),
``nosuid,nodev`` + ``MOUNT_OPTS``) on ``<sandbox dir>/disk``, which holds the overlay's ``upper`` and ``work``
dirs. No process on the create path once the golden image of a size exists. Past the size every write in
the sandbox fails with ENOSPC; uploads are unpacked by the sandbox's own ``tar`` into the same layer, so
they are charged at the blocks they write and fail the same way (the data plane refuses an archive whose
members add up to more than ``free_bytes`` before unpacking it: ``archive.sanitize``). Nothing else on the
node shares the file system: other sandboxes and the host's disk are untouched (the image is sparse, so
the host's disk holds at most the high-water mark of what the sandbox wrote, never more than its size;
no ``discard``: it made every unmount 20-40 ms slower, and the whole image goes with the sandbox).

Why not a project quota on one shared file system: this kernel (and the CI machines) has neither
CONFIG_XFS_QUOTA nor CONFIG_QFMT_V2, so XFS and ext4 project quotas cannot be mounted; and a tmpfs upper
would charge the disk to RAM. The numbers are in bench/RESULTS.md.

Teardown unmounts it; the loop device detaches itself with the last reference (autoclear). A restarted
agent finds the mount in place (it lives in the host's mount namespace, like the rootfs overlay).
The image's usable size is at least ``disk_mb`` (ext4 keeps ~1.6% for inode tables and bitmaps, so the
image is that much larger); ``usage`` reads statfs of the mount: the used bytes, and the limit.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from pilldrops.node.isolation.mounts import MS_NODEV, MS_NOSUID, MountError, mount, umount

LOOP_CTL_GET_FREE = 0x4C82
LOOP_CONFIGURE = 0x4C0A
LOOP_CLR_FD = 0x4C01
LO_FLAGS_AUTOCLEAR = 4
LO_FLAGS_DIRECT_IO = 16
IMAGE = "disk.img"
MOUNT = "disk"
GOLDEN_DIR = "disk-golden"
MIN_DISK_MB = 16
# noinit_itable: no zeroing of inode tables behind the mount (lazy_itable_init left them unzeroed).
# no_mbcache: no xattr-block dedup cache per mount (an 8 KiB hash table and a shrinker each, ~9 KiB of
# unreclaimable slab a sandbox: bench/RESULTS.md, issue 15 session 7); xattrs (overlay's trusted.* ones)
# still work, identical external xattr blocks are just not shared between inodes of one sandbox's disk.
MOUNT_OPTS = "noinit_itable,no_mbcache"
MKFS = ["mkfs.ext4", "-q", "-F", "-b", "4096", "-I", "256", "-i", "16384", "-m", "0",
        "-O", "^has_journal,^resize_inode", "-E", "lazy_itable_init=1,nodiscard,root_owner=0:0"]


class DiskQuotaError(OSError):
    pass


class _LoopInfo64(ctypes.Structure):
    _fields_ = [("lo_device", ctypes.c_uint64), ("lo_inode", ctypes.c_uint64), ("lo_rdevice", ctypes.c_uint64),
                ("lo_offset", ctypes.c_uint64), ("lo_sizelimit", ctypes.c_uint64), ("lo_number", ctypes.c_uint32),
                ("lo_encrypt_type", ctypes.c_uint32), ("lo_encrypt_key_size", ctypes.c_uint32),
                ("lo_flags", ctypes.c_uint32), ("lo_file_name", ctypes.c_uint8 * 64),
                ("lo_crypt_name", ctypes.c_uint8 * 64), ("lo_encrypt_key", ctypes.c_uint8 * 32),
                ("lo_init", ctypes.c_uint64 * 2)]


class _LoopConfig(ctypes.Structure):
    _fields_ = [("fd", ctypes.c_uint32), ("block_size", ctypes.c_uint32), ("info", _LoopInfo64),
                ("reserved", ctypes.c_uint64 * 8)]


def image_mb(disk_mb: int) -> int:
    """Size of the image whose free space is at least ``disk_mb`` MiB: ext4's inode tables and bitmaps take
    1.57% of it, and it keeps min(2%, 16 MiB) in reserve for itself (``s_resv_clusters``), plus ~100 KiB."""
    return disk_mb + -(-disk_mb * 162 // 10_000) + min(-(-disk_mb * 205 // 10_000), 16) + 2


def unavailable_reason() -> str | None:
    """Why per-sandbox disks cannot be made on this host (None: they can)."""
    if os.geteuid() != 0:
        return "disk quotas need root (a loop device per sandbox)"
    if not os.path.exists("/dev/loop-control"):
        return "no /dev/loop-control (the kernel has no loop devices)"
    if not any(os.access(os.path.join(p, "mkfs.ext4"), os.X_OK) for p in ("/usr/sbin", "/sbin", "/usr/bin")):
        return "mkfs.ext4 not installed (e2fsprogs; scripts/install-system-deps)"
    return None


def _golden(state_dir: Path, disk_mb: int) -> Path:
    """The pre-formatted image for ``disk_mb`` (made once; concurrent makers race harmlessly)."""
    g = state_dir / GOLDEN_DIR / f"ext4-{disk_mb}.img"
    if g.exists():
        return g
    g.parent.mkdir(parents=True, exist_ok=True)
    tmp = g.with_name(f"{g.name}.{os.getpid()}.{id(g)}.tmp")
    with open(tmp, "wb") as f:
        f.truncate(image_mb(disk_mb) << 20)
    r = subprocess.run([*MKFS, str(tmp)], capture_output=True, text=True, check=False)
    if r.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise DiskQuotaError(errno.EIO, f"mkfs.ext4 failed: {r.stderr.strip()}")
    os.replace(tmp, g)
    return g


def _sparse_copy(src: Path, dst: Path) -> None:
    """Copy only the data segments of ``src`` (a few hundred KiB of a mostly empty image)."""
    sfd = os.open(src, os.O_RDONLY | os.O_CLOEXEC)
    try:
        dfd = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            size = os.fstat(sfd).st_size
            off = 0
            while off < size:
                try:
                    data = os.lseek(sfd, off, os.SEEK_DATA)
                except OSError as e:
                    if e.errno == errno.ENXIO:      # only a hole is left
                        break
                    raise
                hole = os.lseek(sfd, data, os.SEEK_HOLE)
                pos = data
                while pos < hole:
                    n = os.copy_file_range(sfd, dfd, hole - pos, pos, pos)
                    if n <= 0:
                        raise DiskQuotaError(errno.EIO, f"short copy of {src}")
                    pos += n
                off = hole
            os.ftruncate(dfd, size)
        finally:
            os.close(dfd)
    finally:
        os.close(sfd)


def _attach_loop(image: Path) -> tuple[str, int]:
    """A free loop device backed by ``image`` and an open fd of it (autoclear: the device detaches when
    its last user goes, so the caller mounts it before closing the fd)."""
    ifd = os.open(image, os.O_RDWR | os.O_CLOEXEC)
    try:
        ctl = os.open("/dev/loop-control", os.O_RDWR | os.O_CLOEXEC)
        try:
            for _ in range(64):
                n = fcntl.ioctl(ctl, LOOP_CTL_GET_FREE)
                dev = f"/dev/loop{n}"
                try:
                    lfd = os.open(dev, os.O_RDWR | os.O_CLOEXEC)
                except FileNotFoundError:
                    continue
                ok = False
                try:
                    for flags in (LO_FLAGS_AUTOCLEAR | LO_FLAGS_DIRECT_IO, LO_FLAGS_AUTOCLEAR):
                        cfg = _LoopConfig(fd=ifd, block_size=4096 if flags & LO_FLAGS_DIRECT_IO else 0)
                        cfg.info.lo_flags = flags
                        try:
                            fcntl.ioctl(lfd, LOOP_CONFIGURE, cfg)
                            ok = True
                            return dev, lfd
                        except OSError as e:
                            if e.errno == errno.EBUSY:      # another creator took it first: next one
                                break
                            if e.errno != errno.EINVAL or not flags & LO_FLAGS_DIRECT_IO:
                                raise DiskQuotaError(e.errno, f"LOOP_CONFIGURE {dev}: {e.strerror}") from e
                finally:
                    if not ok:
                        os.close(lfd)
            raise DiskQuotaError(errno.EBUSY, "no free loop device")
        finally:
            os.close(ctl)
    finally:
        os.close(ifd)


def _detach_loop(dev: str) -> None:
    try:
        fd = os.open(dev, os.O_RDWR | os.O_CLOEXEC)
    except OSError:
        return
    try:
        fcntl.ioctl(fd, LOOP_CLR_FD)
    except OSError:
        pass
    finally:
        os.close(fd)


@dataclass(frozen=True)
class Usage:
    used_bytes: int
    limit_bytes: int


def make(state_dir: Path, d: Path, disk_mb: int) -> Path:
    """The writable-layer file system of the sandbox dir ``d``, mounted on ``d/disk`` (returned)."""
    if disk_mb < MIN_DISK_MB:
        raise DiskQuotaError(errno.EINVAL, f"disk_mb must be at least {MIN_DISK_MB}")
    _sparse_copy(_golden(state_dir, disk_mb), d / IMAGE)
    return mount_image(d)


def mount_image(d: Path) -> Path:
    """Attach ``d/disk.img`` to a loop device and mount it on ``d/disk`` (returned)."""
    image, mnt = d / IMAGE, d / MOUNT
    mnt.mkdir(exist_ok=True)
    dev, lfd = _attach_loop(image)
    try:
        mount(dev, mnt, "ext4", MS_NOSUID | MS_NODEV, MOUNT_OPTS)
    except MountError as e:
        raise DiskQuotaError(e.errno, str(e)) from e
    finally:
        os.close(lfd)           # unmounted (a failed mount): the last reference, autoclear detaches it
    return mnt


def move_image(src: Path, dst: Path) -> None:
    """Rename a (sparse) disk image; across file systems copy its data segments and remove it."""
    try:
        os.rename(src, dst)
    except OSError as e:
        if e.errno != errno.EXDEV:
            raise
        _sparse_copy(src, dst)
        os.unlink(src)


def backing_device(mnt: Path) -> str | None:
    """The block device mounted on ``mnt`` (e.g. ``/dev/loop7``), None when nothing is mounted there or it
    is no block device. From stat(2) and sysfs, not the mount table: that holds 3 lines per sandbox and
    parsing it cost ~17 ms of CPU per kill at 6,000 lines (bench/RESULTS.md, issue 15)."""
    try:
        st, parent = os.stat(mnt), os.stat(mnt.parent)
    except OSError:
        return None
    if st.st_dev == parent.st_dev:
        return None                     # not a mount point
    try:
        uevent = Path(f"/sys/dev/block/{os.major(st.st_dev)}:{os.minor(st.st_dev)}/uevent").read_text()
    except OSError:
        return None                     # not a block device's file system (tmpfs, overlay, ...)
    name = next((ln[8:] for ln in uevent.splitlines() if ln.startswith("DEVNAME=")), "")
    return f"/dev/{name}" if name else None


RELEASE_WAIT_S = 10.0       # how long a checkpoint waits for the last mount of a disk elsewhere to go
_libc = ctypes.CDLL("libc.so.6", use_errno=True)


def remove(d: Path, keep_image: bool = False) -> None:
    """Unmount ``d/disk`` (its loop device detaches itself; an attached but unmounted one is cleared).

    ``keep_image`` (a checkpoint moves the image on, and a resume mounts it again): the file system is
    flushed to the image first, and this returns only once the file system is closed everywhere. Our
    unmount does not close it while another mount namespace still holds a copy of the mount (a ``crun
    run`` starting at that moment copies the host's mounts); a mount of the image made before it closes
    would read it stale (a directory made seconds ago missing) and race its last writes."""
    mnt = d / MOUNT
    dev = backing_device(mnt)
    if keep_image and dev is not None:
        _syncfs(mnt)
    umount(mnt)
    if dev and dev.startswith("/dev/loop"):
        if keep_image:
            _wait_released(dev, d / IMAGE)
        _detach_loop(dev)       # no-op after autoclear; clears a device a failed mount left attached


def _syncfs(mnt: Path) -> None:
    fd = os.open(mnt, os.O_RDONLY | os.O_DIRECTORY)
    try:
        if _libc.syncfs(fd) != 0:
            err = ctypes.get_errno()
            raise MountError(err, f"syncfs {mnt}: {os.strerror(err)}")
    finally:
        os.close(fd)


def _wait_released(dev: str, image: Path) -> None:
    """Until the loop device ``dev`` no longer backs ``image`` (autoclear detaches it when its file
    system closes), at most ``RELEASE_WAIT_S``; MountError (EBUSY) after that."""
    backing = Path("/sys/block") / Path(dev).name / "loop" / "backing_file"
    deadline = time.monotonic() + RELEASE_WAIT_S
    while True:
        try:
            still = backing.read_text().strip().removesuffix(" (deleted)") == str(image)
        except OSError:
            still = False       # detached
        if not still:
            return
        if time.monotonic() > deadline:
            raise MountError(errno.EBUSY, f"the disk {image} is still mounted elsewhere ({dev})")
        time.sleep(0.02)


def layer_dirs(d: Path) -> tuple[Path, Path]:
    """The overlay's upper and work dirs of the sandbox dir ``d``: on its own disk when it has one."""
    base = d / MOUNT if (d / MOUNT).is_dir() else d
    return base / "upper", base / "work"


def make_layer_dirs(d: Path) -> tuple[Path, Path]:
    """``layer_dirs`` made empty, with ``upper/etc`` (a create writes the sandbox's identity files there)."""
    upper, work = layer_dirs(d)
    upper.mkdir()
    (upper / "etc").mkdir()
    work.mkdir()
    return upper, work


def _mounted(d: Path) -> bool:
    try:
        return os.stat(d / MOUNT).st_dev != os.stat(d).st_dev
    except OSError:
        return False


def free_bytes(d: Path) -> int | None:
    """Bytes a write may still add to the sandbox's disk (None: it has no disk of its own)."""
    if not _mounted(d):
        return None
    st = os.statvfs(d / MOUNT)
    return st.f_bavail * st.f_frsize


def usage(d: Path, disk_mb: int | None = None) -> Usage | None:
    """Bytes used on the sandbox's disk, and its limit (None: the sandbox has no disk of its own)."""
    if not _mounted(d):
        return None
    try:
        st = os.statvfs(d / MOUNT)
    except OSError:
        return None
    used = (st.f_blocks - st.f_bfree) * st.f_frsize
    limit = (disk_mb << 20) if disk_mb else st.f_blocks * st.f_frsize
    return Usage(used_bytes=used, limit_bytes=limit)
