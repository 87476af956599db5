"""The initial schema: runs, per-step metrics (long form), steps, balancer diagnostics, samples,
checkpoints, evaluations and comparisons.

Revision ID: 0001
Revises:
Create Date: 2026-12-02
"""

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def _per_step_keys() -> list:
    return [sa.Column("run_id", sa.Integer(), nullable=False), sa.Column("step", sa.Integer(), nullable=False)]


def _run_fk(table: str) -> sa.ForeignKeyConstraint:
    return sa.ForeignKeyConstraint(["run_id"], ["runs.id"], name=f"fk_{table}_run_id_runs", ondelete="CASCADE")


def upgrade() -> None:
    op.create_table(
        "runs",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("name", sa.String(200)),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("preset", sa.String(100)),
        sa.Column("strategy", sa.String(64), nullable=False),
        sa.Column("config", sa.JSON(), nullable=False),
        sa.Column("code_version", sa.String(100)),
        sa.Column("run_dir", sa.String(1000), nullable=False),
        sa.Column("total_steps", sa.Integer(), nullable=False),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("headline", sa.JSON()),
        sa.Column("seconds_per_step", sa.Float()),
        sa.Column("device", sa.String(64)),
        sa.Column("num_processes", sa.Integer(), nullable=False),
        sa.Column("num_nodes", sa.Integer(), nullable=False),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.Column("started_at", sa.Float()),
        sa.Column("finished_at", sa.Float()),
        sa.Column("heartbeat_at", sa.Float()),
        sa.Column("pid", sa.Integer()),
        sa.Column("pgid", sa.Integer()),
        sa.Column("host", sa.String(255)),
        sa.Column("proc_key", sa.String(100)),
        sa.Column("devices", sa.String(100)),
        sa.Column("cancel_requested", sa.Boolean(), nullable=False),
        sa.Column("cancel_requested_at", sa.Float()),
        sa.Column("exit_code", sa.Integer()),
        sa.Column("error", sa.Text()),
        sa.PrimaryKeyConstraint("id", name="pk_runs"),
    )
    op.create_index("ix_runs_status", "runs", ["status"])

    op.create_table(
        "metrics", *_per_step_keys(),
        sa.Column("key", sa.String(128), nullable=False),
        sa.Column("value", sa.Float()),
        _run_fk("metrics"),
        sa.PrimaryKeyConstraint("run_id", "step", "key", name="pk_metrics"),
        sqlite_with_rowid=False,
    )
    op.create_table(
        "steps", *_per_step_keys(),
        sa.Column("phase", sa.String(16), nullable=False),
        sa.Column("stage", sa.Integer()),
        sa.Column("at", sa.Float(), nullable=False),
        _run_fk("steps"),
        sa.PrimaryKeyConstraint("run_id", "step", name="pk_steps"),
    )
    op.create_table(
        "balance", *_per_step_keys(),
        sa.Column("phase", sa.String(16), nullable=False),
        sa.Column("solver", sa.String(64)),
        sa.Column("alpha_raw", sa.JSON()),
        sa.Column("alpha_ema", sa.JSON()),
        sa.Column("cosine", sa.JSON()),
        sa.Column("cos_to_update", sa.JSON()),
        sa.Column("grad_norms", sa.JSON()),
        sa.Column("valid", sa.JSON()),
        sa.Column("update_norm", sa.Float()),
        sa.Column("solve_seconds", sa.Float()),
        _run_fk("balance"),
        sa.PrimaryKeyConstraint("run_id", "step", name="pk_balance"),
    )
    op.create_table(
        "samples",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("idx", sa.Integer(), nullable=False),
        sa.Column("prompt", sa.Text(), nullable=False),
        sa.Column("source", sa.String(200)),
        sa.Column("seed", sa.BigInteger()),
        sa.Column("group_id", sa.Integer()),
        sa.Column("path", sa.String(1000), nullable=False),
        sa.Column("rewards", sa.JSON()),
        sa.Column("advantages", sa.JSON()),
        _run_fk("samples"),
        sa.PrimaryKeyConstraint("id", name="pk_samples"),
        sa.UniqueConstraint("run_id", "step", "idx", name="uq_samples_run_id_step_idx"),
    )
    op.create_table(
        "checkpoints", *_per_step_keys(),
        sa.Column("path", sa.String(1000), nullable=False),
        sa.Column("created_at", sa.Float(), nullable=False),
        _run_fk("checkpoints"),
        sa.PrimaryKeyConstraint("run_id", "step", name="pk_checkpoints"),
    )
    op.create_table(
        "evaluations",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("checkpoint_step", sa.Integer()),
        sa.Column("name", sa.String(200), nullable=False),
        sa.Column("scores", sa.JSON(), nullable=False),
        sa.Column("details", sa.JSON()),
        sa.Column("created_at", sa.Float(), nullable=False),
        _run_fk("evaluations"),
        sa.PrimaryKeyConstraint("id", name="pk_evaluations"),
    )
    op.create_index("ix_evaluations_run_id_checkpoint_step", "evaluations", ["run_id", "checkpoint_step"])
    op.create_table(
        "comparisons",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("name", sa.String(200), nullable=False),
        sa.Column("run_ids", sa.JSON(), nullable=False),
        sa.Column("settings", sa.JSON()),
        sa.Column("result", sa.JSON()),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_comparisons"),
    )


def downgrade() -> None:
    for table in ("comparisons", "evaluations", "checkpoints", "samples", "balance", "steps", "metrics"):
        op.drop_table(table)
    op.drop_index("ix_runs_status", table_name="runs")
    op.drop_table("runs")
