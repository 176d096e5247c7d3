"""End to end through the SDK, the control plane, the node agent and real crun sandboxes."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import tarfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import anyio
import httpx
import pytest

from pilldrops import AsyncSandbox, CommandFailed, FileNotFound, InvalidRequest, Sandbox, SandboxNotFound
from tests.e2e.conftest import Server, start_up, stop_up

pytestmark = pytest.mark.integration


def make_env(root: Path) -> Path:
    env = root / "env"
    (env / "lib").mkdir(parents=True)
    (env / "episode.sh").write_text('#!/bin/sh\n. /env/lib/weights.sh\necho $(( $1 * WEIGHT + BIAS ))\n')
    (env / "episode.sh").chmod(0o755)
    (env / "lib" / "weights.sh").write_text("WEIGHT=3\nBIAS=1\n")
    return env


def test_rollout_fanout_64_threads(sdk_env: Server, tmp_path: Path) -> None:
    env = make_env(tmp_path)

    def rollout(policy: int) -> float:
        with Sandbox.create(template="tiny", vcpu=0.5, memory_mb=128, timeout=600) as sb:
            sb.upload(env, "/env")
            r = sb.run(f"/env/episode.sh {policy}")
            assert r.exit_code == 0, r.stderr
            return float(r.stdout)

    policies = list(range(96))
    with ThreadPoolExecutor(max_workers=64) as pool:
        rewards = list(pool.map(rollout, policies))
    assert rewards == [p * 3 + 1 for p in policies]
    assert Sandbox.list(state="running") == []


def test_async_twin(sdk_env: Server, tmp_path: Path) -> None:
    env = make_env(tmp_path)

    async def rollout(policy: int, out: list[float]) -> None:
        async with await AsyncSandbox.create(template="tiny", memory_mb=128) as sb:
            await sb.upload(env, "/env")
            r = await sb.run(f"/env/episode.sh {policy}")
            out.append(float(r.stdout))

    async def main() -> list[float]:
        out: list[float] = []
        async with anyio.create_task_group() as tg:
            for p in range(16):
                tg.start_soon(rollout, p, out)
        return out

    assert sorted(anyio.run(main)) == sorted(p * 3 + 1 for p in range(16))


def test_run_result_shape_streaming_and_check(sdk_env: Server) -> None:
    with Sandbox.create(template="tiny", envs={"GREETING": "hi"}) as sb:
        seen: list[str] = []
        r = sb.run("echo $GREETING; echo oops >&2; printf 'caf\\303\\251 \\377'; exit 7", on_stdout=seen.append)
        assert (r.exit_code, r.stderr) == (7, "oops\n")
        assert r.stdout_bytes == "hi\ncafé \xff".encode("latin-1").replace(b"caf\xe9", "café".encode())
        assert r.stdout == "hi\ncafé \ufffd" and "".join(seen) == r.stdout
        assert r.duration > 0 and not r.truncated and not r.timed_out
        assert sb.run("pwd", cwd="/tmp").stdout == "/tmp\n"
        assert sb.run("echo $X", envs={"X": "from-run"}).stdout == "from-run\n"
        assert sb.run(["sh", "-c", "cat"], stdin="fed in").stdout == "fed in"
        with pytest.raises(CommandFailed) as ei:
            sb.run("exit 3", check=True)
        assert ei.value.result.exit_code == 3


def test_plain_command_lines_run_without_a_shell_with_the_same_semantics(sdk_env: Server) -> None:
    """Issue 15: ``run("true")`` and other plain lines exec directly (node/cmdline.py): PATH lookup, exit
    127 / 126, envs and cwd as under ``sh -c``; anything with shell syntax still gets the shell."""
    with Sandbox.create(template="tiny", envs={"FROM_CREATE": "c"}) as sb:
        assert sb.run("true").exit_code == 0 and sb.run("false").exit_code == 1
        assert sb.run("no-such-command-xyz").exit_code == 127                   # PATH lookup, not found
        assert sb.run("/etc/hostname").exit_code == 126                         # found, not executable
        r = sb.run("env", envs={"FROM_RUN": "r"})
        assert "FROM_CREATE=c" in r.stdout and "FROM_RUN=r" in r.stdout and "PATH=" in r.stdout
        assert sb.run("readlink -f .", cwd="/tmp").stdout == "/tmp\n"
        assert sb.run("/bin/echo a   b").stdout == "a b\n"
        # the process is the command itself, not a shell: its parent is the init's shepherd
        assert sb.run("cat /proc/self/comm").stdout == "cat\n"
        assert sb.run("echo $FROM_CREATE").stdout == "c\n"                     # syntax: still the shell
        assert sb.run("exit 4").exit_code == 4                                    # a builtin: the shell


def test_command_timeout_kills_the_tree_and_output_is_capped(sdk_env: Server) -> None:
    with Sandbox.create(template="tiny") as sb:
        t0 = time.monotonic()
        r = sb.run("sleep 300 & sleep 301 & echo started; wait", timeout=1)
        assert r.timed_out and r.exit_code == 124 and r.stdout == "started\n"
        assert time.monotonic() - t0 < 30
        ps = sb.run("ps -o pid,args").stdout
        assert "sleep 30" not in ps, ps
        r = sb.run("yes | head -c 3000000", max_output_bytes=1000)
        assert r.truncated and len(r.stdout_bytes) == 1000 and r.exit_code == 0
        r = sb.run("head -c 40000000 /dev/zero")    # 40 MB past the default 16 MiB cap: never blocks
        assert r.truncated and len(r.stdout_bytes) == 16 * 1024 * 1024


def test_sandboxes_are_isolated_from_each_other_and_the_host(sdk_env: Server) -> None:
    cp_port = httpx.URL(sdk_env.api_url).port
    with Sandbox.create(template="tiny") as a, Sandbox.create(template="tiny") as b:
        a.files.write("/root/secret.txt", "only-a")
        a.run("sleep 777 >/dev/null 2>&1 &")
        assert b.run("cat /root/secret.txt").exit_code != 0
        assert "777" not in b.run("ps -o args").stdout
        assert b.run("cat /proc/net/dev").stdout.count(":") == 1          # only lo
        r = b.run(f"nc -w 2 127.0.0.1 {cp_port} </dev/null")              # the host's control plane port
        assert r.exit_code != 0
        r = b.run("nc -w 2 198.18.0.1 80 </dev/null")
        assert r.exit_code != 0
        points = [line.split()[1] for line in b.run("cat /proc/mounts").stdout.splitlines()]
        allowed = ("/", "/proc", "/dev", "/sys", "/.pd/init", "/.pd/run")        # /.pd/run: pd-init's socket dir
        assert all(p in allowed or p.startswith(("/proc/", "/dev/", "/sys/")) for p in points), points
        assert b.run(f"ls {sdk_env.data_dir}").exit_code != 0
        assert b.run("hostname").stdout.strip() == b.id.replace("_", "-")


def test_memory_and_pids_limits_hit_only_the_offender(sdk_env: Server) -> None:
    with Sandbox.create(template="tiny", memory_mb=48) as hog, Sandbox.create(template="tiny") as nb:
        r = hog.run("x=$(head -c 200000000 /dev/zero | tr '\\0' a); echo ${#x}")
        assert r.exit_code == 137 and r.oom_killed, r                    # the result says why it died
        with pytest.raises(CommandFailed, match="memory limit"):
            r.check_returncode()
        assert hog.run("echo still-here").stdout == "still-here\n"       # only the command died
        killed = hog.run("kill -9 $$")                                   # a SIGKILL that is not the limit's
        assert killed.exit_code == 137 and not killed.oom_killed
        assert nb.run("echo fine").stdout == "fine\n"
        assert hog.get_info().state == "running"
    with Sandbox.create(template="tiny") as bomb, Sandbox.create(template="tiny") as nb:
        bomb.run("f(){ f | f & }; f", timeout=10)                        # a fork bomb, bounded by pids.max
        time.sleep(2)
        assert nb.run("echo fine").stdout == "fine\n"                   # the neighbour is untouched
        assert subprocess.run(["true"], check=False).returncode == 0                 # so is the host
    # leaving the block killed the bomb's whole cgroup; the autouse leak check verifies nothing is left


def test_files_upload_download_roundtrip(sdk_env: Server, tmp_path: Path) -> None:
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / "sub" / "data.bin").write_bytes(bytes(range(256)) * 1000)
    (src / "run.sh").write_text("echo ok")
    (src / "run.sh").chmod(0o4755)                                        # setuid: must be stripped
    (src / "link").symlink_to("sub/data.bin")
    with Sandbox.create(template="tiny") as sb:
        sb.upload(src, "/work/src")
        sb.upload(src / "run.sh", "/single/renamed.sh")
        assert sb.run("stat -c %a /work/src/run.sh").stdout.strip() == "755"
        assert sb.run("readlink /work/src/link").stdout.strip() == "sub/data.bin"
        assert sb.files.read("/single/renamed.sh") == "echo ok"
        sb.files.write("/out/a.txt", "alpha")
        sb.files.write("/out/b.bin", b"\x00\x01")
        names = {f.name: f for f in sb.files.list("/out")}
        assert set(names) == {"a.txt", "b.bin"} and names["a.txt"].size == 5 and names["a.txt"].type == "file"
        assert sb.files.read_bytes("/out/b.bin") == b"\x00\x01"
        dest = tmp_path / "back"
        sb.download("/work/src", dest)
        assert (dest / "sub" / "data.bin").read_bytes() == (src / "sub" / "data.bin").read_bytes()
        with pytest.raises(FileNotFound):
            sb.files.read("/nope")
        with pytest.raises(FileNotFound):
            sb.download("/nope", tmp_path / "x")


def _tar(*members: tuple[str, bytes, str]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        for name, kind, target in members:
            ti = tarfile.TarInfo(name)
            ti.type = kind
            ti.linkname = target
            data = b"pwned" if kind == tarfile.REGTYPE else b""
            ti.size = len(data)
            tf.addfile(ti, io.BytesIO(data))
    return buf.getvalue()


@pytest.mark.parametrize("members", [
    [("../../../../../../tmp/pilldrops-escape", tarfile.REGTYPE, "")],
    [("/tmp/pilldrops-escape", tarfile.REGTYPE, "")],
    [("lnk", tarfile.SYMTYPE, "/tmp"), ("lnk/pilldrops-escape", tarfile.REGTYPE, "")],
    [("lnk", tarfile.SYMTYPE, "../../../../tmp")],
    [("hard", tarfile.LNKTYPE, "/etc/passwd")],
    [("dev", tarfile.CHRTYPE, "")],
])
def test_upload_traversal_is_refused(server: Server, api: httpx.Client, members: list) -> None:  # type: ignore[type-arg]
    with Sandbox.create(template="tiny", api_url=server.api_url, api_key=server.api_key) as sb:
        info = sb.info
        for base, headers in [(server.api_url, {"Authorization": f"Bearer {server.api_key}"}),
                              (info.envd_url, {"X-Access-Token": info.access_token or ""})]:
            r = httpx.put(f"{base}/v1/sandboxes/{sb.id}/archive", params={"path": "/up"}, content=_tar(*members),
                          headers={**headers, "content-type": "application/x-tar"})
            assert r.status_code == 400, r.text
            assert r.json()["error"]["code"] == "invalid_request"
        assert not Path("/tmp/pilldrops-escape").exists()
        assert sb.run("ls /up").exit_code != 0               # nothing was unpacked


def test_teams_cannot_see_each_other(server: Server, api: httpx.Client) -> None:
    other = _second_team_key(server)
    with Sandbox.create(template="tiny", api_url=server.api_url, api_key=server.api_key) as sb:
        with pytest.raises(SandboxNotFound):
            Sandbox.connect(sb.id, api_url=server.api_url, api_key=other)
        b = httpx.Client(base_url=server.api_url, headers={"Authorization": f"Bearer {other}"})
        theirs, unknown = b.delete(f"/v1/sandboxes/{sb.id}"), b.delete("/v1/sandboxes/sb_unknown")
        assert theirs.status_code == unknown.status_code == 404
        assert theirs.json()["error"]["code"] == unknown.json()["error"]["code"]
        assert sb.run("echo alive").stdout == "alive\n"
        # the data plane needs the sandbox's own token; a wrong one answers as an unknown id would (no oracle)
        r = httpx.post(f"{sb.info.envd_url}/v1/sandboxes/{sb.id}/run", json={"cmd": "id"},
                       headers={"X-Access-Token": "guess"})
        assert r.status_code == 404 and r.json()["error"]["code"] == "sandbox_not_found"
    assert httpx.get(f"{server.api_url}/v1/sandboxes").status_code == 401


def _second_team_key(server: Server) -> str:
    from pilldrops._internal.clock import Clock
    from pilldrops.server.service.auth import AuthService
    from pilldrops.server.store.sql import Store, sqlite_url

    async def make() -> str:
        store = await Store.open(sqlite_url(server.data_dir / "pilldrops.db"))
        try:
            auth = AuthService(store, Clock())
            team = await auth.create_team(f"other-{time.monotonic_ns()}")
            return (await auth.create_key(team.id, "b")).secret
        finally:
            await store.close()

    return anyio.run(make)


def test_idempotent_create_makes_one_sandbox(server: Server, api: httpx.Client) -> None:
    h = {"Idempotency-Key": f"retry-{time.monotonic_ns()}"}
    body = {"template": "tiny", "timeout": 120}
    first, second = api.post("/v1/sandboxes", json=body, headers=h), api.post("/v1/sandboxes", json=body, headers=h)
    assert first.status_code == 201 and second.status_code == 200
    assert first.json()["id"] == second.json()["id"]
    running = api.get("/v1/sandboxes", params={"state": "running"}).json()["items"]
    assert [s["id"] for s in running] == [first.json()["id"]]
    api.delete(f"/v1/sandboxes/{first.json()['id']}")


def test_node_enforces_deadline(sdk_env: Server) -> None:
    sb = Sandbox.create(template="tiny", timeout=2)
    try:
        deadline = time.monotonic() + 20
        while sb.get_info().state == "running" and time.monotonic() < deadline:
            time.sleep(0.2)
        info = sb.get_info()
        assert info.state == "stopped" and info.end_reason == "timeout"
        assert info.ended_at is not None and info.end_at is not None
        assert abs((info.ended_at - info.end_at).total_seconds()) < 2
    finally:
        sb.kill()


def test_set_timeout_extends_life(sdk_env: Server) -> None:
    with Sandbox.create(template="tiny", timeout=2) as sb:
        sb.set_timeout(120)
        time.sleep(3)
        assert sb.run("echo later").stdout == "later\n"


def test_sandboxes_outlive_a_sigkilled_agent_and_are_adopted(tmp_path: Path) -> None:
    """SIGKILL `pilldrops up`: the sandboxes keep running (not children of the agent); a restarted `up`
    on the same data dir (new ports) adopts them, each through the runtime of its isolation mode, and they
    accept run and upload again. One `up`, one SIGKILL, one sandbox per mode this machine runs (container
    always; gVisor and the microVM when available, else named in a warning)."""
    from pilldrops.node.runtime.gvisor import probe
    from pilldrops.node.runtime.qemu import probe_host
    from tests import leakcheck
    from tests.e2e.conftest import MATCH

    modes = ["container"]
    unavailable = []
    if probe().available:
        modes.append("gvisor")
    else:
        unavailable.append(f"gVisor: {probe().reason}")
    ok, reason, _ = probe_host()
    if ok:
        modes.append("microvm")
    else:
        unavailable.append(f"microVM: {reason}")
    root = tmp_path / MATCH
    data, cfg, log = root / "data", root / "cfg", root / "up.log"
    root.mkdir()
    before = leakcheck.snapshot([data / "node" / "crun"], match=MATCH,
                                runsc_roots=[data / "node" / "runtimes" / "gvisor" / "runsc"],
                                qemu_dirs=[data / "node" / "runtimes" / "microvm"])
    proc, url = start_up(data, cfg, log)
    key = json.loads((cfg / "pilldrops" / "config.json").read_text())["api_key"]
    try:
        boxes = {m: Sandbox.create(template="tiny", api_url=url, api_key=key, isolation=m,
                                   memory_mb=256)    # the microVM tier's snapshot size (one template boot per session)
                 for m in modes}
        pids = {}
        for m, sb in boxes.items():
            sb.run(f"echo 41-{m} > /root/state")
            handle = json.loads((data / "node" / "journal" / f"{sb.id}.json").read_text())["handle"]
            assert handle["extra"]["isolation"] == m          # re-adoption goes to the right runtime
            pids[m] = int(handle["pid"])
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        time.sleep(0.5)
        for pid in pids.values():
            os.kill(pid, 0)                                   # still alive
        proc, url2 = start_up(data, cfg, log)
        for m, sb in boxes.items():
            again = Sandbox.connect(sb.id, api_url=url2, api_key=key)
            assert again.run("cat /root/state").stdout == f"41-{m}\n", m
            again.files.write("/root/after.txt", "yes")
            assert again.files.read("/root/after.txt") == "yes", m
            again.kill()
            with pytest.raises(OSError):
                for _ in range(100):
                    os.kill(pids[m], 0)
                    time.sleep(0.05)
    finally:
        assert stop_up(proc) == 0
    leakcheck.assert_no_leaks(before, settle=5)
    if unavailable:          # (shown in pytest's warnings summary: what this machine could not check)
        import warnings
        warnings.warn("re-adoption checked for " + ", ".join(modes) + " only; " + "; ".join(unavailable),
                      stacklevel=1)


def test_bad_requests_are_typed(sdk_env: Server) -> None:
    with pytest.raises(InvalidRequest) as ei:
        Sandbox.create(template="tiny", timeout=86_401)
    assert ei.value.code == "invalid_request" and "86400" in str(ei.value)
    with pytest.raises(SandboxNotFound):
        Sandbox.connect("sb_missing")


def test_run_returns_when_the_command_exits_even_with_a_background_child(sdk_env: Server) -> None:
    """`server &` keeps the pipes open; run still returns when the shell exits, and the child lives on."""
    with Sandbox.create(template="tiny") as sb:
        t0 = time.monotonic()
        r = sb.run("sleep 300 & echo launched")
        assert (r.exit_code, r.stdout, r.timed_out) == (0, "launched\n", False)
        assert time.monotonic() - t0 < 120          # not the child's 300 s
        assert "sleep 300" in sb.run("ps -o args").stdout


def test_custom_template_from_the_user_config_dir(server: Server, tmp_path: Path) -> None:
    """A spec in ~/.config/pilldrops/templates (here: the server's XDG_CONFIG_HOME), built with
    `pilldrops template build`, is usable right away: the node announces it within about a second."""
    spec_dir = server.config_home / "pilldrops" / "templates"
    spec_dir.mkdir(parents=True, exist_ok=True)
    name = f"myenv{os.getpid()}"
    (spec_dir / "episode.sh").write_text("echo $GREETING $(cat /env/answer)\n")
    (spec_dir / f"{name}.toml").write_text(f'''
name = "{name}"
description = "tiny + an environment baked in"
from = "tiny"
workdir = "/env"
[env]
GREETING = "hello-from-template"
[[steps]]
run = "mkdir -p /env && echo 42 > /env/answer"
[[steps]]
copy = {{ src = "episode.sh", dest = "/env/episode.sh" }}
''')
    env = {**os.environ, "XDG_CONFIG_HOME": str(server.config_home)}
    out = subprocess.run([sys.executable, "-m", "pilldrops", "template", "build", name, "--data-dir",
                          str(server.data_dir)], capture_output=True, text=True, env=env, timeout=300, check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    deadline = time.monotonic() + 5
    while True:
        try:
            sb = Sandbox.create(template=name, api_url=server.api_url, api_key=server.api_key)
            break
        except Exception:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
    with sb:
        r = sb.run("sh episode.sh")
        assert r.stdout == "hello-from-template 42\n", r.stderr
