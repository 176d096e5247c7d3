"""The runtime contract (``node/runtime/base.py``), on every runtime in ``conftest.RUNTIMES``.

Each test names one promise: create, exec semantics (streams, exit codes, stdin, env/cwd, timeout and kill
of the whole process tree, output caps, a background child that keeps the pipes open), files and archives
through the data plane (sanitised uploads, downloads), limits in the cgroup, state derived from facts,
destroy leaving nothing (checked after every test), re-adoption by a fresh runtime instance, and
checkpoint/restore where the runtime supports it (skipped with the runtime's own reason where not).
"""

from __future__ import annotations

import io
import json
import os
import tarfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import pytest

from pilldrops import errors
from pilldrops.node.dataplane import DataPlane, Target
from pilldrops.node.journal import handle_from_record, handle_record
from pilldrops.node.runtime.base import ExecProcess, Handle, Runtime, RuntimeFailure
from tests.contract.conftest import RuntimeCase

pytestmark = pytest.mark.anyio
BOUND_S = 30.0        # an upper bound on "returns at all" (not a speed target)


async def collect(proc: ExecProcess) -> tuple[int, str, str]:
    out, err = bytearray(), bytearray()
    with anyio.fail_after(BOUND_S):
        while (chunk := await proc.read()) is not None:
            (out if chunk[0] == "stdout" else err).extend(chunk[1])
        code = await proc.wait()
    return code, out.decode(errors="replace"), err.decode(errors="replace")


async def sh(rt: Runtime, h: Handle, script: str, **kw: Any) -> tuple[int, str, str]:
    kw.setdefault("env", {})
    kw.setdefault("cwd", None)
    return await collect(await rt.exec(h, ["/bin/sh", "-c", script], **kw))


async def gone_soon(rt: Runtime, h: Handle, pid_file: str) -> bool:
    """The process whose in-sandbox pid is in ``pid_file`` is dead within the bound."""
    with anyio.move_on_after(10):
        while True:
            _, out, _ = await sh(rt, h, f'kill -0 "$(cat {pid_file})" 2>/dev/null && echo alive || echo dead')
            if out.strip() == "dead":
                return True
            await anyio.sleep(0.1)
    return False


# ---- create / destroy -----------------------------------------------------------------------------------

async def test_create_runs_init_and_destroy_is_idempotent(case: RuntimeCase, runtime: Runtime) -> None:
    h = await runtime.create(case.spec("c-basic"))
    assert h.id == "c-basic" and h.pid
    st = await runtime.state(h)
    assert st.status == "running" and st.pid == h.pid and not st.oom_killed
    assert "c-basic" in await runtime.list_ids()
    await runtime.destroy(h)
    assert (await runtime.state(h)).status == "gone"
    assert "c-basic" not in await runtime.list_ids()
    await runtime.destroy(h)                         # idempotent


async def test_create_of_an_existing_id_fails_and_keeps_the_first(case: RuntimeCase,
                                                                    runtime: Runtime) -> None:
    h = await runtime.create(case.spec("c-dup"))
    with pytest.raises(RuntimeFailure):
        await runtime.create(case.spec("c-dup"))
    assert (await runtime.state(h)).status == "running"
    assert await sh(runtime, h, "echo ok") == (0, "ok\n", "")
    await runtime.destroy(h)


async def test_destroy_ends_commands_in_flight(case: RuntimeCase, runtime: Runtime) -> None:
    h = await runtime.create(case.spec("c-inflight"))
    proc = await runtime.exec(h, ["/bin/sh", "-c", "sleep 60"], env={}, cwd=None)
    await runtime.destroy(h)
    with anyio.fail_after(BOUND_S):
        code = await proc.wait()
    assert code != 0
    with pytest.raises(RuntimeFailure):
        await runtime.exec(h, ["true"], env={}, cwd=None)


# ---- exec semantics -------------------------------------------------------------------------------------

async def test_exec_streams_and_exit_code(case: RuntimeCase, runtime: Runtime) -> None:
    h = await runtime.create(case.spec("c-exec", envs={"PD_SPEC_ENV": "from-spec"}))
    assert await sh(runtime, h, "echo out; echo err >&2; exit 3") == (3, "out\n", "err\n")
    assert await sh(runtime, h, "kill -KILL $$") == (128 + 9, "", "")        # 128+N for signal N
    code, out, _ = await sh(runtime, h, 'echo "$PD_SPEC_ENV $PD_EXEC_ENV"', env={"PD_EXEC_ENV": "from-exec"})
    assert (code, out) == (0, "from-spec from-exec\n")
    assert (await sh(runtime, h, "mkdir -p sub"))[0] == 0
    code, out, _ = await sh(runtime, h, "pwd", cwd=os.path.join(case.spec("x").workdir, "sub"))
    assert code == 0 and out.strip().endswith("/sub")
    await runtime.destroy(h)


async def test_exec_stdin_bytes_and_stream(case: RuntimeCase, runtime: Runtime) -> None:
    h = await runtime.create(case.spec("c-stdin"))
    assert await sh(runtime, h, "cat", stdin=b"hello\n") == (0, "hello\n", "")

    async def chunks() -> AsyncIterator[bytes]:
        for i in range(3):
            yield f"line{i}\n".encode()
    assert await sh(runtime, h, "cat", stdin=chunks()) == (0, "line0\nline1\nline2\n", "")
    await runtime.destroy(h)


async def test_timeout_kills_the_whole_tree(case: RuntimeCase, runtime: Runtime) -> None:
    h = await runtime.create(case.spec("c-timeout"))
    # a timeout that fires before the shell got to start its child proves nothing: longer ones then
    # (a microVM under TCG can take more than a second to get there)
    for limit in (1.0, 3.0, 9.0):
        proc = await runtime.exec(h, ["/bin/sh", "-c", "sleep 60 & echo $! > bg.pid; sleep 60"], env={},
                                  cwd=None, timeout=limit)
        code, _, _ = await collect(proc)
        assert proc.timed_out and code != 0
        if (await sh(runtime, h, "[ -s bg.pid ] && echo started"))[1].strip() == "started":
            break
    else:
        pytest.fail("the command never got to start its background child")
    assert await gone_soon(runtime, h, "bg.pid"), "the timed-out command's background child survived"
    await runtime.destroy(h)


async def test_kill_kills_the_whole_tree(case: RuntimeCase, runtime: Runtime) -> None:
    h = await runtime.create(case.spec("c-kill"))
    script = "sleep 60 & echo $! > bg.pid; echo ready; sleep 60"
    proc = await runtime.exec(h, ["/bin/sh", "-c", script], env={}, cwd=None)
    with anyio.fail_after(BOUND_S):
        assert await proc.read() == ("stdout", b"ready\n")
        await proc.kill()
        assert await proc.wait() == 128 + 9
    await proc.kill()                                   # idempotent
    assert await gone_soon(runtime, h, "bg.pid"), "the killed command's background child survived"
    await runtime.destroy(h)


async def test_output_cap_drops_the_rest_without_blocking(case: RuntimeCase, runtime: Runtime) -> None:
    h = await runtime.create(case.spec("c-cap"))
    script = "head -c 4194304 /dev/zero; echo tail >&2"
    proc = await runtime.exec(h, ["/bin/sh", "-c", script], env={}, cwd=None, output_cap=1000)
    code, out, err = await collect(proc)
    assert code == 0 and proc.truncated
    assert len(out) == 1000 and err == "tail\n"          # each stream has its own cap
    await runtime.destroy(h)


async def test_a_background_child_does_not_hang_the_call(case: RuntimeCase, runtime: Runtime) -> None:
    h = await runtime.create(case.spec("c-bg"))
    # the child keeps stdout and stderr open for a minute: the call returns when the shell exits
    assert await sh(runtime, h, "sleep 60 & echo started") == (0, "started\n", "")
    await runtime.destroy(h)                             # takes the child with it (leak check)


# ---- files and archives (through the data plane, which moves them with the runtime's exec) ------------

def _tar(members: list[tuple[tarfile.TarInfo, bytes | None]]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        for info, data in members:
            if data is not None:
                info.size = len(data)
            tf.addfile(info, io.BytesIO(data) if data is not None else None)
    return buf.getvalue()


def _file(name: str, data: bytes, mode: int = 0o644) -> tuple[tarfile.TarInfo, bytes]:
    info = tarfile.TarInfo(name)
    info.mode = mode
    return info, data


def _link(name: str, target: str) -> tuple[tarfile.TarInfo, None]:
    info = tarfile.TarInfo(name)
    info.type, info.linkname = tarfile.SYMTYPE, target
    return info, None


async def _body(data: bytes) -> AsyncIterator[bytes]:
    for i in range(0, len(data), 4096):
        yield data[i:i + 4096]


async def test_archive_upload_is_sanitised_and_download_round_trips(case: RuntimeCase,
                                                                      runtime: Runtime) -> None:
    h = await runtime.create(case.spec("c-files"))
    plane = DataPlane(runtime)
    t = Target(id=h.id, handle=h, workdir=case.spec("x").workdir)
    up = case.path(h, "/pd-up")
    good = [_file("a/b.txt", b"bee\n"), _file("a/x.sh", b"#!/bin/sh\n", 0o4755), _link("a/l", "b.txt")]
    n = await plane.put_archive(t, up, _body(_tar(good)))  # type: ignore[arg-type]
    assert n == 3
    assert await plane.read_file(t, f"{up}/a/b.txt") == b"bee\n"
    assert await plane.read_file(t, f"{up}/a/l") == b"bee\n"
    modes = {f.name: f.mode for f in await plane.list_dir(t, f"{up}/a")}
    assert modes["x.sh"] & 0o7000 == 0                  # setuid neutralised
    for evil in ([_file("../escape.txt", b"x")], [_file("/abs.txt", b"x")],
                 [_link("out", "../../etc/passwd")], [_link("abs", "/etc/passwd")]):
        with pytest.raises(errors.InvalidRequest):
            await plane.put_archive(t, up, _body(_tar(evil)))   # type: ignore[arg-type]
    names = {f.name for f in await plane.list_dir(t, up)}
    assert names == {"a"}                                 # nothing of a refused upload was unpacked
    got = b"".join([c async for c in await plane.get_archive(t, f"{up}/a")])
    with tarfile.open(fileobj=io.BytesIO(got)) as tf:
        assert tf.extractfile("a/b.txt").read() == b"bee\n"   # type: ignore[union-attr]
    info = await plane.write_file(t, f"{up}/w/new.txt", _body(b"w" * 10000))
    assert info.size == 10000 and await plane.read_file(t, f"{up}/w/new.txt") == b"w" * 10000
    with pytest.raises(errors.FileNotFound):
        await plane.get_archive(t, f"{up}/missing")
    with pytest.raises(errors.FileNotFound):
        await plane.read_file(t, f"{up}/missing")
    await runtime.destroy(h)


# ---- limits ------------------------------------------------------------------------------------------------

async def test_limits_are_in_the_cgroup(case: RuntimeCase, runtime: Runtime) -> None:
    h = await runtime.create(case.spec("c-limits", vcpu=0.5, memory_mb=96, pids_limit=64))
    try:
        limits = case.cgroup_limits(h)
        if limits is None:
            pytest.skip(f"{case.name}: the runtime puts its sandboxes in no cgroup of their own")
        assert limits["memory_bytes"] == 96 * 1024 * 1024
        assert limits["pids"] == 64
        assert limits["cpu_quota_us"] == limits["cpu_period_us"] // 2
        if case.forks_fail_at_the_limit:
            # the pids limit holds inside: of 80 more processes some cannot start (the kernel counts each fork
            # it refused at the limit; a count taken by a command inside cannot be, its fork is refused too)
            await sh(runtime, h, "for i in $(seq 80); do sleep 5 & done 2>/dev/null")
            after = case.cgroup_limits(h)
            assert after is not None and after["pids_refused"] > 0 and 0 < after["pids_current"] <= 64
        else:
            # the limit holds on the host: far past it the sandbox ends (never the host)
            await sh(runtime, h, "for i in $(seq 200); do sleep 30 & done 2>/dev/null; wait", timeout=BOUND_S)
            with anyio.fail_after(BOUND_S):
                while (await runtime.state(h)).status == "running":
                    await anyio.sleep(0.1)
    finally:
        await runtime.destroy(h)


# ---- state from facts, re-adoption -----------------------------------------------------------------------

async def test_state_comes_from_facts(case: RuntimeCase, runtime: Runtime) -> None:
    h = await runtime.create(case.spec("c-facts"))
    assert (await runtime.state(Handle(id="c-never-made"))).status == "gone"
    await case.kill_init(runtime, h)
    with anyio.fail_after(BOUND_S):
        while (await runtime.state(h)).status == "running":
            await anyio.sleep(0.05)
    assert (await runtime.state(h)).status == "stopped"
    fresh = await case.make()                            # nothing in memory: the same facts, the same answer
    assert (await fresh.state(h)).status == "stopped"
    assert "c-facts" in await fresh.list_ids()
    await fresh.destroy(h)
    assert (await runtime.state(h)).status == "gone"


async def test_a_fresh_instance_readopts_a_live_sandbox(case: RuntimeCase, runtime: Runtime) -> None:
    h = await runtime.create(case.spec("c-adopt"))
    assert (await sh(runtime, h, "echo kept > note"))[0] == 0
    # the handle as the agent's journal persists it, and as an older agent wrote it (no format version)
    stored = json.loads(json.dumps(handle_record(h)))
    legacy = {k: v for k, v in stored.items() if k != "version"}
    assert handle_from_record(stored, h.id) == h == handle_from_record(legacy, h.id)
    fresh = await case.make()
    again = handle_from_record(stored, h.id)
    assert "c-adopt" in await fresh.list_ids()
    st = await fresh.state(again)
    assert st.status == "running" and st.pid == h.pid
    assert await sh(fresh, again, "cat note") == (0, "kept\n", "")
    await fresh.destroy(again)
    assert (await runtime.state(h)).status == "gone" and "c-adopt" not in await runtime.list_ids()


# ---- checkpoint / restore ---------------------------------------------------------------------------------

async def test_checkpoint_then_restore_in_a_fresh_instance(case: RuntimeCase, runtime: Runtime,
                                                             tmp_path: Path) -> None:
    why = runtime.checkpoint_unsupported()
    if why:
        pytest.skip(f"{case.name}: {why}")
    spec = case.spec("c-ckpt")
    h = await runtime.create(spec)
    assert (await sh(runtime, h, "echo before > note"))[0] == 0
    if case.restores_processes:
        assert (await sh(runtime, h, "sleep 600 >/dev/null 2>&1 & echo $! > sleeper.pid"))[0] == 0
    image = tmp_path / "image"
    image.mkdir()
    size = await runtime.checkpoint(h, image)
    assert size > 0 and any(image.iterdir())
    assert (await runtime.state(h)).status == "gone" and "c-ckpt" not in await runtime.list_ids()
    fresh = await case.make()                            # as another node (or a restarted agent) would
    h2 = await fresh.restore(spec, image)
    try:
        assert (await fresh.state(h2)).status == "running"
        assert await sh(fresh, h2, "cat note") == (0, "before\n", "")
        if case.restores_processes:
            code, out, _ = await sh(fresh, h2, 'kill -0 "$(cat sleeper.pid)" && echo alive')
            assert (code, out) == (0, "alive\n")
    finally:
        await fresh.destroy(h2)
