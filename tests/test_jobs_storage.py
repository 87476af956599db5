"""Storage: schema by migration, batched writes, incremental and down-sampled reads, state transitions.

Every test runs on a real SQLite file and, when MARBLE_TEST_DATABASE_URL is set, on PostgreSQL.
"""

import json
import subprocess
import sys

import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.exc import IntegrityError

from jobs import schema as s
from jobs.storage import Batch, RunNotFound, Store, TransitionError
from jobs.writer import EventWriter
from tests.jobs_support import (KEYS_PER_STEP, REPO, REWARDS, balance_event, checkpoint_event, database_urls,
                                sample_event, start_event, step_event)


@pytest.fixture(params=["sqlite", "postgresql"])
def store(request, tmp_path):
    for url in database_urls(tmp_path, request.param):
        st = Store(url, tmp_path / "home")
        yield st
        st.close()


def _new_run(store: Store, total: int = 30, name: str | None = None) -> int:
    return store.create_run({"steps": total}, strategy="marble", total_steps=total, preset="tiny", name=name)


def _running(store: Store, total: int = 30) -> int:
    run_id = _new_run(store, total)
    assert store.claim(run_id) == run_id
    return run_id


def test_open_migrates_to_the_schema_of_jobs_schema(store):
    from alembic.autogenerate import compare_metadata
    from alembic.runtime.migration import MigrationContext
    from alembic.script import ScriptDirectory
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", str(REPO / "jobs" / "migrations"))
    assert store.schema_version() == ScriptDirectory.from_config(cfg).get_current_head()
    engine = create_engine(store.url)
    with engine.connect() as conn:
        diffs = compare_metadata(MigrationContext.configure(conn), s.metadata)
        if store.dialect == "sqlite":
            assert conn.execute(text("PRAGMA journal_mode")).scalar() == "wal"
    engine.dispose()
    assert diffs == []  # the migrations build exactly the tables the code uses
    again = Store(store.url, store.home)  # opening an up-to-date database changes nothing
    assert again.schema_version() == store.schema_version()
    again.close()


def test_writer_buffers_events_and_the_reads_are_incremental(store):
    run_id = _running(store, total=30)
    run_dir = store.run_dir(run_id)
    writer = EventWriter(store, run_id, run_dir)
    writer(start_event(30))  # flushed at once: the run learns its device
    assert store.get_run(run_id).device == "cpu"
    for step in range(1, 21):
        writer(step_event(step, "harmonized" if step % 10 == 1 else "amortized"))
        if step % 10 == 1:
            writer(balance_event(step))
    writer(sample_event(20, n=4))
    assert store.metrics(run_id).rows == [] and writer.pending() > 0  # batched: nothing written yet
    assert writer.flush(heartbeat=True) is False  # no stop requested
    assert writer.pending() == 0

    series = store.metrics(run_id)
    assert len(series.rows) == 20 * KEYS_PER_STEP and series.last_step == 20 and series.stride == 1
    by_key = series.by_key()
    assert by_key["reward/colorfulness"] == (list(range(1, 21)), [float(x + 1) for x in range(1, 21)])
    assert by_key["kl"][1] == [None] * 20  # NaN -> NULL, "not applicable"
    assert by_key["valid/brightness"][1] == [8.0] * 20
    for step in range(21, 26):
        writer(step_event(step))
    writer.flush()
    newer = store.metrics(run_id, since_step=series.last_step)
    assert {row[0] for row in newer.rows} == set(range(21, 26)) and newer.last_step == 25
    assert store.metrics(run_id, since_step=25).rows == []
    only = store.metrics(run_id, since_step=22, keys=["loss"])
    assert only.rows == [(23, "loss", 1 / 23), (24, "loss", 1 / 24), (25, "loss", 1 / 25)]
    assert store.metric_keys(run_id) == sorted(by_key)

    assert [r["phase"] for r in store.steps(run_id, since_step=10)][:2] == ["harmonized", "amortized"]
    rows = store.balance(run_id)
    assert [r["step"] for r in rows] == [1, 11] and [r["step"] for r in store.balance(run_id, since_step=1)] == [11]
    b = rows[0]
    assert b["alpha_raw"]["jpeg_compressibility"] == pytest.approx(0.5) and b["solver"] == "cvxpy-OSQP"
    assert b["cosine"]["to_mean"] == {n: 0.25 for n in REWARDS}  # cos(g_k, Σg/K) kept beside the cosines
    assert b["cosine"]["names"] == REWARDS and b["cosine"]["matrix"][0][1] == pytest.approx(0.1)
    assert b["cos_to_update"] and b["grad_norms"]["brightness"] == 2.0 and b["valid"]["colorfulness"] is True
    assert store.sample_steps(run_id) == [20]
    samples = store.samples(run_id, step=20)
    assert [x["idx"] for x in samples] == [0, 1, 2, 3] and samples[1]["advantages"]["brightness"] == -0.7
    assert samples[0]["image"] == str(run_dir / "samples" / "step_000020" / "000.png") and samples[2]["group"] == 1
    assert store.samples(run_id, since_step=20) == []

    summary = store.list_runs()[0]
    assert (summary.id, summary.status, summary.step, summary.total_steps) == (run_id, s.RUNNING, 25, 30)
    assert summary.progress == pytest.approx(25 / 30) and summary.headline["colorfulness"] == 26.0
    assert summary.eta_seconds is not None and summary.eta_seconds >= 0
    assert store.get_run(run_id).heartbeat_at is not None


def test_a_checkpoint_row_is_written_with_every_row_before_it(store):
    run_id = _running(store, total=10)
    run_dir = store.run_dir(run_id)
    writer = EventWriter(store, run_id, run_dir)
    for step in range(1, 5):
        writer(step_event(step))
    writer(checkpoint_event(4, run_dir))  # no explicit flush
    assert {row[0] for row in store.metrics(run_id).rows} == {1, 2, 3, 4}
    ckpt = store.latest_checkpoint(run_id)
    assert ckpt["step"] == 4 and ckpt["path"] == str(run_dir / "checkpoints" / "step_000004") and ckpt["exists"]


def test_max_points_returns_bucket_means_of_long_runs(store):
    run_id = _running(store, total=1000)
    batch = Batch(metrics=[{"step": t, "key": "loss", "value": float(t)} for t in range(1, 1001)]
                  + [{"step": t, "key": "kl", "value": None if t % 2 else 1.0} for t in range(1, 1001)])
    store.write_batch(run_id, batch)
    series = store.metrics(run_id, max_points=100)
    assert series.stride == 10 and series.last_step == 1000
    loss = series.by_key()["loss"]
    assert len(loss[0]) == 100 and loss[0][:2] == [10, 20] and loss[0][-1] == 1000
    assert loss[1][0] == pytest.approx(5.5) and loss[1][-1] == pytest.approx(995.5)  # mean of 991..1000
    assert series.by_key()["kl"][1][0] == pytest.approx(1.0)  # NULLs (not applicable) do not count
    tail = store.metrics(run_id, since_step=990, max_points=100)
    assert tail.stride == 1 and len(tail.rows) == 20  # short reads are never down-sampled


def test_balance_max_points_keeps_evenly_spaced_rows_and_the_last(store):
    run_id = _running(store, total=2000)
    rows = [{k: v for k, v in balance_event(step).to_dict().items() if k != "event"} for step in range(1, 2001, 10)]
    store.write_batch(run_id, Batch(balance=rows))
    kept = store.balance(run_id, max_points=20)
    steps = [r["step"] for r in kept]
    assert len(steps) == 20 and steps[0] == 1 and steps[-1] == 1991 and steps == sorted(steps)
    assert len(store.balance(run_id)) == 200


def test_truncate_after_deletes_later_rows_of_that_run_only(store):
    a, b = _running(store), _running(store)
    for run_id in (a, b):
        writer = EventWriter(store, run_id, store.run_dir(run_id))
        for step in range(1, 9):
            writer(step_event(step, "harmonized"))
            writer(balance_event(step))
            writer(sample_event(step))
        writer(checkpoint_event(4, store.run_dir(run_id)))
        writer(checkpoint_event(8, store.run_dir(run_id)))
    before_b = (store.metrics(b).rows, store.balance(b), store.samples(b), store.checkpoints(b), store.steps(b))
    dropped = store.truncate_after(a, 4)
    assert dropped == 4 * (KEYS_PER_STEP + 1 + 1 + 2) + 1  # metrics, steps, balance, samples + checkpoint 8
    assert {r[0] for r in store.metrics(a).rows} == {1, 2, 3, 4} and store.get_run(a).step == 4
    assert [c["step"] for c in store.checkpoints(a)] == [4] and store.sample_steps(a) == [1, 2, 3, 4]
    assert (store.metrics(b).rows, store.balance(b), store.samples(b), store.checkpoints(b), store.steps(b)) == before_b


def test_a_step_cannot_be_stored_twice(store):
    run_id = _running(store)
    writer = EventWriter(store, run_id, store.run_dir(run_id))
    writer(step_event(1))
    writer.flush()
    writer(step_event(1))
    with pytest.raises(IntegrityError):
        writer.flush()
    assert writer.pending() > 0  # kept for a retry, not silently dropped
    assert len(store.metrics(run_id).rows) == KEYS_PER_STEP
    from jobs.job import Heartbeat

    before = store.get_run(run_id).heartbeat_at
    store.request_cancel(run_id)
    beat = Heartbeat(writer, interval=1.0)
    beat.beat()  # the refused batch does not silence the heartbeat nor hide the stop flag
    assert beat.should_stop() and (store.get_run(run_id).heartbeat_at or 0) > (before or 0)


def test_a_heartbeat_against_a_dead_database_logs_one_traceback_not_one_per_beat(caplog):
    """A full disk under the database fails every beat: the job log gets the first traceback, then a line at
    the 2nd, 5th and every 20th failed beat, and a line when the database takes the rows again."""
    import logging

    from jobs.job import Heartbeat

    class DeadWriter:
        run_id, fail = 1, True

        def flush(self, heartbeat=False):
            if self.fail:
                raise OSError(28, "No space left on device")
            return False

        class store:  # noqa: N801 - the writer's store attribute
            @staticmethod
            def heartbeat(run_id):
                raise OSError(28, "No space left on device")

    writer = DeadWriter()
    beat = Heartbeat(writer, interval=1.0)
    with caplog.at_level(logging.WARNING, logger="jobs.job"):
        for _ in range(40):
            beat.beat()
        writer.fail = False
        beat.beat()
    records = [r for r in caplog.records if r.name == "jobs.job"]
    assert sum(r.exc_info is not None for r in records) == 1  # one traceback in 40 failed beats
    counted = [r.getMessage() for r in records if "failed beats" in r.getMessage()]
    assert [m.split("(")[1].split(" failed")[0] for m in counted[:4]] == ["2", "5", "20", "40"]
    assert "takes the rows again after 40 failed beats" in records[-1].getMessage() and beat.failures == 0


def test_state_transitions(store):
    first, second, third = _new_run(store), _new_run(store), _new_run(store)
    assert [r.status for r in store.list_runs()] == [s.QUEUED] * 3
    assert store.claim(slots=1) == first  # the oldest queued run
    assert store.claim(slots=1) is None  # the one slot is taken
    assert store.claim(slots=2) == second
    assert store.get_run(second).attempt == 1
    assert store.request_cancel(third) == s.CANCELLED  # queued: cancelled at once
    assert store.claim(third) is None
    assert store.request_cancel(first) == s.RUNNING  # running: the stop flag only
    run = store.get_run(first)
    assert run.cancel_requested and run.cancel_requested_at is not None
    assert store.write_batch(first, Batch(), heartbeat=True) is True  # what the job's heartbeat reads
    with pytest.raises(TransitionError, match="running: resume needs one of failed, cancelled, interrupted"):
        store.requeue(first)
    assert store.finish(first, s.CANCELLED)
    assert not store.finish(first, s.SUCCEEDED)  # only a running run can end
    store.requeue(first)
    run = store.get_run(first)
    assert run.status == s.QUEUED and not run.cancel_requested and run.finished_at is None
    assert store.finish(second, s.SUCCEEDED)
    with pytest.raises(TransitionError, match="succeeded with more steps"):
        store.requeue(second)
    store.requeue(second, total_steps=60)
    assert store.get_run(second).total_steps == 60 and store.claim(second) == second
    assert store.get_run(second).attempt == 2
    with pytest.raises(ValueError, match="valid choices"):
        store.finish(second, s.QUEUED)
    with pytest.raises(RunNotFound):
        store.get_run(999)


def test_evaluations_and_comparisons_round_trip(store):
    a, b = _new_run(store), _new_run(store)
    ev = store.add_evaluation(a, "tiny/test", {"colorfulness": 0.7}, checkpoint_step=10, details={"n": 32})
    store.add_evaluation(a, "tiny/test", {"colorfulness": 0.6}, checkpoint_step=5)
    rows = store.evaluations(a)
    assert [r["checkpoint_step"] for r in rows] == [5, 10] and rows[1]["id"] == ev
    assert rows[1]["scores"] == {"colorfulness": 0.7} and rows[1]["details"] == {"n": 32}
    assert store.evaluations(b) == []
    cid = store.add_comparison("marble vs ws", [a, b], settings={"prompts": "test"}, result={"winner": a})
    assert store.comparisons() == [{"id": cid, "name": "marble vs ws", "run_ids": [a, b], "job_id": None,
                                    "settings": {"prompts": "test"}, "result": {"winner": a},
                                    "created_at": store.comparisons()[0]["created_at"]}]
    store.update_comparison(cid, {"status": "succeeded", "rows": [1, 2]})
    assert store.get_comparison(cid)["result"] == {"status": "succeeded", "rows": [1, 2]}
    store.update_comparison(cid, job_id=b)  # the compare job that makes it; the result stays
    assert store.get_comparison(cid)["job_id"] == b and store.get_comparison(cid)["result"]["rows"] == [1, 2]
    with pytest.raises(LookupError):
        store.get_comparison(cid + 1)


def test_delete_run_removes_a_finished_run_with_its_rows_and_folder_only(store):
    keep, gone = _running(store), _running(store)
    for run_id in (keep, gone):
        writer = EventWriter(store, run_id, store.run_dir(run_id))
        writer(step_event(1, "harmonized"))
        writer(balance_event(1))
        writer(sample_event(1))
        writer(checkpoint_event(1, store.run_dir(run_id)))
        store.add_evaluation(run_id, "tiny/test", {"colorfulness": 0.5}, checkpoint_step=1)
    with pytest.raises(TransitionError, match="run 2 is running: cancel it before deleting it"):
        store.delete_run(gone)
    store.finish(gone, s.FAILED, error="boom")
    before = (store.metrics(keep).rows, store.balance(keep), store.samples(keep), store.checkpoints(keep),
              store.evaluations(keep))
    store.delete_run(gone)
    with pytest.raises(RunNotFound):
        store.get_run(gone)
    assert not (store.home / "run_000002").exists() and store.run_dir(keep).is_dir()
    assert store.metrics(gone).rows == [] and store.balance(gone) == [] and store.evaluations(gone) == []
    assert (store.metrics(keep).rows, store.balance(keep), store.samples(keep), store.checkpoints(keep),
            store.evaluations(keep)) == before


def test_metric_reads_search_the_run_step_index(tmp_path):
    st = Store(f"sqlite:///{tmp_path / 'm.db'}", tmp_path)
    with st._read.connect() as conn:
        for sql in ("SELECT step, key, value FROM metrics WHERE run_id = 1 AND step > 5",
                    "SELECT * FROM balance WHERE run_id = 1 AND step > 5",
                    "SELECT * FROM samples WHERE run_id = 1 AND step = 5"):
            plan = " ".join(str(row[-1]) for row in conn.execute(text("EXPLAIN QUERY PLAN " + sql)))
            assert "SEARCH" in plan and "run_id=?" in plan and "step" in plan, plan
    st.close()


def test_the_read_api_does_not_import_torch():
    code = ("import sys, jobs.storage, jobs.runner, jobs.cli, jobs.writer, jobs.export; "
            "print(json.dumps(sorted(m for m in ('torch', 'diffusers', 'transformers') if m in sys.modules)))")
    out = subprocess.run([sys.executable, "-c", "import json; " + code], cwd=REPO, capture_output=True, text=True,
                         check=True)
    assert json.loads(out.stdout) == []


def test_data_directory_defaults_to_runs_and_follows_marble_home(tmp_path, monkeypatch):
    from jobs.paths import data_home, database_url

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MARBLE_HOME", raising=False)
    monkeypatch.delenv("MARBLE_DATABASE_URL", raising=False)
    assert data_home() == tmp_path / "runs"
    monkeypatch.setenv("MARBLE_HOME", str(tmp_path / "elsewhere"))
    home = data_home()
    assert home == tmp_path / "elsewhere" and home.is_dir()
    assert database_url(home) == f"sqlite:///{home / 'marble.db'}"
    with Store.open() as st:
        run_id = _new_run(st)
        assert st.run_dir(run_id) == home / "run_000001"
    assert (home / "marble.db").is_file()
