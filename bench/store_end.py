"""Store probe (issue 15, session 9): CPU of the billing transactions, one call at a time, SQLite in a temp
dir, in process (``process_time``, medians of ``rounds`` rounds of ``n`` calls; ms a call, or a row for
batches): ``end_sandboxes`` of one running row (a kill) and of one paused row, ``commit_usage`` of one
report, ``end_interval`` of a resume, and ``end_sandboxes`` of batches of 8 and 50 rows (ms a row).
Run it against another checkout with that checkout's ``src`` on ``PYTHONPATH`` to compare.

    PYTHONPATH=src .venv/bin/python bench/store_end.py 100 5
"""
import asyncio
import statistics
import sys
import tempfile
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

from pilldrops.server.domain.billing import Rates
from pilldrops.server.store.interface import EndSandbox, NewSandbox
from pilldrops.server.store.sql import Store

LEGAL = ["pending", "starting", "running", "pausing", "paused", "resuming", "stopping", "lost"]


async def main(n: int, rounds: int) -> None:
    st = await Store.open(f"sqlite:///{Path(tempfile.mkdtemp()) / 'p.sqlite'}")
    now = datetime.now(UTC)
    later = now + timedelta(seconds=10)
    rates = Rates()
    team = await st.create_team("t", now)
    await st.upsert_node(name="n", url="http://n", capacity_vcpu=1e6, capacity_memory_mb=10**9, templates=[],
                         now=now)
    made = 0

    async def make(count: int, state: str = "running") -> list[str]:
        nonlocal made
        ids = []
        for _ in range(count):
            made += 1
            new = NewSandbox(id=f"sb_{made:08d}", team_id=team.id, template="tiny", vcpu=1, memory_mb=64,
                             timeout=300, state="starting", access_token="x", created_at=now,
                             end_at=now + timedelta(hours=1))
            _, row = await st.place_and_insert(new, lambda nodes, a: nodes[0])
            await st.set_sandbox(row.id, from_states=["starting"], state=state, started_at=now)
            ids.append(row.id)
        return ids

    def ending(sid: str, seq: int | None = 5000, run_s: float | None = 5.0) -> EndSandbox:
        return EndSandbox(sid, "stopped", "killed", final=True, seq=seq, run_s=run_s)

    async def timed(name: str, calls: list, per: int = 1) -> None:
        t0 = time.process_time()
        for call in calls:
            await call()
        res.setdefault(name, []).append((time.process_time() - t0) / len(calls) / per * 1000)

    res: dict[str, list[float]] = {}
    await make(300)                        # live rows around, as on a busy control plane
    for _ in range(rounds):
        ids = await make(n)
        await timed("end 1 running", [lambda s=s: st.end_sandboxes([ending(s)], from_states=LEGAL, now=later,
                                                                     rates=rates, charge_credits=True)
                                      for s in ids])
        ids = await make(n)
        await timed("commit_usage 1", [lambda s=s: st.commit_usage(s, 3000, 3.0, now=later, rates=rates,
                                                                    charge_credits=True) for s in ids])
        ids = await make(n, state="pausing")
        for sid in ids:
            await st.record_pause(sid, paused_at=now + timedelta(seconds=2), checkpoint_bytes=10**8,
                                  timeout_left=9)
        half = n // 2
        await timed("end 1 paused", [lambda s=s: st.end_sandboxes([ending(s, None, None)], from_states=LEGAL,
                                                                    now=later, rates=rates,
                                                                    charge_credits=True)
                                     for s in ids[:half]])
        await timed("end_interval (resume)", [
            lambda s=s: st.end_interval(s, from_states=["paused"], until=later, rates=rates,
                                        charge_credits=True, resumed=True, state="running", timeout_left=None)
            for s in ids[half:]])
        for k in (8, 50):
            batches = [await make(k) for _ in range(max(1, n // k // 2))]
            await timed(f"end batch of {k} (a row)", [
                lambda b=b: st.end_sandboxes([ending(s) for s in b], from_states=LEGAL, now=later,
                                             rates=rates, charge_credits=True) for b in batches], per=k)
    print("; ".join(f"{k} {statistics.median(v):.3f} ms" for k, v in res.items()))
    await st.close()

asyncio.run(main(int(sys.argv[1]), int(sys.argv[2])))
