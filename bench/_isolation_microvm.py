"""The microVM mode's raw baseline for ``bench/isolation.py``, and a standalone microVM benchmark.

``RawQemu`` (``RAW_CLASS``, picked up by ``bench/isolation.py``) is "a bare ``qemu-system`` restore of the same snapshot" PillDrops restores sandboxes from: the
template snapshot in the node's own cache (``<data>/node/runtimes/microvm/cache``; booted there by the
same code if the node has not made it yet, so both sides use the very same ``vm.snap`` and disk chain).
One raw sandbox = ``qemu-img create`` of a qcow2 overlay + ``qemu-system-x86_64 -incoming exec:cat vm.snap``
(daemonized) + QMP ``cont`` + the guest agent's sync answer; ``exec_true`` = one command over the agent
channel in-process (no HTTP, no control plane, no node agent); ``kill`` = SIGKILL + wait + rm.
It skips what PillDrops adds: the control plane and node agent, the identity (hostname, machine-id, seed,
clock, pids.max, memory.max) handshake, state files; it does get the same host cgroup (so the memory-cgroup
figures compare).

Standalone (needs root, QEMU and the guest kernel: ``scripts/install-microvm``)::

    .venv/bin/python bench/_isolation_microvm.py [--n 5] [--memory-mb 256] [--live 8] [--json out.json]

runs its own ``pilldrops up`` and measures, interleaved, PillDrops ``Sandbox.create(isolation="microvm")``
→ ready, ``run("true")``, ``kill()`` against ``RawQemu``; then idle PSS and idle CPU per VM with ``--live``
VMs of each side alive at once, and how many would fit on this machine.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, ClassVar

import anyio

from pilldrops.node.isolation import cgroups
from pilldrops.node.isolation.superexec import SupervisorExec
from pilldrops.node.runtime import qemu
from pilldrops.node.runtime.microvm import guest, snapshot, vm
from pilldrops.node.runtime.microvm.channel import AgentLink
from pilldrops.node.runtime.microvm.qmp import Qmp


def pss_mib(pid: int) -> float:
    """Proportional set size of one process (MiB; 0 when gone)."""
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def cpu_s(pid: int) -> float:
    try:
        f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


def qemu_pid_of(sandbox_id: str) -> int | None:
    """The QEMU process of a PillDrops microVM sandbox (its -name ends with the sandbox id)."""
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            argv = Path(f"/proc/{name}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if argv and argv[0].endswith(b"qemu-system-x86_64") and b"-name" in argv:
            tag = argv[argv.index(b"-name") + 1]
            if tag.endswith(b"-" + sandbox_id.encode()):
                return int(name)
    return None


class RawVm:
    def __init__(self, d: Path, pid: int, start: int, link: AgentLink) -> None:
        self.d, self.pid, self.start, self.link = d, pid, start, link


class RawQemu:
    """Bare QEMU restores of the node's template snapshot (see the module doc); ``bench/isolation.py``'s
    raw-baseline interface: ``create/exec_true/kill(cid) -> seconds``, ``pids(cid)``, ``cleanup(cid)``,
    ``cleanup_all()``, ``leftovers()``."""

    name = "qemu"
    label: ClassVar[dict[str, str]] = {"create": "qemu -incoming (same snapshot) + cont + agent sync", "exec": "agent channel: true",
             "kill": "SIGKILL qemu + rm"}

    def __init__(self, data: Path, template: str, memory_mb: int = 256, sub: str = "benchraw-microvm",
                 vcpu: float = 1.0) -> None:
        from pilldrops.node.templates import TemplateStore
        self.cache = Path(data) / "node" / "runtimes" / "microvm" / "cache"
        self.dir = Path(data) / sub
        self.dir.mkdir(parents=True, exist_ok=True)
        self.layers = TemplateStore(data).get(template).layers
        self.memory_mb, self.vcpu = memory_mb, vcpu
        self._snap: Path | None = None
        self._cfg: vm.VmConfig | None = None
        self._vms: dict[str, RawVm] = {}

    @staticmethod
    def available() -> str | None:
        ok, reason, _ = qemu.probe_host()
        return None if ok else reason

    def _snapshot(self) -> tuple[Path, vm.VmConfig]:
        if self._snap is None or self._cfg is None:
            self.cache.mkdir(parents=True, exist_ok=True)
            accel, _ = qemu.detect_accel(self.cache)
            initrd = guest.build_initramfs(self.cache)
            self._cfg = vm.VmConfig(kernel=str(guest.kernel_path()), initrd=str(initrd),
                                    memory_mb=qemu.guest_ram_mb(self.memory_mb),
                                    smp=max(1, math.ceil(self.vcpu)), accel=accel,
                                    tag=f"pilldrops-benchrawvm{os.getpid()}")
            image = guest.build_root_image(self.cache, self.layers, disk_mb=1024)
            self._snap = snapshot.ensure(self.cache, image, self._cfg, boot_timeout=120)
        return self._snap, self._cfg

    def create(self, cid: str) -> float:
        snap, cfg = self._snapshot()       # outside the timing: the node made (or shares) the same snapshot
        d = self.dir / cid
        d.mkdir()
        t = time.perf_counter()
        snapshot.qcow2_overlay(snap / "disk.qcow2", d / "disk.qcow2", backing_format="qcow2")
        procs = vm.cgroup_prepare(self._cgroup(cid), vcpu=self.vcpu, memory_mb=cfg.memory_mb)   # as the product
        pid, start = vm.launch(vm.command(cfg, d, disk=d / "disk.qcow2", console=None, incoming=snap / "vm.snap"), d,
                               cgroup_procs=procs)
        q = Qmp(vm.dir_connector(d, "qmp.sock"))
        try:
            q.wait_status({"paused", "running"}, 60)
            q.cmd("cont")
        finally:
            q.close()
        link = AgentLink(vm.dir_connector(d, "agent.sock"))
        self._vms[cid] = RawVm(d, pid, start, link)
        link.wait_synced(30)
        return time.perf_counter() - t

    def exec_true(self, cid: str) -> float:
        v = self._vms[cid]

        async def run() -> int:
            p = SupervisorExec(Path("/"), ["true"], env={"PATH": "/usr/bin:/bin"}, cwd="/", stdin=None,
                               sock=v.link.open_channel())
            while await p.read() is not None:
                pass
            return await p.wait()
        t = time.perf_counter()
        code = anyio.run(run)
        dt = time.perf_counter() - t
        if code != 0:
            raise RuntimeError(f"raw exec true exited {code}")
        return dt

    def kill(self, cid: str) -> float:
        v = self._vms.pop(cid)
        t = time.perf_counter()
        v.link.close()
        vm.kill(v.pid, v.start)
        cgroups.remove_tree(self._cgroup(cid))
        shutil.rmtree(v.d, ignore_errors=True)
        return time.perf_counter() - t

    @staticmethod
    def _cgroup(cid: str) -> str:
        return f"pilldrops-benchrawvm{os.getpid()}/{cid}"

    def pids(self, cid: str) -> list[int]:
        v = self._vms.get(cid)
        return [v.pid] if v else []

    def idle_pss_mib(self, cid: str) -> float:
        v = self._vms.get(cid)
        return pss_mib(v.pid) if v else 0.0

    def cleanup(self, cid: str) -> None:
        v = self._vms.pop(cid, None)
        if v is not None:
            v.link.close()
        d = self.dir / cid
        pid = vm.read_pid(d)
        if pid and vm.is_qemu(pid, d):
            vm.kill(pid, None)
        cgroups.remove_tree(self._cgroup(cid))
        shutil.rmtree(d, ignore_errors=True)

    def cleanup_all(self) -> None:
        for cid in list(self._vms):
            self.cleanup(cid)
        if self.dir.is_dir():
            for d in self.dir.iterdir():
                self.cleanup(d.name)
            shutil.rmtree(self.dir, ignore_errors=True)
        vm.cgroup_remove_parent(f"pilldrops-benchrawvm{os.getpid()}")

    def leftovers(self) -> list[str]:
        out = []
        for name in os.listdir("/proc"):
            if name.isdigit():
                try:
                    if str(self.dir).encode() in Path(f"/proc/{name}/cmdline").read_bytes():
                        out.append(f"raw qemu process {name}")
                except OSError:
                    pass
        return out


RAW_CLASS = RawQemu


# -- standalone benchmark --------------------------------------------------------------------------------------
def _p50(xs: list[float]) -> float:
    s = sorted(xs)
    return s[(len(s) - 1) // 2] if s else float("nan")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=5, help="sequential create/run/kill iterations per side")
    ap.add_argument("--memory-mb", type=int, default=256)
    ap.add_argument("--live", type=int, default=6, help="VMs of each side alive at once for the idle figures")
    ap.add_argument("--idle-s", type=float, default=10.0)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _harness import Up, meminfo

    from pilldrops import Sandbox
    why = RawQemu.available()
    if why:
        print(f"microVM benchmark skipped: {why}")
        return 0
    tmp = Path(tempfile.mkdtemp(prefix=f"pilldrops-bench{os.getpid()}-"))
    up = Up(tmp, "tiny")
    raw: RawQemu | None = None
    res: dict[str, Any] = {"accel": qemu.detect_accel()[0], "memory_mb": a.memory_mb}
    try:
        kw: dict[str, Any] = {"api_url": up.url, "api_key": up.key}
        raw = RawQemu(up.data, "tiny", memory_mb=a.memory_mb)
        t0 = time.perf_counter()
        Sandbox.create(template="tiny", memory_mb=a.memory_mb, isolation="microvm", **kw).kill()   # boots once
        res["first_create_s"] = time.perf_counter() - t0
        raw.create("warm")           # warm: the same snapshot, now in the page cache for both
        raw.kill("warm")
        times: dict[str, list[float]] = {k: [] for k in ("pd_create", "pd_run", "pd_kill", "raw_create", "raw_run",
                                                         "raw_kill")}
        for i in range(a.n):
            t = time.perf_counter()
            sb = Sandbox.create(template="tiny", memory_mb=a.memory_mb, isolation="microvm", **kw)
            times["pd_create"].append(time.perf_counter() - t)
            for _ in range(3):
                t = time.perf_counter()
                sb.run("true")
                times["pd_run"].append(time.perf_counter() - t)
            t = time.perf_counter()
            sb.kill()
            times["pd_kill"].append(time.perf_counter() - t)
            times["raw_create"].append(raw.create(f"t{i}"))
            for _ in range(3):
                times["raw_run"].append(raw.exec_true(f"t{i}"))
            times["raw_kill"].append(raw.kill(f"t{i}"))
        res["times"] = times
        # idle: --live of each side at once
        before = meminfo()["MemAvailable"]
        sbs = [Sandbox.create(template="tiny", memory_mb=a.memory_mb, isolation="microvm", **kw) for _ in range(a.live)]
        pd_pids = [qemu_pid_of(sb.id) for sb in sbs]
        for i in range(a.live):
            raw.create(f"live{i}")
        raw_pids = [raw.pids(f"live{i}")[0] for i in range(a.live)]
        time.sleep(2)
        c0 = {p: cpu_s(p) for p in pd_pids + raw_pids if p}
        time.sleep(a.idle_s)
        c1 = {p: cpu_s(p) for p in c0}
        used = (before - meminfo()["MemAvailable"]) / 2**20 / (2 * a.live)
        res["idle"] = {
            "pd_pss_mib": _p50([pss_mib(p) for p in pd_pids if p]),
            "raw_pss_mib": _p50([pss_mib(p) for p in raw_pids]),
            "pd_cpu_pct": _p50([100 * (c1[p] - c0[p]) / a.idle_s for p in pd_pids if p]),
            "raw_cpu_pct": _p50([100 * (c1[p] - c0[p]) / a.idle_s for p in raw_pids]),
            "memavailable_drop_mib_per_vm": used,
        }
        for sb in sbs:
            sb.kill()
        for i in range(a.live):
            raw.kill(f"live{i}")
        mem_avail = meminfo()["MemAvailable"] / 2**20
        cores = os.cpu_count() or 1
        idle = res["idle"]
        res["fit"] = {
            "by_idle_pss": int(mem_avail * 0.9 / max(idle["pd_pss_mib"], 1)),
            "by_ram_limit": int(mem_avail * 0.9 / (a.memory_mb + vm.MEMORY_OVERHEAD_MB)),
            "by_idle_cpu": int(cores * 0.8 * 100 / max(idle["pd_cpu_pct"], 0.01)),
        }
    finally:
        if raw is not None:
            raw.cleanup_all()
        code = up.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    t = res["times"]
    rows = [("create->ready", "pd_create", "raw_create"), ('run("true")', "pd_run", "raw_run"),
            ("kill", "pd_kill", "raw_kill")]
    print(f"microVM ({res['accel'].upper()}, {a.memory_mb} MiB guest, n={a.n}; first create incl. template boot "
          f"{res['first_create_s']:.1f} s)")
    print(f"{'':16}{'PillDrops p50':>15}{'raw qemu p50':>15}{'ratio':>8}")
    for label, p, r in rows:
        print(f"{label:16}{_p50(t[p]) * 1000:>12.0f} ms{_p50(t[r]) * 1000:>12.0f} ms{_p50(t[p]) / _p50(t[r]):>8.2f}")
    i = res["idle"]
    print(f"{'idle PSS':16}{i['pd_pss_mib']:>11.0f} MiB{i['raw_pss_mib']:>11.0f} MiB{i['pd_pss_mib'] / i['raw_pss_mib']:>8.2f}")
    print(f"{'idle CPU':16}{i['pd_cpu_pct']:>13.1f} %{i['raw_cpu_pct']:>13.1f} %")
    print(f"MemAvailable drop per live VM: {i['memavailable_drop_mib_per_vm']:.0f} MiB")
    f = res["fit"]
    print(f"fit on this machine: {f['by_idle_pss']} by idle PSS, {f['by_ram_limit']} by RAM limit "
          f"({a.memory_mb}+{vm.MEMORY_OVERHEAD_MB} MiB), {f['by_idle_cpu']} by idle CPU (80 % of {os.cpu_count()} cores)")
    if a.json:
        a.json.write_text(json.dumps(res, indent=1))
    return 0 if code == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
