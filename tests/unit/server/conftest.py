"""Every control-plane test runs on both stores: SQLite (the embedded default) and PostgreSQL (the fleet
store, a throwaway cluster started for the session; skipped with the reason where it cannot run)."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(params=["sqlite", "postgres"])
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite+aiosqlite:///{tmp_path / 'store.sqlite'}"
    return request.getfixturevalue("postgres").new_database()
