"""pause/resume: the current pause on the sandbox row (when, checkpoint size, timeout left), the total
paused seconds (so ended_at = started_at + running + paused), and one row per paused interval (billed as
storage, shown in the history)

Revision ID: 0005
Revises: 0004
"""
import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"


def upgrade() -> None:
    with op.batch_alter_table("sandboxes") as t:
        t.add_column(sa.Column("paused_at", sa.DateTime(), nullable=True))
        t.add_column(sa.Column("checkpoint_bytes", sa.BigInteger(), nullable=True))
        t.add_column(sa.Column("timeout_left", sa.Float(), nullable=True))
        t.add_column(sa.Column("paused_s", sa.Float(), nullable=False, server_default="0"))
        t.add_column(sa.Column("pause_count", sa.Integer(), nullable=False, server_default="0"))
        t.add_column(sa.Column("op_started_at", sa.DateTime(), nullable=True))
    op.create_table(
        "sandbox_pauses",
        sa.Column("sandbox_id", sa.String(40), sa.ForeignKey("sandboxes.id", ondelete="CASCADE"), primary_key=True),
        sa.Column("idx", sa.Integer(), primary_key=True),
        sa.Column("node_id", sa.String(40), nullable=True),
        sa.Column("paused_at", sa.DateTime(), nullable=False),
        sa.Column("resumed_at", sa.DateTime(), nullable=True),
        sa.Column("checkpoint_bytes", sa.BigInteger(), nullable=False),
        sa.Column("storage_gb_s", sa.Float(), nullable=False, server_default="0"),
    )
    op.create_index("ix_sandboxes_state_paused", "sandboxes", ["state", "paused_at"])


def downgrade() -> None:
    op.drop_index("ix_sandboxes_state_paused", "sandboxes")
    op.drop_table("sandbox_pauses")
    with op.batch_alter_table("sandboxes") as t:
        for c in ("op_started_at", "pause_count", "paused_s", "timeout_left", "checkpoint_bytes", "paused_at"):
            t.drop_column(c)
