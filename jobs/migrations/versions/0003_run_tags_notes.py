"""Tags and notes per run (the Runs page): runs.tags (a JSON list of short strings, NULL = none) and runs.notes
(free text). Added in place, as 0002's columns: every existing run keeps its rows and gets no tags and no notes.

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-03
"""

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("runs", sa.Column("tags", sa.JSON()))
    op.add_column("runs", sa.Column("notes", sa.Text()))


def downgrade() -> None:
    op.drop_column("runs", "notes")  # in place (SQLite >= 3.35 drops a plain column without a copy)
    op.drop_column("runs", "tags")
