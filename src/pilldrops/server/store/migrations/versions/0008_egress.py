"""egress per sandbox (issue 14): the sandbox's network policy (allow_internet_access, allow_out, deny_out)

Revision ID: 0008
Revises: 0007
"""
import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"


def upgrade() -> None:
    with op.batch_alter_table("sandboxes") as t:
        t.add_column(sa.Column("network", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("sandboxes") as t:
        t.drop_column("network")
