"""balance.attribution: which samples drive a diagnosed step's worst gradient conflict (per-sample gradient path,
core.per_sample.conflict_attribution). Added in place, as 0002's columns; older rows have none.

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-04
"""

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("balance", sa.Column("attribution", sa.JSON()))


def downgrade() -> None:
    op.drop_column("balance", "attribution")  # in place (SQLite >= 3.35 drops a plain column without a copy)
