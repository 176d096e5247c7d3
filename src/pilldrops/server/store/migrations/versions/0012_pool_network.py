"""warm pools per egress policy (issue 14 part 3): a pool is one template, shape AND network policy; the
policy's identity (``network_id``: "" loopback only, else a digest of the policy) joins the primary key

Revision ID: 0012
Revises: 0011
"""
import sqlalchemy as sa
from alembic import op

revision = "0012"
down_revision = "0011"


def _table(name: str, with_network: bool) -> None:
    cols = [sa.Column("template", sa.String(128), primary_key=True),
            sa.Column("vcpu", sa.Float(), primary_key=True),
            sa.Column("memory_mb", sa.Integer(), primary_key=True)]
    if with_network:
        cols += [sa.Column("network_id", sa.String(64), primary_key=True, server_default=""),
                 sa.Column("network", sa.JSON(), nullable=True)]
    cols += [sa.Column("size", sa.Integer(), nullable=False), sa.Column("updated_at", sa.DateTime(), nullable=False)]
    op.create_table(name, *cols)


def upgrade() -> None:
    _table("pools_v12", True)
    op.execute("INSERT INTO pools_v12 (template, vcpu, memory_mb, network_id, size, updated_at) "
               "SELECT template, vcpu, memory_mb, '', size, updated_at FROM pools")
    op.drop_table("pools")
    op.rename_table("pools_v12", "pools")


def downgrade() -> None:
    _table("pools_v11", False)
    op.execute("INSERT INTO pools_v11 (template, vcpu, memory_mb, size, updated_at) "
               "SELECT template, vcpu, memory_mb, size, updated_at FROM pools WHERE network_id = ''")
    op.drop_table("pools")
    op.rename_table("pools_v11", "pools")
