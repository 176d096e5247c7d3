"""``pilldrops.map`` / ``pilldrops.amap``: one fresh sandbox per item, fanned out, with a progress bar and
per-item errors.

    import pilldrops

    def rollout(sb, seed):
        sb.upload("./env", "/env")
        return float(sb.run(f"python /env/episode.py --seed {seed}", check=True).stdout)

    rewards = pilldrops.map(rollout, range(1000), template="code-interpreter", concurrency=64)
    print(rewards.ok, "ok,", rewards.failed, "failed;", sum(rewards.values()) / rewards.ok)

Each item gets its own sandbox, created for it and killed after it whatever happens (a claimed warm-pool
member when a pool of that shape exists). Creates queue on the server under admission control and wait
for capacity (``capacity_wait``) instead of failing. A failing item never stops the others. Ctrl-C (or any
exception in the caller's thread) kills the sandboxes still running at once and then raises; items not yet
started never start.

The blocking ``map`` uses threads and the async ``amap`` tasks: two concurrency models, so each is
written once here (not generated from the other).
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Awaitable, Callable, Iterable
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any, Generic, Self, TypeVar

import anyio

from pilldrops.errors import (
    AuthenticationError,
    InsufficientCredits,
    InvalidRequest,
    PermissionDenied,
    TemplateNotFound,
)
from pilldrops.schema.api import DEFAULT_TIMEOUT_S
from pilldrops.sdk._async.sandbox import AsyncSandbox
from pilldrops.sdk._base import Metadata, item_metadata
from pilldrops.sdk._sync.sandbox import Sandbox

T = TypeVar("T")
R = TypeVar("R")
# errors of the *create* that no item can get past (a wrong template, key, shape or no credits): the whole
# map stops with it at once instead of failing every item the same way
FATAL_CREATE_ERRORS = (TemplateNotFound, AuthenticationError, PermissionDenied, InvalidRequest, InsufficientCredits)


class _Stop(Exception):
    pass




@dataclass
class MapItem(Generic[R]):
    """One item of a :func:`map`: its value or error, and the episode's sandbox, cost and end.

    ``cost_usd`` and ``end_reason`` are the sandbox's final record (None if its create failed);
    ``duration`` is the seconds from the create's start to the sandbox's teardown, as this client saw them.
    """

    index: int
    value: R | None = None
    error: BaseException | None = None
    sandbox_id: str | None = None
    cost_usd: float | None = None
    duration: float = 0.0
    end_reason: str | None = None
    metadata: dict[str, str] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.error is None

    def _finish(self, sb: Any, t0: float) -> None:
        self.duration = time.monotonic() - t0
        if sb is not None:
            info = sb.info
            self.sandbox_id, self.cost_usd, self.metadata = info.id, info.cost_usd, dict(info.metadata)
            self.end_reason = info.end_reason.value if info.end_reason is not None else None


class MapResult(list, Generic[R]):  # type: ignore[type-arg]
    """Results in item order. A failed item's slot holds its exception (also in :attr:`errors`).

    :attr:`items` has, per item, the sandbox id, final cost, duration and end reason beside the value or
    error (:class:`MapItem`); :attr:`total_cost_usd` sums the costs.
    """

    def __init__(self, results: list[Any], errors: dict[int, BaseException], elapsed: float,
                 items: list[MapItem[R]] | None = None) -> None:
        super().__init__(results)
        self.errors = errors
        self.elapsed = elapsed
        self.items: list[MapItem[R]] = items if items is not None else [
            MapItem(i, value=None if i in errors else r, error=errors.get(i)) for i, r in enumerate(results)]

    @property
    def total_cost_usd(self) -> float:
        """The cost of every item's sandbox, in USD."""
        return sum(it.cost_usd or 0.0 for it in self.items)

    @property
    def ok(self) -> int:
        return len(self) - len(self.errors)

    @property
    def failed(self) -> int:
        return len(self.errors)

    def values(self) -> list[R]:
        """The results of the items that succeeded, in order."""
        return [r for i, r in enumerate(self) if i not in self.errors]

    def raise_for_errors(self) -> MapResult[R]:
        """Raise the first item's error (with every failed index in its notes) if any item failed."""
        if self.errors:
            i, first = next(iter(sorted(self.errors.items())))
            first.add_note(f"pilldrops.map: {self.failed} of {len(self)} items failed (indices "
                           f"{sorted(self.errors)[:20]}{'...' if self.failed > 20 else ''}); this is item {i}")
            raise first
        return self


class _Progress:
    """A rich progress bar on stderr (done / failed / rate), or nothing."""

    def __init__(self, total: int, enabled: bool | None, label: str) -> None:
        self.enabled = sys.stderr.isatty() if enabled is None else enabled
        self.failed = 0
        self._lock = threading.Lock()
        self._bar: Any = None
        if self.enabled:
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeElapsedColumn,
                TimeRemainingColumn,
            )
            self._bar = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                                 TextColumn("{task.fields[failed]} failed"), TextColumn("{task.fields[rate]}/s"),
                                 TimeElapsedColumn(), TimeRemainingColumn(), console=Console(stderr=True))
            self._task = self._bar.add_task(label, total=total, failed=0, rate="-")
            self._t0 = time.monotonic()

    def __enter__(self) -> Self:
        if self._bar is not None:
            self._bar.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._bar is not None:
            self._bar.stop()

    def summary(self, result: MapResult[Any]) -> None:
        """After the bar: what failed, grouped by error (first indices), so failures never pass unseen."""
        if not self.enabled or not result.errors:
            return
        groups: dict[str, list[int]] = {}
        for i, e in result.errors.items():
            groups.setdefault(f"{type(e).__name__}: {str(e)[:160]}", []).append(i)
        lines = [f"{len(result.errors)} of {len(result)} items failed:"]
        for msg, idx in sorted(groups.items(), key=lambda kv: -len(kv[1]))[:5]:
            lines.append(f"  {len(idx)}x {msg} (items {idx[:8]}{' ...' if len(idx) > 8 else ''})")
        print("\n".join(lines), file=sys.stderr)

    def advance(self, failed: bool) -> None:
        with self._lock:
            self.failed += failed
            if self._bar is not None:
                done = self._bar.tasks[0].completed + 1
                rate = done / max(time.monotonic() - self._t0, 1e-9)
                self._bar.update(self._task, advance=1, failed=self.failed, rate=f"{rate:.1f}")


def map(fn: Callable[[Sandbox, T], R], items: Iterable[T], *, template: str = "base",
        vcpu: float = 1, memory_mb: int = 512, timeout: int = DEFAULT_TIMEOUT_S, concurrency: int = 64,
        envs: dict[str, str] | None = None, metadata: Metadata[T] = None,
        capacity_wait: float = 600.0, progress: bool | None = None, api_key: str | None = None,
        api_url: str | None = None, transport: Any = None) -> MapResult[R]:
    """Call ``fn(sandbox, item)`` for every item, each in a fresh sandbox, ``concurrency`` at a time
    (threads). Returns a :class:`MapResult` in item order (``result.items[i]`` has the sandbox id, cost,
    duration and end reason of item ``i``); ``progress`` shows a bar on stderr (default: when stderr is a
    terminal) and a summary of failures after it. ``metadata`` is a dict for every sandbox or a function
    of the item returning one (``metadata=lambda seed: {"seed": str(seed)}`` makes each episode findable
    in history). ``capacity_wait`` is how long a create may wait for room in the fleet. A create error no
    item can get past (unknown template, bad shape or key, no credits) is raised at once instead."""
    work = list(items)
    results: list[Any] = [None] * len(work)
    errors: dict[int, BaseException] = {}
    meta = [item_metadata(metadata, x) for x in work]
    done: list[MapItem[R]] = [MapItem(i, metadata=meta[i]) for i in range(len(work))]
    opts = {"template": template, "vcpu": vcpu, "memory_mb": memory_mb, "timeout": timeout, "envs": envs,
                "capacity_wait": capacity_wait, "api_key": api_key, "api_url": api_url, "transport": transport}
    t0 = time.monotonic()
    fatal: list[BaseException] = []
    live: dict[int, Sandbox] = {}          # items whose sandbox runs now: what an interrupt kills
    lock, stopping = threading.Lock(), threading.Event()

    def one(i: int, bar: _Progress) -> None:
        if fatal or stopping.is_set():
            return
        started, sb = time.monotonic(), None
        try:
            sb = Sandbox.create(metadata=meta[i], **opts)  # type: ignore[arg-type]
        except FATAL_CREATE_ERRORS as exc:
            fatal.append(exc)
            return
        except Exception as exc:  # noqa: BLE001 - per-item errors are data
            results[i] = errors[i] = exc
        else:
            with lock:
                live[i] = sb
            try:
                with sb:
                    if stopping.is_set():         # interrupted while it was being created
                        raise InterruptedError("pilldrops.map was interrupted")
                    results[i] = fn(sb, work[i])
            except Exception as exc:  # noqa: BLE001 - per-item errors are data
                results[i] = errors[i] = exc
            finally:
                with lock:
                    live.pop(i, None)
        done[i]._finish(sb, started)
        done[i].value, done[i].error = (None, errors[i]) if i in errors else (results[i], None)
        bar.advance(i in errors)

    with _Progress(len(work), progress, f"{template} x{len(work)}") as bar:
        pool = ThreadPoolExecutor(max_workers=max(1, min(concurrency, len(work) or 1)))
        try:
            pending = {pool.submit(one, i, bar) for i in range(len(work))}
            while pending:      # woken often, so a Ctrl-C is seen at once, not when an item ends
                finished, pending = wait(pending, timeout=0.2, return_when=FIRST_COMPLETED)
                for f in finished:
                    f.result()
        except BaseException:
            stopping.set()
            _kill_live(live, lock, api_key=api_key, api_url=api_url, transport=transport)
            raise
        finally:
            pool.shutdown(wait=True, cancel_futures=True)     # queued items never start
    if fatal:
        raise fatal[0]
    result: MapResult[R] = MapResult(results, dict(sorted(errors.items())), time.monotonic() - t0, done)
    bar.summary(result)
    return result


def _kill_live(live: dict[int, Sandbox], lock: threading.Lock, **options: Any) -> None:
    """Kill every sandbox still running at once, in ONE batch-kill request (the server calls each node
    once), so their items' commands end now; errors ignored (each item's own ``with`` block kills it again
    on its way out, which also fetches its final record). A server without batch kills gets one kill per
    sandbox, in parallel."""
    with lock:
        victims = list(live.values())
    if not victims:
        return
    print(f"pilldrops.map: interrupted: killing {len(victims)} running sandbox(es)", file=sys.stderr)
    try:
        Sandbox.kill_many([sb.id for sb in victims], **options)
        return
    except Exception:  # noqa: BLE001 - best effort: one by one instead
        pass

    def kill(sb: Sandbox) -> None:
        try:
            sb.kill()
        except Exception:  # noqa: BLE001 - best effort: the item's own teardown retries
            pass

    with ThreadPoolExecutor(max_workers=min(16, len(victims))) as killers:
        list(killers.map(kill, victims))


async def amap(fn: Callable[[AsyncSandbox, T], Awaitable[R]], items: Iterable[T], *, template: str = "base",
               vcpu: float = 1, memory_mb: int = 512, timeout: int = DEFAULT_TIMEOUT_S, concurrency: int = 64,
               envs: dict[str, str] | None = None, metadata: Metadata[T] = None,
               capacity_wait: float = 600.0, progress: bool | None = None, api_key: str | None = None,
               api_url: str | None = None, transport: Any = None) -> MapResult[R]:
    """The asyncio twin of :func:`map`: ``await fn(sandbox, item)`` per item, ``concurrency`` tasks."""
    work = list(items)
    results: list[Any] = [None] * len(work)
    errors: dict[int, BaseException] = {}
    meta = [item_metadata(metadata, x) for x in work]
    done: list[MapItem[R]] = [MapItem(i, metadata=meta[i]) for i in range(len(work))]
    opts = {"template": template, "vcpu": vcpu, "memory_mb": memory_mb, "timeout": timeout, "envs": envs,
                "capacity_wait": capacity_wait, "api_key": api_key, "api_url": api_url, "transport": transport}
    limit = anyio.Semaphore(max(1, concurrency))
    t0 = time.monotonic()

    async def one(i: int, bar: _Progress) -> None:
        async with limit:
            started, sb = time.monotonic(), None
            try:
                sb = await AsyncSandbox.create(metadata=meta[i], **opts)  # type: ignore[arg-type]
            except FATAL_CREATE_ERRORS as exc:
                raise _Stop() from exc                 # cancels the other items
            except Exception as exc:  # noqa: BLE001 - per-item errors are data
                results[i] = errors[i] = exc
            else:
                try:
                    async with sb:
                        results[i] = await fn(sb, work[i])
                except Exception as exc:  # noqa: BLE001 - per-item errors are data
                    results[i] = errors[i] = exc
            done[i]._finish(sb, started)
            done[i].value, done[i].error = (None, errors[i]) if i in errors else (results[i], None)
            bar.advance(i in errors)

    with _Progress(len(work), progress, f"{template} x{len(work)}") as bar:
        try:
            async with anyio.create_task_group() as tg:
                for i in range(len(work)):
                    tg.start_soon(one, i, bar)
        except BaseExceptionGroup as eg:
            stop = eg.subgroup(_Stop)
            if stop is None:
                raise
            raise stop.exceptions[0].__cause__ from None  # type: ignore[misc]
    result: MapResult[R] = MapResult(results, dict(sorted(errors.items())), time.monotonic() - t0, done)
    bar.summary(result)
    return result


__all__ = ["MapItem", "MapResult", "amap", "map"]
