"""the template store (issue 19): one row per build of a template (content-addressed layers by digest), and
the version each sandbox runs

Revision ID: 0010
Revises: 0009
"""
import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0009"


def upgrade() -> None:
    op.create_table(
        "template_versions",
        sa.Column("name", sa.String(128), primary_key=True),
        sa.Column("version", sa.Integer(), primary_key=True),
        sa.Column("key", sa.String(80), nullable=False, index=True),
        sa.Column("layers", sa.JSON(), nullable=False),
        sa.Column("env", sa.JSON(), nullable=False),
        sa.Column("workdir", sa.String(1024), nullable=False),
        sa.Column("user", sa.String(64), nullable=True),
        sa.Column("home", sa.String(1024), nullable=True),
        sa.Column("size_bytes", sa.BigInteger(), nullable=False),
        sa.Column("description", sa.Text(), nullable=False),
        sa.Column("isolation", sa.String(16), nullable=True),
        sa.Column("parent", sa.String(128), nullable=True),
        sa.Column("builder", sa.String(128), nullable=True),
        sa.Column("build_seconds", sa.Float(), nullable=False),
        sa.Column("built_at", sa.DateTime(), nullable=False),
    )
    with op.batch_alter_table("sandboxes") as t:
        t.add_column(sa.Column("template_version", sa.Integer(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("sandboxes") as t:
        t.drop_column("template_version")
    op.drop_table("template_versions")
