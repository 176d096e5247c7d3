"""Store probe (issue 15): CPU of one kill's store work the old way (get, commit_usage, get, CAS update) and
the new (get, ``end_sandboxes``: one transaction), per sandbox of one batch ``end_sandboxes``, and what the
allocations GROUP BY costs inside ``place_and_insert`` at N live (the most an in-memory placement index
could save per create). SQLite in a temp dir, in process; CPU time (``process_time``), so load matters less.

    .venv/bin/python bench/store_kill.py 250      # and 1000
"""
import asyncio
import sys
import tempfile
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

from pilldrops.schema.api import SandboxState as S
from pilldrops.server.domain.billing import Rates
from pilldrops.server.service.context import legal_from
from pilldrops.server.store.interface import EndSandbox, NewSandbox
from pilldrops.server.store.sql import Store, _allocations_sync


async def main(n: int) -> None:
    d = Path(tempfile.mkdtemp())
    st = await Store.open(f"sqlite:///{d/'p.sqlite'}")
    now = datetime.now(UTC)
    team = await st.create_team("t", now)
    await st.upsert_node(name="n", url="http://n", capacity_vcpu=1e6, capacity_memory_mb=10**9, templates=[], now=now)
    ids = []
    for i in range(n):
        new = NewSandbox(id=f"sb_{i:06d}", team_id=team.id, template="tiny", vcpu=1, memory_mb=64, timeout=300,
                         state="starting", access_token="x", created_at=now, end_at=now + timedelta(hours=1))
        _, row = await st.place_and_insert(new, lambda nodes, a: nodes[0])
        await st.set_sandbox(row.id, from_states=["starting"], state="running", started_at=now)
        ids.append(row.id)
    rates = Rates()
    half = n // 2
    t0 = time.process_time()
    for i, sid in enumerate(ids[:half]):    # the old kill's store calls
        row = await st.get_sandbox(sid)
        await st.commit_usage(sid, 5000, 5.0, now=now + timedelta(seconds=10), rates=rates, charge_credits=True)
        row = await st.get_sandbox(sid)
        await st.update_sandbox(sid, from_states=legal_from(S.stopped), not_paused=True, state="stopped",
                                end_reason="killed", ended_at=now + timedelta(seconds=5))
    old = (time.process_time() - t0) / half * 1000
    t0 = time.process_time()
    for sid in ids[half:]:
        row = await st.get_sandbox(sid)
        await st.end_sandboxes([EndSandbox(sid, "stopped", "killed", final=True, seq=5000, run_s=5.0)],
                               from_states=legal_from(S.stopped), now=now + timedelta(seconds=10), rates=rates,
                               charge_credits=True)
    new_ = (time.process_time() - t0) / (n - half) * 1000
    t0 = time.process_time()
    # batch: re-create n rows and end them in one call
    more = []
    for i in range(n):
        new = NewSandbox(id=f"sc_{i:06d}", team_id=team.id, template="tiny", vcpu=1, memory_mb=64, timeout=300,
                         state="running", access_token="x", created_at=now, end_at=now + timedelta(hours=1))
        _, row = await st.place_and_insert(new, lambda nodes, a: nodes[0])
        await st.set_sandbox(row.id, from_states=["running"], started_at=now)
        more.append(row.id)
    # allocations GROUP BY with n live (what an in-memory index would save per create)
    hot = st._hot
    with hot.connect() as c:
        t0 = time.process_time()
        for _ in range(50):
            _allocations_sync(c)
        alloc = (time.process_time() - t0) / 50 * 1000
    t0 = time.process_time()
    for i in range(50):
        new = NewSandbox(id=f"sd_{i:06d}", team_id=team.id, template="tiny", vcpu=1, memory_mb=64, timeout=300,
                         state="starting", access_token="x", created_at=now, end_at=now + timedelta(hours=1))
        await st.place_and_insert(new, lambda nodes, a: nodes[0])
    place = (time.process_time() - t0) / 50 * 1000
    t0 = time.process_time()
    await st.end_sandboxes([EndSandbox(s, "stopped", "killed", final=True, seq=5000, run_s=5.0) for s in more],
                           from_states=legal_from(S.stopped), now=now + timedelta(seconds=10), rates=rates,
                           charge_credits=True)
    batch = (time.process_time() - t0) / n * 1000
    print(f"n={n}: kill store CPU old (get, commit_usage, get, CAS) {old:.2f} ms; new (get, end_sandboxes) "
          f"{new_:.2f} ms; batch end_sandboxes of {n}: {batch:.3f} ms a sandbox; place_and_insert at {n} live "
          f"{place:.2f} ms of which the allocations GROUP BY {alloc:.2f} ms")
    await st.close()

asyncio.run(main(int(sys.argv[1])))
