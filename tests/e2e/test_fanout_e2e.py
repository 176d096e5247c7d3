"""Batch create and the fan-out helpers on the real stack: Sandbox.create_many, pilldrops.map/amap."""

from __future__ import annotations

import anyio
import pytest

import pilldrops
from pilldrops import AsyncSandbox, InvalidRequest, Sandbox
from tests.e2e.conftest import Server


def test_create_many_each_item_on_its_own(sdk_env: Server) -> None:
    sbs = Sandbox.create_many(6, template="tiny", memory_mb=64, metadata={"t": "many"})
    try:
        assert len({sb.id for sb in sbs}) == 6
        outs = [sb.run("hostname").stdout for sb in sbs]
        assert len(set(outs)) == 6
    finally:
        for sb in sbs:
            sb.kill()
    mixed = Sandbox.create_many(2, template="no-such-template", return_exceptions=True)
    assert all(isinstance(e, pilldrops.TemplateNotFound) for e in mixed)
    with pytest.raises(InvalidRequest):
        Sandbox.create_many(2, template="tiny", memory_mb=1)        # refused before anything is made


def test_map_collects_results_and_per_item_errors(sdk_env: Server) -> None:
    def episode(sb: Sandbox, i: int) -> int:
        if i == 3:
            raise ValueError("item 3 fails on purpose")
        return int(sb.run(f"echo $(({i} * {i}))", check=True).stdout)

    res = pilldrops.map(episode, range(10), template="tiny", memory_mb=64, concurrency=4, progress=False)
    assert res.ok == 9 and res.failed == 1 and isinstance(res[3], ValueError) and list(res.errors) == [3]
    assert res.values() == [i * i for i in range(10) if i != 3]
    with pytest.raises(ValueError, match="on purpose"):
        res.raise_for_errors()


def test_amap(sdk_env: Server) -> None:
    async def episode(sb: AsyncSandbox, i: int) -> str:
        return (await sb.run(f"echo {i}")).stdout.strip()

    async def main() -> pilldrops.MapResult:  # type: ignore[type-arg]
        return await pilldrops.amap(episode, range(6), template="tiny", memory_mb=64, concurrency=3,
                                    progress=False)

    res = anyio.run(main)
    assert list(res) == [str(i) for i in range(6)] and res.failed == 0


def test_map_stops_at_once_on_a_create_error_no_item_can_pass(sdk_env: Server) -> None:
    with pytest.raises(pilldrops.TemplateNotFound):
        pilldrops.map(lambda sb, i: i, range(50), template="no-such-template", progress=False)

    async def main() -> None:
        await pilldrops.amap(_echo, range(20), template="no-such-template", progress=False)

    with pytest.raises(pilldrops.TemplateNotFound):
        anyio.run(main)


async def _echo(sb: AsyncSandbox, i: int) -> int:
    return i


def test_ctrl_c_in_map_kills_the_running_episodes_and_raises_at_once(sdk_env: Server) -> None:
    """SIGINT while 3 episodes each run `sleep 60` (and 3 more wait): the map kills the 3 sandboxes and
    raises KeyboardInterrupt without waiting for the commands; the waiting items never start."""
    import os
    import signal
    import threading
    import time

    tag = f"ctrl-c-{os.getpid()}"
    started: list[int] = []

    def episode(sb: Sandbox, i: int) -> str:
        started.append(i)
        return sb.run("sleep 60").stdout

    def interrupt() -> None:
        deadline = time.monotonic() + 60
        while len(Sandbox.list(metadata={"run": tag})) < 3 or len(started) < 3:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        time.sleep(0.5)                                   # their `sleep 60` is running
        os.kill(os.getpid(), signal.SIGINT)

    threading.Thread(target=interrupt, daemon=True).start()
    t0 = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        pilldrops.map(episode, range(6), template="tiny", memory_mb=64, concurrency=3, progress=False,
                      metadata={"run": tag})
    assert time.monotonic() - t0 < 45, "the map waited for its episodes' commands instead of killing them"
    assert sorted(started) == [0, 1, 2]                   # the queued items never started
    assert Sandbox.list(metadata={"run": tag}) == []      # nothing left running
    ended = Sandbox.list(metadata={"run": tag}, include_ended=True)
    assert len(ended) == 3 and all(s.end_reason == "killed" for s in ended), ended
