"""A writable layer a checkpoint could not move into its image (crun keeps it in the sandbox dir, see
``CrunRuntime._keep_layer``), on a FakeRuntime that keeps it the same way: the paused sandbox's storage
counts it, its end and a move's ``forget`` remove it, and the checkpoint cannot be exported without it."""

from __future__ import annotations

import json
import os
import shutil
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from pilldrops import errors
from pilldrops.node.agent import NodeAgent, Settings
from pilldrops.node.runtime.base import Handle, RuntimeFailure
from pilldrops.node.runtime.fake import FakeRuntime
from pilldrops.schema.node import NodeSandboxSpec
from tests.stack import FakeTemplates

pytestmark = pytest.mark.anyio

LAYER_BYTES = 1 << 20


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


class _KeepsLayer(FakeRuntime):
    """The dump goes through (its processes are gone), the layer cannot land in the image: it stays in
    ``root/<id>`` and the checkpoint fails, as crun's does."""

    async def checkpoint(self, handle: Handle, image_dir: Path) -> int:
        (image_dir / "spec.json").write_text(json.dumps({"id": handle.id}))
        (self.root / handle.id / "KEPT").write_text(str(image_dir))
        self._forget(handle.id)
        raise RuntimeFailure(f"checkpoint of {handle.id} failed; its writable layer is kept")

    def kept_layer(self, sandbox_id: str) -> Path | None:
        d = self.root / sandbox_id
        return d if (d / "KEPT").is_file() else None

    async def destroy(self, handle: Handle) -> None:
        await super().destroy(handle)
        if self.kept_layer(handle.id) is not None:
            shutil.rmtree(self.root / handle.id)


def spec(sid: str) -> NodeSandboxSpec:
    return NodeSandboxSpec(id=sid, template="tiny", vcpu=1, memory_mb=128, access_token="t",
                           end_at=datetime.now(UTC) + timedelta(hours=1))


async def paused_with_kept_layer(tmp_path: Path, sid: str) -> tuple[NodeAgent, _KeepsLayer, Path]:
    runtime = _KeepsLayer(tmp_path / "fake")
    agent = NodeAgent(Settings(name="n", public_url="http://n", capacity_vcpu=8, capacity_memory_mb=8192,
                               node_token="tok"), runtime, FakeTemplates("tiny"), tmp_path / "state")
    await agent.create(spec(sid))
    (runtime.root / sid / "data").write_bytes(os.urandom(LAYER_BYTES))
    status = await agent.pause(sid)
    assert status.state.value == "paused"
    kept = runtime.root / sid
    assert runtime.kept_layer(sid) == kept
    return agent, runtime, kept


async def test_a_kept_layer_is_billed_and_cannot_be_exported(tmp_path: Path) -> None:
    agent, runtime, _ = await paused_with_kept_layer(tmp_path, "sb_k")
    image = agent.sandboxes.get("sb_k").image
    assert image.size >= LAYER_BYTES                  # the kept disk is stored (and billed) too
    with pytest.raises(errors.NotSupported) as e:
        await agent.export_checkpoint("sb_k")
    assert e.value.details["layer_kept"] is True
    await runtime.close()


async def test_a_paused_sandboxs_end_removes_its_kept_layer(tmp_path: Path) -> None:
    agent, runtime, kept = await paused_with_kept_layer(tmp_path, "sb_e")
    image = agent.sandboxes.get("sb_e").image.path
    await agent.kill("sb_e")
    assert not image.exists() and not kept.exists()
    await runtime.close()


async def test_forgetting_a_checkpoint_removes_its_kept_layer(tmp_path: Path) -> None:
    agent, runtime, kept = await paused_with_kept_layer(tmp_path, "sb_f")
    image = agent.sandboxes.get("sb_f").image.path
    await agent.forget("sb_f")
    assert not image.exists() and not kept.exists()
    await runtime.close()
