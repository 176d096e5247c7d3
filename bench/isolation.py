"""The isolation modes side by side, each against its raw runtime measured in the same run.

    .venv/bin/python bench/isolation.py [--modes container,gvisor,microvm] [--n 10] [--runs 5] [--mem 5]
                                        [--template tiny] [--json out.json]

Needs root. What it does:

1. Starts its own ``pilldrops up`` (as bench/latency.py: temp data dir ``pilldrops-bench<pid>-*``, own
   ports, config dir and node name) and asks it which modes its node runs; a mode it does not run is
   printed with the node's reason and skipped.
2. Per mode, ``--n`` times, interleaved: through the sync SDK ``Sandbox.create(template, memory_mb=256,
   isolation=mode)`` (returns once it runs: "create→ready"), ``--runs`` × ``sb.run("true")``, ``sb.kill()``;
   then the mode's raw baseline on the same template layers and the same OCI spec: ``crun run --detach`` /
   ``crun exec <id> true`` / ``crun delete --force`` for containers, the same three with ``runsc`` (same
   flags as the product: ptrace platform, no network) for gVisor, and whatever ``RAW["microvm"]`` does
   (a bare ``qemu-system`` restore of the same snapshot, added by the microVM runtime).
3. Idle memory: ``--mem`` idle sandboxes of each mode at once, PillDrops and raw, after 2 s of rest: the
   PSS (``/proc/<pid>/smaps_rollup``) of every host process of each sandbox (its cgroup's processes;
   for gVisor the Sentry, the gofer and the ptrace stubs), averaged per sandbox.
4. Three small workloads inside one sandbox of each mode (fork+exec, small files, an awk loop), against the
   container mode in the same run: what the mode's system calls cost.
5. How many live sandboxes of each mode would fit on this machine: an ESTIMATE, MemAvailable at the end
   divided by the measured PSS per sandbox (the kernel's own per-sandbox memory — cgroups, page tables —
   and CPU are not in it; bench/live.py measures real counts for containers).
6. Prints the tables (p50/p99, ratio and overhead vs the baseline), optionally the raw numbers as JSON, and
   checks that nothing is left: no container in any runtime root, no mount, cgroup or process of ours.

Adding a mode: a class like ``RawRunsc`` below (``available()``, ``create(cid)``, ``exec_true(cid)``,
``kill(cid)``, ``pids(cid)``, ``cleanup(cid)``, ``cleanup_all()``, ``leftovers()``, ``label``, ``name``; built as
``Cls(data_dir, template, memory_mb, sub=...)``) put in ``RAW``; a module ``bench/_isolation_<mode>.py``
defining ``RAW_CLASS`` is picked up on its own. The PillDrops sandbox's host processes are those of its
cgroup (``/<sandbox id>``), unless the class has ``sandbox_pids(sandbox_id)``.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import httpx
from _harness import PID, Raw, Up, cpu_times, leftovers, machine, meminfo, pct, pd_cycle, sh
from rich import box
from rich.console import Console
from rich.table import Table

from pilldrops import Sandbox
from pilldrops.node.runtime.gvisor import RUNSC_FLAGS, require_runsc, runsc_version

MEMORY_MB = 256
# kernel memory of one v1 memory cgroup (its per-cgroup structures, not charged to itself), measured on this
# machine kind (1,000 cgroups: ~462 KiB each); every mode gives each sandbox a memory cgroup
MEMCG_KERNEL_MIB = 462 / 1024
IDLE_S = 5.0
MODES = ("container", "gvisor", "microvm")
console = Console(width=170)


def cgroup_pids(cid: str) -> list[int]:
    """Host processes whose pids-controller cgroup ends with ``/<cid>`` (a sandbox's own cgroup)."""
    out = []
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            cg = (p / "cgroup").read_text()
        except OSError:
            continue
        if any(line.split(":", 2)[1] == "pids" and line.rstrip().endswith(f"/{cid}")
               for line in cg.splitlines() if line.count(":") >= 2):
            out.append(int(p.name))
    return out


def pss(pids: list[int]) -> int:
    """Summed PSS of ``pids`` in bytes."""
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/smaps_rollup") as f:
                total += next(int(ln.split()[1]) * 1024 for ln in f if ln.startswith("Pss:"))
        except (OSError, StopIteration):
            pass
    return total


def cgroup_memory(pids: list[int]) -> int:
    """Bytes charged to the memory cgroups of ``pids`` (v1 ``memory.usage_in_bytes``: user and kernel
    memory, page cache included)."""
    paths = set()
    for pid in pids:
        try:
            for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
                _, ctrl, path = line.split(":", 2)
                if "memory" in ctrl.split(","):
                    paths.add(path)
        except (OSError, ValueError):
            pass
    total = 0
    for path in paths:
        try:
            total += int((Path("/sys/fs/cgroup/memory") / path.lstrip("/") / "memory.usage_in_bytes").read_text())
        except (OSError, ValueError):
            pass
    return total


class RawCrun(Raw):
    """Raw ``crun`` of the product's OCI bundle (bench/_harness.Raw)."""

    label = {"create": "crun run --detach", "exec": "crun exec <id> true", "kill": "crun delete --force"}  # noqa: RUF012 - read-only table

    @staticmethod
    def available() -> str | None:
        return None

    def create(self, cid: str) -> float:
        return self.run(cid, self.prepare(cid))

    def kill(self, cid: str) -> float:
        return self.delete(cid)

    def pids(self, cid: str) -> list[int]:
        return cgroup_pids(cid)

    def leftovers(self) -> list[str]:
        r = sh(self.cmd("list", "--format", "json"), capture_output=True)
        return [f"{self.name} container {c['id']}" for c in json.loads(r.stdout or b"[]") or []]


class RawRunsc(RawCrun):
    """Raw ``runsc`` of the same bundle, with the product's runsc flags."""

    name = "runsc"
    label = {"create": "runsc run --detach", "exec": "runsc exec <id> true", "kill": "runsc delete --force"}  # noqa: RUF012 - read-only table

    @staticmethod
    def binary() -> str:
        return require_runsc()

    @staticmethod
    def available() -> str | None:
        return None if shutil.which("runsc") else "runsc not installed"

    def cmd(self, *args: str) -> list[str]:
        return [self.crun, "--root", str(self.root), *RUNSC_FLAGS, *args]


RAW: dict[str, type] = {"container": RawCrun, "gvisor": RawRunsc}
for _mode in MODES:
    if _mode not in RAW:
        try:
            RAW[_mode] = importlib.import_module(f"_isolation_{_mode}").RAW_CLASS
        except ImportError:
            pass


def node_modes(up: Up) -> dict[str, dict]:  # type: ignore[type-arg]
    r = httpx.get(f"{up.url}/v1/nodes", headers={"Authorization": f"Bearer {up.key}"}, timeout=30)
    (node,) = r.raise_for_status().json()["items"]
    return node["isolation"]


def iteration(i: str, mode: str, up: Up, raw: RawCrun, template: str, runs: int,
              out: dict[str, list[float]] | None) -> None:
    rec = (lambda k, v: out.setdefault(f"{mode}:{k}", []).append(v * 1000)) if out is not None else (lambda k, v: None)
    pd_cycle(up, template, runs, rec, MEMORY_MB, isolation=mode)
    cid = f"raw{PID}-{mode[:3]}-{i}"
    try:
        rec("raw_create", raw.create(cid))
        for _ in range(runs):
            rec("raw_exec", raw.exec_true(cid))
        rec("raw_kill", raw.kill(cid))
    finally:
        raw.cleanup(cid)


def memory(mode: str, up: Up, raw: RawCrun, template: str, k: int) -> dict[str, float]:
    """MiB of PSS per idle sandbox, PillDrops and raw, ``k`` of each alive at once."""
    sbs = [Sandbox.create(template=template, memory_mb=MEMORY_MB, isolation=mode, api_url=up.url, api_key=up.key)
           for _ in range(k)]
    cids = [f"rawmem{PID}-{mode[:3]}-{j}" for j in range(k)]
    try:
        for cid in cids:
            raw.create(cid)
        time.sleep(2.0)
        of_sandbox = getattr(raw, "sandbox_pids", cgroup_pids)     # a mode whose processes are elsewhere
        pd_pids = [of_sandbox(sb.id) for sb in sbs]
        cpu0, t0 = sum(cpu_times(p)[0] for ps in pd_pids for p in ps), time.perf_counter()
        time.sleep(IDLE_S)                                          # idle CPU of the PillDrops sandboxes
        idle_cpu = (sum(cpu_times(p)[0] for ps in pd_pids for p in ps) - cpu0) / (time.perf_counter() - t0) / k
        raw_pids = [raw.pids(cid) for cid in cids]
        mib = 2**20 * k
        return {"pd_mib": sum(pss(p) for p in pd_pids) / mib, "raw_mib": sum(pss(p) for p in raw_pids) / mib,
                "pd_cg_mib": sum(cgroup_memory(p) for p in pd_pids) / mib,
                "raw_cg_mib": sum(cgroup_memory(p) for p in raw_pids) / mib, "idle_cpu_pct": 100 * idle_cpu}
    finally:
        for sb in sbs:
            sb.kill()
        for cid in cids:
            raw.cleanup(cid)


WORKLOADS = {   # small shell workloads (busybox in the tiny template): the cost of each mode's system calls
    "fork+exec ×200": "for i in $(seq 200); do /bin/true; done",
    "write+read 2,000 files": "mkdir -p /root/w && cd /root/w && for i in $(seq 2000); do echo $i > f$i; done && "
                              "cat f* > /dev/null && cd / && rm -r /root/w",
    "awk loop (3M iterations)": "awk 'BEGIN{s=0; for(i=0;i<3000000;i++) s+=i; print s}' > /dev/null",
}


def workloads(mode: str, up: Up, template: str, repeat: int = 3) -> dict[str, float]:
    """Median ms of each workload in one sandbox of ``mode`` (through ``run``, so ~one exec of overhead)."""
    out = {}
    with Sandbox.create(template=template, memory_mb=MEMORY_MB, isolation=mode, api_url=up.url, api_key=up.key,
                        timeout=900) as sb:
        for name, cmd in WORKLOADS.items():
            ts = []
            for _ in range(repeat):
                t = time.perf_counter()
                sb.run(cmd, timeout=300, check=True)
                ts.append((time.perf_counter() - t) * 1000)
            out[name] = sorted(ts)[len(ts) // 2]
    return out


def report(res: dict[str, list[float]], mem: dict[str, dict[str, float]], skipped: dict[str, str],
           raws: dict[str, RawCrun], a: argparse.Namespace, info: dict[str, str],
           work: dict[str, dict[str, float]]) -> None:
    console.print(f"[bold]PillDrops isolation modes[/] — N={a.n} sandboxes per mode, {a.runs} runs each, memory of "
                  f"{a.mem} idle; {info['cores']} cores, kernel {info['kernel']}, {info['crun']}, "
                  f"{info.get('runsc', '')}, Python {info['python']}, {info['date']}")
    t = Table(box=box.ASCII2)
    for c in ("mode", "operation", "PillDrops p50", "p99", "baseline", "baseline p50", "p99", "ratio p50",
              "overhead p50"):
        t.add_column(c, justify="left" if c in ("mode", "operation", "baseline") else "right")
    for mode, raw in raws.items():
        for name, pk, op, bk in (("create→ready", "pd_create", "create", "raw_create"),
                                 ('run("true")', "pd_run", "exec", "raw_exec"), ("kill", "pd_kill", "kill", "raw_kill")):
            p, b = res.get(f"{mode}:{pk}"), res.get(f"{mode}:{bk}")
            if not p or not b:
                continue
            p50, p99, b50, b99 = pct(p, 50), pct(p, 99), pct(b, 50), pct(b, 99)
            t.add_row(mode, name, f"{p50:.1f} ms", f"{p99:.1f} ms", raw.label[op], f"{b50:.1f} ms", f"{b99:.1f} ms",
                      f"{p50 / b50:.2f}×", f"{p50 - b50:+.1f} ms")
        if mode in mem:
            m = mem[mode]
            t.add_row(mode, "idle memory (PSS)", f"{m['pd_mib']:.1f} MiB", "", f"raw {raw.name}", f"{m['raw_mib']:.1f} MiB",
                      "", f"{m['pd_mib'] / m['raw_mib']:.2f}×" if m["raw_mib"] else "", f"{m['pd_mib'] - m['raw_mib']:+.1f} MiB")
            t.add_row(mode, "idle memory (its memory cgroup)", f"{m['pd_cg_mib']:.1f} MiB", "", f"raw {raw.name}",
                      f"{m['raw_cg_mib']:.1f} MiB", "", f"{m['pd_cg_mib'] / m['raw_cg_mib']:.2f}×" if m["raw_cg_mib"] else "",
                      f"{m['pd_cg_mib'] - m['raw_cg_mib']:+.1f} MiB")
            t.add_row(mode, f"idle CPU per sandbox ({IDLE_S:g} s)", f"{m['idle_cpu_pct']:.2f} %", *[""] * 6)
    for mode, why in skipped.items():
        t.add_row(mode, f"[dim]not measured: {why}[/]", *[""] * 7)
    console.print(t)
    if work:
        w = Table(box=box.ASCII2, title="workloads inside one sandbox (median of 3; baseline: the container mode, same run)")
        w.add_column("workload")
        for mode in work:
            w.add_column(mode, justify="right")
            if mode != "container" and "container" in work:
                w.add_column(f"{mode} / container", justify="right")
        for name in WORKLOADS:
            row = [name]
            for mode, r in work.items():
                row.append(f"{r[name]:.0f} ms")
                if mode != "container" and "container" in work:
                    row.append(f"{r[name] / work['container'][name]:.1f}×")
            w.add_row(*row)
        console.print(w)
    avail = meminfo()["MemAvailable"] / 2**20
    fits = ", ".join(f"{mode} ~{int(avail / per):,} ({per:.2f} MiB each)" for mode, m in mem.items()
                     if (per := max(m["pd_mib"], m["pd_cg_mib"]) + MEMCG_KERNEL_MIB) > 0)
    console.print(f"Live sandboxes that would fit in this machine's {avail / 1024:.1f} GiB available: {fits}. ESTIMATE "
                  "by memory alone, not a count: available memory / (the larger of the measured PSS and memory-cgroup "
                  f"charge per idle sandbox + {MEMCG_KERNEL_MIB:.2f} MiB of memory-cgroup kernel structures); CPU, "
                  "pids and the mount table are not in it (bench/live.py counts real live containers).")
    console.print("Notes: PillDrops run(\"true\") execs `true` (no `sh -c` for a plain line) through pd-init's control socket behind HTTP, in "
                  "every mode; raw exec is the runtime's own exec. Raw kill times only the runtime's delete "
                  "(PillDrops kill also unmounts, removes cgroups and the bundle).")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--n", type=int, default=10, help="timed sandboxes per mode")
    ap.add_argument("--runs", type=int, default=5, help='sb.run("true") / raw exec per sandbox')
    ap.add_argument("--mem", type=int, default=5, help="idle sandboxes per mode for the memory figure")
    ap.add_argument("--warmup", type=int, default=2, help="untimed iterations per mode first")
    ap.add_argument("--template", default="tiny")
    ap.add_argument("--no-workloads", dest="workloads", action="store_false", help="skip the in-sandbox workloads")
    ap.add_argument("--json", type=Path, help="write raw numbers here")
    a = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("bench/isolation.py needs root (crun, runsc, mounts, cgroups)")
    tmp = Path(tempfile.mkdtemp(prefix=f"pilldrops-bench{PID}-"))
    up = None
    raws: dict[str, RawCrun] = {}
    res: dict[str, list[float]] = {}
    mem: dict[str, dict[str, float]] = {}
    skipped: dict[str, str] = {}
    work: dict[str, dict[str, float]] = {}
    info = {**machine(), "runsc": runsc_version() if shutil.which("runsc") else "no runsc"}
    code = 0
    try:
        console.print(f"starting pilldrops up (data in {tmp}) ...")
        up = Up(tmp, a.template, seed=[a.template])
        offered = node_modes(up)
        for mode in [m.strip() for m in a.modes.split(",") if m.strip()]:
            st = offered.get(mode, {"available": False, "reason": "unknown mode"})
            why = None if st["available"] else f"the node runs no {mode} ({st['reason']})"
            if why is None and mode not in RAW:
                why = f"no raw baseline for {mode} in bench/isolation.py"
            if why is None:
                why = RAW[mode].available()
            if why:
                skipped[mode] = why
                continue
            raws[mode] = RAW[mode](up.data, a.template, MEMORY_MB, sub=f"benchraw-{mode}")
        with console.status("") as status:
            for mode, raw in raws.items():
                for i in range(a.warmup):
                    status.update(f"{mode}: warm-up {i + 1}/{a.warmup}")
                    iteration(f"w{i}", mode, up, raw, a.template, a.runs, None)
                for i in range(a.n):
                    status.update(f"{mode}: iteration {i + 1}/{a.n}")
                    iteration(str(i), mode, up, raw, a.template, a.runs, res)
                status.update(f"{mode}: idle memory of {a.mem}")
                mem[mode] = memory(mode, up, raw, a.template, a.mem)
                if a.workloads:
                    status.update(f"{mode}: workloads")
                    work[mode] = workloads(mode, up, a.template)
    except KeyboardInterrupt:
        console.print("[yellow]interrupted[/]: cleaning up")
        code = 130
    finally:
        for raw in raws.values():
            raw.cleanup_all()
        if up is not None:
            rc = up.stop()
            if rc != 0:
                console.print(f"[red]pilldrops up exited {rc}[/]:\n{up.log.read_text()[-2000:]}")
                code = code or 1
        runsc = tmp / "data" / "node" / "runtimes" / "gvisor" / "runsc"
        for _ in range(50):                         # teardown may settle for a moment
            left = [x for raw in raws.values() for x in raw.leftovers()]
            left += leftovers(tmp, [tmp / "data" / "node" / "crun"], procs=True)
            if runsc.is_dir():
                r = sh([require_runsc(), "--root", str(runsc), "list", "-quiet"], capture_output=True, text=True)
                left += [f"runsc container {c} in {runsc}" for c in r.stdout.split()]
            if not left:
                break
            time.sleep(0.1)
        if left:
            console.print(f"[red]left behind ({len(left)}); {tmp} kept:[/]\n" + "\n".join(left))
            code = code or 1
        else:
            shutil.rmtree(tmp)
    if code == 0 and res:
        report(res, mem, skipped, raws, a, info, work)
        if a.json:
            a.json.write_text(json.dumps({"args": vars(a) | {"json": str(a.json)}, "machine": info, "ms": res,
                                          "memory_mib": mem, "workloads_ms": work, "skipped": skipped}, indent=1))
    return code


if __name__ == "__main__":
    sys.exit(main())
