"""admin keys: the operator's key (made by `pilldrops up` / `serve` on first start) may manage nodes

Revision ID: 0003
Revises: 0002
"""
import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"


def upgrade() -> None:
    with op.batch_alter_table("api_keys") as t:
        t.add_column(sa.Column("admin", sa.Boolean(), nullable=False, server_default=sa.false()))
    op.execute("UPDATE api_keys SET admin = true WHERE name = 'pilldrops-up'")


def downgrade() -> None:
    with op.batch_alter_table("api_keys") as t:
        t.drop_column("admin")
