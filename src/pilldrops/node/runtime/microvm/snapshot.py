"""Boot a template's guest once and keep it as a snapshot that sandboxes are restored from.

A snapshot dir ``<cache>/snapshots/<key>/`` holds ``vm.snap`` (QMP ``migrate exec:cat`` of the stopped VM:
RAM + device state), ``disk.qcow2`` (the boot's own overlay over the template's ``root.img``; read-only
from then on, the backing file of every sandbox disk) and ``meta.json`` (written last: marks it complete).
The key covers everything the VM state depends on: root image, kernel, initramfs, guest RAM, vCPUs,
accelerator and QEMU's version. A boot happens in a temp dir renamed into place, under a file lock, so
concurrent creates (and agents) boot a template once; a failed boot leaves neither process nor file.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import shutil
import subprocess
import time
from pathlib import Path

from pilldrops.node.runtime.microvm import vm
from pilldrops.node.runtime.microvm.channel import AgentLink, LinkError
from pilldrops.node.runtime.microvm.qmp import Qmp, QmpError

FORMAT = "1"


def snapshot_key(image: Path, cfg: vm.VmConfig, qemu_version: str) -> str:
    h = hashlib.sha256()
    # content names, not cache paths: image dir = hash of the layers, initramfs file = hash of its inputs
    for part in (FORMAT, image.parent.name, cfg.kernel, Path(cfg.initrd).name, str(cfg.memory_mb), str(cfg.smp),
                 cfg.accel, qemu_version, vm.kernel_append(cfg.accel)):
        h.update(part.encode() + b"\0")
    return h.hexdigest()[:16]


def qcow2_overlay(backing: Path, out: Path, *, backing_format: str) -> None:
    r = subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", "-F", backing_format, "-b", str(backing),
                        str(out)], capture_output=True, text=True, check=False)
    if r.returncode != 0:
        raise vm.VmError("qemu-img create failed", r.stderr.strip())


def wait_agent(link: AgentLink, deadline: float, pid: int, start: int, d: Path, log: str) -> None:
    """Wait until the guest agent answers and pd-init listens (or the VM died / the deadline passed)."""
    while True:
        left = deadline - time.monotonic()
        try:
            link.wait_synced(max(0.1, min(left, 0.5)))
            reply = link.request(b"", timeout=max(0.1, min(left, 2.0)))
            if reply == "ok" or reply.startswith("ok "):
                return
        except LinkError as e:
            reply = str(e)
        if not vm.alive(pid, start):
            raise vm.VmError("the guest did not boot (QEMU exited)", _boot_detail(d, log))
        if time.monotonic() > deadline:
            raise vm.VmError("the guest did not boot in time", f"last agent reply: {reply}; {_boot_detail(d, log)}")
        if link.dead:
            raise vm.VmError("the guest agent link closed during boot", f"{link.dead}; {_boot_detail(d, log)}")
        time.sleep(0.05)


def _boot_detail(d: Path, log: str) -> str:
    console = vm.log_tail(d, log, 1500)
    fails = [ln for ln in console.splitlines() if "PD-BOOT-FAIL" in ln or "Kernel panic" in ln]
    return "; ".join(fails[-3:]) or console[-600:] or vm.log_tail(d)


def ensure(cache_dir: Path, image: Path, cfg: vm.VmConfig, *, boot_timeout: float) -> Path:
    """The complete snapshot dir for ``image`` + ``cfg`` (booting and snapshotting it first if needed).
    Blocking: run it in a worker thread."""
    key = snapshot_key(image, cfg, vm.qemu_version())
    root = cache_dir / "snapshots"
    final = root / key
    if (final / "meta.json").exists():
        return final
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f".{key}.lock", "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (final / "meta.json").exists():
            return final
        shutil.rmtree(final, ignore_errors=True)
        tmp = root / f".{key}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        pid = start = None
        try:
            t0 = time.monotonic()
            qcow2_overlay(image, tmp / "disk.qcow2", backing_format="raw")
            boot_cfg = vm.VmConfig(**{**cfg.__dict__, "tag": f"{cfg.tag}-boot"})
            pid, start = vm.launch(vm.command(boot_cfg, tmp, disk=tmp / "disk.qcow2", console=tmp / "console.log",
                                              incoming=None), tmp)
            link = AgentLink(vm.dir_connector(tmp, "agent.sock"))
            try:
                wait_agent(link, t0 + boot_timeout, pid, start, tmp, "console.log")
            finally:
                link.close()           # the guest is snapshotted with its host end closed
            booted = time.monotonic() - t0
            q = Qmp(vm.dir_connector(tmp, "qmp.sock"))
            try:
                q.migrate_to(f"cat > {vm._sh_quote(str(tmp / 'vm.snap'))}", timeout=120)
                try:
                    q.cmd("quit")
                except QmpError:
                    pass
            finally:
                q.close()
            if not vm.kill(pid, start):
                raise vm.VmError("QEMU did not exit after the snapshot")
            pid = None
            meta = {"format": FORMAT, "key": key, "image": str(image), "config": cfg.__dict__,
                    "boot_s": round(booted, 3), "snapshot_s": round(time.monotonic() - t0 - booted, 3),
                    "snap_bytes": (tmp / "vm.snap").stat().st_size, "created": time.time()}
            for f in ("qemu.pid", "agent.sock", "qmp.sock"):
                (tmp / f).unlink(missing_ok=True)
            (tmp / "meta.json").write_text(json.dumps(meta))
            tmp.rename(final)
            return final
        except (vm.VmError, QmpError, LinkError, OSError) as e:
            detail = e.detail if isinstance(e, vm.VmError) else str(e)
            msg = e.message if isinstance(e, vm.VmError) else "template snapshot failed"
            raise vm.VmError(msg, detail) from e
        finally:
            if pid is not None:
                vm.kill(pid, start)
            shutil.rmtree(tmp, ignore_errors=True)
