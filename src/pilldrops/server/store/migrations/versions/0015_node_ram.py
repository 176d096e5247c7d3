"""a node's RAM as its agent reports it: no sandbox's memory_mb may be more (capacity overcommits it)

Revision ID: 0015
Revises: 0014
"""
import sqlalchemy as sa
from alembic import op

revision = "0015"
down_revision = "0014"


def upgrade() -> None:
    with op.batch_alter_table("nodes") as t:
        t.add_column(sa.Column("ram_mb", sa.Integer(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("nodes") as t:
        t.drop_column("ram_mb")
