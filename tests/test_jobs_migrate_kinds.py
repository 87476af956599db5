"""Migration 0002 (one queue for every kind of job) on a database written by the previous schema: every run, row
and comparison survives; runs become training jobs; a comparison's own status words become the runs'."""

import time

import pytest
from alembic import command
from alembic.config import Config
from sqlalchemy import create_engine, text

from jobs import schema as s
from jobs.storage import MIGRATIONS, Store
from tests.jobs_support import database_urls


@pytest.fixture(params=["sqlite", "postgresql"])
def old_url(request, tmp_path):
    """A database at revision 0001 with a finished run (metrics, a checkpoint, an evaluation) and three comparisons
    in the old vocabulary (done / running / failed)."""
    for url in database_urls(tmp_path, request.param):
        engine = create_engine(url)
        with engine.begin() as conn:
            cfg = Config()
            cfg.set_main_option("script_location", str(MIGRATIONS))
            cfg.attributes["connection"] = conn
            command.upgrade(cfg, "0001")
        now = time.time()
        with engine.begin() as conn:
            conn.execute(text(
                "INSERT INTO runs (name, status, strategy, config, run_dir, total_steps, step, num_processes, "
                "num_nodes, attempt, created_at, cancel_requested) VALUES ('old run', 'succeeded', 'marble', "
                "'{\"steps\": 2}', 'run_000001', 2, 2, 1, 1, 1, :now, false)"), {"now": now})
            for step in (1, 2):
                conn.execute(text("INSERT INTO metrics (run_id, step, key, value) VALUES (1, :s, 'reward/x', :v)"),
                             {"s": step, "v": step / 10})
            conn.execute(text("INSERT INTO checkpoints (run_id, step, path, created_at) VALUES "
                              "(1, 2, 'checkpoints/step_000002', :now)"), {"now": now})
            conn.execute(text("INSERT INTO evaluations (run_id, checkpoint_step, name, scores, created_at) VALUES "
                              "(1, 2, 'held-out test', '{\"x\": 0.5}', :now)"), {"now": now})
            # ids come from the table's own sequence, as the app wrote them (an explicit id would leave a
            # PostgreSQL sequence behind and the next insert would collide with it): 1, 2, 3 in this order
            for result in ('{"status": "done", "rows": [{"prompt": "p", "seed": 0, "cells": []}]}',
                           '{"status": "running"}', '{"status": "failed", "error": "boom"}'):
                conn.execute(text("INSERT INTO comparisons (name, run_ids, result, created_at) VALUES "
                                  "('c', '[1]', :r, :now)"), {"r": result, "now": now})
        engine.dispose()
        yield url


def test_an_old_database_migrates_without_loss(old_url, tmp_path):
    store = Store(old_url, tmp_path / "home")  # opening it upgrades it to the newest revision
    try:
        run = store.get_run(1)
        assert (run.kind, run.subject_id, run.status, run.name, run.step) == (s.TRAIN, None, s.SUCCEEDED, "old run", 2)
        assert store.metrics(1).by_key()["reward/x"] == ([1, 2], [0.1, 0.2])
        assert [c["step"] for c in store.checkpoints(1)] == [2]
        assert store.evaluations(1)[0]["scores"] == {"x": 0.5}
        assert [r.id for r in store.list_runs(kind=s.TRAIN)] == [1] and store.list_runs(kind=s.EVALUATE) == []
        results = {c["id"]: (c["job_id"], c["result"]) for c in store.comparisons()}
        assert results[1][0] is None and results[1][1]["status"] == s.SUCCEEDED and results[1][1]["rows"]
        assert results[2][1]["status"] == s.INTERRUPTED and "start it again" in results[2][1]["error"]
        assert results[3][1] == {"status": s.FAILED, "error": "boom"}
        new = store.create_run({"run_id": 1}, strategy="-", total_steps=2, kind=s.EVALUATE, subject_id=1)
        assert store.get_run(new).kind == s.EVALUATE
        store.finish(new, s.CANCELLED, expect=(s.QUEUED,))
        store.delete_run(1)  # the foreign keys still cascade: the run's rows and its evaluate job go with it
        assert store.metrics(1).rows == [] and store.list_runs() == []
    finally:
        store.close()
