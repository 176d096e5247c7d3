"""a retried create's claim on its sandbox: a batch whose client left kills only what no retry was handed

Revision ID: 0013
Revises: 0012
"""
import sqlalchemy as sa
from alembic import op

revision = "0013"
down_revision = "0012"


def upgrade() -> None:
    with op.batch_alter_table("sandboxes") as t:
        t.add_column(sa.Column("replayed_at", sa.DateTime(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("sandboxes") as t:
        t.drop_column("replayed_at")
