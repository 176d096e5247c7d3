"""a template-store version's sandbox defaults: the spec's disk_mb and [network]

Revision ID: 0014
Revises: 0013
"""
import sqlalchemy as sa
from alembic import op

revision = "0014"
down_revision = "0013"


def upgrade() -> None:
    with op.batch_alter_table("template_versions") as t:
        t.add_column(sa.Column("disk_mb", sa.Integer(), nullable=True))
        t.add_column(sa.Column("network", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("template_versions") as t:
        t.drop_column("network")
        t.drop_column("disk_mb")
