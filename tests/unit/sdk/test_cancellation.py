"""Leaving ``async with AsyncSandbox`` kills the sandbox even when the task is cancelled (again) meanwhile.

Not under ``_async/``: cancellation has no blocking twin, so these tests are not unasync-generated.
"""

from __future__ import annotations

import asyncio
from typing import Any

import anyio
import httpx
import pytest

from pilldrops import AsyncSandbox, SandboxState
from pilldrops.sdk.testing import FakeControlPlane

SB = r"/v1/sandboxes/[^/]+"


class SlowDeletes(httpx.AsyncBaseTransport):
    """Delegates to the fake, but a DELETE takes ``delay`` seconds of event-loop time first."""

    def __init__(self, fake: FakeControlPlane, delay: float = 0.05) -> None:
        self.fake = fake
        self.delay = delay
        self.started = 0

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if request.method == "DELETE":
            self.started += 1
            await anyio.sleep(self.delay)
        return await self.fake.transport.handle_async_request(request)


def _opts(fake: FakeControlPlane, transport: Any) -> dict[str, Any]:
    return {**fake.client_options(), "transport": transport}


async def _wait_for(cond: Any) -> None:
    with anyio.fail_after(5):
        while not cond():
            await anyio.sleep(0.001)


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
@pytest.mark.anyio
async def test_double_native_cancel_still_kills() -> None:
    fake = FakeControlPlane()
    slow = SlowDeletes(fake)
    entered = asyncio.Event()

    async def rollout() -> None:
        async with await AsyncSandbox.create(**_opts(fake, slow)):
            entered.set()
            await asyncio.sleep(3600)

    task = asyncio.create_task(rollout())
    await entered.wait()
    task.cancel()  # first cancel: leaves the block, __aexit__ starts the DELETE
    await _wait_for(lambda: slow.started == 1)
    task.cancel()  # second cancel (asyncio.run's shutdown) while the DELETE is in flight
    with pytest.raises(asyncio.CancelledError):
        await task
    (sid,) = fake.sandboxes
    assert fake.requests_to("DELETE", SB), "the kill never reached the control plane"
    assert fake.sandboxes[sid].info.state == SandboxState.stopped


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
@pytest.mark.anyio
async def test_many_cancels_and_cancelled_kill_task_still_kill() -> None:
    """Like asyncio.run's shutdown: every task, the kill's own included, gets cancelled repeatedly."""
    fake = FakeControlPlane()
    slow = SlowDeletes(fake)
    entered = asyncio.Event()
    bystanders = asyncio.all_tasks()  # the test runner's own tasks: not ours to cancel

    async def rollout() -> None:
        async with await AsyncSandbox.create(**_opts(fake, slow)):
            entered.set()
            await asyncio.sleep(3600)

    task = asyncio.create_task(rollout())
    await entered.wait()
    task.cancel()
    for _ in range(3):
        await _wait_for(lambda: slow.started >= 1)
        for t in asyncio.all_tasks():
            if t not in bystanders:
                t.cancel()
        await asyncio.sleep(0.01)
    with pytest.raises(asyncio.CancelledError):
        await task
    (sid,) = fake.sandboxes
    assert fake.sandboxes[sid].info.state == SandboxState.stopped


@pytest.mark.anyio
async def test_gather_of_rollouts_cancelled_kills_all(anyio_backend: str) -> None:
    """Cancelling a group of rollouts (a task group / gather) kills every sandbox, on asyncio and trio."""
    fake = FakeControlPlane()
    slow = SlowDeletes(fake, delay=0.01)
    n = 8
    entered = 0

    async def rollout() -> None:
        nonlocal entered
        async with await AsyncSandbox.create(**_opts(fake, slow)):
            entered += 1
            await anyio.sleep(3600)

    async with anyio.create_task_group() as tg:
        for _ in range(n):
            tg.start_soon(rollout)
        await _wait_for(lambda: entered == n)
        tg.cancel_scope.cancel()
    assert len(fake.sandboxes) == n
    assert all(sb.info.state == SandboxState.stopped for sb in fake.sandboxes.values())


@pytest.mark.anyio
async def test_kill_on_exit_when_a_cancel_scope_is_cancelled_twice(anyio_backend: str) -> None:
    fake = FakeControlPlane()
    slow = SlowDeletes(fake)
    with anyio.CancelScope() as outer:
        with anyio.CancelScope() as inner:
            async with await AsyncSandbox.create(**_opts(fake, slow)):
                inner.cancel()
                outer.cancel()
                await anyio.sleep(3600)
    (sid,) = fake.sandboxes
    assert fake.sandboxes[sid].info.state == SandboxState.stopped


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return request.param
