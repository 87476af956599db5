"""The previews table: the fixed preview prompts a run renders at each sample step (TrainConfig.preview_prompts),
the Dashboard's progression strip. A new table: every existing row stays; runs made before it have no previews
and the strip falls back to their rollout samples.

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-04
"""

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "previews",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("idx", sa.Integer(), nullable=False),
        sa.Column("prompt", sa.Text(), nullable=False),
        sa.Column("source", sa.String(200)),
        sa.Column("seed", sa.BigInteger()),
        sa.Column("path", sa.String(1000), nullable=False),
        sa.Column("rewards", sa.JSON()),
        sa.ForeignKeyConstraint(["run_id"], ["runs.id"], name="fk_previews_run_id_runs", ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id", name="pk_previews"),
        sa.UniqueConstraint("run_id", "step", "idx", name="uq_previews_run_id_step_idx"),
    )


def downgrade() -> None:
    op.drop_table("previews")
