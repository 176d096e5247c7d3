"""Every control-plane test runs on both stores: SQLite (the embedded default) and PostgreSQL (the fleet
store, a throwaway cluster started for the session; skipped with the reason where it cannot run)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests import pg


@pytest.fixture(scope="session")
def postgres() -> Iterator[pg.Postgres]:
    why = pg.why_not()
    if why:
        pytest.skip(why)
    server = pg.Postgres()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(params=["sqlite", "postgres"])
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite+aiosqlite:///{tmp_path / 'store.sqlite'}"
    return request.getfixturevalue("postgres").new_database()
