"""Alembic environment: runs migrations on a synchronous engine built from the store URL."""

from alembic import context
from sqlalchemy import create_engine

from pilldrops.server.store.models import Base

config = context.config
url = config.get_main_option("sqlalchemy.url")


def run() -> None:
    engine = create_engine(url)
    with engine.connect() as conn:
        context.configure(connection=conn, target_metadata=Base.metadata, render_as_batch=True)
        with context.begin_transaction():
            context.run_migrations()
    engine.dispose()


run()
