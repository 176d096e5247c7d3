"""The SQL store: every query the control plane makes, each in its own short transaction.

Never hold a transaction across a call to a node: callers read, call, then write. SQLite (the embedded
default) is used through one connection per process in WAL mode with a long busy timeout; transactions
that read before they write take the write lock first (``_write_lock``), since SQLite has no FOR UPDATE.
PostgreSQL uses a normal pool and row locks.
"""

from __future__ import annotations

import base64
import functools
import inspect
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import anyio
import orjson
from alembic import command
from alembic.config import Config
from sqlalchemy import (
    Connection,
    Engine,
    and_,
    bindparam,
    case,
    create_engine,
    event,
    func,
    insert,
    literal,
    or_,
    select,
    text,
    update,
)
from sqlalchemy.exc import IntegrityError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeout
from sqlalchemy.ext.asyncio import AsyncEngine, async_sessionmaker, create_async_engine

from pilldrops._internal.ids import new_id
from pilldrops.server.domain.billing import Rates, billable, end_time, running_usage, storage_usage
from pilldrops.server.domain.states import HOLDING, LIVE
from pilldrops.server.store.interface import Choose, DuplicateIdempotencyKey, Ended, EndSandbox, NewSandbox
from pilldrops.server.store.models import (
    ApiKey,
    Node,
    Pool,
    Sandbox,
    SandboxLabel,
    SandboxPause,
    ServerSecret,
    Team,
    TemplateVersion,
    UsageEntry,
)

MIGRATIONS = Path(__file__).parent / "migrations"
__all__ = ["DuplicateIdempotencyKey", "Page", "Store", "normalize_url", "sqlite_url"]


def _dumps(value: Any) -> str:
    return orjson.dumps(value).decode()


# JSON columns (labels, envs, a node's templates and pool status on every heartbeat) through orjson
_JSON: dict[str, Any] = {"json_serializer": _dumps, "json_deserializer": orjson.loads}


def sqlite_url(path: Path) -> str:
    return f"sqlite+aiosqlite:///{path}"


def normalize_url(url: str) -> str:
    """Accept plain ``postgresql://`` and ``sqlite:///`` URLs and pick the async drivers."""
    if url.startswith(("postgresql://", "postgres://")):
        return "postgresql+asyncpg://" + url.split("://", 1)[1]
    if url.startswith("sqlite:///"):
        return "sqlite+aiosqlite:///" + url[len("sqlite:///"):]
    return url


def _migrate(sync_conn: Any) -> None:
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS))
    cfg.attributes["connection"] = sync_conn
    command.upgrade(cfg, "head")


@dataclass(frozen=True)
class Page:
    items: list[Sandbox]
    next_cursor: str | None


def _encode_cursor(row: Sandbox) -> str:
    return base64.urlsafe_b64encode(f"{row.created_at.isoformat()}|{row.id}".encode()).decode()


def _decode_cursor(cursor: str) -> tuple[datetime, str]:
    try:
        at, sid = base64.urlsafe_b64decode(cursor.encode()).decode().split("|", 1)
        when = datetime.fromisoformat(at)
    except Exception as exc:  # any garbage is a bad cursor
        raise ValueError("invalid cursor") from exc
    if when.tzinfo is None or "\x00" in sid:      # PostgreSQL's text refuses a NUL: no id holds one
        raise ValueError("invalid cursor")
    return when, sid


async def _write_lock(s: Any) -> None:
    """SQLite ignores FOR UPDATE and starts its transaction at the first write: take the database's write
    lock first, so everything read afterwards in this transaction is serialised with every other writer
    (other processes included, e.g. `pilldrops credits add` beside a running `up`)."""
    if s.bind.dialect.name == "sqlite":
        await s.execute(update(Node).where(text("0 = 1")).values(draining=Node.draining))


async def _allocations(s: Any) -> dict[str, tuple[float, int]]:
    return await s.run_sync(lambda ss: _allocations_sync(ss.connection()))


# The hot path (get, compare-and-set, insert of a sandbox) in SQLAlchemy Core on a plain connection: no
# session, unit of work or identity map; one UPDATE ... RETURNING instead of an update and a read back. The
# records handed out are the same ``Sandbox`` class, detached (as the session's were, expire_on_commit off).
@functools.cache
def _cols(model: Any) -> list[Any]:
    return [a.columns[0] for a in model.__mapper__.column_attrs]


@functools.cache
def _keys(model: Any) -> tuple[str, ...]:
    return tuple(a.key for a in model.__mapper__.column_attrs)


def _record(model: Any, row: Any) -> Any:
    """A detached ``model`` instance from a Core row of ``_cols(model)``: made as the ORM's own loading makes
    one (a new instance, its values put in its ``__dict__``), not through the constructor's attribute
    events, which cost ~80 us a row against ~4 us (a node's heartbeat reads every live sandbox row: at
    1,500 live that was a fifth of the control plane's CPU during creates; bench/RESULTS.md, issue 15)."""
    return _detached(model, zip(_keys(model), row, strict=True))


def _detached(model: Any, values: Any) -> Any:
    """A detached ``model`` instance of ``values`` (``{attribute: value}``, or its pairs), as ``_record``."""
    obj = model.__mapper__.class_manager.new_instance()
    obj.__dict__.update(values)
    return obj


@functools.cache
def _by_statement(model: Any, columns: tuple[str, ...]) -> Any:
    """``SELECT <every column> FROM model WHERE col = :col AND ...``, built once per (model, columns)."""
    table = model.__table__
    return select(*_cols(model)).where(*(table.c[c] == bindparam(c) for c in columns))


_SB = Sandbox.__table__
_SB_COLS = _cols(Sandbox)
# the hottest statements built once, their values bound at execution: building a select or insert of the
# sandbox's ~40 columns and its cache key cost ~250 us a statement, a prebuilt one's memoised key ~1 us
_GET_SB = select(*_SB_COLS).where(_SB.c.id == bindparam("sandbox_id"))
_INSERT_SB = insert(_SB).returning(*_SB_COLS)
_COLUMN_KEY = {a.key: a.columns[0].key for a in Sandbox.__mapper__.column_attrs}   # metadata_ -> metadata
_LIVE_ON = select(*_SB_COLS).where(_SB.c.node_id == bindparam("node_id"), _SB.c.state.in_([st.value for st in LIVE]))
_SB_IN = select(*_SB_COLS).where(_SB.c.id.in_(bindparam("ids", expanding=True)))


def _sandbox(row: Any) -> Sandbox:
    return _record(Sandbox, row)


_WRITE_LOCK = update(Node.__table__).where(text("0 = 1")).values(draining=Node.draining)
_ALLOCATIONS = (select(Sandbox.node_id, func.sum(Sandbox.vcpu), func.sum(Sandbox.memory_mb))
                .where(Sandbox.state.in_([st.value for st in HOLDING]), Sandbox.node_id.is_not(None))
                .group_by(Sandbox.node_id))
_NODES_LOCKED = select(*_cols(Node)).order_by(Node.id).with_for_update()


def _write_lock_sync(c: Connection) -> None:
    """``_write_lock`` on a plain connection, unless its transaction holds the lock already: sqlite3 reports
    a transaction open only after ``BEGIN IMMEDIATE`` (the event loop's connection, ``_try_on_loop``) or a
    first write (the worker's connection begins its transactions there), and either took the lock."""
    if c.dialect.name == "sqlite" and not c.connection.dbapi_connection.in_transaction:
        c.execute(_WRITE_LOCK)


def _allocations_sync(c: Connection) -> dict[str, tuple[float, int]]:
    return {nid: (float(cpu or 0), int(mem or 0)) for nid, cpu, mem in c.execute(_ALLOCATIONS).all()}


@functools.cache
def _cas_statement(keys: tuple[str, ...]) -> Any:
    """``UPDATE sandboxes SET <keys> WHERE id = :sandbox_id AND state IN :from_states``, built once per set
    of columns (``set_sandbox``), its values bound as ``v_<column>``."""
    return (update(_SB).where(_SB.c.id == bindparam("sandbox_id"),
                              _SB.c.state.in_(bindparam("from_states", expanding=True)))
            .values({_COLUMN_KEY[k]: bindparam("v_" + _COLUMN_KEY[k]) for k in keys}))


def _columns(values: dict[str, Any]) -> dict[Any, Any]:
    """``{attribute name: value}`` (e.g. ``metadata_``) -> ``{column: value}`` for a Core statement."""
    return {getattr(Sandbox, k): v for k, v in values.items()}


# ---- billing on locked rows (Core) ---------------------------------------------------------------------
# One transaction's billing (a usage commit, an end, a closed paused interval) reads the locked rows as
# plain dicts of their attributes (``_locked_sandboxes``), moves them with the rules below, and writes
# everything together (``_Billing.write``): no session, unit of work or identity map, and every statement
# prebuilt (the ORM's were ~3.5 ms of CPU a kill, a third of the control plane's; issue 15, session 9).
_TEAMS = Team.__table__
_PAUSES = SandboxPause.__table__
_LOCKED_SB = (select(*_SB_COLS).where(_SB.c.id.in_(bindparam("ids", expanding=True))).order_by(_SB.c.id)
              .with_for_update())
_LOCKED_ONE = select(*_SB_COLS).where(_SB.c.id == bindparam("sandbox_id")).with_for_update()   # ~50 us less
_INSERT_USAGE = insert(UsageEntry.__table__)
# one statement: SET's expressions all see the row as it was, so the CASE asks whether this charge takes the
# balance to zero or below (``balance <= cost``: for floats, a - b <= 0 exactly when a <= b)
_CHARGE = (update(_TEAMS).where(_TEAMS.c.id == bindparam("b_team"))
           .values(credits_usd=_TEAMS.c.credits_usd - bindparam("b_cost"),
                   credits_exhausted_at=case((and_(_TEAMS.c.credits_exhausted_at.is_(None),
                                                   _TEAMS.c.credits_usd <= bindparam("b_cost")),
                                              bindparam("b_at", type_=_TEAMS.c.credits_exhausted_at.type)),
                                             else_=_TEAMS.c.credits_exhausted_at)))
_PAUSE_ENDED = (update(_PAUSES)
                .where(_PAUSES.c.sandbox_id == bindparam("b_sandbox"), _PAUSES.c.idx == bindparam("b_idx"))
                .values(storage_gb_s=bindparam("b_storage")))
_PAUSE_RESUMED = _PAUSE_ENDED.values(resumed_at=bindparam("b_at"))
# the columns each rule may change (written back from the row's dict)
_RUNNING_KEYS = ("billed_run_s", "billed_seq", "cost_usd", "gb_s", "vcpu_s")
_PAUSE_KEYS = ("checkpoint_bytes", "cost_usd", "paused_at", "paused_s", "storage_gb_s")
_END_KEYS = tuple(sorted({*_RUNNING_KEYS, *_PAUSE_KEYS, "state", "end_reason", "ended_at"}))
# a billing transaction (an end, a usage commit) of at most this many rows runs on the event loop's
# connection (``quick``): each row more holds the loop ~0.15 ms (8 rows ~1.8 ms, about what a create's
# placement holds it; more go to the worker thread; bench/store_end.py)
_QUICK_ROWS = 8


@functools.cache
def _set_statement(keys: tuple[str, ...]) -> Any:
    """``UPDATE sandboxes SET <keys> WHERE id = :sandbox_id`` (a row this transaction locked), built once per
    set of columns, its values bound as ``v_<column>``."""
    return (update(_SB).where(_SB.c.id == bindparam("sandbox_id"))
            .values({_COLUMN_KEY[k]: bindparam("v_" + _COLUMN_KEY[k]) for k in keys}))


def _charge_sync(c: Connection, team_id: str, cost: float, at: datetime) -> None:
    """Take ``cost`` off the team's credits, in SQL (never a read-modify-write of the balance); crossing zero
    starts the grace clock. The one credit-charging update (running usage and storage both come here)."""
    if cost <= 0:
        return
    c.execute(_CHARGE, {"b_team": team_id, "b_cost": cost, "b_at": at})


def _locked_sandboxes(c: Connection, ids: Iterable[str]) -> dict[str, dict[str, Any]]:
    """The rows of ``ids`` as ``{attribute: value}`` dicts, locked: ``FOR UPDATE`` in id order (two
    transactions never lock them in opposite orders); on SQLite the caller holds the write lock."""
    keys, wanted = _keys(Sandbox), sorted(set(ids))
    found = (c.execute(_LOCKED_ONE, {"sandbox_id": wanted[0]}) if len(wanted) == 1
             else c.execute(_LOCKED_SB, {"ids": wanted}))
    return {sb["id"]: sb for sb in (dict(zip(keys, r, strict=True)) for r in found)}


class _Billing:
    """The billing of one transaction on rows of ``_locked_sandboxes``: each rule moves a row's dict and
    gathers its writes (ledger rows, closed paused intervals, each team's cost); ``write`` then executes
    them together, the changed rows' columns included, and charges each team once."""

    def __init__(self, now: datetime, rates: Rates) -> None:
        self.now, self.rates = now, rates
        self.ledger: list[dict[str, Any]] = []
        self.pauses: dict[Any, list[dict[str, Any]]] = {}       # statement -> its rows
        self.charges: dict[str, float] = {}
        self.changed: dict[str, dict[str, Any]] = {}

    def touch(self, sb: dict[str, Any]) -> None:
        """Write ``sb``'s columns back (``write``): the caller changed it too."""
        self.changed[sb["id"]] = sb

    def running(self, sb: dict[str, Any], seq: int, run_s: float) -> UsageEntry | None:
        """Bill a node's cumulative running seconds ``run_s`` (report ``seq``) of a locked row, exactly once:
        its ledger row (returned) and its moved totals; None when nothing new was billed (an old or resent
        report, or nothing past what is billed)."""
        if sb["started_at"] is None or seq <= sb["billed_seq"]:
            return None
        self.touch(sb)
        wall = ((sb["ended_at"] or self.now) - sb["started_at"]).total_seconds() - (sb["paused_s"] or 0.0)
        total, delta = billable(run_s, sb["billed_run_s"], wall)
        sb["billed_seq"] = seq
        if delta <= 0:             # nothing new to bill: remember the report, write no ledger row
            return None
        use = running_usage(sb["vcpu"], sb["memory_mb"], delta)
        cost = use.cost(self.rates)
        entry = {"sandbox_id": sb["id"], "seq": seq, "team_id": sb["team_id"], "state": "running",
                 "vcpu": sb["vcpu"], "memory_mb": sb["memory_mb"], "storage_gb": 0.0,
                 "from_s": sb["billed_run_s"], "to_s": total, "vcpu_s": use.vcpu_s, "gb_s": use.gb_s,
                 "storage_gb_s": use.storage_gb_s, "cost_usd": cost, "committed_at": self.now}
        self.ledger.append(entry)
        sb["vcpu_s"] += use.vcpu_s
        sb["gb_s"] += use.gb_s
        sb["cost_usd"] += cost
        sb["billed_run_s"] = total
        self.charges[sb["team_id"]] = self.charges.get(sb["team_id"], 0.0) + cost
        return _detached(UsageEntry, entry)

    def close_pause(self, sb: dict[str, Any], until: datetime, resumed: bool) -> bool:
        """End a locked row's open paused interval at ``until``: its storage billed exactly once (the ledger
        row ``(sandbox, -idx)``, the interval's own row and the cleared ``paused_at``); ``resumed`` stamps
        the interval's end as a resume. False when it had no open interval."""
        if sb["paused_at"] is None:
            return False
        self.touch(sb)
        secs = max(0.0, (until - sb["paused_at"]).total_seconds())
        size = sb["checkpoint_bytes"] or 0
        use = storage_usage(size, secs)
        cost = use.cost(self.rates)
        idx = sb["pause_count"] or 0
        self.pauses.setdefault(_PAUSE_RESUMED if resumed else _PAUSE_ENDED, []).append(
            {"b_sandbox": sb["id"], "b_idx": idx, "b_storage": use.storage_gb_s, "b_at": until})
        self.ledger.append({"sandbox_id": sb["id"], "seq": -idx, "team_id": sb["team_id"], "state": "paused",
                            "vcpu": sb["vcpu"], "memory_mb": sb["memory_mb"], "storage_gb": size / 1024**3,
                            "from_s": 0.0, "to_s": secs, "vcpu_s": 0.0, "gb_s": 0.0,
                            "storage_gb_s": use.storage_gb_s, "cost_usd": cost, "committed_at": until})
        sb["storage_gb_s"] += use.storage_gb_s
        sb["cost_usd"] += cost
        sb["paused_s"] = (sb["paused_s"] or 0.0) + secs
        sb["paused_at"] = None
        sb["checkpoint_bytes"] = None
        self.charges[sb["team_id"]] = self.charges.get(sb["team_id"], 0.0) + cost
        return True

    def write(self, c: Connection, keys: tuple[str, ...], charge_credits: bool) -> None:
        """Execute the gathered writes: the ledger rows, the closed intervals, the ``keys`` columns of every
        changed row, and (``charge_credits``) one charge per team, in team order, stamped ``now``."""
        if self.ledger:
            c.execute(_INSERT_USAGE, self.ledger)
        for q, rows in self.pauses.items():
            c.execute(q, rows)
        if self.changed:
            cols = [(k, "v_" + _COLUMN_KEY[k]) for k in keys]
            c.execute(_set_statement(keys), [{"sandbox_id": sid, **{p: sb[k] for k, p in cols}}
                                             for sid, sb in self.changed.items()])
        if charge_credits:
            for team_id, cost in sorted(self.charges.items()):
                _charge_sync(c, team_id, cost, self.now)


def _shielded(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    async def call(*args: Any, **kwargs: Any) -> Any:
        with anyio.CancelScope(shield=True):
            return await fn(*args, **kwargs)
    return call


def _never_abandoned(cls: type) -> type:
    """Every store call runs to its end even when its caller is cancelled (the cancellation lands right
    after it): a query cancelled halfway leaves its pooled connection to be torn down by a task of its own,
    which can outlive the event loop (and hang its shutdown). Store calls take milliseconds."""
    for name, fn in list(vars(cls).items()):
        if not name.startswith("_") and inspect.iscoroutinefunction(fn):
            setattr(cls, name, _shielded(fn))
    return cls


def _sqlite_pragmas(conn: Any, _rec: Any) -> None:
    """Every connection: WAL, ``synchronous=NORMAL`` (a commit is written to the WAL file, without an fsync,
    before it returns: it survives a SIGKILL of this process, not a power loss or kernel crash, which may
    lose the last commits but never corrupts the database; docs/architecture.md "Durability")."""
    cur = conn.cursor()
    cur.execute("PRAGMA journal_mode=WAL")
    cur.execute("PRAGMA synchronous=NORMAL")
    cur.execute("PRAGMA foreign_keys=ON")
    cur.close()


_SQLITE_BUSY = (5, 6)        # SQLITE_BUSY, SQLITE_LOCKED (the primary codes; extended ones are code & 0xff)


def _busy(exc: BaseException) -> bool:
    code = getattr(getattr(exc, "orig", None), "sqlite_errorcode", None)
    return isinstance(exc, OperationalError) and code is not None and code & 0xFF in _SQLITE_BUSY


def _loop_pragmas(conn: Any, rec: Any) -> None:
    """The on-loop connection (``Store._on_loop``): the same pragmas, no busy wait (a lock held by another
    connection is an immediate SQLITE_BUSY: the call goes to the worker thread, which waits), transactions
    begun by us (``BEGIN IMMEDIATE`` for writes), and no checkpoint run by its commits (a checkpoint
    fsyncs; the other connections' commits run them, as SQLite's default of 1,000 pages says)."""
    conn.isolation_level = None
    _sqlite_pragmas(conn, rec)
    cur = conn.cursor()
    cur.execute("PRAGMA wal_autocheckpoint=0")
    cur.close()


@_never_abandoned
class Store:
    def __init__(self, engine: AsyncEngine, hot: Engine | None = None, on_loop: Engine | None = None) -> None:
        self.engine = engine
        self.session = async_sessionmaker(engine, expire_on_commit=False)
        # SQLite: the hot path's calls (``_hot``) run whole, each in ONE hop to a worker thread, on a plain
        # sqlite3 connection of their own (same file, same pragmas; SQLite's locks and busy timeout order it
        # with the other connection and other processes). Through aiosqlite every statement, begin, fetch
        # and commit is a hop of its own (measured: 5 hops and ~1.8 ms of CPU for one read).
        self._hot = hot
        self._hot_lock = anyio.CapacityLimiter(1)
        # SQLite: the small calls of every request (``quick``: one row read or written by key) run on the
        # event loop's own thread, on a third connection that never waits for a lock: a hop to a worker
        # thread cost 1-10 ms whenever the loop was busy (the thread waits for the GIL up to the interpreter's
        # 5 ms switch interval, twice), against ~0.1-0.3 ms for the statement itself (bench/RESULTS.md,
        # issue 15 session 7). Busy (another connection or process holds the write lock): the worker thread.
        self._on_loop = on_loop

    @classmethod
    async def open(cls, url: str) -> Store:
        url = normalize_url(url)
        if url.startswith("sqlite"):
            engine = create_async_engine(url, pool_size=1, max_overflow=0, pool_timeout=120,
                                         connect_args={"timeout": 60}, **_JSON)
            event.listen(engine.sync_engine, "connect", _sqlite_pragmas)
        else:
            engine = create_async_engine(url, pool_size=20, max_overflow=20, pool_pre_ping=True, **_JSON)
        async with engine.begin() as conn:   # schema migrations (Alembic) on the same driver
            if engine.dialect.name == "postgresql":
                # several control planes may start at once: one migrates, the others wait for it
                await conn.execute(text("SELECT pg_advisory_xact_lock(727274)"))
            await conn.run_sync(_migrate)
        hot = None
        if engine.dialect.name == "sqlite":
            hot = create_engine(url.replace("+aiosqlite", "", 1), pool_size=1, max_overflow=0, pool_timeout=120,
                                connect_args={"timeout": 60, "check_same_thread": False}, **_JSON)
            event.listen(hot, "connect", _sqlite_pragmas)
            on_loop = create_engine(url.replace("+aiosqlite", "", 1), pool_size=1, max_overflow=0, pool_timeout=0,
                                    connect_args={"timeout": 0, "check_same_thread": False}, **_JSON)
            event.listen(on_loop, "connect", _loop_pragmas)
            return cls(engine, hot, on_loop)
        return cls(engine, hot)

    async def close(self) -> None:
        await self.engine.dispose()
        if self._hot is not None:
            self._hot.dispose()
        if self._on_loop is not None:
            self._on_loop.dispose()

    async def _records(self, model: Any, *where: Any, order_by: tuple[Any, ...] = (), quick: bool = False
                       ) -> list[Any]:
        """Detached ``model`` records of the rows matching ``where`` (Core, one ``_run``)."""
        q = select(*_cols(model)).where(*where).order_by(*order_by)
        return await self._run(lambda c: [_record(model, r) for r in c.execute(q)], write=False, quick=quick)

    async def _first(self, model: Any, *where: Any) -> Any:
        """The first record matching ``where``: a read by key (``quick``)."""
        found = await self._records(model, *where, quick=True)
        return found[0] if found else None

    async def _by(self, model: Any, *columns: str, quick: bool = True, **values: Any) -> list[Any]:
        """Records of ``model`` whose ``columns`` equal ``values`` (a prebuilt statement: ``_by_statement``)."""
        q = _by_statement(model, columns)
        return await self._run(lambda c: [_record(model, r) for r in c.execute(q, values)], write=False, quick=quick)

    async def _one_by(self, model: Any, *columns: str, **values: Any) -> Any:
        """The record of ``model`` whose ``columns`` equal ``values`` (a read by key), or None."""
        found = await self._by(model, *columns, **values)
        return found[0] if found else None

    def _try_on_loop(self, fn: Callable[..., Any], args: tuple[Any, ...], write: bool) -> tuple[bool, Any]:
        """``fn`` on the event loop's thread (``__init__``): ``(True, result)``, or ``(False, None)`` when
        SQLite was busy (then nothing was committed: the caller runs it again in the worker thread)."""
        assert self._on_loop is not None
        try:
            with self._on_loop.connect() as c:
                if write:
                    c.exec_driver_sql("BEGIN IMMEDIATE")     # the write lock first, or BUSY before any work
                    out = fn(c, *args)
                    c.commit()
                    return True, out
                return True, fn(c, *args)
        except PoolTimeout:             # in use (a call from another thread than the loop's): the thread
            return False, None
        except OperationalError as exc:
            if _busy(exc):
                return False, None
            raise

    async def _run(self, fn: Callable[..., Any], *args: Any, write: bool, quick: bool = False) -> Any:
        """``fn(connection, *args)`` in one transaction (``write``) or on one connection: on SQLite in one
        worker-thread hop (see ``__init__``), or, ``quick`` (a small read or write: a few rows by key), on the
        event loop's thread; else through the async engine's ``run_sync``. A ``quick`` ``fn`` may run twice
        (the loop's attempt refused by a busy database, rolled back, then run on the worker thread; a refusal
        comes at ``BEGIN IMMEDIATE``, before ``fn`` starts, as WAL never refuses the lock's holder later): it
        has no effect outside its transaction, but for a last step right before the commit (the usage
        commits' ``before_commit`` fault hook, which would then count one commit attempt more)."""
        if quick and self._on_loop is not None:
            done, out = self._try_on_loop(fn, args, write)
            if done:
                return out
        if self._hot is not None:
            hot = self._hot

            def go() -> Any:
                with hot.begin() if write else hot.connect() as c:
                    return fn(c, *args)
            return await anyio.to_thread.run_sync(go, limiter=self._hot_lock)
        async with self.engine.begin() if write else self.engine.connect() as ac:
            return await ac.run_sync(fn, *args)

    # ---- teams and keys -------------------------------------------------------------------------------

    async def create_team(self, name: str, now: datetime, credits_usd: float = 5.0) -> Team:
        team = Team(id=new_id("team"), name=name, created_at=now, credits_usd=credits_usd)
        async with self.session.begin() as s:
            s.add(team)
        return team

    async def list_teams(self) -> list[Team]:
        async with self.session() as s:
            return list((await s.scalars(select(Team).order_by(Team.created_at))).all())

    async def get_team(self, team_id: str) -> Team | None:
        return await self._one_by(Team, "id", id=team_id)

    async def team_by_id_or_name(self, ref: str) -> Team | None:
        async with self.session() as s:
            return (await s.scalars(select(Team).where(or_(Team.id == ref, Team.name == ref)))).first()

    async def add_credits(self, team_id: str, amount_usd: float, now: datetime | None = None) -> Team | None:
        """Atomic: ``credits = credits + amount`` in SQL, never a read-modify-write that could erase a
        usage charge committed meanwhile. Crossing zero either way starts or ends the grace clock."""
        async with self.session.begin() as s:
            await _write_lock(s)
            res = await s.execute(update(Team).where(Team.id == team_id)
                                  .values(credits_usd=Team.credits_usd + amount_usd))
            if res.rowcount == 0:
                return None
            await s.execute(update(Team).where(Team.id == team_id, Team.credits_usd > 0)
                            .values(credits_exhausted_at=None))
            await s.execute(update(Team).where(Team.id == team_id, Team.credits_usd <= 0,
                                               Team.credits_exhausted_at.is_(None))
                            .values(credits_exhausted_at=now or datetime.now(UTC)))
        return await self.get_team(team_id)

    async def exhausted_teams(self, before: datetime) -> list[Team]:
        """Teams out of credits since before ``before`` (their grace period is over)."""
        async with self.session() as s:
            q = select(Team).where(Team.credits_usd <= 0, Team.credits_exhausted_at.is_not(None),
                                   Team.credits_exhausted_at <= before)
            return list((await s.scalars(q)).all())

    async def add_key(self, team_id: str, name: str, prefix: str, key_hash: str, now: datetime,
                      admin: bool = False) -> ApiKey:
        key = ApiKey(id=new_id("key"), team_id=team_id, name=name, prefix=prefix, key_hash=key_hash,
                     created_at=now, admin=admin)
        async with self.session.begin() as s:
            s.add(key)
        return key

    async def key_by_hash(self, key_hash: str) -> ApiKey | None:
        return await self._one_by(ApiKey, "key_hash", key_hash=key_hash)

    async def touch_key(self, key_id: str, now: datetime) -> None:
        q = update(ApiKey.__table__).where(ApiKey.id == key_id).values(last_used_at=now)
        await self._run(lambda c: c.execute(q), write=True, quick=True)

    async def list_keys(self, team_id: str) -> list[ApiKey]:
        async with self.session() as s:
            q = select(ApiKey).where(ApiKey.team_id == team_id).order_by(ApiKey.created_at)
            return list((await s.scalars(q)).all())

    async def revoke_key(self, team_id: str, key_id: str, now: datetime) -> ApiKey | None:
        async with self.session.begin() as s:
            key = await s.get(ApiKey, key_id)
            if key is None or key.team_id != team_id:
                return None
            if key.revoked_at is None:
                key.revoked_at = now
            return key

    # ---- nodes ---------------------------------------------------------------------------------------

    async def upsert_node(self, *, name: str, url: str, capacity_vcpu: float, capacity_memory_mb: int,
                          templates: list[dict[str, Any]], now: datetime, instance: str | None = None,
                          isolation: dict[str, Any] | None = None, ram_mb: int | None = None) -> Node:
        async with self.session.begin() as s:
            node = (await s.scalars(select(Node).where(Node.name == name))).first()
            if node is None:
                node = Node(id=new_id("node"), name=name, registered_at=now, draining=False)
                s.add(node)
            node.url = url
            node.instance = instance or node.instance
            node.capacity_vcpu = capacity_vcpu
            node.capacity_memory_mb = capacity_memory_mb
            node.ram_mb = ram_mb or None
            node.templates = templates
            node.isolation = isolation
            node.state = "ready"
            node.last_heartbeat_at = now
            return node

    async def heartbeat(self, node_id: str, templates: list[dict[str, Any]], now: datetime,
                        pool_status: list[dict[str, Any]] | None = None) -> Node | None:
        q = (update(Node.__table__).where(Node.id == node_id)
             .values(templates=templates, state="ready", last_heartbeat_at=now, pool_status=pool_status or [])
             .returning(*_cols(Node)))

        def go(c: Connection) -> Node | None:
            found = c.execute(q).first()
            return _record(Node, found) if found is not None else None

        return await self._run(go, write=True)

    async def get_node(self, node_id: str) -> Node | None:
        return await self._one_by(Node, "id", id=node_id)

    async def list_nodes(self) -> list[Node]:
        return await self._records(Node, order_by=(Node.name,))

    async def node_by_id_or_name(self, ref: str) -> Node | None:
        return await self._first(Node, or_(Node.id == ref, Node.name == ref))

    async def live_counts(self) -> dict[str, int]:
        q = (select(Sandbox.node_id, func.count()).where(Sandbox.state.in_([st.value for st in LIVE]))
             .group_by(Sandbox.node_id))
        return await self._run(lambda c: {nid: int(n) for nid, n in c.execute(q).all() if nid}, write=False)

    async def set_node(self, node_id: str, **values: Any) -> Node | None:
        async with self.session.begin() as s:
            await s.execute(update(Node).where(Node.id == node_id).values(**values))
        return await self.get_node(node_id)

    async def allocations(self) -> dict[str, tuple[float, int]]:
        """(vCPU, MiB) held per node by sandboxes not yet ended, reservations in flight included (paused
        ones hold nothing: they are a checkpoint on disk)."""
        async with self.session() as s:
            return await _allocations(s)

    async def place_and_insert(self, new: NewSandbox, choose: Choose) -> tuple[Node, Sandbox]:
        """Choose a node and record the sandbox on it in ONE transaction, with the node rows locked
        (``FOR UPDATE`` on PostgreSQL; SQLite serialises writers): two control planes creating at once
        can never both fill the last slot of a node."""
        values = {"id": new.id, "team_id": new.team_id, "template": new.template, "vcpu": new.vcpu,
                  "memory_mb": new.memory_mb, "timeout": new.timeout, "state": new.state,
                  "metadata_": dict(new.metadata), "envs": dict(new.envs), "access_token": new.access_token,
                  "idempotency_key": new.idempotency_key, "request_hash": new.request_hash,
                  "created_at": new.created_at, "end_at": new.end_at,
                  "template_version": new.template_version,
                  "public_ports": list(new.public_ports) or None, "public": new.public}

        def go(c: Connection) -> tuple[Node, Sandbox]:
            _write_lock_sync(c)
            nodes = [_record(Node, r) for r in c.execute(_NODES_LOCKED)]
            node = choose(nodes, _allocations_sync(c))
            values.update(node_id=node.id, isolation=new.isolation, disk_mb=new.disk_mb, network=new.network)
            row = _sandbox(c.execute(_INSERT_SB, {_COLUMN_KEY[k]: v for k, v in values.items()}).one())
            if row.metadata_:
                c.execute(insert(SandboxLabel.__table__),
                          [{"sandbox_id": row.id, "key": k, "value": v} for k, v in row.metadata_.items()])
            return node, row

        try:
            # on SQLite on the event loop's thread (``quick``, under BEGIN IMMEDIATE; ``go`` may run twice when
            # that connection finds the database busy): no worker-thread hop on every cold create. Not a
            # by-key call: the allocations are one aggregate over the live rows (indexed by state), which holds
            # the loop ~1-3 ms at 1,000 live (bench/RESULTS.md, session 8), less than the hop it replaces
            return await self._run(go, write=True, quick=True)
        except IntegrityError as exc:
            if new.idempotency_key:
                raise DuplicateIdempotencyKey(new.idempotency_key) from exc
            raise

    async def insert_claimed(self, new: NewSandbox, node_id: str, started_at: datetime) -> Sandbox | None:
        """Record a create answered from a warm member pre-issued by ``node_id`` (issue 15): ONE insert (and
        its labels), already ``running`` since ``started_at`` (billing starts at the claim). The member's
        capacity is the pool's reservation, so no node row is locked. The primary key is the member's
        grant id: of control planes racing for the same member exactly one insert wins; the others get None
        (as does a grant whose sandbox was recorded before). ``DuplicateIdempotencyKey`` as for
        ``place_and_insert``."""
        values = {"id": new.id, "team_id": new.team_id, "template": new.template, "vcpu": new.vcpu,
                  "memory_mb": new.memory_mb, "timeout": new.timeout, "state": new.state,
                  "metadata_": dict(new.metadata), "envs": dict(new.envs), "access_token": new.access_token,
                  "idempotency_key": new.idempotency_key, "request_hash": new.request_hash,
                  "created_at": new.created_at, "started_at": started_at, "end_at": new.end_at,
                  "template_version": new.template_version, "node_id": node_id, "isolation": new.isolation,
                  "disk_mb": new.disk_mb, "network": new.network,
                  "public_ports": list(new.public_ports) or None, "public": new.public}

        params = {_COLUMN_KEY[k]: v for k, v in values.items()}

        def go(c: Connection) -> Sandbox:
            row = _sandbox(c.execute(_INSERT_SB, params).one())
            if row.metadata_:
                c.execute(insert(SandboxLabel.__table__),
                          [{"sandbox_id": row.id, "key": k, "value": v} for k, v in row.metadata_.items()])
            return row

        try:
            return await self._run(go, write=True, quick=True)
        except IntegrityError as exc:
            if await self.get_sandbox(new.id) is not None:
                return None                  # the member was claimed already (another control plane won)
            if new.idempotency_key:
                raise DuplicateIdempotencyKey(new.idempotency_key) from exc
            raise

    async def place_existing(self, sandbox_id: str, from_state: str, choose: Choose) -> Node | None:
        """Like ``place_and_insert`` for a sandbox that already exists (a resume): choose a node with the
        node rows locked and move the sandbox's reservation there, while it is still in ``from_state``.
        ``choose`` sees the allocations without this sandbox's own. None when the state changed meanwhile."""
        async with self.session.begin() as s:
            await _write_lock(s)
            nodes = list((await s.scalars(select(Node).order_by(Node.id).with_for_update())).all())
            sb = await s.get(Sandbox, sandbox_id, with_for_update=True)
            if sb is None or sb.state != from_state:
                return None
            allocs = await _allocations(s)
            if sb.node_id in allocs and sb.state in {st.value for st in HOLDING}:
                c, m = allocs[sb.node_id]
                allocs[sb.node_id] = (c - sb.vcpu, m - sb.memory_mb)
            node = choose(nodes, allocs)
            sb.node_id = node.id
        return node

    # ---- shared secrets ------------------------------------------------------------------------------

    async def shared_secret(self, name: str, new_value: str, now: datetime) -> str:
        """The secret ``name``; the first caller's ``new_value`` is stored (a racing process reads it back)."""
        async with self.session() as s:
            row = await s.get(ServerSecret, name)
        if row is not None:
            return row.value
        try:
            async with self.session.begin() as s:
                s.add(ServerSecret(name=name, value=new_value, created_at=now))
            return new_value
        except IntegrityError:
            async with self.session() as s:
                row = await s.get(ServerSecret, name)
            assert row is not None
            return row.value

    # ---- sandboxes -----------------------------------------------------------------------------------

    async def get_sandbox(self, sandbox_id: str, team_id: str | None = None) -> Sandbox | None:
        if "\x00" in sandbox_id:       # no id holds a NUL (PostgreSQL's text refuses one): unknown, not an error
            return None

        def go(c: Connection) -> Sandbox | None:
            found = c.execute(_GET_SB, {"sandbox_id": sandbox_id}).first()
            return _sandbox(found) if found is not None else None

        row = await self._run(go, write=False, quick=True)
        if row is None or (team_id is not None and row.team_id != team_id):
            return None
        return row

    async def sandbox_by_idempotency_key(self, team_id: str, key: str) -> Sandbox | None:
        return await self._one_by(Sandbox, "team_id", "idempotency_key", team_id=team_id, idempotency_key=key)

    async def list_sandboxes(self, team_id: str, *, states: Iterable[str] = (),
                             labels: dict[str, str] | None = None, limit: int = 100,
                             cursor: str | None = None, template: str | None = None,
                             since: datetime | None = None, until: datetime | None = None) -> Page:
        q = select(Sandbox).where(Sandbox.team_id == team_id)
        states = list(states)
        if states:
            q = q.where(Sandbox.state.in_(states))
        if template:
            q = q.where(Sandbox.template == template)
        if since:
            q = q.where(Sandbox.created_at >= since)
        if until:
            q = q.where(Sandbox.created_at < until)
        for k, v in (labels or {}).items():
            lab = select(SandboxLabel.sandbox_id).where(SandboxLabel.key == k, SandboxLabel.value == v)
            q = q.where(Sandbox.id.in_(lab))
        if cursor:
            at, sid = _decode_cursor(cursor)
            q = q.where(or_(Sandbox.created_at < at, and_(Sandbox.created_at == at, Sandbox.id < sid)))
        q = q.order_by(Sandbox.created_at.desc(), Sandbox.id.desc()).limit(limit + 1)
        async with self.session() as s:
            rows = list((await s.scalars(q)).all())
        more = len(rows) > limit
        rows = rows[:limit]
        return Page(rows, _encode_cursor(rows[-1]) if more and rows else None)

    async def live_sandboxes_on(self, node_id: str) -> list[Sandbox]:
        return await self._run(lambda c: [_sandbox(r) for r in c.execute(_LIVE_ON, {"node_id": node_id})],
                               write=False)

    async def claim_replay(self, sandbox_id: str, key: str, now: datetime) -> bool:
        """A retry is handed this sandbox: True while it still holds ``key`` (marks it replayed, once)."""
        q = (update(_SB).where(_SB.c.id == sandbox_id, _SB.c.idempotency_key == key)
             .values(replayed_at=func.coalesce(_SB.c.replayed_at, literal(now, _SB.c.replayed_at.type))))
        return bool(await self._run(lambda c: c.execute(q).rowcount, write=True, quick=True))

    async def release_unclaimed_key(self, sandbox_id: str, key: str) -> bool:
        """Release ``key`` unless a retry was handed the sandbox (``claim_replay``): one compare-and-set, so
        a replay and a release never both win."""
        q = (update(_SB).where(_SB.c.id == sandbox_id, _SB.c.idempotency_key == key, _SB.c.replayed_at.is_(None))
             .values(idempotency_key=None))
        return bool(await self._run(lambda c: c.execute(q).rowcount, write=True, quick=True))

    async def set_sandbox(self, sandbox_id: str, *, from_states: Iterable[str], **values: Any) -> bool:
        """Compare-and-set without reading the row back: whether it was in one of ``from_states``."""
        q = _cas_statement(tuple(sorted(values)))       # prebuilt: its values bound (~250 us less a call)
        params = {"sandbox_id": sandbox_id, "from_states": list(from_states),
                  **{"v_" + _COLUMN_KEY[k]: v for k, v in values.items()}}
        return bool(await self._run(lambda c: c.execute(q, params).rowcount, write=True, quick=True))

    async def update_sandbox(self, sandbox_id: str, *, from_states: Iterable[str] | None = None,
                             not_paused: bool = False, **values: Any) -> Sandbox | None:
        """Compare-and-set: update only while the row is in one of ``from_states`` (and, with
        ``not_paused``, has no open paused interval); None when it was not. The updated row comes back
        from the same statement (``RETURNING``)."""
        q = update(_SB).where(_SB.c.id == sandbox_id)
        if from_states is not None:
            q = q.where(_SB.c.state.in_(list(from_states)))
        if not_paused:
            q = q.where(_SB.c.paused_at.is_(None))
        q = q.values(_columns(values)).returning(*_SB_COLS)

        def go(c: Connection) -> Sandbox | None:
            found = c.execute(q).first()
            return _sandbox(found) if found is not None else None

        return await self._run(go, write=True, quick=True)

    # ---- usage ---------------------------------------------------------------------------------------

    async def commit_usage(self, sandbox_id: str, seq: int, run_s: float, *, now: datetime, rates: Rates,
                           charge_credits: bool, before_commit: Callable[[], None] | None = None
                           ) -> UsageEntry | None:
        """Bill a node's cumulative running seconds for one sandbox, exactly once per (sandbox, seq).

        The ledger row, the sandbox's totals and the team's credits change in one transaction: a crash
        before the commit leaves nothing, and the node's resend (same or later cumulative value) bills it
        then; a resend after the commit finds ``seq <= billed_seq`` and adds nothing.
        """
        entries = await self.commit_usage_many([(sandbox_id, seq, run_s)], now=now, rates=rates,
                                               charge_credits=charge_credits, before_commit=before_commit)
        return entries[0] if entries else None

    async def commit_usage_many(self, reports: list[tuple[str, int, float]], *, now: datetime, rates: Rates,
                                charge_credits: bool, before_commit: Callable[[], None] | None = None
                                ) -> list[UsageEntry]:
        """``commit_usage`` for many ``(sandbox_id, seq, run_s)`` reports (a node's heartbeat) in ONE
        transaction: one locked read of the rows, the ledger rows, and one credit update per team."""
        if not reports:
            return []

        def go(c: Connection) -> list[UsageEntry]:
            _write_lock_sync(c)
            rows = _locked_sandboxes(c, (sid for sid, _, _ in reports))
            bill = _Billing(now, rates)
            entries = [entry for sid, seq, run_s in reports
                       if (sb := rows.get(sid)) is not None
                       and (entry := bill.running(sb, seq, run_s)) is not None]
            bill.write(c, _RUNNING_KEYS, charge_credits)
            if before_commit is not None and entries:
                before_commit()            # the last step, right before the commit (``_run``)
            return entries

        return await self._run(go, write=True, quick=len(reports) <= _QUICK_ROWS)

    async def get_sandboxes(self, ids: Iterable[str]) -> dict[str, Sandbox]:
        """Many sandboxes by id in a few queries (chunks of 500)."""
        wanted = [sid for sid in dict.fromkeys(ids) if "\x00" not in sid]    # none holds a NUL (get_sandbox)
        out: dict[str, Sandbox] = {}
        for i in range(0, len(wanted), 500):
            chunk = wanted[i:i + 500]
            for row in await self._run(lambda c, ids: [_sandbox(r) for r in c.execute(_SB_IN, {"ids": ids})],
                                       chunk, write=False):
                out[row.id] = row
        return out

    # ---- the template store (issue 19) ---------------------------------------------------------------

    async def add_template_version(self, **values: Any) -> TemplateVersion:
        """Record a build as the next version of its name (one more than the highest, in one transaction)."""
        async with self.session.begin() as s:
            await _write_lock(s)
            top = (await s.execute(select(func.max(TemplateVersion.version))
                                   .where(TemplateVersion.name == values["name"]))).scalar()
            row = TemplateVersion(version=int(top or 0) + 1, **values)
            s.add(row)
        return row

    async def template_versions(self, name: str | None = None) -> list[TemplateVersion]:
        """Every version (of ``name``, or of all), newest first per name."""
        async with self.session() as s:
            q = select(TemplateVersion).order_by(TemplateVersion.name, TemplateVersion.version.desc())
            if name is not None:
                q = q.where(TemplateVersion.name == name)
            return list((await s.scalars(q)).all())

    async def template_version(self, name: str, version: int | None = None) -> TemplateVersion | None:
        """That version, or (``None``) the current one: the highest (Core, one ``_run``: read by creates)."""
        q = select(*_cols(TemplateVersion)).where(TemplateVersion.name == name)
        q = (q.where(TemplateVersion.version == version) if version is not None
             else q.order_by(TemplateVersion.version.desc()).limit(1))
        return await self._run(lambda c: next((_record(TemplateVersion, r) for r in c.execute(q)), None),
                               write=False, quick=True)

    async def template_versions_in_use(self) -> set[tuple[str, int]]:
        """(name, version) of every sandbox not yet ended (running, paused, starting...)."""
        async with self.session() as s:
            q = (select(Sandbox.template, Sandbox.template_version).distinct()
                 .where(Sandbox.ended_at.is_(None), Sandbox.template_version.is_not(None)))
            return {(t, int(v)) for t, v in (await s.execute(q)).all()}

    async def delete_template_version(self, name: str, version: int) -> None:
        async with self.session.begin() as s:
            row = await s.get(TemplateVersion, (name, version))
            if row is not None:
                await s.delete(row)

    # ---- warm pools ----------------------------------------------------------------------------------

    async def set_pool(self, template: str, vcpu: float, memory_mb: int, size: int, now: datetime,
                       network: dict[str, Any] | None = None, network_id: str = "") -> None:
        """Create, resize or (size 0) remove a pool (one template, shape and egress policy)."""
        async with self.session.begin() as s:
            row = await s.get(Pool, (template, vcpu, memory_mb, network_id))
            if size == 0:
                if row is not None:
                    await s.delete(row)
            elif row is None:
                s.add(Pool(template=template, vcpu=vcpu, memory_mb=memory_mb, network_id=network_id,
                           network=network, size=size, updated_at=now))
            else:
                row.size, row.updated_at = size, now

    async def list_pools(self) -> list[Pool]:
        return await self._records(Pool, order_by=(Pool.template, Pool.vcpu, Pool.memory_mb, Pool.network_id))

    # ---- pauses --------------------------------------------------------------------------------------

    async def record_pause(self, sandbox_id: str, *, paused_at: datetime, checkpoint_bytes: int,
                           timeout_left: float) -> Sandbox | None:
        """``pausing`` -> ``paused`` with a new paused interval, in one transaction."""
        async with self.session.begin() as s:
            await _write_lock(s)
            sb = await s.get(Sandbox, sandbox_id, with_for_update=True)
            if sb is None or sb.state != "pausing":
                return None
            sb.state = "paused"
            sb.pause_count = (sb.pause_count or 0) + 1
            sb.paused_at, sb.checkpoint_bytes, sb.timeout_left = paused_at, checkpoint_bytes, timeout_left
            s.add(SandboxPause(sandbox_id=sb.id, idx=sb.pause_count, node_id=sb.node_id, paused_at=paused_at,
                               checkpoint_bytes=checkpoint_bytes))
        return await self.get_sandbox(sandbox_id)

    async def end_interval(self, sandbox_id: str, *, from_states: Iterable[str], until: datetime, rates: Rates,
                           charge_credits: bool, resumed: bool, **values: Any) -> Sandbox | None:
        """Apply ``values`` (the new state: resumed, stopped, lost, ended) while the row is in ``from_states``,
        ending its billing interval at ``until`` in the same transaction: an open paused interval is closed
        and its storage billed exactly once (``_Billing.close_pause``). Running time is billed from the node's
        reports (``commit_usage``), not here. None when the row was not in ``from_states``."""
        states = set(from_states)

        def go(c: Connection) -> Sandbox | None:
            _write_lock_sync(c)
            sb = _locked_sandboxes(c, [sandbox_id]).get(sandbox_id)
            if sb is None or sb["state"] not in states:
                return None
            bill = _Billing(until, rates)
            closed = bill.close_pause(sb, until, resumed)
            sb.update(values)
            if values:
                bill.touch(sb)
            bill.write(c, tuple(sorted({*values, *(_PAUSE_KEYS if closed else ())})), charge_credits)
            return _detached(Sandbox, sb)

        return await self._run(go, write=True, quick=True)

    async def end_sandboxes(self, ends: list[EndSandbox], *, from_states: Iterable[str], now: datetime,
                            rates: Rates, charge_credits: bool, before_commit: Callable[[], None] | None = None
                            ) -> Ended:
        """End many sandboxes (a kill, a batch kill) in ONE transaction: each row locked, the node's final
        usage report billed (exactly once, as ``commit_usage``), ``ended_at`` computed from the locked,
        just-billed row (start + final running seconds + paused time; ``now`` when the node had no final
        report or the sandbox was paused), an open paused interval closed then (never before it began) with
        its storage billed (``end_interval``), and the new state set. A row not in ``from_states`` is left as
        it is (already ended: what it was billed is final). The credits of each team are charged once.

        On SQLite an end of a few rows (``_QUICK_ROWS``: a kill) runs on the event loop's connection
        (``quick``): ``go`` writes only inside its transaction, and ``before_commit`` (the exactly-once
        test's fault hook) is its last step, right before the commit (``_run``)."""
        states = set(from_states)

        def go(c: Connection) -> Ended:
            out = Ended()
            _write_lock_sync(c)
            rows = _locked_sandboxes(c, (e.sandbox_id for e in ends))
            bill = _Billing(now, rates)
            for e in ends:
                sb = rows.get(e.sandbox_id)
                if sb is None or sb["state"] not in states or e.sandbox_id in out.ended:
                    continue
                if e.seq is not None and e.run_s is not None:
                    entry = bill.running(sb, e.seq, e.run_s)
                    if entry is not None:
                        out.entries.append(entry)
                if sb["paused_at"] is not None:    # paused (maybe just now): the interval ends with it, never
                    ended_at = max(now, sb["paused_at"])      # before its own start (issue 16 item 5)
                    out.storage_charged |= bill.close_pause(sb, ended_at, resumed=False)
                elif e.final:
                    ended_at = end_time(sb["started_at"], sb["billed_run_s"], sb["paused_s"], e.run_s, now)
                else:
                    ended_at = now
                sb.update(state=e.state, end_reason=e.end_reason, ended_at=ended_at)
                bill.touch(sb)
                out.ended.add(e.sandbox_id)
            bill.write(c, _END_KEYS, charge_credits)
            out.rows = {sid: _detached(Sandbox, sb) for sid, sb in rows.items()}
            if before_commit is not None and out.entries:
                before_commit()            # the last step, right before the commit (``_run``)
            return out

        return await self._run(go, write=True, quick=len(ends) <= _QUICK_ROWS)

    async def pauses_of(self, sandbox_ids: Iterable[str]) -> dict[str, list[SandboxPause]]:
        ids = list(sandbox_ids)
        if not ids:
            return {}
        out: dict[str, list[SandboxPause]] = {}
        async with self.session() as s:
            q = select(SandboxPause).where(SandboxPause.sandbox_id.in_(ids)).order_by(SandboxPause.idx)
            for p in (await s.scalars(q)).all():
                out.setdefault(p.sandbox_id, []).append(p)
        return out

    async def paused_before(self, cutoff: datetime, limit: int = 500) -> list[Sandbox]:
        async with self.session() as s:
            q = (select(Sandbox).where(Sandbox.state == "paused", Sandbox.paused_at < cutoff)
                 .order_by(Sandbox.paused_at).limit(limit))
            return list((await s.scalars(q)).all())

    async def usage_totals(self, team_id: str, since: datetime | None, until: datetime | None
                           ) -> tuple[int, float, float, float, float]:
        q = select(func.count(func.distinct(UsageEntry.sandbox_id)), func.sum(UsageEntry.vcpu_s),
                   func.sum(UsageEntry.gb_s), func.sum(UsageEntry.storage_gb_s),
                   func.sum(UsageEntry.cost_usd)).where(UsageEntry.team_id == team_id)
        if since:
            q = q.where(UsageEntry.committed_at >= since)
        if until:
            q = q.where(UsageEntry.committed_at < until)
        async with self.session() as s:
            n, v, g, st, c = (await s.execute(q)).one()
        return int(n or 0), float(v or 0), float(g or 0), float(st or 0), float(c or 0)
