"""The microVM mode's raw baseline for ``bench/isolation.py``, and a standalone microVM benchmark.

``RawQemu`` is "a bare ``qemu-system`` restore of the same snapshot" PillDrops restores sandboxes from: the
template snapshot in the node's own cache (``<data>/node/runtimes/microvm/cache``; booted there by the
same code if the node has not made it yet, so both sides use the very same ``vm.snap`` and disk chain).
One raw sandbox = ``qemu-img create`` of a qcow2 overlay + ``qemu-system-x86_64 -incoming exec:cat vm.snap``
(daemonized) + QMP ``cont`` + the guest agent's sync answer; ``exec_true`` = one command over the agent
channel in-process (no HTTP, no control plane, no node agent); ``kill`` = SIGKILL + wait + rm.
It skips what PillDrops adds: the control plane and node agent, the identity (hostname, machine-id, seed,
clock, pids.max) handshake, the host cgroup, state files.

Standalone (needs root, QEMU and the guest kernel: ``scripts/install-microvm``)::

    .venv/bin/python bench/_isolation_qemu.py [--n 5] [--memory-mb 256] [--live 8] [--json out.json]

runs its own ``pilldrops up`` and measures, interleaved, PillDrops ``Sandbox.create(isolation="microvm")``
→ ready, ``run("true")``, ``kill()`` against ``RawQemu``; then idle PSS and idle CPU per VM with ``--live``
VMs of each side alive at once, and how many would fit on this machine.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio

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
    """Bare QEMU restores of the node's template snapshot (see the module doc)."""

    name = "qemu-system restore"

    def __init__(self, data_dir: Path, layers: tuple[Path, ...], *, memory_mb: int = 256, vcpu: float = 1.0) -> None:
        self.cache = Path(data_dir) / "node" / "runtimes" / "microvm" / "cache"
        self.root = Path(tempfile.mkdtemp(prefix=f"pilldrops-benchrawvm{os.getpid()}-"))
        self.layers, self.memory_mb, self.vcpu = layers, memory_mb, vcpu
        self._snap: Path | None = None
        self._cfg: vm.VmConfig | None = None

    @staticmethod
    def available() -> str | None:
        ok, reason, _ = qemu.probe_host()
        return None if ok else reason

    def _snapshot(self) -> tuple[Path, vm.VmConfig]:
        if self._snap is None or self._cfg is None:
            self.cache.mkdir(parents=True, exist_ok=True)
            accel, _ = qemu.detect_accel(self.cache)
            initrd = guest.build_initramfs(self.cache)
            self._cfg = vm.VmConfig(kernel=str(guest.kernel_path()), initrd=str(initrd), memory_mb=self.memory_mb,
                                    smp=max(1, int(-(-self.vcpu // 1))), accel=accel,
                                    tag=f"pilldrops-benchrawvm{os.getpid()}")
            image = guest.build_root_image(self.cache, self.layers, disk_mb=1024)
            self._snap = snapshot.ensure(self.cache, image, self._cfg, boot_timeout=120)
        return self._snap, self._cfg

    def create(self, i: int) -> RawVm:
        snap, cfg = self._snapshot()
        d = self.root / f"vm{i}"
        d.mkdir()
        snapshot.qcow2_overlay(snap / "disk.qcow2", d / "disk.qcow2", backing_format="qcow2")
        pid, start = vm.launch(vm.command(cfg, d, disk=d / "disk.qcow2", console=None, incoming=snap / "vm.snap"), d)
        q = Qmp(vm.dir_connector(d, "qmp.sock"))
        q.wait_status({"paused", "running"}, 60)
        q.cmd("cont")
        q.close()
        link = AgentLink(vm.dir_connector(d, "agent.sock"))
        link.wait_synced(30)
        return RawVm(d, pid, start, link)

    def exec_true(self, v: RawVm) -> None:
        async def run() -> int:
            p = SupervisorExec(Path("/"), ["true"], env={"PATH": "/usr/bin:/bin"}, cwd="/", stdin=None,
                               sock=v.link.open_channel())
            while await p.read() is not None:
                pass
            return await p.wait()
        code = anyio.run(run)
        if code != 0:
            raise RuntimeError(f"raw exec true exited {code}")

    def kill(self, v: RawVm) -> None:
        v.link.close()
        vm.kill(v.pid, v.start)
        shutil.rmtree(v.d, ignore_errors=True)

    def idle_rss_mib(self, v: RawVm) -> float:
        return pss_mib(v.pid)

    def close(self) -> None:
        for d in self.root.glob("vm*"):
            pid = vm.read_pid(d)
            if pid and vm.is_qemu(pid, d):
                vm.kill(pid, None)
        shutil.rmtree(self.root, ignore_errors=True)


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
        from pilldrops.node.templates import TemplateStore
        layers = TemplateStore(up.data).ensure("tiny").layers
        raw = RawQemu(up.data, layers, memory_mb=a.memory_mb)
        t0 = time.perf_counter()
        Sandbox.create(template="tiny", memory_mb=a.memory_mb, isolation="microvm", **kw).kill()   # boots once
        res["first_create_s"] = time.perf_counter() - t0
        raw.kill(raw.create(-1))     # warm: the same snapshot, now in the page cache for both
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
            t = time.perf_counter()
            v = raw.create(i)
            times["raw_create"].append(time.perf_counter() - t)
            for _ in range(3):
                t = time.perf_counter()
                raw.exec_true(v)
                times["raw_run"].append(time.perf_counter() - t)
            t = time.perf_counter()
            raw.kill(v)
            times["raw_kill"].append(time.perf_counter() - t)
        res["times"] = times
        # idle: --live of each side at once
        before = meminfo()["MemAvailable"]
        sbs = [Sandbox.create(template="tiny", memory_mb=a.memory_mb, isolation="microvm", **kw) for _ in range(a.live)]
        pd_pids = [qemu_pid_of(sb.id) for sb in sbs]
        raws = [raw.create(100 + i) for i in range(a.live)]
        time.sleep(2)
        c0 = {p: cpu_s(p) for p in pd_pids + [v.pid for v in raws] if p}
        time.sleep(a.idle_s)
        c1 = {p: cpu_s(p) for p in c0}
        used = (before - meminfo()["MemAvailable"]) / 2**20 / (2 * a.live)
        res["idle"] = {
            "pd_pss_mib": _p50([pss_mib(p) for p in pd_pids if p]),
            "raw_pss_mib": _p50([raw.idle_rss_mib(v) for v in raws]),
            "pd_cpu_pct": _p50([100 * (c1[p] - c0[p]) / a.idle_s for p in pd_pids if p]),
            "raw_cpu_pct": _p50([100 * (c1[v.pid] - c0[v.pid]) / a.idle_s for v in raws]),
            "memavailable_drop_mib_per_vm": used,
        }
        for sb in sbs:
            sb.kill()
        for v in raws:
            raw.kill(v)
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
            raw.close()
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
