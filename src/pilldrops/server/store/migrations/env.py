"""Alembic environment: runs migrations on the connection the store hands over (``attributes["connection"]``,
a sync facade over the async engine), or on an engine built from ``sqlalchemy.url``."""

from alembic import context
from sqlalchemy import create_engine

from pilldrops.server.store.models import Base

config = context.config


def _migrate(conn) -> None:  # type: ignore[no-untyped-def]
    context.configure(connection=conn, target_metadata=Base.metadata, render_as_batch=True)
    with context.begin_transaction():
        context.run_migrations()


conn = config.attributes.get("connection")
if conn is not None:
    _migrate(conn)
else:
    engine = create_engine(config.get_main_option("sqlalchemy.url"))
    with engine.connect() as c:
        _migrate(c)
    engine.dispose()
