"""initial schema: teams, api keys, nodes, sandboxes, sandbox labels

Revision ID: 0001
Revises:
"""
import sqlalchemy as sa
from alembic import op

from pilldrops.server.store.models import UTCDateTime

revision = "0001"
down_revision = None


def upgrade() -> None:
    op.create_table(
        "teams",
        sa.Column("id", sa.String(40), primary_key=True),
        sa.Column("name", sa.String(128), nullable=False, unique=True),
        sa.Column("created_at", UTCDateTime(), nullable=False),
    )
    op.create_table(
        "api_keys",
        sa.Column("id", sa.String(40), primary_key=True),
        sa.Column("team_id", sa.String(40), sa.ForeignKey("teams.id"), nullable=False, index=True),
        sa.Column("name", sa.String(128), nullable=False),
        sa.Column("prefix", sa.String(16), nullable=False),
        sa.Column("key_hash", sa.String(64), nullable=False, unique=True),
        sa.Column("created_at", UTCDateTime(), nullable=False),
        sa.Column("revoked_at", UTCDateTime(), nullable=True),
        sa.Column("last_used_at", UTCDateTime(), nullable=True),
    )
    op.create_table(
        "nodes",
        sa.Column("id", sa.String(40), primary_key=True),
        sa.Column("name", sa.String(128), nullable=False, unique=True),
        sa.Column("url", sa.String(512), nullable=False),
        sa.Column("capacity_vcpu", sa.Float(), nullable=False),
        sa.Column("capacity_memory_mb", sa.Integer(), nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("draining", sa.Boolean(), nullable=False, server_default=sa.false()),
        sa.Column("templates", sa.JSON(), nullable=False),
        sa.Column("registered_at", UTCDateTime(), nullable=False),
        sa.Column("last_heartbeat_at", UTCDateTime(), nullable=False),
    )
    op.create_table(
        "sandboxes",
        sa.Column("id", sa.String(40), primary_key=True),
        sa.Column("team_id", sa.String(40), sa.ForeignKey("teams.id"), nullable=False),
        sa.Column("template", sa.String(128), nullable=False),
        sa.Column("vcpu", sa.Float(), nullable=False),
        sa.Column("memory_mb", sa.Integer(), nullable=False),
        sa.Column("timeout", sa.Integer(), nullable=False),
        sa.Column("state", sa.String(16), nullable=False, index=True),
        sa.Column("end_reason", sa.String(32), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("metadata", sa.JSON(), nullable=False),
        sa.Column("envs", sa.JSON(), nullable=False),
        sa.Column("node_id", sa.String(40), nullable=True, index=True),
        sa.Column("access_token", sa.String(64), nullable=False),
        sa.Column("idempotency_key", sa.String(256), nullable=True),
        sa.Column("request_hash", sa.String(64), nullable=True),
        sa.Column("created_at", UTCDateTime(), nullable=False),
        sa.Column("started_at", UTCDateTime(), nullable=True),
        sa.Column("end_at", UTCDateTime(), nullable=True),
        sa.Column("ended_at", UTCDateTime(), nullable=True),
    )
    op.create_index("ix_sandboxes_team_created", "sandboxes", ["team_id", "created_at", "id"])
    op.create_index("ux_sandboxes_team_idem", "sandboxes", ["team_id", "idempotency_key"], unique=True)
    op.create_table(
        "sandbox_labels",
        sa.Column("sandbox_id", sa.String(40), sa.ForeignKey("sandboxes.id", ondelete="CASCADE"),
                  primary_key=True),
        sa.Column("key", sa.String(256), primary_key=True),
        sa.Column("value", sa.Text(), nullable=False),
    )
    op.create_index("ix_labels_key_value", "sandbox_labels", ["key", "value"])


def downgrade() -> None:
    op.drop_table("sandbox_labels")
    op.drop_table("sandboxes")
    op.drop_table("nodes")
    op.drop_table("api_keys")
    op.drop_table("teams")
