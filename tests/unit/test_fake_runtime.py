"""FakeRuntime keeps the Runtime contract's observable semantics without root (test-only driver)."""

from __future__ import annotations

import os
from pathlib import Path

import anyio
import pytest

from pilldrops.node.isolation import procs
from pilldrops.node.runtime.base import Handle, RuntimeFailure, SandboxSpec
from pilldrops.node.runtime.fake import FakeRuntime

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
async def rt(tmp_path: Path):  # type: ignore[no-untyped-def]
    r = FakeRuntime(tmp_path / "fake")
    yield r
    await r.close()


async def collect(p):  # type: ignore[no-untyped-def]
    chunks = []
    while (c := await p.read()) is not None:
        chunks.append(c)
    return chunks, await p.wait()


async def test_create_exec_streams_and_codes(rt: FakeRuntime) -> None:
    h = await rt.create(SandboxSpec(id="a", layers=(), envs={"S": "spec"}, workdir="/home"))
    p = await rt.exec(h, ["sh", "-c", "echo out; echo err >&2; echo $S $E; pwd; exit 3"], env={"E": "e"}, cwd=None)
    chunks, code = await collect(p)
    out = b"".join(d for s, d in chunks if s == "stdout").decode().splitlines()
    assert code == 3 and out[0] == "out" and out[1] == "spec e" and out[2].endswith("/a/home")
    assert b"".join(d for s, d in chunks if s == "stderr") == b"err\n"
    p = await rt.exec(h, ["sh", "-c", "kill -9 $$"], env={}, cwd="/")
    assert (await collect(p))[1] == 137
    p = await rt.exec(h, ["cat"], env={}, cwd=None, stdin=b"in")
    assert (await collect(p)) == ([("stdout", b"in")], 0)
    with pytest.raises(RuntimeFailure):
        await rt.exec(h, ["/no/such/bin"], env={}, cwd=None)


async def test_large_output_is_chunked(rt: FakeRuntime) -> None:
    h = await rt.create(SandboxSpec(id="big", layers=()))
    p = await rt.exec(h, ["sh", "-c", "head -c 300000 /dev/zero"], env={}, cwd=None)
    chunks, code = await collect(p)
    assert code == 0 and sum(len(d) for _, d in chunks) == 300000
    assert all(len(d) <= 64 * 1024 for _, d in chunks)


async def test_kill_kills_tree(rt: FakeRuntime) -> None:
    h = await rt.create(SandboxSpec(id="t", layers=()))
    p = await rt.exec(h, ["sh", "-c", "sleep 100 & sleep 100 & wait"], env={}, cwd=None)
    with anyio.fail_after(5):
        while len(procs.descendants(p.pid)) < 2:
            await anyio.sleep(0.01)
    kids = procs.descendants(p.pid)
    await p.kill()
    assert await p.wait() == 137
    with anyio.fail_after(5):
        while any(procs.alive(k) for k in kids):
            await anyio.sleep(0.01)
    await p.kill()


async def test_state_destroy_list_and_knobs(tmp_path: Path) -> None:
    rt = FakeRuntime(tmp_path / "f")
    a = await rt.create(SandboxSpec(id="a", layers=()))
    b = await rt.create(SandboxSpec(id="b", layers=()))
    assert await rt.list_ids() == ["a", "b"]
    assert (await rt.state(a)).status == "running"
    await rt.simulate_exit(a, 0)
    st = await rt.state(a)
    assert st.status == "stopped" and st.exit_code == 0 and not st.oom_killed
    with pytest.raises(RuntimeFailure):
        await rt.exec(a, ["true"], env={}, cwd=None)
    await rt.simulate_oom(b)
    st = await rt.state(b)
    assert st.status == "stopped" and st.oom_killed and st.exit_code == 137
    await rt.destroy(a)
    await rt.destroy(a)                                     # idempotent
    assert (await rt.state(a)).status == "gone"
    assert not (tmp_path / "f" / "a").exists()
    with pytest.raises(RuntimeFailure):
        await rt.create(SandboxSpec(id="b", layers=()))     # duplicate id
    rt.fail_create = True
    with pytest.raises(RuntimeFailure):
        await rt.create(SandboxSpec(id="c", layers=()))
    rt.fail_create = OSError("boom")
    with pytest.raises(OSError):
        await rt.create(SandboxSpec(id="c", layers=()))
    await rt.close()
    assert await rt.list_ids() == []


async def test_destroy_kills_running_commands(rt: FakeRuntime) -> None:
    h = await rt.create(SandboxSpec(id="d", layers=()))
    p = await rt.exec(h, ["sleep", "100"], env={}, cwd=None)
    pid = p.pid
    await rt.destroy(h)
    assert await p.wait() == 137
    assert not procs.alive(pid)
    assert os.getpid() > 0
    assert (await rt.state(Handle(id="d"))).status == "gone"
