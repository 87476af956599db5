"""The database schema (SQLAlchemy Core). Alembic migrations in jobs/migrations/ create it; a test checks
that the migrations and these tables agree.

Times are UNIX seconds (float): portable between SQLite and PostgreSQL and compared against
``time.time()`` for heartbeats. Per-step tables use the primary key (run_id, step, ...), whose leading
columns are the (run_id, step) index that incremental reads (``since_step``) scan; the key also makes a
duplicated step impossible.
"""

from __future__ import annotations

from sqlalchemy import (JSON, BigInteger, Boolean, Column, Float, ForeignKey, Index, Integer, MetaData, String,
                        Table, Text, UniqueConstraint)

# The job states (huey-style: a small fixed set). queued -> running -> one of the final states.
QUEUED = "queued"
RUNNING = "running"
SUCCEEDED = "succeeded"
FAILED = "failed"
CANCELLED = "cancelled"
INTERRUPTED = "interrupted"
STATUSES = (QUEUED, RUNNING, SUCCEEDED, FAILED, CANCELLED, INTERRUPTED)
ACTIVE = (QUEUED, RUNNING)
FINAL = (SUCCEEDED, FAILED, CANCELLED, INTERRUPTED)
RESUMABLE = (FAILED, CANCELLED, INTERRUPTED)

# The kinds of job (one queue, one worker, the states above for all): a training run, a held-out evaluation of a
# training run's checkpoint (jobs.evaluations), a side-by-side comparison (jobs.compare). jobs.job dispatches on it.
TRAIN = "train"
EVALUATE = "evaluate"
COMPARE = "compare"
KINDS = (TRAIN, EVALUATE, COMPARE)

metadata = MetaData(naming_convention={
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
})

runs = Table(
    "runs", metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("kind", String(16), nullable=False, server_default=TRAIN),  # TRAIN / EVALUATE / COMPARE
    # the training run an evaluate job scores (NULL for the other kinds). No foreign key: SQLite adds a column
    # with one only by copying the table, and dropping the old runs table would cascade into every per-step row
    Column("subject_id", Integer),
    Column("origin", String(1000)),  # an imported run (jobs import): the folder it was copied from, absolute
    Column("name", String(200)),
    Column("status", String(16), nullable=False),
    Column("preset", String(100)),  # the preset the config started from, if any
    Column("strategy", String(64), nullable=False),
    Column("config", JSON, nullable=False),  # TrainConfig.to_dict(), what the job trains (other kinds: their request)
    Column("code_version", String(100)),  # `git describe` of the code that submitted it
    Column("run_dir", String(1000), nullable=False),  # relative to the data directory (absolute: an imported run)
    Column("total_steps", Integer, nullable=False),
    Column("step", Integer, nullable=False, default=0),  # completed steps stored so far
    Column("headline", JSON),  # the latest mean reward per reward name
    Column("seconds_per_step", Float),  # wall seconds per step in the current attempt (for the ETA)
    Column("device", String(64)),
    Column("num_processes", Integer, nullable=False, default=1),  # > 1: launched with torchrun
    Column("num_nodes", Integer, nullable=False, default=1),
    Column("attempt", Integer, nullable=False, default=0),  # 1 on the first start, +1 per resume
    Column("created_at", Float, nullable=False),
    Column("started_at", Float),
    Column("finished_at", Float),
    Column("heartbeat_at", Float),
    # the job's process: pgid is set only when the job has its own process group (never in immediate
    # mode), so signals never reach the caller's group; proc_key = boot id + start time guards pid reuse
    Column("pid", Integer),
    Column("pgid", Integer),
    Column("host", String(255)),
    Column("proc_key", String(100)),
    Column("devices", String(100)),  # CUDA_VISIBLE_DEVICES given to the job
    Column("cancel_requested", Boolean, nullable=False, default=False),  # the cooperative stop flag
    Column("cancel_requested_at", Float),
    Column("exit_code", Integer),
    Column("error", Text),  # failed / interrupted: what went wrong, shown verbatim
    Column("tags", JSON),  # the researcher's labels, a list of short strings (NULL = none); Runs page filter
    Column("notes", Text),  # the researcher's free text about the run
    Index(None, "status"),
)

metrics = Table(  # long form: one row per (step, key); value NULL where not applicable (NaN)
    "metrics", metadata,
    Column("run_id", Integer, ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True),
    Column("step", Integer, primary_key=True),
    Column("key", String(128), primary_key=True),  # "loss", "reward/colorfulness", "alpha/brightness", ...
    Column("value", Float),
    sqlite_with_rowid=False,  # SQLite: rows clustered on (run_id, step, key); range reads scan them in order
)

steps = Table(  # one row per optimizer step: what is not a number
    "steps", metadata,
    Column("run_id", Integer, ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True),
    Column("step", Integer, primary_key=True),
    Column("phase", String(16), nullable=False),  # full / diagnostic / amortized
    Column("stage", Integer),
    Column("at", Float, nullable=False),
)

balance = Table(  # per-reward gradient diagnostics of full and diagnostic steps
    "balance", metadata,
    Column("run_id", Integer, ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True),
    Column("step", Integer, primary_key=True),
    Column("phase", String(16), nullable=False),
    Column("solver", String(64)),
    Column("alpha_raw", JSON),  # α* of this solve, by reward name
    Column("alpha_ema", JSON),  # ᾱ after it
    Column("cosine", JSON),  # {"names": [...], "matrix": [[...]], "to_mean": {name: cos(g_k, Σg/K)}}, null = invalid
    Column("cos_to_update", JSON),
    Column("grad_norms", JSON),
    Column("valid", JSON),
    Column("update_norm", Float),
    Column("solve_seconds", Float),
    # which samples drive the worst conflict (core.events.BalanceEvent.attribution); read one step at a time
    Column("attribution", JSON),
)

samples = Table(
    "samples", metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("run_id", Integer, ForeignKey("runs.id", ondelete="CASCADE"), nullable=False),
    Column("step", Integer, nullable=False),
    Column("idx", Integer, nullable=False),  # position in the step's batch
    Column("prompt", Text, nullable=False),
    Column("source", String(200)),
    Column("seed", BigInteger),
    Column("group_id", Integer),  # the prompt group of the advantage
    Column("path", String(1000), nullable=False),  # image, relative to the run folder
    Column("rewards", JSON),
    Column("advantages", JSON),
    UniqueConstraint("run_id", "step", "idx"),
)

# The fixed preview prompts rendered at each sample step (TrainConfig.preview_prompts): the progression strip.
previews = Table(
    "previews", metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("run_id", Integer, ForeignKey("runs.id", ondelete="CASCADE"), nullable=False),
    Column("step", Integer, nullable=False),
    Column("idx", Integer, nullable=False),  # which preview (the same prompt and seed at every step)
    Column("prompt", Text, nullable=False),
    Column("source", String(200)),
    Column("seed", BigInteger),
    Column("path", String(1000), nullable=False),  # image, relative to the run folder
    Column("rewards", JSON),
    UniqueConstraint("run_id", "step", "idx"),
)

checkpoints = Table(
    "checkpoints", metadata,
    Column("run_id", Integer, ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True),
    Column("step", Integer, primary_key=True),
    Column("path", String(1000), nullable=False),  # relative to the run folder
    Column("created_at", Float, nullable=False),
)

evaluations = Table(  # filled by the evaluation issue: held-out scores of a run's checkpoint
    "evaluations", metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("run_id", Integer, ForeignKey("runs.id", ondelete="CASCADE"), nullable=False),
    Column("checkpoint_step", Integer),
    Column("name", String(200), nullable=False),  # e.g. the prompt set
    Column("scores", JSON, nullable=False),  # {reward name: mean score}
    Column("details", JSON),
    Column("created_at", Float, nullable=False),
    Index(None, "run_id", "checkpoint_step"),
)

comparisons = Table(  # several runs side by side; made by a compare job (its status is the job's)
    "comparisons", metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("job_id", Integer),  # the compare job (a runs row of kind COMPARE) that makes it; no foreign key, as subject_id
    Column("name", String(200), nullable=False),
    Column("run_ids", JSON, nullable=False),
    Column("settings", JSON),
    Column("result", JSON),
    Column("created_at", Float, nullable=False),
)
