"""The storage of runs: one narrow interface over SQLAlchemy, SQLite by default, PostgreSQL by URL.

The web app reads runs only through :class:`Store` (no torch, no diffusers here). Reads are incremental:
``metrics(run_id, since_step=s)`` returns rows after step ``s`` and the step to continue from, and
``max_points`` down-samples a long run to bucket means.

SQLite runs in WAL mode (readers never block the writer) with a busy timeout, and every write
transaction starts with ``BEGIN IMMEDIATE``: a deferred transaction that reads and then writes can fail
with "database is locked" at once, without waiting, when another process committed in between.
The schema is created and upgraded by the Alembic migrations in jobs/migrations/ when a store opens.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Sequence

from sqlalchemy import Engine, Table, create_engine, delete, event, func, insert, select, text, update

from jobs import schema as s
from jobs.paths import LOG_FILE, data_home, database_url, run_folder_name

BUSY_TIMEOUT_SECONDS = 60.0
MAX_TAGS, MAX_TAG_CHARS, MAX_NOTES_CHARS = 16, 40, 5000  # a run's tags and notes (set_annotations)
MIGRATIONS = Path(__file__).parent / "migrations"
_PER_STEP_TABLES = (s.metrics, s.steps, s.balance, s.samples, s.previews, s.checkpoints)
_BATCH_TABLES = ("steps", "metrics", "balance", "samples", "previews", "checkpoints")  # Batch's row lists


class RunNotFound(LookupError):
    def __init__(self, run_id: Any):
        super().__init__(f"run {run_id!r} does not exist")


class TransitionError(ValueError):
    """An action that the run's current state does not allow; the message names both."""


@dataclass
class RunSummary:
    """What the runs list shows."""

    id: int
    name: str | None
    status: str
    strategy: str
    preset: str | None
    step: int
    total_steps: int
    progress: float  # step / total_steps
    eta_seconds: float | None  # running runs only
    headline: dict[str, float | None]  # the latest mean reward per reward
    attempt: int
    created_at: float
    started_at: float | None
    finished_at: float | None
    error: str | None
    kind: str = s.TRAIN  # train / evaluate / compare (jobs.schema.KINDS)
    subject_id: int | None = None  # an evaluate job: the training run it scores
    tags: list[str] = field(default_factory=list)  # the researcher's labels (Runs page)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclass
class RunDetail(RunSummary):
    """One run in full."""

    config: dict = field(default_factory=dict)
    code_version: str | None = None
    run_dir: Path = Path()
    log_path: Path = Path()
    device: str | None = None
    seconds_per_step: float | None = None
    num_processes: int = 1
    num_nodes: int = 1
    heartbeat_at: float | None = None
    pid: int | None = None
    pgid: int | None = None
    host: str | None = None
    proc_key: str | None = None
    devices: str | None = None
    cancel_requested: bool = False
    cancel_requested_at: float | None = None
    exit_code: int | None = None
    notes: str | None = None  # the researcher's free text

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["run_dir"], d["log_path"] = str(self.run_dir), str(self.log_path)
        return d


@dataclass
class MetricSeries:
    """Long-form metric rows ``(step, key, value)`` ordered by step then key; ``value`` None = n/a.

    ``last_step`` is the highest step read: pass it as the next ``since_step``. With down-sampling
    (``stride`` > 1) each row is the mean over the bucket of ``stride`` steps that ends at ``step``
    (buckets are aligned on multiples of ``stride``; the last one may be partial).
    """

    rows: list[tuple[int, str, float | None]]
    last_step: int
    stride: int = 1

    def by_key(self) -> dict[str, tuple[list[int], list[float | None]]]:
        out: dict[str, tuple[list[int], list[float | None]]] = {}
        for step, key, value in self.rows:
            xs, ys = out.setdefault(key, ([], []))
            xs.append(step)
            ys.append(value)
        return out


@dataclass
class Batch:
    """Rows of one flush, written in one transaction (see jobs.writer)."""

    steps: list[dict] = field(default_factory=list)
    metrics: list[dict] = field(default_factory=list)
    balance: list[dict] = field(default_factory=list)
    samples: list[dict] = field(default_factory=list)
    previews: list[dict] = field(default_factory=list)
    checkpoints: list[dict] = field(default_factory=list)
    run: dict = field(default_factory=dict)  # column updates of the run row

    def tables(self) -> list[tuple[Table, list[dict]]]:
        """(table, rows) of every per-step table, in insert order."""
        return [(getattr(s, name), getattr(self, name)) for name in _BATCH_TABLES]

    def __len__(self) -> int:
        return sum(len(rows) for _, rows in self.tables())

    def extend(self, later: "Batch") -> None:
        for name in _BATCH_TABLES:
            getattr(self, name).extend(getattr(later, name))
        self.run.update(later.run)


def _sqlite_engine(url: str, write: bool) -> Engine:
    engine = create_engine(url, connect_args={"timeout": BUSY_TIMEOUT_SECONDS, "check_same_thread": False})

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection, _record) -> None:
        dbapi_connection.isolation_level = None  # the driver's own BEGIN is replaced by _on_begin
        cursor = dbapi_connection.cursor()
        cursor.execute(f"PRAGMA busy_timeout = {int(BUSY_TIMEOUT_SECONDS * 1000)}")
        cursor.execute("PRAGMA journal_mode = WAL")
        cursor.execute("PRAGMA synchronous = NORMAL")  # WAL + NORMAL: durable across a process crash
        cursor.execute("PRAGMA foreign_keys = ON")
        cursor.close()

    @event.listens_for(engine, "begin")
    def _on_begin(connection) -> None:
        connection.exec_driver_sql("BEGIN IMMEDIATE" if write else "BEGIN")

    return engine


class Store:
    """Runs, their per-step rows, checkpoints, evaluations and comparisons in one database.

    ``Store.open()`` uses the data directory (``MARBLE_HOME``, default ./runs) and its SQLite file unless a
    URL is given. Thread-safe; open one per process.
    """

    def __init__(self, url: str, home: str | Path, migrate: bool = True):
        self.url = url
        self.home = Path(home).resolve()
        self.dialect = url.split(":", 1)[0].split("+", 1)[0]
        if self.dialect == "sqlite":
            if url.rstrip("/") in ("sqlite:", "sqlite:/:memory:") or ":memory:" in url:
                raise ValueError(f"database url {url!r}: an in-memory SQLite database is private to one "
                                 f"connection; use a file (the job runs in another process)")
            self._read = _sqlite_engine(url, write=False)
            self._write = _sqlite_engine(url, write=True)
        else:
            self._read = self._write = create_engine(url, pool_pre_ping=True)
        if migrate:
            self.migrate()

    @classmethod
    def open(cls, home: str | Path | None = None, url: str | None = None, migrate: bool = True) -> "Store":
        root = data_home(home)
        return cls(database_url(root, url), root, migrate)

    def close(self) -> None:
        self._read.dispose()
        if self._write is not self._read:
            self._write.dispose()

    def __enter__(self) -> "Store":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- schema ---------------------------------------------------------------------------------------
    def migrate(self) -> None:
        """Upgrade the schema to the newest migration. Concurrent openers are serialized (SQLite: the
        write lock of BEGIN IMMEDIATE; PostgreSQL: an advisory lock), so the loser finds it done."""
        from alembic import command
        from alembic.config import Config
        from alembic.script import ScriptDirectory

        cfg = Config()
        cfg.set_main_option("script_location", str(MIGRATIONS))
        head = ScriptDirectory.from_config(cfg).get_current_head()
        if self.schema_version() == head:
            return
        with self._write.begin() as conn:
            if self.dialect == "postgresql":
                conn.execute(text("SELECT pg_advisory_xact_lock(7274953)"))
            cfg.attributes["connection"] = conn
            command.upgrade(cfg, "head")

    def schema_version(self) -> str | None:
        with self._read.connect() as conn:
            try:
                return conn.execute(text("SELECT version_num FROM alembic_version")).scalar()
            except Exception:  # noqa: BLE001 - no table yet
                return None

    @contextlib.contextmanager
    def _tx(self) -> Iterator[Any]:
        with self._write.begin() as conn:
            yield conn

    # ---- runs: writes ---------------------------------------------------------------------------------
    def create_run(self, config: dict, *, strategy: str, total_steps: int, preset: str | None = None,
                   name: str | None = None, code_version: str | None = None, num_processes: int = 1,
                   num_nodes: int = 1, kind: str = s.TRAIN, subject_id: int | None = None) -> int:
        """A new queued job of ``kind`` (a training run unless said otherwise); its folder is
        ``<home>/run_NNNNNN``. ``config`` is what the job does: a TrainConfig, or another kind's request."""
        if kind not in s.KINDS:
            raise ValueError(f"kind={kind!r}: valid choices: {', '.join(s.KINDS)}")
        with self._tx() as conn:
            run_id = conn.execute(insert(s.runs).values(
                kind=kind, subject_id=subject_id, name=name, status=s.QUEUED, preset=preset, strategy=strategy,
                config=config, code_version=code_version, run_dir="", total_steps=total_steps, step=0,
                num_processes=num_processes, num_nodes=num_nodes, attempt=0, created_at=time.time(),
                cancel_requested=False)).inserted_primary_key[0]
            conn.execute(update(s.runs).where(s.runs.c.id == run_id).values(run_dir=run_folder_name(run_id)))
        return int(run_id)

    def import_run(self, config: dict, origin: str, *, strategy: str, total_steps: int, step: int, batch: "Batch",
                   name: str | None, started_at: float | None, finished_at: float | None) -> tuple[int, bool]:
        """Register a finished training run made outside the queue (``python -m jobs import``): its row as
        succeeded, with every per-step row of ``batch``, in one transaction; its folder is ``<home>/run_NNNNNN``
        (the caller moves the copied folder there). Returns (run id, created); a run already imported from
        ``origin`` is not imported again: (its id, False)."""
        with self._tx() as conn:
            found = conn.execute(select(s.runs.c.id).where(s.runs.c.origin == origin)).scalar()
            if found is not None:
                return int(found), False
            run_id = int(conn.execute(insert(s.runs).values(
                kind=s.TRAIN, origin=origin, name=name, status=s.SUCCEEDED, preset=None, strategy=strategy,
                config=config, run_dir="", total_steps=total_steps, step=step, headline=batch.run.get("headline"),
                device=batch.run.get("device"), num_processes=1, num_nodes=1, attempt=1, created_at=time.time(),
                started_at=started_at, finished_at=finished_at, cancel_requested=False)).inserted_primary_key[0])
            conn.execute(update(s.runs).where(s.runs.c.id == run_id).values(run_dir=run_folder_name(run_id)))
            for table, rows in batch.tables():
                if rows:
                    conn.execute(insert(table), [{"run_id": run_id, **row} for row in rows])
        return run_id, True

    def imported_from(self, origin: str) -> int | None:
        """The run imported from the folder ``origin`` (absolute), or None."""
        with self._read.connect() as conn:
            found = conn.execute(select(s.runs.c.id).where(s.runs.c.origin == origin)).scalar()
        return None if found is None else int(found)

    def claim(self, run_id: int | None = None, slots: int | None = None) -> int | None:
        """queued -> running for ``run_id`` (or the oldest queued run) while fewer than ``slots`` run.
        Returns the claimed id, or None."""
        r = s.runs.c
        with self._tx() as conn:
            if slots is not None:
                running = conn.execute(select(func.count()).where(r.status == s.RUNNING)).scalar_one()
                if running >= slots:
                    return None
            if run_id is None:
                run_id = conn.execute(select(r.id).where(r.status == s.QUEUED).order_by(r.id).limit(1)).scalar()
                if run_id is None:
                    return None
            done = conn.execute(update(s.runs).where(r.id == run_id, r.status == s.QUEUED).values(
                status=s.RUNNING, started_at=time.time(), finished_at=None, heartbeat_at=None, pid=None,
                pgid=None, host=None, proc_key=None, devices=None, exit_code=None, error=None,
                attempt=r.attempt + 1)).rowcount
        return int(run_id) if done else None

    def set_process(self, run_id: int, *, pid: int, pgid: int | None, host: str, proc_key: str | None,
                    devices: str | None = None) -> None:
        with self._tx() as conn:
            conn.execute(update(s.runs).where(s.runs.c.id == run_id).values(
                pid=pid, pgid=pgid, host=host, proc_key=proc_key, devices=devices))

    def finish(self, run_id: int, status: str, *, error: str | None = None, exit_code: int | None = None,
               expect: Sequence[str] = (s.RUNNING,)) -> bool:
        """Move a run to a final state if it is in ``expect``; False when someone else moved it first."""
        if status not in s.FINAL:
            raise ValueError(f"finish: status={status!r}: valid choices: {', '.join(s.FINAL)}")
        with self._tx() as conn:
            done = conn.execute(update(s.runs).where(s.runs.c.id == run_id, s.runs.c.status.in_(expect)).values(
                status=status, error=error, exit_code=exit_code, finished_at=time.time())).rowcount
        return bool(done)

    def request_cancel(self, run_id: int) -> str:
        """Queued: cancelled at once. Running: raise the stop flag that the job polls. Returns the status."""
        r = s.runs.c
        with self._tx() as conn:
            status = conn.execute(select(r.status).where(r.id == run_id)).scalar()
            if status is None:
                raise RunNotFound(run_id)
            if status == s.QUEUED:
                conn.execute(update(s.runs).where(r.id == run_id).values(status=s.CANCELLED, finished_at=time.time()))
                return s.CANCELLED
            if status == s.RUNNING:
                conn.execute(update(s.runs).where(r.id == run_id, r.cancel_requested.is_(False)).values(
                    cancel_requested=True, cancel_requested_at=time.time()))
            return status

    def requeue(self, run_id: int, config: dict | None = None, total_steps: int | None = None,
                from_step: int | None = None) -> None:
        """A stopped run back to queued, to resume from its last checkpoint (jobs.job does the rest);
        ``from_step``: from that checkpoint instead: the rows after it (and the later checkpoints' records)
        are deleted in the same transaction."""
        r = s.runs.c
        with self._tx() as conn:
            row = conn.execute(select(r.status, r.step, r.total_steps).where(r.id == run_id)).first()
            if row is None:
                raise RunNotFound(run_id)
            more_steps = total_steps is not None and total_steps > row.step
            if not (row.status in s.RESUMABLE or (row.status == s.SUCCEEDED and more_steps)):
                raise TransitionError(
                    f"run {run_id} is {row.status}: resume needs one of {', '.join(s.RESUMABLE)} (or "
                    f"{s.SUCCEEDED} with more steps than the {row.step} done)")
            values: dict[str, Any] = dict(status=s.QUEUED, finished_at=None, error=None, exit_code=None,
                                          cancel_requested=False, cancel_requested_at=None)
            if config is not None:
                values["config"] = config
            if total_steps is not None:
                values["total_steps"] = total_steps
            if from_step is not None:
                for t in _PER_STEP_TABLES:
                    conn.execute(delete(t).where(t.c.run_id == run_id, t.c.step > from_step))
                values["step"] = min(row.step, from_step)
            conn.execute(update(s.runs).where(r.id == run_id, r.status == row.status).values(**values))

    def truncate_after(self, run_id: int, step: int) -> int:
        """Delete every per-step row after ``step`` (a resumed run writes them again); returns the count."""
        with self._tx() as conn:
            n = sum(conn.execute(delete(t).where(t.c.run_id == run_id, t.c.step > step)).rowcount
                    for t in _PER_STEP_TABLES)
            conn.execute(update(s.runs).where(s.runs.c.id == run_id, s.runs.c.step > step).values(step=step))
        return n

    def write_batch(self, run_id: int, batch: Batch, heartbeat: bool = False) -> bool:
        """Insert a batch and update the run row in one transaction; with ``heartbeat`` also stamp
        heartbeat_at. Returns the run's stop flag."""
        with self._tx() as conn:
            for table, rows in batch.tables():
                if rows:
                    conn.execute(insert(table), [{"run_id": run_id, **row} for row in rows])
            values = dict(batch.run)
            if heartbeat:
                values["heartbeat_at"] = time.time()
            if values:
                conn.execute(update(s.runs).where(s.runs.c.id == run_id).values(**values))
            return bool(conn.execute(select(s.runs.c.cancel_requested).where(s.runs.c.id == run_id)).scalar())

    def heartbeat(self, run_id: int) -> bool:
        """Stamp heartbeat_at alone; returns the stop flag (the job's fallback when a batch fails)."""
        return self.write_batch(run_id, Batch(), heartbeat=True)

    def set_annotations(self, run_id: int, tags: Sequence[str] | None = None, notes: str | None = None) -> None:
        """Replace a run's tags and notes (any state: they are the researcher's, not the job's). A tag is
        trimmed; duplicates are dropped; an empty notes text is stored as none. Raises ValueError naming the
        value and the rule it breaks, RunNotFound for an unknown run."""
        clean: list[str] = []
        for tag in tags or []:
            t = str(tag).strip()
            if not t or len(t) > MAX_TAG_CHARS or "," in t:
                raise ValueError(f"tag {t!r}: a tag is 1 to {MAX_TAG_CHARS} characters without a comma")
            if t not in clean:
                clean.append(t)
        if len(clean) > MAX_TAGS:
            raise ValueError(f"tags ({len(clean)} of them): at most {MAX_TAGS} per run")
        text_ = (notes or "").strip() or None
        if text_ is not None and len(text_) > MAX_NOTES_CHARS:
            raise ValueError(f"notes ({len(text_)} characters): at most {MAX_NOTES_CHARS} characters")
        with self._tx() as conn:
            done = conn.execute(update(s.runs).where(s.runs.c.id == run_id).values(tags=clean or None, notes=text_))
        if done.rowcount == 0:
            raise RunNotFound(run_id)

    def add_evaluation(self, run_id: int, name: str, scores: dict, checkpoint_step: int | None = None,
                       details: dict | None = None) -> int:
        with self._tx() as conn:
            return int(conn.execute(insert(s.evaluations).values(
                run_id=run_id, name=name, scores=scores, checkpoint_step=checkpoint_step, details=details,
                created_at=time.time())).inserted_primary_key[0])

    def add_comparison(self, name: str, run_ids: list[int], settings: dict | None = None,
                       result: dict | None = None, job_id: int | None = None) -> int:
        with self._tx() as conn:
            return int(conn.execute(insert(s.comparisons).values(
                name=name, run_ids=list(run_ids), settings=settings, result=result, job_id=job_id,
                created_at=time.time())).inserted_primary_key[0])

    def update_comparison(self, comparison_id: int, result: dict | None = None, *, job_id: int | None = None) -> None:
        """Replace a comparison's result (its job writes the grid) and/or link the job that makes it."""
        values: dict[str, Any] = {}
        if result is not None:
            values["result"] = result
        if job_id is not None:
            values["job_id"] = job_id
        if not values:
            return
        with self._tx() as conn:
            done = conn.execute(update(s.comparisons).where(s.comparisons.c.id == comparison_id)
                                .values(**values)).rowcount
        if not done:
            raise LookupError(f"comparison {comparison_id!r} does not exist")

    def delete_run(self, run_id: int) -> None:
        """Delete a job that is not queued or running: its rows, its evaluations, the finished evaluate jobs of it,
        and their folders (a folder outside the data directory, e.g. an imported run's, is left alone)."""
        r = s.runs.c
        with self._tx() as conn:
            row = conn.execute(select(r.status, r.run_dir).where(r.id == run_id)).first()
            if row is None:
                raise RunNotFound(run_id)
            if row.status in s.ACTIVE:
                raise TransitionError(f"run {run_id} is {row.status}: cancel it before deleting it")
            busy = conn.execute(select(r.id).where(r.subject_id == run_id, r.status.in_(s.ACTIVE))).scalar()
            if busy is not None:
                raise TransitionError(f"run {run_id} is being evaluated by job {busy}: cancel that job before "
                                      f"deleting the run")
            dirs = [row.run_dir] + list(conn.execute(select(r.run_dir).where(r.subject_id == run_id)).scalars())
            for table in (*_PER_STEP_TABLES, s.evaluations):
                conn.execute(delete(table).where(table.c.run_id == run_id))
            conn.execute(delete(s.runs).where(r.subject_id == run_id))
            conn.execute(update(s.comparisons).where(s.comparisons.c.job_id == run_id).values(job_id=None))
            conn.execute(delete(s.runs).where(r.id == run_id))
        for rel in dirs:
            folder = self.home / rel
            if rel and folder.is_dir() and folder.resolve().is_relative_to(self.home):  # never outside home
                shutil.rmtree(folder, ignore_errors=True)

    # ---- runs: reads ----------------------------------------------------------------------------------
    def list_runs(self, status: str | Sequence[str] | None = None, limit: int | None = None,
                  kind: str | Sequence[str] | None = None) -> list[RunSummary]:
        """Newest first, with progress, ETA and the latest rewards: one query on the runs table. Every kind of
        job unless ``kind`` says which (the worker counts them all: each takes a slot)."""
        r = s.runs.c
        q = select(*[r[c] for c in _SUMMARY_COLUMNS]).order_by(r.id.desc())
        if status is not None:
            q = q.where(r.status.in_([status] if isinstance(status, str) else list(status)))
        if kind is not None:
            q = q.where(r.kind.in_([kind] if isinstance(kind, str) else list(kind)))
        if limit is not None:
            q = q.limit(limit)
        with self._read.connect() as conn:
            return [_summary(row._mapping) for row in conn.execute(q)]

    def get_run(self, run_id: int) -> RunDetail:
        with self._read.connect() as conn:
            row = conn.execute(select(s.runs).where(s.runs.c.id == run_id)).first()
        if row is None:
            raise RunNotFound(run_id)
        m = row._mapping
        base = _summary(m)
        run_dir = self.home / m["run_dir"]
        return RunDetail(**dataclasses.asdict(base), config=m["config"], code_version=m["code_version"],
                         run_dir=run_dir, log_path=run_dir / LOG_FILE, device=m["device"],
                         seconds_per_step=m["seconds_per_step"], num_processes=m["num_processes"],
                         num_nodes=m["num_nodes"], heartbeat_at=m["heartbeat_at"], pid=m["pid"], pgid=m["pgid"],
                         host=m["host"], proc_key=m["proc_key"], devices=m["devices"],
                         cancel_requested=bool(m["cancel_requested"]),
                         cancel_requested_at=m["cancel_requested_at"], exit_code=m["exit_code"], notes=m["notes"])

    def run_dir(self, run_id: int) -> Path:
        with self._read.connect() as conn:
            rel = conn.execute(select(s.runs.c.run_dir).where(s.runs.c.id == run_id)).scalar()
        if rel is None:
            raise RunNotFound(run_id)
        return self.home / rel

    def status(self, run_id: int) -> str:
        with self._read.connect() as conn:
            st = conn.execute(select(s.runs.c.status).where(s.runs.c.id == run_id)).scalar()
        if st is None:
            raise RunNotFound(run_id)
        return st

    def count_runs(self, status: str | Sequence[str]) -> int:
        statuses = [status] if isinstance(status, str) else list(status)
        with self._read.connect() as conn:
            return int(conn.execute(select(func.count()).where(s.runs.c.status.in_(statuses))).scalar_one())

    # ---- per-step reads -------------------------------------------------------------------------------
    def metrics(self, run_id: int, since_step: int = 0, keys: Sequence[str] | None = None,
                max_points: int | None = None) -> MetricSeries:
        """Metric rows of steps after ``since_step`` (see :class:`MetricSeries`). ``max_points`` caps the
        number of steps returned per key by averaging buckets of ``stride`` consecutive steps."""
        m = s.metrics.c
        where = [m.run_id == run_id, m.step > since_step]
        if keys is not None:
            where.append(m.key.in_(list(keys)))
        with self._read.connect() as conn:
            last = conn.execute(select(func.max(m.step)).where(*where)).scalar()
            if last is None:
                return MetricSeries([], since_step, 1)
            stride = 1
            if max_points is not None and max_points > 0 and last - since_step > max_points:
                stride = math.ceil((last - since_step) / max_points)
            if stride == 1:
                q = select(m.step, m.key, m.value).where(*where).order_by(m.step, m.key)
            else:
                bucket = (m.step - 1) // stride
                q = (select(func.max(m.step).label("step"), m.key, func.avg(m.value).label("value"))
                     .where(*where).group_by(bucket, m.key).order_by(func.max(m.step), m.key))
            rows = [(int(a), b, None if c is None else float(c)) for a, b, c in conn.execute(q)]
        return MetricSeries(rows, int(last), stride)

    def metric_keys(self, run_id: int) -> list[str]:
        """The metric names of a run (read from its first step)."""
        m = s.metrics.c
        with self._read.connect() as conn:
            first = conn.execute(select(func.min(m.step)).where(m.run_id == run_id)).scalar()
            if first is None:
                return []
            return list(conn.execute(select(m.key).where(m.run_id == run_id, m.step == first).order_by(m.key))
                        .scalars())

    def steps(self, run_id: int, since_step: int = 0) -> list[dict]:
        """Per step: phase (full / diagnostic / amortized), stage and wall time."""
        t = s.steps.c
        q = select(t.step, t.phase, t.stage, t.at).where(t.run_id == run_id, t.step > since_step).order_by(t.step)
        with self._read.connect() as conn:
            return [dict(row._mapping) for row in conn.execute(q)]

    def balance(self, run_id: int, since_step: int = 0, max_points: int | None = None) -> list[dict]:
        """Balancer rows after ``since_step``: α raw and EMA, cosine matrix, cosine to the update, gradient
        norms, validity, solver. ``max_points`` keeps that many rows, evenly spaced, always the last."""
        b = s.balance.c
        where = [b.run_id == run_id, b.step > since_step]
        columns = [c for c in s.balance.c if c.name != "attribution"]  # per-sample records: read one step at a time
        with self._read.connect() as conn:
            if max_points is not None and max_points > 0:
                all_steps = list(conn.execute(select(b.step).where(*where).order_by(b.step)).scalars())
                if len(all_steps) > max_points:
                    chosen = _evenly_spaced(all_steps, max_points)
                    rows = []
                    for i in range(0, len(chosen), 500):
                        rows += conn.execute(select(*columns).where(b.run_id == run_id,
                                                                    b.step.in_(chosen[i:i + 500]))
                                             .order_by(b.step)).all()
                    return [_balance_row(r._mapping) for r in rows]
            q = select(*columns).where(*where).order_by(b.step)
            return [_balance_row(r._mapping) for r in conn.execute(q)]

    def attribution(self, run_id: int, step: int) -> dict:
        """The conflict attribution recorded at diagnosed step ``step`` ({} when none: the per-reward gradient
        path, or a run from before it was recorded)."""
        b = s.balance.c
        with self._read.connect() as conn:
            found = conn.execute(select(b.attribution).where(b.run_id == run_id, b.step == step)).scalar()
        return found or {}

    def samples(self, run_id: int, step: int | None = None, since_step: int = 0,
                prompt: str | None = None) -> list[dict]:
        """Samples of one ``step``, or of every step after ``since_step`` (only those of ``prompt`` when given):
        prompt, source, seed, group, per-reward scores and advantages, and ``image`` (absolute path)."""
        t = s.samples.c
        where = [t.run_id == run_id] + ([t.step == step] if step is not None else [t.step > since_step])
        if prompt is not None:
            where.append(t.prompt == prompt)
        run_dir = self.run_dir(run_id)
        q = select(s.samples).where(*where).order_by(t.step, t.idx)
        with self._read.connect() as conn:
            out = []
            for row in conn.execute(q):
                d = dict(row._mapping)
                d.pop("id")
                d.pop("run_id")
                d["group"] = d.pop("group_id")
                d["image"] = str(run_dir / d["path"])
                out.append(d)
            return out

    def sample_prompts(self, run_id: int) -> list[tuple[str, int]]:
        """(prompt, number of sample steps it appears at), most frequent first (then first seen)."""
        t = s.samples.c
        n = func.count(t.step.distinct())
        q = (select(t.prompt, n).where(t.run_id == run_id).group_by(t.prompt)
             .order_by(n.desc(), func.min(t.step), func.min(t.idx)))
        with self._read.connect() as conn:
            return [(p, int(c)) for p, c in conn.execute(q)]

    def previews(self, run_id: int, prompt: str | None = None) -> list[dict]:
        """The run's preview images (every sample step, or those of ``prompt``), by step then preview index:
        prompt, source, seed, idx, per-reward scores and ``image`` (absolute path)."""
        t = s.previews.c
        where = [t.run_id == run_id] + ([t.prompt == prompt] if prompt is not None else [])
        run_dir = self.run_dir(run_id)
        with self._read.connect() as conn:
            rows = conn.execute(select(t.step, t.idx, t.prompt, t.source, t.seed, t.path, t.rewards)
                                .where(*where).order_by(t.step, t.idx))
            return [{**row._mapping, "image": str(run_dir / row.path)} for row in rows]

    def preview_prompts(self, run_id: int) -> list[tuple[str, int]]:
        """(prompt, number of sample steps it was rendered at), in preview order."""
        t = s.previews.c
        q = (select(t.prompt, func.count(t.step.distinct())).where(t.run_id == run_id).group_by(t.prompt)
             .order_by(func.min(t.idx)))
        with self._read.connect() as conn:
            return [(p, int(c)) for p, c in conn.execute(q)]

    def preview_steps(self, run_id: int) -> list[int]:
        t = s.previews.c
        with self._read.connect() as conn:
            return list(conn.execute(select(t.step).where(t.run_id == run_id).distinct().order_by(t.step)).scalars())

    def sample_steps(self, run_id: int) -> list[int]:
        t = s.samples.c
        with self._read.connect() as conn:
            return list(conn.execute(select(t.step).where(t.run_id == run_id).distinct().order_by(t.step)).scalars())

    def checkpoints(self, run_id: int) -> list[dict]:
        """``{step, path (absolute), created_at, exists}``, oldest first."""
        t = s.checkpoints.c
        run_dir = self.run_dir(run_id)
        with self._read.connect() as conn:
            rows = conn.execute(select(t.step, t.path, t.created_at).where(t.run_id == run_id).order_by(t.step))
            out = []
            for row in rows:
                path = run_dir / row.path
                out.append({"step": row.step, "path": str(path), "created_at": row.created_at,
                            "exists": path.is_dir()})
            return out

    def latest_checkpoint(self, run_id: int) -> dict | None:
        """The newest recorded checkpoint whose folder exists. A checkpoint row is written in the same
        transaction as (or after) every row up to its step, so resuming from it loses nothing."""
        found = [c for c in self.checkpoints(run_id) if c["exists"]]
        return found[-1] if found else None

    def evaluations(self, run_id: int) -> list[dict]:
        t = s.evaluations.c
        with self._read.connect() as conn:
            q = select(s.evaluations).where(t.run_id == run_id).order_by(t.checkpoint_step, t.id)
            return [dict(row._mapping) for row in conn.execute(q)]

    def comparisons(self) -> list[dict]:
        with self._read.connect() as conn:
            return [dict(row._mapping) for row in conn.execute(select(s.comparisons).order_by(s.comparisons.c.id))]

    def get_comparison(self, comparison_id: int) -> dict:
        with self._read.connect() as conn:
            row = conn.execute(select(s.comparisons).where(s.comparisons.c.id == comparison_id)).first()
        if row is None:
            raise LookupError(f"comparison {comparison_id!r} does not exist")
        return dict(row._mapping)

    def log_tail(self, run_id: int, lines: int = 40) -> str:
        """The last ``lines`` lines of the run's job log ('' when there is none)."""
        path = self.run_dir(run_id) / LOG_FILE
        if not path.is_file():
            return ""
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - 64 * 1024))
            data = f.read().decode("utf-8", errors="replace")
        return "\n".join(data.splitlines()[-lines:])


_SUMMARY_COLUMNS = ("id", "name", "status", "strategy", "preset", "step", "total_steps", "headline", "attempt",
                    "created_at", "started_at", "finished_at", "error", "seconds_per_step", "kind", "subject_id",
                    "tags")


def _summary(m: Any) -> RunSummary:
    total = m["total_steps"] or 0
    step = m["step"] or 0
    eta = None
    if m["status"] == s.RUNNING and m["seconds_per_step"] is not None:
        eta = max(total - step, 0) * float(m["seconds_per_step"])
    return RunSummary(id=m["id"], name=m["name"], status=m["status"], strategy=m["strategy"], preset=m["preset"],
                      step=step, total_steps=total, progress=(step / total) if total else 0.0, eta_seconds=eta,
                      headline=dict(m["headline"] or {}), attempt=m["attempt"], created_at=m["created_at"],
                      started_at=m["started_at"], finished_at=m["finished_at"], error=m["error"],
                      kind=m["kind"] or s.TRAIN, subject_id=m["subject_id"], tags=list(m["tags"] or []))


def _balance_row(m: Any) -> dict:
    d = dict(m)
    d.pop("run_id")
    return d


def _evenly_spaced(items: list[int], n: int) -> list[int]:
    if n <= 1:
        return items[-1:]
    idx = sorted({round(i * (len(items) - 1) / (n - 1)) for i in range(n)})
    return [items[i] for i in idx]
