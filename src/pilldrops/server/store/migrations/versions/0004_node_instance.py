"""node instance: the id an agent keeps in its own state dir, so a restarted agent (any port) is the same
node, and a second agent using the same name is told so

Revision ID: 0004
Revises: 0003
"""
import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"


def upgrade() -> None:
    with op.batch_alter_table("nodes") as t:
        t.add_column(sa.Column("instance", sa.String(64), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("nodes") as t:
        t.drop_column("instance")
