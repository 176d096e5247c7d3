"""CPU of the kill's two HTTP edges without the kill itself: the raw routes (``node/killroute.py``,
``server/api/killroute.py``) against the FastAPI routes they front, in the same process and minutes.

    .venv/bin/python bench/kill_route_cost.py [--n 2000] [--rounds 7]

No root, no crun: one control plane (SQLite) and one node agent in-process on the fake runtime
(``tests/stack.py``). What a kill does past its route is stubbed with a fixed answer: ``NodeAgent.kill`` on
the node, ``SandboxService.kill`` and ``info`` on the control plane (the API key check stays real: both
routes make it, from the in-memory key cache). Each request is one direct ASGI call of the whole app (its
middlewares included: what uvicorn calls), so no HTTP client or server is in the figure. ``raw`` is the app
as served; ``fastapi`` is the same app without the raw route in front (what main serves), so the
difference is the framework's share. Rounds alternate the two; prints the median µs of CPU
(``process_time``) per request, and what the stubbed calls alone cost.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import anyio

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from pilldrops.node.api import create_node_app
from pilldrops.node.killroute import KillRoute as NodeKillRoute
from pilldrops.schema.api import SandboxInfo
from pilldrops.schema.node import NodeSandboxStatus
from pilldrops.server.api.app import create_app
from pilldrops.server.api.killroute import KillRoute as CPKillRoute
from tests.stack import TOKEN, stack
from tests.unit.rawroutes import without


def _scope(path: str, auth: str) -> dict[str, Any]:
    return {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
            "method": "DELETE", "scheme": "http", "path": path, "raw_path": path.encode(), "root_path": "",
            "query_string": b"", "server": ("127.0.0.1", 8000), "client": ("127.0.0.1", 50000),
            "headers": [(b"host", b"127.0.0.1:8000"), (b"user-agent", b"python-httpx/0.28.1"),
                        (b"accept", b"*/*"), (b"accept-encoding", b"gzip, deflate"), (b"connection", b"keep-alive"),
                        (b"authorization", f"Bearer {auth}".encode()), (b"content-length", b"0")]}


async def _receive() -> dict[str, Any]:
    return {"type": "http.request", "body": b"", "more_body": False}


async def _calls(app: Any, path: str, auth: str, n: int, expect: int = 200) -> float:
    """µs of CPU per request over ``n`` direct ASGI calls of ``app``."""
    status: list[int] = []

    async def send(msg: dict[str, Any]) -> None:
        if msg["type"] == "http.response.start":
            status.append(msg["status"])

    t = time.process_time()
    for _ in range(n):
        await app(_scope(path, auth), _receive, send)
    dt = time.process_time() - t
    assert status == [expect] * n, status[:3]
    return dt / n * 1e6


async def _service(call: Any, n: int) -> float:
    t = time.process_time()
    for _ in range(n):
        await call()
    return (time.process_time() - t) / n * 1e6


async def main(n: int, rounds: int) -> None:
    now = datetime.now(UTC)
    final = NodeSandboxStatus(id="sb_bench", state="stopped", pid=4242, started_at=now, end_at=now + timedelta(300),
                              ended_at=now + timedelta(seconds=12), end_reason="killed", run_s=12.345, seq=12345)
    with tempfile.TemporaryDirectory() as tmp:
        async with stack(Path(tmp)) as st, st.client() as c:
            sb = (await c.post("/v1/sandboxes", json={"template": "tiny", "metadata": {"ep": "1"}})).json()
            sid = sb["id"]
            sbx = st.cp.services.sandboxes
            row = await sbx.get_row(st.team_id, sid)
            info = SandboxInfo.model_validate({**sb, "state": "stopped", "ended_at": now.isoformat(),
                                               "end_reason": "killed", "access_token": None, "envd_url": None})

            async def node_kill(_: str) -> NodeSandboxStatus:
                return final

            async def cp_kill(team_id: str, sandbox_id: str) -> Any:
                return row

            async def cp_info(r: Any, *, with_token: bool = False) -> SandboxInfo:
                return info

            st.agent.kill = node_kill  # type: ignore[method-assign]
            sbx.kill = cp_kill  # type: ignore[method-assign]
            sbx.info = cp_info  # type: ignore[method-assign]
            node_raw = create_node_app(st.agent, TOKEN)
            node_fastapi = without(create_node_app(st.agent, TOKEN), NodeKillRoute)
            cp_raw = create_app(st.cp.services)
            cp_fastapi = without(create_app(st.cp.services), CPKillRoute)
            node_path, cp_path = f"/node/v1/sandboxes/{sid}", f"/v1/sandboxes/{sid}"
            auth = st.cp.services.auth

            async def cp_service() -> None:
                p = await auth.authenticate(st.key)
                await cp_info(await cp_kill(p.team_id, sid))

            cases = {"node raw": (node_raw, node_path, TOKEN), "node fastapi": (node_fastapi, node_path, TOKEN),
                     "cp raw": (cp_raw, cp_path, st.key), "cp fastapi": (cp_fastapi, cp_path, st.key)}
            for app, path, key in cases.values():          # warm up (FastAPI builds its stack on the first call)
                await _calls(app, path, key, 200)
            out: dict[str, list[float]] = {k: [] for k in (*cases, "node service", "cp service (auth + stubs)")}
            for r in range(rounds):
                order = list(cases) if r % 2 == 0 else list(reversed(cases))
                for name in order:
                    app, path, key = cases[name]
                    out[name].append(await _calls(app, path, key, n))
                    await anyio.sleep(0.05)       # (untimed) the loop's own tasks run: heartbeats, ...
                out["node service"].append(await _service(lambda: node_kill(sid), n))
                out["cp service (auth + stubs)"].append(await _service(cp_service, n))
            med = {k: statistics.median(v) for k, v in out.items()}
            print(f"{n} requests x {rounds} rounds, µs of CPU per request (median of rounds; min-max):")
            for k, v in out.items():
                print(f"  {k:28s} {med[k]:8.1f}   ({min(v):.1f}-{max(v):.1f})")
            for hop, svc in (("node", "node service"), ("cp", "cp service (auth + stubs)")):
                raw, fast = med[f"{hop} raw"] - med[svc], med[f"{hop} fastapi"] - med[svc]
                print(f"  {hop}: framework share per kill {fast:.1f} -> {raw:.1f} µs ({raw / fast:.2f}x)")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=7)
    a = ap.parse_args()
    anyio.run(main, a.n, a.rounds)
