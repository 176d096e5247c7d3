"""The 50-sandbox version of bench/live.py (issue 5): 50 sandboxes live at once, each used, all torn down,
nothing left behind (the autouse leak check of conftest). No timing assertions: timings live in bench/."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from pilldrops import Sandbox
from tests.e2e.conftest import Server

pytestmark = pytest.mark.integration

N = 50


def test_50_concurrent_sandboxes_created_used_torn_down(sdk_env: Server, tmp_path: Path) -> None:
    env = tmp_path / "env"
    (env / "lib").mkdir(parents=True)
    (env / "episode.sh").write_text('#!/bin/sh\n. /env/lib/weights.sh\necho $(( $1 * WEIGHT + BIAS ))\n')
    (env / "episode.sh").chmod(0o755)
    (env / "lib" / "weights.sh").write_text("WEIGHT=3\nBIAS=1\n")
    meta = {"test": "scale"}
    sandboxes: list[Sandbox] = []
    try:
        with ThreadPoolExecutor(max_workers=8) as pool:
            sandboxes = list(pool.map(
                lambda _: Sandbox.create(template="tiny", vcpu=0.5, memory_mb=64, timeout=300, metadata=meta),
                range(N)))
        # all of them live at the same time, each with its own id, process tree and hostname
        running = Sandbox.list(state="running", metadata=meta)
        assert sorted(s.id for s in running) == sorted(sb.id for sb in sandboxes)
        assert len({sb.id for sb in sandboxes}) == N

        def use(pair: tuple[int, Sandbox]) -> tuple[str, float]:
            i, sb = pair
            sb.upload(env, "/env")
            r = sb.run(f"/env/episode.sh {i} && hostname", check=True)
            reward, host = r.stdout.split()
            return host, float(reward)

        with ThreadPoolExecutor(max_workers=16) as pool:
            used = list(pool.map(use, enumerate(sandboxes)))
        assert [r for _, r in used] == [i * 3 + 1 for i in range(N)]
        assert len({h for h, _ in used}) == N            # 50 distinct UTS namespaces
    finally:
        with ThreadPoolExecutor(max_workers=8) as pool:
            list(pool.map(lambda sb: sb.kill(), sandboxes))
    assert Sandbox.list(state="running", metadata=meta) == []
