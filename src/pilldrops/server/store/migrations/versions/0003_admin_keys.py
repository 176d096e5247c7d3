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
    # the operator's key is the first one `pilldrops up`/`serve` made (not any key later given that name)
    op.execute("UPDATE api_keys SET admin = true WHERE id = (SELECT id FROM api_keys WHERE name = 'pilldrops-up' "
               "ORDER BY created_at LIMIT 1)")


def downgrade() -> None:
    with op.batch_alter_table("api_keys") as t:
        t.drop_column("admin")
