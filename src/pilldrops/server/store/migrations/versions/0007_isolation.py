"""isolation per sandbox (issue 11): the mode each sandbox runs in, and what each node can run

Revision ID: 0007
Revises: 0006
"""
import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"


def upgrade() -> None:
    with op.batch_alter_table("sandboxes") as t:
        t.add_column(sa.Column("isolation", sa.String(16), nullable=False, server_default="container"))
    with op.batch_alter_table("nodes") as t:
        t.add_column(sa.Column("isolation", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("nodes") as t:
        t.drop_column("isolation")
    with op.batch_alter_table("sandboxes") as t:
        t.drop_column("isolation")
