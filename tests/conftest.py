"""Fixtures shared by every tier."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests import pg


@pytest.fixture(scope="session")
def postgres() -> Iterator[pg.Postgres]:
    """A throwaway PostgreSQL cluster for the session (skipped, with the reason, where it cannot run)."""
    why = pg.why_not()
    if why:
        pytest.skip(why)
    server = pg.Postgres()
    try:
        yield server
    finally:
        server.stop()
