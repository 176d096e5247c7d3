"""The node's side of delta heartbeats against control planes of either age (``ControlPlaneClient``)."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from pilldrops.node.control_plane import ControlPlaneClient, Identity
from pilldrops.schema.node import NodeSandboxStatus

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


class Pools:
    def reserved(self) -> tuple[float, int]:
        return 0.0, 0

    def statuses(self, grants: bool = False) -> list[Any]:
        return []

    def configure(self, specs: Any) -> None:
        pass


def client(handler: Any, statuses: list[NodeSandboxStatus]) -> ControlPlaneClient:
    http = httpx.AsyncClient(transport=httpx.MockTransport(handler))
    cp = ControlPlaneClient("http://cp", http, Identity("n", "http://n", 4, 4096, "i"), Pools(),  # type: ignore[arg-type]
                            statuses=lambda: list(statuses), usage=lambda: (0.0, 0), templates=list)
    cp.node_id = "node_1"
    return cp


async def test_an_older_control_plane_gets_full_beats_without_the_new_fields() -> None:
    """A control plane from before delta heartbeats refuses their fields (422, extra="forbid"): the node
    sends the same beat without them at once, and full beats from then on."""
    bodies: list[dict[str, Any]] = []

    def old_cp(req: httpx.Request) -> httpx.Response:
        body = json.loads(req.content)
        bodies.append(body)
        if {"count", "digest", "delta_of", "gone"} & set(body):
            return httpx.Response(422, json={"detail": "extra fields not permitted"})
        return httpx.Response(200, json={"ok": True, "pools": []})

    sts = [NodeSandboxStatus(id="sb_a", state="running", run_s=1.0, seq=1000)]
    cp = client(old_cp, sts)
    await cp.heartbeat()
    await cp.heartbeat()
    assert [("digest" in b, [s["id"] for s in b["sandboxes"]]) for b in bodies] == [
        (True, ["sb_a"]), (False, ["sb_a"]), (False, ["sb_a"])]


async def test_a_new_control_plane_gets_deltas_and_a_full_beat_when_it_asks() -> None:
    bodies: list[dict[str, Any]] = []
    epoch = ["e1"]

    def new_cp(req: httpx.Request) -> httpx.Response:
        body = json.loads(req.content)
        bodies.append(body)
        refused = body.get("delta_of") not in (None, epoch[0])
        return httpx.Response(200, json={"ok": True, "pools": [], "epoch": epoch[0], "full": refused,
                                         "usage_every_s": 30.0})

    sts = [NodeSandboxStatus(id="sb_a", state="running", run_s=1.0, seq=1000)]
    cp = client(new_cp, sts)
    await cp.heartbeat()                              # full (no ack yet)
    sts[0] = sts[0].model_copy(update={"run_s": 6.0, "seq": 6000})
    await cp.heartbeat()                              # a delta: nothing changed, usage not due
    assert bodies[0].get("delta_of") is None and len(bodies[0]["sandboxes"]) == 1
    assert bodies[1]["delta_of"] == "e1" and bodies[1].get("sandboxes", []) == [] and bodies[1]["count"] == 1
    sts[0] = sts[0].model_copy(update={"run_s": 31.5, "seq": 31500})
    await cp.heartbeat()                              # usage due: carried
    assert [s["id"] for s in bodies[2]["sandboxes"]] == ["sb_a"]
    epoch[0] = "e2"                                   # the control plane restarted
    bodies.clear()
    await cp.heartbeat()
    assert [b.get("delta_of") for b in bodies] == ["e1", None] and len(bodies[1]["sandboxes"]) == 1
