"""warm pools: the fleet-wide config (one row per template and shape) and what each node last reported
about its pools

Revision ID: 0006
Revises: 0005
"""
import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"


def upgrade() -> None:
    op.create_table(
        "pools",
        sa.Column("template", sa.String(128), primary_key=True),
        sa.Column("vcpu", sa.Float(), primary_key=True),
        sa.Column("memory_mb", sa.Integer(), primary_key=True),
        sa.Column("size", sa.Integer(), nullable=False),
        sa.Column("updated_at", sa.DateTime(), nullable=False),
    )
    with op.batch_alter_table("nodes") as t:
        t.add_column(sa.Column("pool_status", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("nodes") as t:
        t.drop_column("pool_status")
    op.drop_table("pools")
