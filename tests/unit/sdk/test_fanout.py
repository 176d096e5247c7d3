"""pilldrops.map / amap against the FakeControlPlane: per-item attribution (sandbox, cost, duration, end)
and metadata as a function of the item."""

from __future__ import annotations

from typing import Any

import pytest

import pilldrops
from pilldrops.sdk.testing import FakeControlPlane


def _episode(sb: Any, seed: int) -> float:
    if seed == 3:
        raise RuntimeError("episode 3 crashed")
    return float(sb.run(f"echo {seed}").stdout)


async def _aepisode(sb: Any, seed: int) -> float:
    if seed == 3:
        raise RuntimeError("episode 3 crashed")
    return float((await sb.run(f"echo {seed}")).stdout)


def _check(result: pilldrops.MapResult[float], fake: FakeControlPlane) -> None:
    assert result.ok == 4 and result.failed == 1
    assert [it.index for it in result.items] == [0, 1, 2, 3, 4]
    for it in result.items:
        assert it.sandbox_id and it.sandbox_id.startswith("sb_")
        assert it.end_reason == "killed" and it.duration > 0 and it.cost_usd is not None
        assert it.metadata == {"seed": str(it.index), "run": "r1"}
        # findable in history by the item's own metadata
        assert fake.sandboxes[it.sandbox_id].info.metadata == it.metadata
    assert [it.value for it in result.items] == [0.0, 1.0, 2.0, None, 4.0]
    assert isinstance(result.items[3].error, RuntimeError) and not result.items[3].ok
    assert result.total_cost_usd == pytest.approx(sum(it.cost_usd or 0 for it in result.items))
    assert len({it.sandbox_id for it in result.items}) == 5


def test_map_attributes_each_episode(fake: FakeControlPlane, opts: dict[str, Any]) -> None:
    result = pilldrops.map(_episode, range(5), concurrency=2, progress=False,
                           metadata=lambda seed: {"seed": seed, "run": "r1"},
                           api_key=opts["api_key"], api_url=opts["api_url"], transport=opts["transport"])
    _check(result, fake)


@pytest.mark.anyio
async def test_amap_attributes_each_episode(fake: FakeControlPlane, opts: dict[str, Any]) -> None:
    result = await pilldrops.amap(_aepisode, range(5), concurrency=2, progress=False,
                                  metadata=lambda seed: {"seed": seed, "run": "r1"},
                                  api_key=opts["api_key"], api_url=opts["api_url"], transport=opts["transport"])
    _check(result, fake)


def test_metadata_function_must_return_a_dict(fake: FakeControlPlane, opts: dict[str, Any]) -> None:
    with pytest.raises(TypeError, match="must be a dict"):
        pilldrops.map(_episode, [1], progress=False, metadata=lambda s: "nope",  # type: ignore[arg-type,return-value]
                      api_key=opts["api_key"], api_url=opts["api_url"], transport=opts["transport"])
