"""disk quota per sandbox (issue 16 part 2): the writable layer's size each sandbox was created with

Revision ID: 0009
Revises: 0008
"""
import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"


def upgrade() -> None:
    with op.batch_alter_table("sandboxes") as t:
        t.add_column(sa.Column("disk_mb", sa.Integer(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("sandboxes") as t:
        t.drop_column("disk_mb")
