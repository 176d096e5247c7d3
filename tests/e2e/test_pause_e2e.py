"""Pause and resume end to end (issue 6): the real `pilldrops up` (or `serve` + two `node` processes), real
crun and real CRIU, through the SDK and the CLI.

- a Python process in a code-interpreter sandbox keeps its random token, its counter and its in-sandbox pid
  across a pause, while the paused sandbox has no process and no cgroup on the host;
- concurrent resumes (and pauses) of one sandbox: exactly one wins, the others get 409 naming both states,
  and the sandbox runs once;
- a foreground command in flight at pause time returns with ``paused=True``; background work carries on;
- files (a large one, many small ones, a truncated one, a deleted template file) are intact over 20 cycles;
- `pilldrops sandbox pause|resume` and `pilldrops history --json` (paused intervals billed as storage only);
- on a fleet, a paused sandbox whose node is drained resumes on the other node with its memory intact and the
  old node keeps no checkpoint and never runs it again.

The code-interpreter template comes from the user's template cache (~/.local/share/pilldrops; built there
once, about a minute, the first time on a machine) and is seeded into the server's data dir: its manifest
names the cached read-only layers, so nothing is copied or rebuilt. Every test is leak-checked.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from pilldrops import FileNotFound, InvalidState, Sandbox
from pilldrops.node.isolation import criu
from tests import leakcheck
from tests.e2e.conftest import MATCH, Server, _why_not_runnable
from tests.e2e.fleet import Fleet, clean_env
from tests.up import TEMPLATE_CACHE, seed_templates  # noqa: F401  (their home is tests/up.py; kept importable here)

pytestmark = pytest.mark.integration

# holds a random token and 32 MiB of random bytes in memory; 20x/s appends "token pid count time digest_ok"
# to a log and renames the count into /home/user/counter
PY_PROG = r"""
import os, time
token = os.urandom(16).hex()
blob = bytearray(os.urandom(32 << 20))
first = digest = hash(bytes(blob))
count = 0
while True:
    count += 1
    if count % 20 == 0:
        digest = hash(bytes(blob))
    with open('/home/user/log', 'a') as f:
        f.write(f'{token} {os.getpid()} {count} {time.time():.6f} {int(digest == first)}\n')
    with open('/home/user/counter.tmp', 'w') as f:
        f.write(str(count))
    os.replace('/home/user/counter.tmp', '/home/user/counter')
    time.sleep(0.05)
"""

# the same idea in busybox sh (tiny template): a random token and a counter held in shell variables
SH_LOOP = ("T=$(head -c 8 /dev/urandom | od -An -tx1 | tr -d ' \\n'); n=0; "
           "while :; do n=$((n+1)); echo \"$T $$ $n\" >> /root/log; sleep 0.1; done")


# ---- helpers ------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def criu_ready() -> None:
    why = _why_not_runnable() or criu.unavailable_reason()
    if why:
        pytest.skip(f"pause/resume needs real crun + CRIU: {why}")


@pytest.fixture(scope="module")
def py_server(server: Server, criu_ready: None) -> Server:
    """The session's server with the code-interpreter template (announced by the node within a second)."""
    server.seed("code-interpreter")
    return server


def journal_handle(data_dir: Path, sid: str) -> dict:  # type: ignore[type-arg]
    return json.loads((data_dir / "node" / "journal" / f"{sid}.json").read_text())["handle"]


def host_procs_of(sid: str) -> list[int]:
    """Live (non-zombie) host processes in the sandbox's cgroup."""
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            cg = Path(f"/proc/{name}/cgroup").read_text()
            stat = Path(f"/proc/{name}/stat").read_bytes()
        except OSError:
            continue
        if not any(ln.endswith(f"/{sid}") or f"/{sid}/" in ln for ln in cg.splitlines()):
            continue
        if not stat[stat.rindex(b")") + 2:].startswith(b"Z"):
            out.append(int(name))
    return out


def cgroup_dirs_of(cgroup: str) -> list[Path]:
    """The sandbox's cgroup dir in every v1 hierarchy that has it."""
    root = Path("/sys/fs/cgroup")
    return [h / cgroup.lstrip("/") for h in root.iterdir() if (h / cgroup.lstrip("/")).is_dir()]


def crun_ids(crun_root: Path) -> list[str]:
    out = subprocess.run(["crun", "--root", str(crun_root), "list", "--format", "json"], capture_output=True,
                         text=True, check=True)
    return sorted(c["id"] for c in json.loads(out.stdout or "[]") or [])


def wait_until(cond, timeout: float = 30, what: str = "condition"):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while True:
        v = cond()
        if v:
            return v
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def log_lines(sb: Sandbox, path: str, fields: int) -> list[list[str]]:
    """The complete lines of a log the sandbox appends to (a reader can catch the writer mid-line)."""
    try:
        text = sb.files.read(path)
    except FileNotFound:
        return []
    return [ln.split() for ln in text.split("\n")[:-1] if len(ln.split()) == fields]


# ---- 1. token and counter ------------------------------------------------------------------------------

def test_python_keeps_token_counter_and_pid_and_the_host_holds_nothing(py_server: Server) -> None:
    srv = py_server
    with Sandbox.create(template="code-interpreter", memory_mb=512, api_url=srv.api_url,
                        api_key=srv.api_key) as sb:
        sb.files.write("/home/user/prog.py", PY_PROG)
        sb.files.write("/home/user/notes/before.txt", "written before pause")
        r = sb.run("python3 /home/user/prog.py </dev/null >/dev/null 2>&1 &")
        assert r.exit_code == 0, r.stderr
        wait_until(lambda: len(log_lines(sb, "/home/user/log", 5)) >= 25, what="20 log lines")
        before = log_lines(sb, "/home/user/log", 5)
        token, ns_pid = before[0][0], before[0][1]
        assert all(int(ln[4]) for ln in before)           # the blob's digest held so far
        handle = journal_handle(srv.data_dir, sb.id)
        cgroup = handle["extra"]["cgroup"]
        mem = Path("/sys/fs/cgroup/memory") / cgroup.lstrip("/")
        assert int((mem / "memory.usage_in_bytes").read_text()) > 32 << 20     # the blob is live memory
        procs = host_procs_of(sb.id)
        assert handle["pid"] in procs and len(procs) >= 2, procs                # pd-init + python (at least)

        info = sb.pause()
        t_paused = time.time()
        assert info.state == "paused" and info.checkpoint_bytes and info.checkpoint_bytes > 32 << 20
        assert info.paused_at is not None and info.timeout_left and info.timeout_left > 0
        assert sb.get_info().state == "paused"
        # the host holds nothing of it: no process, no cgroup in any hierarchy, no container
        assert host_procs_of(sb.id) == []
        assert cgroup_dirs_of(cgroup) == [], cgroup_dirs_of(cgroup)
        assert sb.id not in crun_ids(srv.crun_root)
        ckpt = srv.data_dir / "node" / "checkpoints" / sb.id
        assert ckpt.is_dir() and any(ckpt.iterdir())
        with pytest.raises(InvalidState):
            sb.run("echo no")                                  # a paused sandbox runs nothing
        time.sleep(2)                                          # paused for a while: the counter must not move
        t_resume = time.time()

        after = sb.resume()
        assert after.state == "running" and after.paused_at is None
        n_before = len(log_lines(sb, "/home/user/log", 5))
        wait_until(lambda: len(log_lines(sb, "/home/user/log", 5)) >= n_before + 25,
                   what="20 more log lines after resume")
        lines = log_lines(sb, "/home/user/log", 5)
        assert {ln[0] for ln in lines} == {token}                        # the same token: memory came back
        assert {ln[1] for ln in lines} == {ns_pid}                       # the same in-sandbox pid
        assert [int(ln[2]) for ln in lines] == list(range(1, len(lines) + 1))   # never reset, no gap
        assert all(int(ln[4]) for ln in lines)                           # the 32 MiB blob is intact
        # exactly one step spans the pause: the last count before it and the next count after resume
        times = [float(ln[3]) for ln in lines]
        spans = [i for i in range(1, len(times)) if times[i - 1] < t_paused and times[i] > t_resume]
        assert len(spans) == 1, spans
        assert int(sb.files.read("/home/user/counter")) >= int(lines[-1][2])
        assert "python3" in sb.run(f"cat /proc/{ns_pid}/cmdline").stdout
        assert sb.files.read("/home/user/notes/before.txt") == "written before pause"
        assert not ckpt.exists()                               # the image is dropped once it runs again
        assert sb.id in crun_ids(srv.crun_root)


# ---- 2. concurrent resumes (and pauses) -------------------------------------------------------------------

def _race(n: int, call) -> tuple[list, list[BaseException]]:  # type: ignore[no-untyped-def]
    barrier = threading.Barrier(n)
    wins: list = []
    errs: list[BaseException] = []
    lock = threading.Lock()

    def go() -> None:
        barrier.wait()
        try:
            v = call()
        except BaseException as exc:  # noqa: BLE001
            with lock:
                errs.append(exc)
        else:
            with lock:
                wins.append(v)

    threads = [threading.Thread(target=go) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
        assert not t.is_alive(), "a concurrent call hung"
    return wins, errs


def test_concurrent_resumes_exactly_one_wins(server: Server, criu_ready: None) -> None:
    opts = {"api_url": server.api_url, "api_key": server.api_key}
    sb = Sandbox.create(template="tiny", memory_mb=128, **opts)
    try:
        sb.run("sleep 777 >/dev/null 2>&1 &")
        # concurrent pauses first: one pauses it, the others are told it is pausing/paused
        wins, errs = _race(4, lambda: Sandbox.pause(sb.id, **opts))
        assert len(wins) == 1 and wins[0].state == "paused", (wins, errs)
        assert len(errs) == 3 and all(isinstance(e, InvalidState) for e in errs), errs
        for e in errs:
            assert e.status == 409 and e.code == "invalid_state"
            assert e.details["from"] in ("pausing", "paused") and e.details["to"] == "paused", e.details
            assert e.details["from"] in str(e) and "paused" in str(e)

        wins, errs = _race(4, lambda: Sandbox.resume(sb.id, **opts))
        assert len(wins) == 1 and wins[0].info.state == "running", (wins, errs)
        assert len(errs) == 3 and all(isinstance(e, InvalidState) for e in errs), errs
        for e in errs:
            assert e.status == 409 and e.code == "invalid_state"
            assert e.details["from"] in ("resuming", "running") and e.details["to"] == "running", e.details
            assert e.details["from"] in str(e) and "running" in str(e)
        # it runs exactly once: one container, one copy of its background process
        assert crun_ids(server.crun_root).count(sb.id) == 1
        winner = wins[0]
        ps = winner.run("ps -o args").stdout
        assert ps.count("sleep 777") == 1, ps
        assert Sandbox.connect(sb.id, **opts).get_info().state == "running"
        # a resume of a running sandbox is a 409 too
        with pytest.raises(InvalidState) as ei:
            Sandbox.resume(sb.id, **opts)
        assert ei.value.details == {"from": "running", "to": "running"}
        # killing a paused sandbox drops its checkpoint
        assert winner.pause().state == "paused"
        ended = sb.kill()
        assert (ended.state, ended.end_reason) == ("stopped", "killed")
        assert not (server.data_dir / "node" / "checkpoints" / sb.id).exists()
    finally:
        sb.kill()


# ---- 3. a command in flight -------------------------------------------------------------------------------

def test_run_in_flight_ends_paused_and_background_work_continues(server: Server, criu_ready: None) -> None:
    opts = {"api_url": server.api_url, "api_key": server.api_key}
    with Sandbox.create(template="tiny", memory_mb=128, **opts) as sb:
        sb.run("sh -c 'n=0; while :; do n=$((n+1)); echo $n > /root/bg.tmp; mv /root/bg.tmp /root/bg; "
               "sleep 0.1; done' >/dev/null 2>&1 &")
        wait_until(lambda: sb.run("cat /root/bg 2>/dev/null").stdout.strip().isdigit(), what="background loop")
        started = threading.Event()
        result: list = []
        errors: list[BaseException] = []

        def foreground() -> None:
            try:
                fg = Sandbox.connect(sb.id, **opts)
                result.append(fg.run("echo started; sleep 600; echo never", timeout=900,
                                     on_stdout=lambda s: started.set()))
            except BaseException as exc:  # noqa: BLE001
                errors.append(exc)
                started.set()

        t = threading.Thread(target=foreground)
        t.start()
        assert started.wait(60)
        info = Sandbox.pause(sb.id, **opts)
        assert info.state == "paused"
        t.join(timeout=60)
        assert not t.is_alive(), "a run in flight during pause hung"
        assert not errors, errors
        r = result[0]
        assert r.paused is True, r
        assert r.stdout == "started\n" and "never" not in r.stdout
        assert r.exit_code != 0 and not r.timed_out

        sb.resume()
        n0 = int(sb.run("cat /root/bg").stdout)
        wait_until(lambda: int(sb.run("cat /root/bg").stdout) > n0 + 3, what="background loop after resume")
        assert "sleep 600" not in sb.run("ps -o args").stdout          # the foreground command is gone
        again = sb.run("echo after")                                   # and new commands run normally
        assert (again.exit_code, again.stdout, again.paused) == (0, "after\n", False)


# ---- 4. files over many cycles ----------------------------------------------------------------------------

CYCLES = 20


def test_files_intact_over_many_pause_resume_cycles(server: Server, criu_ready: None, tmp_path: Path) -> None:
    rnd = random.Random(6)
    src = tmp_path / "data"
    (src / "small").mkdir(parents=True)
    (src / "big.bin").write_bytes(os.urandom(16 << 20))
    for i in range(300):
        (src / "small" / f"f{i:03}.txt").write_bytes(os.urandom(rnd.randint(0, 3000)))
    trunc = os.urandom(1 << 20)
    (src / "trunc.bin").write_bytes(trunc)
    expected = {f"/data/{p.relative_to(src)}": hashlib.sha256(p.read_bytes()).hexdigest()
                for p in src.rglob("*") if p.is_file()}
    expected["/data/trunc.bin"] = hashlib.sha256(trunc[:4097]).hexdigest()
    expected["/data/grown.bin"] = hashlib.sha256(b"x" * 10 + b"\0" * 90_000).hexdigest()

    def digests() -> dict[str, str]:
        r = sb.run("find /data -type f | sort | xargs sha256sum")
        assert r.exit_code == 0, r.stderr
        return {path: h for h, path in (ln.split() for ln in r.stdout.splitlines())}

    opts = {"api_url": server.api_url, "api_key": server.api_key}
    with Sandbox.create(template="tiny", memory_mb=128, **opts) as sb:
        sb.upload(src, "/data")
        r = sb.run("truncate -s 4097 /data/trunc.bin && printf xxxxxxxxxx > /data/grown.bin && "
                   "truncate -s 90010 /data/grown.bin && rm /usr/bin/yes")
        assert r.exit_code == 0, r.stderr
        assert sb.run("(" + SH_LOOP + ") >/dev/null 2>&1 &").exit_code == 0
        assert digests() == expected
        bg_pid = wait_until(lambda: log_lines(sb, "/root/log", 3), what="loop log")[0][1]
        last = 0
        for cycle in range(CYCLES):
            sb.files.write(f"/data/cycle/{cycle}.txt", f"cycle {cycle}\n" * (cycle + 1))
            expected[f"/data/cycle/{cycle}.txt"] = hashlib.sha256(
                (f"cycle {cycle}\n" * (cycle + 1)).encode()).hexdigest()
            assert sb.pause().state == "paused"
            assert sb.resume().state == "running"
            assert digests() == expected, f"files differ after cycle {cycle + 1}"
            assert sb.run("[ ! -e /usr/bin/yes ]").exit_code == 0           # a deleted template file stays deleted
            lines = log_lines(sb, "/root/log", 3)
            counts = [int(ln[2]) for ln in lines]
            assert counts == list(range(1, len(counts) + 1)) and counts[-1] >= last
            assert {ln[1] for ln in lines} == {bg_pid} and len({ln[0] for ln in lines}) == 1
            last = counts[-1]
        wait_until(lambda: len(log_lines(sb, "/root/log", 3)) > last + 3, what="loop after cycles")


# ---- 5. CLI and history -----------------------------------------------------------------------------------

def test_cli_pause_resume_and_history(server: Server, criu_ready: None) -> None:
    env = clean_env(server.config_home, PILLDROPS_API_URL=server.api_url, PILLDROPS_API_KEY=server.api_key)

    def cli(*args: str) -> str:
        out = subprocess.run([sys.executable, "-m", "pilldrops", *args], capture_output=True, text=True, env=env,
                             timeout=120, check=False)
        assert out.returncode == 0, out.stdout + out.stderr
        return out.stdout

    opts = {"api_url": server.api_url, "api_key": server.api_key}
    sb = Sandbox.create(template="tiny", vcpu=1, memory_mb=128, timeout=600, **opts)
    try:
        sb.run("echo kept > /root/state; sleep 999 >/dev/null 2>&1 &")
        out = cli("sandbox", "pause", sb.id)
        assert out.startswith(f"paused {sb.id} (checkpoint ") and "timeout left" in out, out
        got = json.loads(cli("sandbox", "get", sb.id, "--json"))
        assert got["state"] == "paused" and got["checkpoint_bytes"] > 0
        assert sb.id in cli("sandbox", "list")                 # paused ones are listed as live
        time.sleep(3)                                           # a paused interval worth billing
        out = cli("sandbox", "resume", sb.id)
        assert out.strip().startswith(f"resumed {sb.id} on node "), out
        assert Sandbox.connect(sb.id, **opts).run("cat /root/state").stdout == "kept\n"
        # a second pause/resume, as JSON
        assert json.loads(cli("sandbox", "pause", sb.id, "--json"))["state"] == "paused"
        assert json.loads(cli("sandbox", "resume", sb.id, "--json"))["state"] == "running"
        # illegal transitions: a clear error and a non-zero exit
        bad = subprocess.run([sys.executable, "-m", "pilldrops", "sandbox", "resume", sb.id], capture_output=True,
                             text=True, env=env, timeout=60, check=False)
        assert bad.returncode != 0 and "running" in bad.stderr + bad.stdout, bad
    finally:
        sb.kill()
    records = [r for r in json.loads(cli("history", "--json")) if r["id"] == sb.id]
    assert len(records) == 1
    rec = records[0]
    assert rec["state"] == "stopped" and len(rec["pauses"]) == 2, rec
    for p in rec["pauses"]:
        assert p["resumed_at"] and p["checkpoint_bytes"] > 0 and p["storage_gb_s"] > 0, p
        secs = _dt(p["resumed_at"]) - _dt(p["paused_at"])
        assert p["storage_gb_s"] == pytest.approx(p["checkpoint_bytes"] / 1024**3 * secs, rel=0.05, abs=1e-9)
    assert rec["storage_gb_s"] == pytest.approx(sum(p["storage_gb_s"] for p in rec["pauses"]), rel=1e-3, abs=1e-6)
    paused_s = sum(_dt(p["resumed_at"]) - _dt(p["paused_at"]) for p in rec["pauses"])
    life = _dt(rec["ended_at"]) - _dt(rec["started_at"])
    assert paused_s >= 3
    # paused time is not billed as CPU: vcpu_s covers the running time only (life minus the pauses)
    assert rec["vcpu_s"] <= rec["vcpu"] * (life - paused_s) + 0.5, (rec, life, paused_s)
    assert rec["vcpu_s"] > 0


def test_paused_time_does_not_count_against_the_timeout(server: Server, criu_ready: None) -> None:
    """Paused for longer than its whole timeout, it still resumes, with the time it had left; then its
    deadline ends it as usual (``timeout``)."""
    opts = {"api_url": server.api_url, "api_key": server.api_key}
    sb = Sandbox.create(template="tiny", memory_mb=128, timeout=4, **opts)
    try:
        info = sb.pause()
        assert info.timeout_left is not None and 0 < info.timeout_left <= 4
        time.sleep(5)                                         # longer than its timeout
        assert sb.get_info().state == "paused"
        assert sb.resume().state == "running"
        assert sb.run("echo alive").stdout == "alive\n"
        wait_until(lambda: sb.get_info().state == "stopped", timeout=30, what="its deadline after resume")
        assert sb.get_info().end_reason == "timeout"
    finally:
        sb.kill()


def test_paused_survives_a_sigkilled_up_and_retention_expires_it(tmp_path: Path, criu_ready: None) -> None:
    """A paused sandbox outlives a SIGKILLed `pilldrops up` (its checkpoint and journal entry) and resumes
    with its memory after the restart. Then `pilldrops up --paused-retention 1`: a sandbox paused for
    longer is deleted (``paused_expired``), its checkpoint with it, its paused interval billed."""
    from tests.e2e.conftest import start_up, stop_up

    root = tmp_path / MATCH
    data, cfg, log = root / "data", root / "cfg", root / "up.log"
    root.mkdir()
    before = leakcheck.snapshot([data / "node" / "crun"], match=MATCH)
    proc, url = start_up(data, cfg, log)
    try:
        key = json.loads((cfg / "pilldrops" / "config.json").read_text())["api_key"]
        sb = Sandbox.create(template="tiny", memory_mb=128, api_url=url, api_key=key)
        sb.run("(" + SH_LOOP + ") >/dev/null 2>&1 &")
        wait_until(lambda: len(log_lines(sb, "/root/log", 3)) >= 3, what="loop log")
        assert sb.pause().state == "paused"
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        proc, url = start_up(data, cfg, root / "up2.log")   # a fresh log: start_up looks for "is up at"
        again = Sandbox.resume(sb.id, api_url=url, api_key=key)
        n = len(log_lines(again, "/root/log", 3))
        wait_until(lambda: len(log_lines(again, "/root/log", 3)) >= n + 3, what="loop log after restart")
        lines = log_lines(again, "/root/log", 3)
        assert len({ln[0] for ln in lines}) == 1 and len({ln[1] for ln in lines}) == 1
        assert [int(ln[2]) for ln in lines] == list(range(1, len(lines) + 1))
        again.kill()
        assert stop_up(proc) == 0

        proc, url = start_up(data, cfg, root / "up3.log", "--paused-retention", "1")
        sb = Sandbox.create(template="tiny", memory_mb=128, api_url=url, api_key=key)
        sb.run("sleep 999 >/dev/null 2>&1 &")
        assert sb.pause().state == "paused"
        assert (data / "node" / "checkpoints" / sb.id).is_dir()
        info = wait_until(lambda: (i := sb.get_info()).state == "stopped" and i, timeout=30,
                          what="the paused sandbox to expire")
        assert info.end_reason == "paused_expired" and info.storage_gb_s > 0, info
        assert not (data / "node" / "checkpoints" / sb.id).exists()
        # the node's journal entry stays, with the end, until the control plane has that end (its next
        # report), so that an agent dying in between reports it again
        wait_until(lambda: not (data / "node" / "journal" / f"{sb.id}.json").exists(), timeout=30,
                   what="the ended sandbox's journal entry to go once its end was delivered")
    finally:
        assert stop_up(proc) == 0
    leakcheck.assert_no_leaks(before, settle=5)


def _dt(s: str) -> float:
    from datetime import datetime
    return datetime.fromisoformat(s).timestamp()


# ---- 6. fleet: resume on another node ---------------------------------------------------------------------

@pytest.fixture
def fleet(tmp_path: Path, criu_ready: None) -> Iterator[Fleet]:
    root = tmp_path / f"{MATCH}-pfleet"
    root.mkdir()
    f = Fleet(root, f"{MATCH.split('-', 1)[1]}pf")
    before = leakcheck.snapshot(f.crun_roots(), match=MATCH)
    try:
        yield f
    finally:
        f.stop()
    leakcheck.assert_no_leaks(before, settle=5)


def test_fleet_resume_moves_to_the_other_node(fleet: Fleet) -> None:
    fleet.start_cp()
    fleet.add_node()
    fleet.add_node()
    fleet.wait_nodes_ready(2)
    env = {**fleet.env, "PILLDROPS_API_URL": fleet.url, "PILLDROPS_API_KEY": fleet.key}

    def cli(*args: str) -> str:
        out = subprocess.run([sys.executable, "-m", "pilldrops", *args], capture_output=True, text=True, env=env,
                             check=False)
        assert out.returncode == 0, out.stderr
        return out.stdout

    nodes = {n["id"]: n["name"] for n in json.loads(cli("nodes", "list", "--json"))}
    index = {name: i for i, name in enumerate(fleet.node_names)}
    opts = {"api_url": fleet.url, "api_key": fleet.key}
    sb = Sandbox.create(template="tiny", memory_mb=128, **opts)
    try:
        sb.files.write("/root/before.txt", "from the first node")
        # a writable layer big enough that copying it to the other node spans several heartbeats
        big = sb.run("head -c 200000000 /dev/urandom > /root/big.bin && sha256sum /root/big.bin")
        assert big.exit_code == 0, big.stderr
        sb.run("(" + SH_LOOP + ") >/dev/null 2>&1 &")
        wait_until(lambda: len(log_lines(sb, "/root/log", 3)) >= 5, what="loop log")
        first = index[nodes[sb.info.node_id]]
        other = 1 - first
        old_state = fleet.root / f"node{first}" / "node"
        sb.pause()
        assert (old_state / "checkpoints" / sb.id).is_dir()
        cli("nodes", "drain", fleet.node_names[first])          # its node takes nothing: resume elsewhere
        sb.resume()
        assert sb.info.node_id is not None and index[nodes[sb.info.node_id]] == other
        wait_until(lambda: len(log_lines(sb, "/root/log", 3)) >= 15, what="loop log after the move")
        lines = log_lines(sb, "/root/log", 3)
        assert len({ln[0] for ln in lines}) == 1 and len({ln[1] for ln in lines}) == 1   # same token, same pid
        assert [int(ln[2]) for ln in lines] == list(range(1, len(lines) + 1))        # the counter carried on
        assert sb.files.read("/root/before.txt") == "from the first node"
        assert sb.run("sha256sum /root/big.bin").stdout == big.stdout
        # the old node has no checkpoint, no journal entry and no container of it; the new one runs it
        assert list((old_state / "checkpoints").iterdir()) == []
        assert not (old_state / "journal" / f"{sb.id}.json").exists()
        new_root = fleet.root / f"node{other}" / "node"
        assert crun_ids(old_state / "crun") == [] and crun_ids(new_root / "crun") == [sb.id]
        assert list((new_root / "checkpoints").iterdir()) == []
        # the old node never runs it again: undrained, after heartbeats, and across another pause/resume
        cli("nodes", "undrain", fleet.node_names[first])
        time.sleep(1.5)                                           # three heartbeats
        assert crun_ids(old_state / "crun") == []
        sb.pause()
        sb.resume()
        assert index[nodes[sb.info.node_id]] == other             # its own node (the new one) first
        assert crun_ids(old_state / "crun") == [] and crun_ids(new_root / "crun") == [sb.id]
        lines = log_lines(sb, "/root/log", 3)
        assert [int(ln[2]) for ln in lines] == list(range(1, len(lines) + 1))
        with fleet.api() as c:
            assert c.get(f"/v1/sandboxes/{sb.id}").json()["state"] == "running"
    finally:
        sb.kill()
    assert list((fleet.root / f"node{other}" / "node" / "checkpoints").iterdir()) == []
