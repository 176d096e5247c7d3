"""billing: team credits, per-sandbox usage totals, the usage ledger

Revision ID: 0002
Revises: 0001
"""
import sqlalchemy as sa
from alembic import op

from pilldrops.server.store.models import UTCDateTime

revision = "0002"
down_revision = "0001"


def upgrade() -> None:
    with op.batch_alter_table("teams") as t:
        t.add_column(sa.Column("credits_usd", sa.Float(), nullable=False, server_default="5.0"))
        t.add_column(sa.Column("credits_exhausted_at", UTCDateTime(), nullable=True))
    with op.batch_alter_table("sandboxes") as t:
        for col in ("vcpu_s", "gb_s", "storage_gb_s", "cost_usd", "billed_run_s"):
            t.add_column(sa.Column(col, sa.Float(), nullable=False, server_default="0"))
        t.add_column(sa.Column("billed_seq", sa.BigInteger(), nullable=False, server_default="0"))
    op.create_table(
        "usage_ledger",
        sa.Column("sandbox_id", sa.String(40), sa.ForeignKey("sandboxes.id", ondelete="CASCADE"),
                  primary_key=True),
        sa.Column("seq", sa.BigInteger(), primary_key=True),
        sa.Column("team_id", sa.String(40), nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("vcpu", sa.Float(), nullable=False),
        sa.Column("memory_mb", sa.Integer(), nullable=False),
        sa.Column("storage_gb", sa.Float(), nullable=False),
        sa.Column("from_s", sa.Float(), nullable=False),
        sa.Column("to_s", sa.Float(), nullable=False),
        sa.Column("vcpu_s", sa.Float(), nullable=False),
        sa.Column("gb_s", sa.Float(), nullable=False),
        sa.Column("storage_gb_s", sa.Float(), nullable=False),
        sa.Column("cost_usd", sa.Float(), nullable=False),
        sa.Column("committed_at", UTCDateTime(), nullable=False),
    )
    op.create_index("ix_ledger_team_committed", "usage_ledger", ["team_id", "committed_at"])


def downgrade() -> None:
    op.drop_table("usage_ledger")
    with op.batch_alter_table("sandboxes") as t:
        for col in ("vcpu_s", "gb_s", "storage_gb_s", "cost_usd", "billed_run_s", "billed_seq"):
            t.drop_column(col)
    with op.batch_alter_table("teams") as t:
        t.drop_column("credits_usd")
        t.drop_column("credits_exhausted_at")
