"""The microVM runtime (``isolation="microvm"``): each sandbox is a QEMU ``-M microvm`` guest with its own
Debian kernel (issue 11 part 3; pieces in ``runtime/microvm/``).

Per sandbox ``<state_dir>/pilldrops-vms/<id>/``::

    vm.json      the VM's config (kernel, initramfs, RAM, vCPUs, accel, tag) + env/workdir/snapshot
    disk.qcow2   its disk: a qcow2 overlay whose backing chain is the template snapshot's disk -> root.img
    qemu.pid qemu.log qmp.sock agent.sock

Root disks, initramfs and template snapshots live in ``cache_dir`` (default ``$PILLDROPS_MICROVM_CACHE``,
else ``<state_dir>/cache``), keyed by content, so runtimes sharing a cache share the boots.

``create`` never boots: the template's guest is booted once per (template, guest-RAM class, vCPUs) and snapshotted
(``microvm.snapshot``); a sandbox is QEMU restoring that snapshot (``-incoming exec:cat``) over a fresh
disk overlay, then ``cont``, then the host gives it its own identity over the agent channel (hostname,
machine-id, a fresh random seed with a forced CRNG reseed, the wall clock, pids.max, memory.max): no two restores of a
snapshot share a machine-id or a random stream. It returns once the guest agent answered.

Commands run through ``SupervisorExec`` (the crun fast path's client) over a channel of the agent link
(``microvm.channel``), served in the guest by pd-init itself: same streaming, exit codes, timeouts killing
the process tree, output caps. Files and archives travel as commands (``sh``/``tar`` in the guest, see
``node/dataplane.py``), so they get the crun path's sanitising and bounds unchanged.

Limits: memory = ``memory_mb`` as the guest memory cgroup's ``memory.max`` (pd-init and every command are in
it: an OOM kills the offender inside the guest, as in a container), in a guest whose RAM (``-m``) is the size
class that holds it (``guest_ram_mb``: 256, 512, 1024, ... MiB; a snapshot serves every size of its class);
vCPUs = ``ceil(vcpu)`` guest CPUs plus a host CPU quota of ``vcpu`` cores on the QEMU process (cgroup
``pilldrops-<name>/<id>``, with a host memory limit of guest RAM + overhead); pids = the guest cgroup's
``pids.max``; disk = the template's root disk size (``disk_mb`` of the runtime, 1024 MiB by default): the
guest's root file system cannot grow past it, so a sandbox's ``disk_mb`` at or above it holds as is; one
below it cannot be enforced (the virtio-blk disk is a qcow2 overlay of the template snapshot's disk, whose
file system has that size) and is refused (``disk_refusal``: the agent answers 400 invalid_request).

Pause/resume = ``checkpoint``/``restore``: ``migrate`` to ``image_dir/vm.snap``, the disk overlay moves
into the image. QEMU is daemonized (not our child); a new runtime instance re-adopts a VM from its handle
(pid + start time) and its dir: it reconnects the QMP and agent sockets on first use.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import threading
import time
import uuid
from collections.abc import AsyncIterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio

from pilldrops.node.isolation import cgroups
from pilldrops.node.isolation.rmtree import remove_tree_quietly
from pilldrops.node.isolation.superexec import SupervisorExec
from pilldrops.node.runtime.base import Handle, RuntimeFailure, RuntimeState, SandboxSpec
from pilldrops.node.runtime.microvm import guest, snapshot, vm
from pilldrops.node.runtime.microvm.channel import AgentLink, LinkError
from pilldrops.node.runtime.microvm.qmp import Qmp, QmpError
from pilldrops.node.runtime.oci_spec import merged_env

if TYPE_CHECKING:
    from pilldrops.node.runtime.registry import Probe

_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
_HOST_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9.-]{0,62}$")
CHECKPOINT_FORMAT = 1
CHECKPOINT_META = "pilldrops-checkpoint.json"
KVM_PROBE_FILE = guest.KERNEL_ROOT.parent / "kvm-probe.json"
MIN_GUEST_RAM_MB = 256
LINK_IDLE_S = 1.0       # an agent link with no command for this long is closed (reopened on the next one)


# -- probing -------------------------------------------------------------------------------------------------
def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def detect_accel(cache_dir: Path | None = None) -> tuple[str, str]:
    """("kvm" | "tcg", why): KVM only when a real timed boot under it worked. Cached per host boot."""
    forced = os.environ.get("PILLDROPS_MICROVM_ACCEL", "").strip().lower()
    if forced in ("tcg", "kvm"):
        return forced, "forced by PILLDROPS_MICROVM_ACCEL"
    key = f"{_boot_id()}|{guest.kernel_release()}|{vm.qemu_version()}"
    try:
        cached = json.loads(KVM_PROBE_FILE.read_text())
        if cached.get("key") == key:
            return cached["accel"], cached["why"]
    except (OSError, ValueError, KeyError):
        pass
    initrd = guest.build_probe_initramfs(cache_dir or KVM_PROBE_FILE.parent)
    ok, why = vm.kvm_probe(guest.kernel_path(), initrd)
    accel = "kvm" if ok else "tcg"
    try:
        KVM_PROBE_FILE.parent.mkdir(parents=True, exist_ok=True)
        tmp = KVM_PROBE_FILE.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"key": key, "accel": accel, "why": why, "at": time.time()}))
        os.replace(tmp, KVM_PROBE_FILE)
    except OSError:
        pass
    return accel, why


def probe_host() -> tuple[bool, str, str]:
    """(available, reason when not, detail when available: "tcg" / "kvm" and why)."""
    if os.geteuid() != 0:
        return False, "the microvm runtime needs root", ""
    if not vm.qemu_path():
        return False, f"{vm.QEMU} not installed (scripts/install-microvm)", ""
    if not shutil.which("qemu-img"):
        return False, "qemu-img not installed (scripts/install-microvm)", ""
    if guest.kernel_release() is None or not guest.kernel_path().exists():
        return False, f"no guest kernel in {guest.KERNEL_ROOT} (scripts/install-microvm)", ""
    if not shutil.which("mkfs.ext4"):
        return False, "mkfs.ext4 not installed (scripts/install-microvm)", ""
    try:
        accel, why = detect_accel()
    except (OSError, vm.VmError) as e:
        return False, f"KVM/TCG probe failed: {e}", ""
    return True, "", f"{accel} ({why})" if accel == "tcg" else accel


def probe() -> Probe:
    from pilldrops.node.runtime.registry import Probe
    ok, reason, detail = probe_host()
    return Probe(ok, reason=reason, detail=detail)


def guest_ram_mb(memory_mb: float) -> int:
    """The guest RAM for a sandbox of ``memory_mb``: the smallest size class (256, 512, 1024, ... MiB) that
    holds it, so one snapshot per template serves a whole class. The guest kernel's own ~35 MiB come out of
    it, as in any VM of that size; below the class, the exact ``memory_mb`` is enforced by the guest memory
    cgroup's ``memory.max`` around pd-init and every command."""
    ram = MIN_GUEST_RAM_MB
    while ram < memory_mb:
        ram *= 2
    return ram


def _backing_problem(disk: Path) -> str:
    """Why the qcow2 chain of a checkpoint's disk is not usable here ("" when it is): the disk of a paused
    microVM is an overlay over its template snapshot's disk in the node's cache, so it resumes on a node that
    has that very snapshot (the node that paused it, or one sharing its cache)."""
    r = subprocess.run(["qemu-img", "info", "-U", "--backing-chain", "--output=json", str(disk)],
                       capture_output=True, text=True, check=False)
    if r.returncode != 0:
        return f"its disk's backing chain is not on this node: {r.stderr.strip()[-500:]}"
    return ""


# -- the runtime ---------------------------------------------------------------------------------------------
class QemuRuntime:
    """``Runtime`` backed by QEMU microVMs. Needs root, QEMU and the guest kernel (``probe_host``)."""

    name = "microvm"

    def __init__(self, state_dir: Path, *, name: str = "default", cache_dir: Path | None = None,
                 accel: str | None = None, kernel: Path | None = None, disk_mb: int = 1024,
                 boot_timeout: float = 90.0, restore_timeout: float = 30.0) -> None:
        if not _NAME_RE.match(name):
            raise ValueError(f"invalid runtime instance name {name!r}")
        ok, reason, _ = probe_host()
        if not ok and not (kernel and reason.startswith("no guest kernel")):
            raise RuntimeFailure("microvm runtime unavailable", detail=reason)
        self.instance_name = name
        self.state_dir = Path(state_dir).resolve()
        self.vms_dir = self.state_dir / "pilldrops-vms"
        cache = cache_dir or os.environ.get("PILLDROPS_MICROVM_CACHE") or self.state_dir / "cache"
        self.cache_dir = Path(cache).resolve()
        self.vms_dir.mkdir(parents=True, exist_ok=True)
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        self.accel = accel or detect_accel(self.cache_dir)[0]
        self.kernel = Path(kernel) if kernel else guest.kernel_path()
        self.disk_mb = disk_mb
        self.boot_timeout = boot_timeout
        self.restore_timeout = restore_timeout
        self.cgroup_parent = f"pilldrops-{name}"
        self._links: dict[str, AgentLink] = {}
        self._initrd: Path | None = None
        self._link_lock = threading.Lock()
        self._vm: dict[str, dict[str, Any]] = {}       # vm.json per live sandbox

    # -- helpers -------------------------------------------------------------------------------------
    def _dir(self, sandbox_id: str) -> Path:
        if not _ID_RE.match(sandbox_id):
            raise RuntimeFailure(f"invalid sandbox id {sandbox_id!r}")
        return self.vms_dir / sandbox_id

    def _cgroup(self, sandbox_id: str) -> str:
        return f"{self.cgroup_parent}/{sandbox_id}"

    def disk_refusal(self, spec: SandboxSpec) -> str | None:
        """Why ``spec.disk_mb`` cannot be enforced here (None: the root disk is no larger than it)."""
        if spec.disk_mb is not None and spec.disk_mb < self.disk_mb:
            return (f"a microvm sandbox's disk is its template's {self.disk_mb} MiB root disk: disk_mb "
                    f"{spec.disk_mb} below that cannot be enforced (ask for at least {self.disk_mb}, or use "
                    "isolation container or gvisor)")
        return None

    def _config(self, spec: SandboxSpec) -> vm.VmConfig:
        if (why := self.disk_refusal(spec)) is not None:
            raise RuntimeFailure(why)
        if spec.vcpu <= 0 or spec.memory_mb <= 0 or spec.pids_limit <= 0:
            raise RuntimeFailure(f"limits must be positive: vcpu={spec.vcpu} memory_mb={spec.memory_mb} "
                                 f"pids_limit={spec.pids_limit}")
        initrd = self._initrd
        if initrd is None or not initrd.exists():
            try:
                initrd = self._initrd = guest.build_initramfs(self.cache_dir)
            except guest.GuestBuildError as e:
                raise RuntimeFailure("cannot build the microVM initramfs", detail=str(e)) from e
        return vm.VmConfig(kernel=str(self.kernel), initrd=str(initrd), memory_mb=guest_ram_mb(spec.memory_mb),
                           smp=max(1, math.ceil(spec.vcpu)), accel=self.accel,
                           tag=f"pilldrops-{self.instance_name}-{spec.id}"[:128])

    def _meta(self, d: Path) -> dict[str, Any]:
        sid = d.name
        if sid not in self._vm:
            try:
                self._vm[sid] = json.loads((d / "vm.json").read_text())
            except (OSError, ValueError) as e:
                raise RuntimeFailure(f"sandbox {sid} has no readable vm.json", detail=str(e)) from e
        return self._vm[sid]

    def _link(self, sandbox_id: str, d: Path, timeout: float = 5.0) -> AgentLink:
        """The agent link of a running VM: reused, or (re)connected (a restarted agent, a dead link)."""
        link = self._links.get(sandbox_id)
        if link is not None and not link.dead:
            return link
        with self._link_lock:         # one connection per VM: QEMU serves the port to one client at a time
            link = self._links.get(sandbox_id)
            if link is not None and not link.dead:
                return link
            if link is not None:
                link.close()
            link = None
            try:
                link = AgentLink(vm.dir_connector(d, "agent.sock"), idle_close=LINK_IDLE_S)
                link.wait_synced(timeout)
            except LinkError as e:
                if link is not None:
                    link.close()
                raise RuntimeFailure(f"cannot reach the agent of microVM {sandbox_id}", detail=str(e)) from e
            self._links[sandbox_id] = link
            return link

    @staticmethod
    def _identity(spec: SandboxSpec, *, fresh: bool) -> bytes:
        lines = [f"seed={os.urandom(32).hex()}", f"time_ns={time.time_ns()}", f"pids_max={spec.pids_limit}",
                 f"memory_max={int(spec.memory_mb) * 1024 * 1024}"]
        if fresh:
            host = spec.hostname if _HOST_RE.match(spec.hostname or "") else "sandbox"   # one line, no "="
            lines += [f"hostname={host}", f"machine_id={uuid.uuid4().hex}"]
        return ("\n".join(lines) + "\n").encode()

    def _start_restored(self, d: Path, spec: SandboxSpec, cfg: vm.VmConfig, snap: Path, *,
                        fresh_identity: bool) -> Handle:
        """Blocking: QEMU restoring ``snap`` over ``d/disk.qcow2``, resumed, identity sent. On failure the
        caller tears ``d`` down."""
        t0 = time.monotonic()
        procs = vm.cgroup_prepare(self._cgroup(spec.id), vcpu=spec.vcpu, memory_mb=cfg.memory_mb)
        pid, start = vm.launch(vm.command(cfg, d, disk=d / "disk.qcow2", console=None, incoming=snap), d,
                               cgroup_procs=procs)
        try:
            q = Qmp(vm.dir_connector(d, "qmp.sock"), timeout=self.restore_timeout)
        except QmpError as e:
            raise vm.VmError("snapshot restore failed (no QMP)", f"{e}; {vm.log_tail(d)}") from e
        try:
            try:
                q.wait_status({"paused", "running"}, self.restore_timeout,
                              fail={"shutdown", "internal-error", "guest-panicked", "io-error"})
                if q.cmd("query-status")["status"] == "paused":
                    q.cmd("cont")
            except QmpError as e:
                raise vm.VmError("snapshot restore failed", f"{e}; {vm.log_tail(d)}") from e
        finally:
            q.close()
        link = AgentLink(vm.dir_connector(d, "agent.sock"), idle_close=LINK_IDLE_S)
        try:
            link.wait_synced(max(1.0, self.restore_timeout - (time.monotonic() - t0)))
            reply = link.request(self._identity(spec, fresh=fresh_identity), timeout=10.0)
        except LinkError as e:
            link.close()
            raise vm.VmError("the restored guest's agent did not answer", f"{e}; {vm.log_tail(d)}") from e
        if reply != "ok" and not reply.startswith("ok "):
            link.close()
            raise vm.VmError("the restored guest refused its identity", reply)
        # the limits as the guest's cgroup has them (read back by the guest agent): a fact for inspection
        (d / "limits.json").write_text(json.dumps(dict(kv.split("=", 1) for kv in reply.split()[1:] if "=" in kv)))
        self._links[spec.id] = link
        return Handle(id=spec.id, pid=pid, pid_start_time=start, bundle=str(d),
                      extra={"accel": cfg.accel, "cgroup": "/" + self._cgroup(spec.id)})

    async def guest_cgroup(self, handle: Handle) -> dict[str, str]:
        """The guest cgroup's limits and counters now (``pids.max``, ``memory.max``, ``pids.current``,
        ``pids.refused``), asked of the guest agent (for inspection and tests)."""
        link = await anyio.to_thread.run_sync(self._link, handle.id, self._dir(handle.id))
        try:
            reply = await anyio.to_thread.run_sync(link.request, b"", 10.0)
        except LinkError as e:
            raise RuntimeFailure(f"microVM {handle.id} did not answer", detail=str(e)) from e
        return dict(kv.split("=", 1) for kv in reply.split()[1:] if "=" in kv)

    # -- Runtime ---------------------------------------------------------------------------------------
    async def create(self, spec: SandboxSpec) -> Handle:
        d = self._dir(spec.id)
        if d.exists():
            raise RuntimeFailure(f"sandbox {spec.id} already exists", detail=str(d))
        cfg = self._config(spec)
        ok = False
        try:
            d.mkdir(parents=True)
            snap = await anyio.to_thread.run_sync(self._template_snapshot, spec, cfg)
            meta = {"config": json.loads(cfg.to_json()), "snapshot": str(snap), "workdir": spec.workdir or "/",
                    "env": dict(item.split("=", 1) for item in merged_env(None, spec.envs)),
                    "hostname": spec.hostname, "vcpu": spec.vcpu, "pids_limit": spec.pids_limit}
            (d / "vm.json").write_text(json.dumps(meta))
            self._vm[spec.id] = meta
            await anyio.to_thread.run_sync(lambda: snapshot.qcow2_overlay(snap / "disk.qcow2", d / "disk.qcow2",
                                                                          backing_format="qcow2"))
            handle = await anyio.to_thread.run_sync(
                lambda: self._start_restored(d, spec, cfg, snap / "vm.snap", fresh_identity=True))
            ok = True
            return handle
        except vm.VmError as e:
            raise RuntimeFailure(f"microVM {spec.id}: {e.message}", detail=e.detail) from e
        finally:
            if not ok:
                with anyio.CancelScope(shield=True):
                    await self._teardown(spec.id)

    def _template_snapshot(self, spec: SandboxSpec, cfg: vm.VmConfig) -> Path:
        try:
            image = guest.build_root_image(self.cache_dir, spec.layers, disk_mb=self.disk_mb)
        except guest.GuestBuildError as e:
            raise vm.VmError("cannot build the template's root disk", str(e)) from e
        return snapshot.ensure(self.cache_dir, image, cfg, boot_timeout=self.boot_timeout)

    async def exec(self, handle: Handle, argv: list[str], *, env: dict[str, str], cwd: str | None,
                   stdin: AsyncIterable[bytes] | bytes | None = None, timeout: float | None = None,
                   output_cap: int | None = None, user: str | None = None,
                   pid_late: bool = False) -> SupervisorExec:
        if not argv:
            raise RuntimeFailure("exec needs a non-empty argv")
        d = self._dir(handle.id)
        if not vm.alive(handle.pid, handle.pid_start_time):
            raise RuntimeFailure(f"sandbox {handle.id} is not running")
        meta = self._meta(d)
        try:
            link = await anyio.to_thread.run_sync(self._link, handle.id, d)
            sock = link.open_channel()
        except LinkError:          # it went idle just now: connect again, once
            link = await anyio.to_thread.run_sync(self._link, handle.id, d)
            try:
                sock = link.open_channel()
            except LinkError as e:
                raise RuntimeFailure(f"cannot open a channel to microVM {handle.id}", detail=str(e)) from e
        try:
            return SupervisorExec(Path("/"), argv, env={**meta["env"], **env}, cwd=cwd or meta["workdir"],
                                  stdin=stdin, timeout=timeout, output_cap=output_cap, sock=sock, user=user,
                                  pid_late=pid_late)
        except (OSError, ValueError) as e:
            sock.close()
            raise RuntimeFailure(f"cannot start a command in microVM {handle.id}", detail=str(e)) from e

    def running_by_pid(self, handle: Handle) -> bool:
        return False        # no cheaper check than ``state`` here

    async def state(self, handle: Handle) -> RuntimeState:
        """From facts: the QEMU pid (+ start time) and QMP ``query-status``. A guest that shut down,
        panicked or hit an internal error is stopped even while its QEMU lingers."""
        d = self._dir(handle.id)
        if vm.alive(handle.pid, handle.pid_start_time):
            status = await anyio.to_thread.run_sync(self._qmp_status, d)
            if status in ("shutdown", "guest-panicked", "internal-error", "io-error"):
                return RuntimeState(status="stopped", pid=None)
            return RuntimeState(status="running", pid=handle.pid)
        # QEMU gone: killed by the host memory cgroup (RAM + overhead) counts as an OOM kill
        oom = cgroups.oom_kill_count(self._cgroup(handle.id)) > 0
        return RuntimeState(status="stopped" if d.exists() else "gone", oom_killed=oom)

    @staticmethod
    def _qmp_status(d: Path) -> str | None:
        try:
            q = Qmp(vm.dir_connector(d, "qmp.sock"), timeout=2.0)
        except QmpError:
            return None
        try:
            return str(q.cmd("query-status")["status"])
        except (QmpError, KeyError, TypeError):
            return None
        finally:
            q.close()

    async def destroy(self, handle: Handle) -> None:
        with anyio.CancelScope(shield=True):
            await self._teardown(handle.id, pid=handle.pid, start=handle.pid_start_time)

    async def abort_restore(self, handle: Handle, image_dir: Path) -> None:
        """A restore the agent was killed in: tear it down, its disk going back into ``image_dir`` (the
        restore renames it out of the image)."""
        image = Path(image_dir) / "disk.qcow2"
        keep = None if image.exists() or not Path(image_dir).is_dir() else {"disk.qcow2": image}
        with anyio.CancelScope(shield=True):
            await self._teardown(handle.id, pid=handle.pid, start=handle.pid_start_time, keep=keep)

    async def _teardown(self, sandbox_id: str, *, pid: int | None = None, start: int | None = None,
                        keep: dict[str, Path] | None = None) -> None:
        link = self._links.pop(sandbox_id, None)
        self._vm.pop(sandbox_id, None)
        if link is not None:
            await anyio.to_thread.run_sync(link.close)
        problem = await anyio.to_thread.run_sync(self._teardown_sync, sandbox_id, pid, start, keep or {})
        if problem:
            raise RuntimeFailure(f"destroy {sandbox_id} incomplete", detail=problem)

    def _teardown_sync(self, sandbox_id: str, pid: int | None, start: int | None, keep: dict[str, Path]) -> str:
        d = self._dir(sandbox_id)
        problems = []
        pids = {pid} if pid else set()
        file_pid = vm.read_pid(d)
        if file_pid and vm.is_qemu(file_pid, d):
            pids.add(file_pid)
        for p in pids:
            if not vm.kill(p, start if p == pid else None):
                problems.append(f"QEMU {p} did not die")
        left = cgroups.remove_tree(self._cgroup(sandbox_id))
        if left:
            problems.append(f"cgroups left: {left}")
        vm.cgroup_remove_parent(self.cgroup_parent)       # the last VM gone: no empty parent stays behind
        for name, dst in keep.items():
            if (d / name).exists():
                try:
                    shutil.move(str(d / name), str(dst))
                except OSError as e:
                    problems.append(f"cannot move {name} to {dst}: {e}")
        remove_tree_quietly(d)
        if d.exists():
            problems.append(f"{d} is left")
        return "; ".join(problems)

    async def list_ids(self) -> list[str]:
        return sorted(p.name for p in self.vms_dir.iterdir() if p.is_dir())

    # -- pause / resume --------------------------------------------------------------------------------
    def checkpoint_unsupported(self) -> str | None:
        return None

    async def checkpoint(self, handle: Handle, image_dir: Path) -> int:
        d = self._dir(handle.id)
        image_dir = Path(image_dir).resolve()
        if not vm.alive(handle.pid, handle.pid_start_time):
            raise RuntimeFailure(f"sandbox {handle.id} is not running")
        if not image_dir.is_dir() or any(image_dir.iterdir()):
            raise RuntimeFailure(f"checkpoint image dir {image_dir} must exist and be empty")
        meta = self._meta(d)
        with anyio.CancelScope(shield=True):
            link = self._links.pop(handle.id, None)
            if link is not None:
                await anyio.to_thread.run_sync(link.close)
            try:
                await anyio.to_thread.run_sync(self._migrate_out, d, image_dir / "vm.snap")
            except QmpError as e:
                (image_dir / "vm.snap").unlink(missing_ok=True)
                await anyio.to_thread.run_sync(self._resume_quietly, d)
                raise RuntimeFailure(f"checkpoint of {handle.id} failed", detail=f"{e}; {vm.log_tail(d)}") from e
            await self._teardown(handle.id, pid=handle.pid, start=handle.pid_start_time,
                                 keep={"disk.qcow2": image_dir / "disk.qcow2"})
            snap_bytes = (image_dir / "vm.snap").stat().st_size
            disk_bytes = (image_dir / "disk.qcow2").stat().st_size
            out = {"format": CHECKPOINT_FORMAT, "id": handle.id, "created": time.time(), "runtime": "microvm",
                   "vm": meta, "snap_bytes": snap_bytes, "disk_bytes": disk_bytes}
            (image_dir / (CHECKPOINT_META + ".tmp")).write_text(json.dumps(out))
            os.replace(image_dir / (CHECKPOINT_META + ".tmp"), image_dir / CHECKPOINT_META)
            return snap_bytes + disk_bytes

    @staticmethod
    def _migrate_out(d: Path, out: Path) -> None:
        q = Qmp(vm.dir_connector(d, "qmp.sock"), timeout=10.0)
        try:
            q.migrate_to(f"cat > {vm._sh_quote(str(out))}", timeout=120)
            try:
                q.cmd("quit")
            except QmpError:
                pass
        finally:
            q.close()

    @staticmethod
    def _resume_quietly(d: Path) -> None:
        try:
            q = Qmp(vm.dir_connector(d, "qmp.sock"), timeout=5.0)
            try:
                q.cmd("cont")
            finally:
                q.close()
        except QmpError:
            pass

    async def restore(self, spec: SandboxSpec, image_dir: Path) -> Handle:
        d = self._dir(spec.id)
        if d.exists():
            raise RuntimeFailure(f"sandbox {spec.id} already exists", detail=str(d))
        image_dir = Path(image_dir).resolve()
        try:
            meta = json.loads((image_dir / CHECKPOINT_META).read_text())
        except (OSError, ValueError) as e:
            raise RuntimeFailure(f"{image_dir} is not a complete checkpoint image", detail=str(e)) from e
        if meta.get("format") != CHECKPOINT_FORMAT or meta.get("id") != spec.id or meta.get("runtime") != "microvm":
            raise RuntimeFailure(f"checkpoint image {image_dir} does not fit sandbox {spec.id}",
                                 detail=f"format={meta.get('format')} id={meta.get('id')} runtime={meta.get('runtime')}")
        if not (image_dir / "vm.snap").is_file() or not (image_dir / "disk.qcow2").is_file():
            raise RuntimeFailure(f"checkpoint image {image_dir} is incomplete (no vm.snap or disk.qcow2)")
        vmeta = meta["vm"]
        cfg = vm.VmConfig(**vmeta["config"])
        if not Path(cfg.kernel).exists() or not Path(cfg.initrd).exists():
            raise RuntimeFailure(f"checkpoint image {image_dir} needs a kernel/initramfs this node lacks",
                                 detail=f"{cfg.kernel} {cfg.initrd}")
        chain = await anyio.to_thread.run_sync(_backing_problem, image_dir / "disk.qcow2")
        if chain:
            raise RuntimeFailure(f"checkpoint image {image_dir} cannot be restored on this node", detail=chain)
        ok = moved = False
        try:
            d.mkdir(parents=True)
            (d / "vm.json").write_text(json.dumps(vmeta))
            self._vm[spec.id] = vmeta
            os.rename(image_dir / "disk.qcow2", d / "disk.qcow2")
            moved = True
            handle = await anyio.to_thread.run_sync(
                lambda: self._start_restored(d, spec, cfg, image_dir / "vm.snap", fresh_identity=False))
            ok = True
            return handle
        except (vm.VmError, OSError) as e:
            msg = e.message if isinstance(e, vm.VmError) else "restore failed"
            raise RuntimeFailure(f"microVM {spec.id}: {msg}",
                                 detail=e.detail if isinstance(e, vm.VmError) else str(e)) from e
        finally:
            if not ok:
                with anyio.CancelScope(shield=True):
                    await self._teardown(spec.id, keep={"disk.qcow2": image_dir / "disk.qcow2"} if moved else None)

    # -- instance lifetime -----------------------------------------------------------------------------
    async def close(self) -> None:
        """Drop the agent links (VMs keep running: a later instance re-adopts them) and the cgroup parent
        when it is empty."""
        links, self._links = self._links, {}
        for link in links.values():
            await anyio.to_thread.run_sync(link.close)
        if not any(self.vms_dir.iterdir()):
            await anyio.to_thread.run_sync(vm.cgroup_remove_parent, self.cgroup_parent)
