"""Shared by tests/test_jobs_*.py: database URLs (SQLite file, and PostgreSQL when
MARBLE_TEST_DATABASE_URL is set), synthetic events and process helpers."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from core.events import BalanceEvent, CheckpointEvent, SampleEvent, StartEvent, StepEvent

REPO = Path(__file__).resolve().parents[1]
PG_URL_ENV = "MARBLE_TEST_DATABASE_URL"
PG_SKIP = (f"PostgreSQL variant: {PG_URL_ENV} is not set (e.g. postgresql+psycopg://postgres@127.0.0.1:5432/postgres;"
           f" .ci/run starts a local server and sets it)")
REWARDS = ["jpeg_compressibility", "colorfulness", "brightness"]
KEYS_PER_STEP = 4 + 4 * len(REWARDS)  # loss, kl, grad_norm, seconds + reward/std/alpha/valid per reward


def database_urls(tmp_path: Path, backend: str):
    """Yields a fresh database URL of ``backend`` ("sqlite" or "postgresql"); PostgreSQL gets a new
    database, dropped afterwards."""
    if backend == "sqlite":
        yield f"sqlite:///{tmp_path / 'marble.db'}"
        return
    base = os.environ.get(PG_URL_ENV)
    if not base:
        pytest.skip(PG_SKIP)
    from sqlalchemy import create_engine, make_url, text

    name = f"marble_test_{uuid.uuid4().hex[:12]}"
    admin = create_engine(base, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    try:
        yield make_url(base).set(database=name).render_as_string(hide_password=False)
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


def step_event(step: int, phase: str = "amortized", value: float | None = None) -> StepEvent:
    v = float(step) if value is None else value
    return StepEvent(step=step, rewards={n: v + i for i, n in enumerate(REWARDS)},
                     alpha={n: 1 / 3 for n in REWARDS}, seconds=0.5, loss=1.0 / step, kl=float("nan"),
                     grad_norm=0.1, phase=phase, valid_counts={n: 8 for n in REWARDS},
                     reward_std={n: 0.1 for n in REWARDS})


def balance_event(step: int) -> BalanceEvent:
    k = len(REWARDS)
    return BalanceEvent(step=step, alpha_raw={n: 0.2 + 0.3 * (i == 0) for i, n in enumerate(REWARDS)},
                        alpha_ema={n: 1 / 3 for n in REWARDS},
                        cosine={"names": REWARDS, "matrix": [[1.0 if i == j else 0.1 for j in range(k)]
                                                             for i in range(k)]},
                        cos_to_update={n: 0.5 for n in REWARDS}, cos_to_mean={n: 0.25 for n in REWARDS},
                        grad_norms={n: 2.0 for n in REWARDS},
                        valid={n: True for n in REWARDS}, solver="cvxpy-OSQP", phase="harmonized", update_norm=1.5)


def sample_event(step: int, n: int = 2) -> SampleEvent:
    return SampleEvent(step=step, items=[{
        "prompt": f"a red circle {i}", "source": "tiny", "seed": 1000 + i, "group": i // 2,
        "path": f"samples/step_{step:06d}/{i:03d}.png", "rewards": {r: 0.5 for r in REWARDS},
        "advantages": {r: (-1) ** i * 0.7 for r in REWARDS}} for i in range(n)])


def start_event(total: int, step: int = 0) -> StartEvent:
    return StartEvent(step=step, total_steps=total, reward_names=REWARDS, strategy="marble",
                      trainable_parameters=1000, device="cpu")


def checkpoint_event(step: int, run_dir: Path) -> CheckpointEvent:
    path = run_dir / "checkpoints" / f"step_{step:06d}"
    path.mkdir(parents=True, exist_ok=True)
    return CheckpointEvent(step=step, path=str(path))


def subprocess_env(home: Path, db_url: str | None = None, **extra: str) -> dict:
    env = dict(os.environ, MARBLE_HOME=str(home), HF_HUB_OFFLINE="1", PYTHONPATH=str(REPO),
               MARBLE_HEARTBEAT_SECONDS="0.5", TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
    if db_url:
        env["MARBLE_DATABASE_URL"] = db_url
    env.update(extra)
    return env


def jobs_cli(home: Path, *args: str, db_url: str | None = None, timeout: float = 120, **env: str):
    """``python -m jobs ARGS`` in a subprocess; returns the CompletedProcess."""
    return subprocess.run([sys.executable, "-m", "jobs", *args], cwd=REPO, env=subprocess_env(home, db_url, **env),
                          capture_output=True, text=True, timeout=timeout)


def wait_for(predicate, timeout: float, what: str, interval: float = 0.2, log=None):
    """Poll ``predicate`` until it returns a truthy value (returned); fail after ``timeout`` seconds
    (with ``log()`` in the message when given)."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            detail = f"\n{log()}" if log else ""
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}{detail}")
        time.sleep(interval)


def kill_group(pgid: int | None) -> None:
    if not pgid:
        return
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def stop_everything(store, workers: list, extra_pids: list[int] = ()) -> None:
    """A worker fixture's teardown: kill the workers' process groups (and ``extra_pids``'), then every job
    process a run of ``store`` still has, and close the store."""
    from jobs.runner import process_alive

    for pid in [*(w.pid for w in workers), *extra_pids]:
        kill_group(pid)
    for w in workers:
        w.wait(timeout=30)
    for summary in store.list_runs():
        run = store.get_run(summary.id)
        if run.pgid and process_alive(run.pid, run.proc_key):
            kill_group(run.pgid)
    store.close()


def run_cli(home: Path, *args: str) -> tuple[int, str, str]:
    """``python -m jobs ARGS`` in this process (the CLI code without a new interpreter); returns
    (exit code, stdout, stderr)."""
    import contextlib
    import io

    from jobs.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["--home", str(home), *args])
    return code, out.getvalue(), err.getvalue()
