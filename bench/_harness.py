"""Shared pieces of the benchmarks: their own ``pilldrops up``, raw crun containers as a baseline, the
leak check, machine facts, /proc/meminfo and percentiles.

Everything a benchmark starts is named after its pid: the temp dir ``pilldrops-bench<pid>-*``, the node
``bench<pid>`` (so its cgroup parent is ``pilldrops-bench<pid>-<instance>``) and the raw containers'
cgroup parent ``pilldrops-benchraw<pid>``, so benchmarks and tests running at the same time never see
each other's sandboxes.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from pilldrops.node.isolation import cgroups, diskquota
from pilldrops.node.isolation.host import require_crun
from pilldrops.node.isolation.mounts import mount_overlay, mounts_under, umount_all_under
from pilldrops.node.runtime.base import SandboxSpec
from pilldrops.node.runtime.crun import _nofile_limit
from pilldrops.node.runtime.oci_spec import build_spec
from pilldrops.node.templates import TemplateStore

PID = os.getpid()
NODE_NAME = f"bench{PID}"
MATCH = f"pilldrops-bench{PID}"          # temp dir, node cgroup parent (raw: pilldrops-benchraw<pid>)
RAW_PARENT = f"pilldrops-benchraw{PID}"
DEFAULT_DATA_DIR = Path(os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share") / "pilldrops"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pct(xs: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100) of a non-empty list."""
    s = sorted(xs)
    return s[max(0, math.ceil(q / 100 * len(s)) - 1)]


def sh(argv: list[str], **kw: object) -> subprocess.CompletedProcess:
    return subprocess.run(argv, stdin=subprocess.DEVNULL, check=False, **kw)  # type: ignore[call-overload]


def timed(argv: list[str], **kw: object) -> tuple[float, subprocess.CompletedProcess]:
    t = time.perf_counter()
    r = sh(argv, **kw)
    return time.perf_counter() - t, r


def ok(dt: float, r: subprocess.CompletedProcess, err: str | bytes) -> float:
    if r.returncode:
        raise RuntimeError(f"{' '.join(map(str, r.args))} exited {r.returncode}: {err!r}")
    return dt


def pd_cycle(up: Up, template: str, runs: int, rec: Callable[[str, float], None], memory_mb: int,
             **create: object) -> None:
    """One PillDrops cycle through the sync SDK, each step timed into ``rec``: ``pd_create`` (returns once it
    runs), ``runs`` x ``pd_run`` (``sb.run("true")``), each followed by ``pd_get`` (one bare ``GET /healthz``
    to the same server, the sandbox's data plane, on the same kept-alive client: the floor of one request),
    ``pd_kill``."""
    from pilldrops import Sandbox
    t = time.perf_counter()
    sb = Sandbox.create(template=template, memory_mb=memory_mb, api_url=up.url, api_key=up.key, **create)  # type: ignore[arg-type]
    rec("pd_create", time.perf_counter() - t)
    http, health = sb._client._http, f"{(sb.info.envd_url or up.url).rstrip('/')}/healthz"
    try:
        for _ in range(runs):
            t = time.perf_counter()
            r = sb.run("true")
            rec("pd_run", time.perf_counter() - t)
            assert r.exit_code == 0, r
            t = time.perf_counter()
            http.get(health).raise_for_status()
            rec("pd_get", time.perf_counter() - t)
    finally:
        t = time.perf_counter()
        sb.kill()
        rec("pd_kill", time.perf_counter() - t)


def seed_templates(data: Path, names: list[str], cache: Path = DEFAULT_DATA_DIR) -> None:
    """Make the built templates ``names`` (and their parents) of the data dir ``cache`` usable in ``data``
    without rebuilding them: build them in ``cache`` if needed (a Debian template takes a minute the
    first time), then copy their manifests. A manifest names its layers by absolute path, so the
    benchmark's sandboxes use the cached read-only layers directly."""
    store = TemplateStore(cache)
    todo = list(names)
    while todo:
        name = todo.pop()
        tpl = store.ensure(name, progress=lambda m: print(f"  {m}", flush=True))
        src = cache / "templates" / name / tpl.hash
        dst = data / "templates" / name / tpl.hash
        dst.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src / "manifest.json", dst / "manifest.json")
        base = store.spec(name).base
        if not store.spec(name).is_builder:
            todo.append(base)


class Up:
    """A `pilldrops up` subprocess with its own data dir, config dir, ports and node name."""

    def __init__(self, root: Path, template: str, extra: list[str] | None = None,
                 seed: list[str] | None = None) -> None:
        self.data, self.config, self.log = root / "data", root / "config", root / "up.log"
        if seed:
            seed_templates(self.data, seed)
        port, node_port = free_port(), free_port()
        env = {**os.environ, "XDG_CONFIG_HOME": str(self.config), "PYTHONUNBUFFERED": "1"}
        for k in ("PILLDROPS_API_KEY", "PILLDROPS_API_URL", "E2B_API_KEY"):
            env.pop(k, None)
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "pilldrops", "up", "--port", str(port), "--node-port", str(node_port), "--ports-port", "0",
                 "--data-dir", str(self.data), "--templates", template, "--node-name", NODE_NAME,
                 *(extra or [])],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                start_new_session=True)      # our Ctrl-C must not reach it: we stop it ourselves
        self.url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 180
        while "is up at" not in self.log.read_text():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"pilldrops up did not start:\n{self.log.read_text()[-3000:]}")
            time.sleep(0.1)
        self.key = json.loads((self.config / "pilldrops" / "config.json").read_text())["api_key"]

    def stop(self, timeout: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


class Raw:
    """Raw crun containers equivalent to a PillDrops sandbox (same spec builder, layers and init). With
    ``disk_mb`` each gets the node's disk quota too (``isolation.diskquota``: a loop-mounted ext4 image
    holding upper/work), made and removed the way the node does."""

    name = "crun"

    def __init__(self, data: Path, template: str, memory_mb: int = 256, sub: str = "benchraw",
                 disk_mb: int = 0) -> None:
        self.disk_mb = disk_mb
        self.crun = self.binary()
        self.tpl = TemplateStore(data).get(template)
        self.init = data / "node" / "bin" / "pd-init"       # built by the node at start
        self.memory_mb = memory_mb
        self.dir = data / sub
        self.root = self.dir / self.name
        self.root.mkdir(parents=True)

    @staticmethod
    def binary() -> str:
        return require_crun()

    def cmd(self, *args: str) -> list[str]:
        return [self.crun, "--root", str(self.root), *args]

    def prepare(self, cid: str) -> Path:
        d = self.dir / cid
        (d / "rootfs").mkdir(parents=True)
        layer = diskquota.make(self.dir, d, self.disk_mb) if self.disk_mb else d
        for p in ("upper", "work"):
            (layer / p).mkdir()
        mount_overlay(d / "rootfs", list(self.tpl.layers), layer / "upper", layer / "work")
        spec = SandboxSpec(id=cid, layers=self.tpl.layers, vcpu=1, memory_mb=self.memory_mb, pids_limit=1024,
                           envs=dict(self.tpl.env), workdir=self.tpl.workdir or "/", hostname=cid)
        cfg = build_spec(spec, rootfs=d / "rootfs", init_path=self.init, cgroup_parent=RAW_PARENT,
                         nofile=_nofile_limit())
        (d / "config.json").write_text(json.dumps(cfg))
        return d

    def run(self, cid: str, d: Path) -> float:
        with open(d / "crun.err", "wb") as err:                  # never a pipe for a detached crun
            dt, r = timed(self.cmd("run", "--detach", "--bundle", str(d), cid), stdout=subprocess.DEVNULL,
                          stderr=err)
        return ok(dt, r, (d / "crun.err").read_text())

    def start(self, cid: str) -> str:
        """``prepare`` and ``run``: the container made and started; its id."""
        self.run(cid, self.prepare(cid))
        return cid

    def warm_up(self, prefix: str, n: int = 3) -> None:
        """``n`` containers started and removed (``<prefix><pid>--1`` …) before anything is timed."""
        for i in range(n):
            self.cleanup(self.start(f"{prefix}{PID}-{-i - 1}"))

    def exec_true(self, cid: str) -> float:
        dt, r = timed(self.cmd("exec", cid, "true"), capture_output=True)
        return ok(dt, r, r.stderr)

    def delete(self, cid: str) -> float:
        dt, r = timed(self.cmd("delete", "--force", cid), capture_output=True)
        return ok(dt, r, r.stderr)

    def cleanup(self, cid: str) -> None:
        sh(self.cmd("delete", "--force", cid), capture_output=True)
        cgroups.remove_tree(f"{RAW_PARENT}/{cid}")
        umount_all_under(self.dir / cid / "rootfs")
        diskquota.remove(self.dir / cid)        # no-op without a disk
        umount_all_under(self.dir / cid)
        shutil.rmtree(self.dir / cid, ignore_errors=True)

    def cleanup_all(self) -> None:
        r = sh(self.cmd("list", "--format", "json"), capture_output=True)
        ids = {c["id"] for c in json.loads(r.stdout or b"[]") or []}
        ids |= {p.name for p in self.dir.iterdir() if p.is_dir() and p.name not in (self.name, diskquota.GOLDEN_DIR)}
        for cid in ids:
            self.cleanup(cid)
        cgroups.remove_tree(RAW_PARENT)


def leftovers(data: Path, roots: list[Path], procs: bool = False) -> list[str]:
    """What a benchmark left: crun containers in ``roots``, mounts under ``data`` or named like our temp
    dir, our cgroups (either parent, any depth of interest) and, with ``procs``, live processes in them."""
    found = []
    for root in roots:
        if root.exists():
            r = sh([require_crun(), "--root", str(root), "list", "-q"], capture_output=True, text=True)
            found += [f"crun container {c} in {root}" for c in r.stdout.split()]
    found += [f"mount {m}" for m in mounts_under(data)]
    with open("/proc/self/mountinfo") as f:
        found += [f"mount {ln.split()[4]}" for ln in f if MATCH in ln.split()[4]]
    found += [f"cgroup {p}" for p in Path("/sys/fs/cgroup").glob("*/*") if f"{MATCH}" in p.name
              or p.name == RAW_PARENT]
    if procs:
        for p in Path("/proc").iterdir():
            if not p.name.isdigit():
                continue
            try:
                cg = (p / "cgroup").read_text()
                stat = (p / "stat").read_bytes()
            except OSError:
                continue
            if (MATCH in cg or RAW_PARENT in cg) and not stat[stat.rindex(b")") + 2:].startswith(b"Z"):
                found.append(f"process {p.name}")
    return sorted(set(found))


def check_leaks(tmp: Path, roots: list[Path], settle: float = 5.0, procs: bool = True) -> list[str]:
    """``leftovers`` after up to ``settle`` seconds for teardown to finish; empty when clean."""
    deadline = time.monotonic() + settle
    while (left := leftovers(tmp, roots, procs)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


def machine() -> dict[str, str]:
    crun_v = sh([require_crun(), "--version"], capture_output=True, text=True).stdout.split("\n")[0]
    now = datetime.datetime.now().astimezone().isoformat("T", "seconds")
    mem = meminfo()["MemTotal"] / 1024**3
    return {"cores": str(os.cpu_count()), "kernel": platform.release(), "crun": crun_v,
            "python": platform.python_version(), "date": now, "mem": f"{mem:.1f} GiB"}


def meminfo() -> dict[str, int]:
    """/proc/meminfo in bytes."""
    out = {}
    with open("/proc/meminfo") as f:
        for line in f:
            k, v = line.split(":", 1)
            parts = v.split()
            out[k] = int(parts[0]) * (1024 if parts[1:] == ["kB"] else 1)
    return out


def memory_cgroups() -> int:
    """The memory controller's cgroup count (/proc/cgroups): removed cgroups whose memory is still charged
    ("dying") count until the kernel frees them."""
    with open("/proc/cgroups") as f:
        for line in f:
            parts = line.split()
            if parts and parts[0] == "memory":
                return int(parts[2])
    return 0


def settle_host(limit: float = 90.0, quiet: float = 3.0) -> dict[str, float]:
    """Let what an earlier run tore down finish leaving before a memory baseline is read: write back and drop
    the page cache (the pages that keep removed cgroups alive as "dying" ones), then wait until the memory
    cgroup count has not fallen for ``quiet`` seconds (at most ``limit``). Without it a baseline taken right
    after hundreds of teardowns (another benchmark's, or this run's previous phase) starts on memory that is
    still being freed, and the phase after it looks cheaper or dearer than it is. Root only (else a no-op)."""
    t0 = time.monotonic()
    before = memory_cgroups()
    if os.geteuid() == 0:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
    low, low_t = memory_cgroups(), time.monotonic()
    while time.monotonic() - low_t < quiet and time.monotonic() - t0 < limit:
        time.sleep(0.25)
        n = memory_cgroups()
        if n < low:
            low, low_t = n, time.monotonic()
    return {"memory_cgroups_before": before, "memory_cgroups_after": memory_cgroups(),
            "settle_s": round(time.monotonic() - t0, 1)}


def _rss1(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            return next(int(ln.split()[1]) * 1024 for ln in f if ln.startswith("VmRSS:"))
    except (OSError, StopIteration):
        return 0


def _procs() -> dict[int, tuple[int, str]]:
    """pid -> (ppid, comm) of every live process."""
    out = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                head, _, rest = f.read().rpartition(")")
            out[int(name)] = (int(rest.split()[1]), head.partition("(")[2])
        except (OSError, IndexError, ValueError):
            continue
    return out


def python_tree(pid: int) -> list[int]:
    """``pid`` and every live Python process descended from it, through Python processes only (the node
    agent `pilldrops up` starts as a child; not crun, nor what crun starts)."""
    procs = _procs()
    kids: dict[int, list[int]] = {}
    for p, (pp, _) in procs.items():
        kids.setdefault(pp, []).append(p)
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(k for k in kids.get(p, []) if procs[k][1].startswith(("python", "pilldrops")))
    return out


def anon_bytes(pid: int) -> int:
    """Anonymous memory of one process (smaps_rollup), bytes; 0 once it is gone."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            return next(int(ln.split()[1]) * 1024 for ln in f if ln.startswith("Anonymous:"))
    except (OSError, StopIteration):
        return 0


def own_anon(up_pid: int, cgroup: str) -> int:
    """Anonymous memory of `up` and its Python children plus of every process in a cgroup whose path holds
    ``cgroup`` (the sandboxes' or the raw containers'), bytes: the part of AnonPages that is ours, whatever
    other processes on a shared machine allocate or free meanwhile."""
    total = sum(anon_bytes(p) for p in python_tree(up_pid))
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/cgroup") as f:
                    if cgroup not in f.read():
                        continue
            except OSError:
                continue
            total += anon_bytes(int(name))
    return total


def rss(pid: int) -> int:
    """Resident set size of a process and its Python descendants (`up` and its node agent), bytes."""
    return sum(_rss1(p) for p in python_tree(pid))


TICK = os.sysconf("SC_CLK_TCK")


def cpu_times(pid: int) -> tuple[float, float]:
    """(own user+system, waited children's user+system) CPU seconds of one process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0, 0.0
    u, s, cu, cs = (int(x) for x in fields[11:15])
    return (u + s) / TICK, (cu + cs) / TICK


def up_cpu_times(pid: int) -> tuple[float, float]:
    """(own user+system, waited children's user+system) CPU seconds of a process and its Python
    descendants (`pilldrops up` and the node agent it starts): "own" is all the Python, "children" what
    they ran and waited for (crun, tar)."""
    own = kids = 0.0
    for p in python_tree(pid):
        o, k = cpu_times(p)
        own, kids = own + o, kids + k
    return own, kids


def host_busy() -> float:
    """CPU seconds all cores spent not idle since boot."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    return (sum(v[:8]) - v[3] - v[4]) / TICK


@dataclass
class Phase:
    """One timed phase: per-item latencies (ms), wall seconds, errors and CPU seconds by who spent them."""

    name: str
    lat: list[float] = field(default_factory=list)
    wall: float = 0.0
    errors: list[str] = field(default_factory=list)
    cpu: dict[str, float] = field(default_factory=dict)

    @property
    def rate(self) -> float:
        return len(self.lat) / self.wall if self.wall else 0.0


def run_phase(name: str, items: list, fn: Callable, threads: int, up_pid: int, st) -> tuple[Phase, list]:  # type: ignore[type-arg]
    """``fn(item)`` for every item on ``threads`` threads; returns the phase and the results (None = error)."""
    ph = Phase(name)
    lock = threading.Lock()
    done = [0]

    def one(item):  # type: ignore[no-untyped-def]
        t = time.perf_counter()
        try:
            res = fn(item)
        except Exception as e:  # noqa: BLE001 - counted and reported with its text
            with lock:
                ph.errors.append(f"{type(e).__name__}: {e}")
                done[0] += 1
            return None
        dt = (time.perf_counter() - t) * 1000
        with lock:
            ph.lat.append(dt)
            done[0] += 1
        return res

    own0, kids0 = up_cpu_times(up_pid)
    me0, busy0 = os.times(), host_busy()
    stop = threading.Event()

    def progress() -> None:
        while not stop.wait(0.5):
            st.update(f"{name}: {done[0]}/{len(items)}")

    pt = threading.Thread(target=progress, daemon=True)
    pt.start()
    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=threads) as pool:
        out = list(pool.map(one, items))
    ph.wall = time.perf_counter() - t0
    stop.set()
    own1, kids1 = up_cpu_times(up_pid)
    me1 = os.times()
    ph.cpu = {"up (Python)": own1 - own0, "up's children (crun, tar)": kids1 - kids0,
              "bench client": (me1.user + me1.system) - (me0.user + me0.system),
              "bench's children (raw crun, host python)": (me1.children_user + me1.children_system)
              - (me0.children_user + me0.children_system),
              "host busy (all)": host_busy() - busy0}
    return ph, out


@contextmanager
def profiled(pid: int, out: Path | None) -> Iterator[None]:
    """``py-spy record --gil --subprocesses`` of process ``pid`` and its children (the node agent `up`
    starts) (the thread holding the GIL, i.e. running Python, 100 Hz,
    not pausing it) while the block runs, written to ``out`` in py-spy's raw (collapsed stacks) format. No-op when
    ``out`` is None."""
    if out is None:
        yield
        return
    spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    with open(f"{out}.log", "wb") as log:
        p = subprocess.Popen([spy, "record", "-p", str(pid), "--format", "raw", "--full-filenames", "--gil", "--nonblocking", "--subprocesses", "-r", "100",
                              "-o", str(out)], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=log)
    time.sleep(1.0)                                  # attached
    try:
        yield
    finally:
        p.send_signal(signal.SIGINT)
        try:
            p.wait(timeout=60)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


CATEGORIES = (   # (label, path fragments); a sample goes to the first category its stack matches, leaf first
    ("crun/tar subprocesses: fork+exec, wait", ("/subprocess.py", "asyncio/unix_events.py", "anyio/_core/_subprocesses",
                                              "asyncio/subprocess.py", "asyncio/base_subprocess.py")),
    ("SQLite store: SQLAlchemy + aiosqlite", ("sqlalchemy/", "aiosqlite/", "sqlite3/")),
    ("pydantic validation/serialisation", ("pydantic/", "pydantic_core/")),
    ("json", ("/json/",)),
    ("HTTP server: uvicorn/h11/starlette/fastapi", ("uvicorn/", "h11/", "starlette/", "fastapi/")),
    ("HTTP client: httpx/httpcore", ("httpx/", "httpcore/")),
    ("mounts, cgroups, rm -r, files", ("isolation/mounts.py", "isolation/cgroups.py", "/shutil.py", "/pathlib.py",
                                      "node/journal.py")),
    ("PillDrops code (other)", ("pilldrops/",)),
    ("event loop / threads", ("asyncio/", "/selectors.py", "/threading.py", "anyio/", "concurrent/")),
)


def _category(frames: list[str]) -> str:
    for f in reversed(frames):
        for label, frags in CATEGORIES:
            if any(x in f for x in frags):
                return label
    return "other"


def _frame(f: str, lineno: bool) -> str:
    """``func (path/file.py:123)`` -> ``func (file.py:123)`` (or without the line)."""
    name, _, where = f.partition(" (")
    where = where.rstrip(")")
    path, _, line = where.rpartition(":")
    short = "/".join(path.split("/")[-3 if "pilldrops/" in path else -2:]) if path else where
    return f"{name} ({short}:{line})" if lineno and line else f"{name} ({short})"


def summarize_profile(path: Path, top: int = 10, lineno: bool = False) -> dict[str, object]:
    """Self and total sample counts per frame of a py-spy raw file (``a;b;c N`` lines, root first, full
    file names); "total" only over PillDrops' own frames; and samples per ``CATEGORIES``."""
    self_c: dict[str, int] = {}
    total_c: dict[str, int] = {}
    cats: dict[str, int] = {}
    n = 0
    for line in Path(path).read_text().splitlines():
        stack, _, cnt = line.rpartition(" ")
        if not stack or not cnt.isdigit():
            continue
        c = int(cnt)
        full = [f for f in stack.split(";") if not f.startswith(("process ", "thread "))]
        if not full:
            continue
        frames = [_frame(f, lineno) for f in full]
        n += c
        self_c[frames[-1]] = self_c.get(frames[-1], 0) + c
        for f, ff in set(zip(frames, full)):
            if "pilldrops/" in ff and "cli/" not in ff and "__main__" not in ff:
                total_c[f] = total_c.get(f, 0) + c
        cat = _category(full)
        cats[cat] = cats.get(cat, 0) + c
    by_self = sorted(self_c.items(), key=lambda x: -x[1])[:top]
    by_total = sorted(total_c.items(), key=lambda x: -x[1])[:top]
    return {"samples": n, "self": by_self, "total": by_total,
            "categories": sorted(cats.items(), key=lambda x: -x[1])}


@contextmanager
def two_ups(base_src: Path, template: str) -> Iterator[dict[str, Up]]:
    """Two ``pilldrops up`` side by side for an A/B in the same minutes: ``"base"`` runs the tree at
    ``base_src`` (its ``src/``, through PYTHONPATH), ``"this tree"`` this checkout's; both stopped and their
    data dirs removed at the end."""
    here = Path(__file__).resolve().parent.parent / "src"
    ups: dict[str, Up] = {}
    tmps: list[Path] = []
    try:
        for name, src in (("base", base_src.resolve()), ("this tree", here)):
            tmp = Path(tempfile.mkdtemp(prefix=f"pilldrops-bench{PID}-"))
            tmps.append(tmp)
            os.environ["PYTHONPATH"] = str(src)
            ups[name] = Up(tmp, template)
        os.environ.pop("PYTHONPATH", None)
        yield ups
    finally:
        os.environ.pop("PYTHONPATH", None)
        for u in ups.values():
            u.stop()
        for t in tmps:
            shutil.rmtree(t, ignore_errors=True)
