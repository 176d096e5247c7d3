"""ports by URL (issue 14): a sandbox's public ports, and the deployment's shared secrets (the URL signing key)

Revision ID: 0011
Revises: 0010 (chained after the template store when merged into tmpl-artifacts)
"""
import sqlalchemy as sa
from alembic import op

revision = "0011"
down_revision = "0010"


def upgrade() -> None:
    with op.batch_alter_table("sandboxes") as t:
        t.add_column(sa.Column("public_ports", sa.JSON(), nullable=True))
        t.add_column(sa.Column("public", sa.Boolean(), nullable=False, server_default=sa.false()))
    op.create_table(
        "server_secrets",
        sa.Column("name", sa.String(64), primary_key=True),
        sa.Column("value", sa.String(256), nullable=False),
        sa.Column("created_at", sa.DateTime(), nullable=False),
    )


def downgrade() -> None:
    op.drop_table("server_secrets")
    with op.batch_alter_table("sandboxes") as t:
        t.drop_column("public")
        t.drop_column("public_ports")
