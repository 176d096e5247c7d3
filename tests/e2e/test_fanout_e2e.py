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
