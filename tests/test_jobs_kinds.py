"""One queue for every kind of job (issue 18): evaluations and comparisons are rows of the runs table, run by the
same worker in their own process, with the runs' states: a slot each, cancel, interrupted after a kill. Real SQLite,
real worker subprocesses, the tiny preset."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from jobs import schema as s
from jobs.compare import cancel_comparison, start_comparison, status_of
from jobs.evaluations import latest, queue
from jobs.runner import submit
from jobs.storage import Store
from tests.helpers import small_config
from tests.jobs_support import REPO, run_cli, stop_everything, subprocess_env, wait_for

pytestmark = pytest.mark.slow


@pytest.fixture
def env(tmp_path):
    home = tmp_path / "home"
    store = Store.open(home)
    workers: list = []

    def start_worker(*args: str) -> subprocess.Popen:
        log = open(tmp_path / f"worker{len(workers)}.log", "ab")
        proc = subprocess.Popen([sys.executable, "-m", "jobs", "worker", "--poll", "0.2", *args], cwd=REPO,
                                env=subprocess_env(home), stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        log.close()
        workers.append(proc)
        return proc

    def logs() -> str:
        text = "\n".join((tmp_path / f"worker{i}.log").read_text()[-2000:] for i in range(len(workers)))
        return text + "\n" + "\n".join(store.log_tail(r.id, 20) for r in store.list_runs())

    yield type("Env", (), {"home": home, "store": store, "start_worker": staticmethod(start_worker),
                           "logs": staticmethod(logs)})
    stop_everything(store, workers)


def finished_run(store: Store, steps: int = 2) -> int:
    cfg = small_config("marble", steps=steps, checkpoint_every=1)
    run_id = submit(store, cfg, name="trained", immediate=True)
    assert store.status(run_id) == s.SUCCEEDED
    return run_id


def entries(store: Store, run_id: int, n: int) -> list[dict]:
    """``n`` columns: the base model, then the run's checkpoints (repeated when it has fewer)."""
    cfg = store.get_run(run_id).config
    common = {"model": cfg["model"]["name"], "resolution": cfg["sampling"]["resolution"],
              "max_sequence_length": cfg["sampling"]["max_sequence_length"], "rewards": cfg["rewards"]}
    ckpts = [c["path"] for c in store.checkpoints(run_id)]
    out = [{**common, "label": "base", "lora": None, "run_id": None}]
    for i in range(n - 1):
        out.append({**common, "label": f"column {i + 1}", "lora": ckpts[i % len(ckpts)], "run_id": run_id})
    return out


def test_an_evaluate_job_runs_in_the_worker_and_stores_its_scores(env):
    run_id = finished_run(env.store)
    code, out, err = run_cli(env.home, "evaluate", str(run_id), "--queue", "--checkpoint", "1",
                             "--prompts-per-source", "2", "--seeds", "2")
    assert code == 0, err
    job_id = int(out.split()[2])
    job = env.store.get_run(job_id)
    assert (job.kind, job.subject_id, job.status, job.total_steps) == (s.EVALUATE, run_id, s.QUEUED, 2)
    assert latest(env.store, run_id) is None
    worker = env.start_worker("--once")
    assert worker.wait(timeout=300) == 0, env.logs()
    job = env.store.get_run(job_id)
    assert job.status == s.SUCCEEDED and job.step == 2, env.logs()
    ev = latest(env.store, run_id)
    assert ev["checkpoint_step"] == 1 and ev["details"]["job_id"] == job_id and ev["details"]["images"] == 4
    assert set(ev["details"]["rewards"]) >= {"colorfulness", "brightness"}
    assert ev["details"]["rewards"]["colorfulness"]["trained_on"] is True
    assert "recorded as evaluation" in env.store.log_tail(job_id, 40)  # its own job log
    # the training run's record is untouched, and the job is not a run of the Dashboard / Study pickers
    assert env.store.get_run(run_id).status == s.SUCCEEDED
    assert [r.id for r in env.store.list_runs(kind=s.TRAIN)] == [run_id]


def test_evaluate_refuses_what_is_not_a_finished_runs_checkpoint(env):
    store = env.store
    done = finished_run(store)
    queued = submit(store, small_config("marble", steps=5), name="not yet")
    with pytest.raises(ValueError, match=r"run=99: no such run"):
        queue(store, 99)
    with pytest.raises(ValueError, match=rf"run={queued}: run #{queued} is queued at step 0/5; only a finished "
                                         r"\(succeeded\) run can be evaluated"):
        queue(store, queued)
    with pytest.raises(ValueError, match=rf"checkpoint step=7: run {done} has no checkpoint at that step "
                                         r"\(its checkpoints: 1, 2\)"):
        queue(store, done, 7, field="checkpoint step")
    job = queue(store, done)
    assert store.get_run(job).config["checkpoint_step"] == 2  # the newest, fixed when queued
    with pytest.raises(ValueError, match=rf"run={done}: its checkpoint 2 is already being evaluated by job #{job}"):
        queue(store, done)
    with pytest.raises(ValueError, match=rf"run={job}: #{job} is an evaluate job, not a training run"):
        queue(store, job)
    store.request_cancel(queued)  # cancelled at step 0: still not finished
    code, _, err = run_cli(env.home, "evaluate", str(queued), "--queue")
    assert code == 2 and f"run #{queued} is cancelled at step 0/5" in err and "resume it to the end first" in err
    assert len(err.strip().splitlines()) == 1


def test_every_kind_takes_a_worker_slot(env):
    store = env.store
    run_id = finished_run(store, steps=1)
    cid = start_comparison(store, "slot", entries(store, run_id, 2), ["a red circle"], [0])
    job = store.get_comparison(cid)["job_id"]
    assert store.claim(slots=1) == job  # the comparison runs ...
    train = submit(store, small_config("marble", steps=1), name="waits")
    assert store.claim(slots=1) is None  # ... so a training run waits for the slot
    store.finish(job, s.SUCCEEDED)
    assert store.claim(slots=1) == train


def test_a_comparison_is_a_job_the_worker_runs_and_cancel_stops(env):
    store = env.store
    run_id = finished_run(store)
    done = start_comparison(store, "two columns", entries(store, run_id, 2), ["a red circle"], [0, 1])
    assert status_of(store, store.get_comparison(done))[0] == s.QUEUED
    queued_then_cancelled = start_comparison(store, "never", entries(store, run_id, 2), ["a blue square"], [0])
    assert cancel_comparison(store, queued_then_cancelled) == s.CANCELLED  # queued: at once, never started
    with pytest.raises(ValueError, match=rf"comparison #{queued_then_cancelled} is cancelled: there is nothing to "
                                         r"cancel"):
        cancel_comparison(store, queued_then_cancelled)
    prompts = [f"a red circle {i}" for i in range(15)]
    long = start_comparison(store, "long", entries(store, run_id, 6), prompts, list(range(2)))
    long_job = store.get_comparison(long)["job_id"]
    worker = env.start_worker()
    wait_for(lambda: store.get_run(long_job).status == s.RUNNING and store.get_run(long_job).step >= 1, 300,
             "the long comparison to generate its first column", log=env.logs)
    row = store.get_comparison(done)
    assert status_of(store, row)[0] == s.SUCCEEDED, env.logs()
    assert [c["label"] for c in row["result"]["rows"][0]["cells"]] == ["base", "column 1"]
    assert all(os.path.isfile(c["path"]) for r in row["result"]["rows"] for c in r["cells"])
    assert cancel_comparison(store, long) == s.RUNNING  # the stop flag: it stops after the column it generates
    wait_for(lambda: store.get_run(long_job).status == s.CANCELLED, 120, "the comparison to stop", log=env.logs)
    job = store.get_run(long_job)
    assert job.kind == s.COMPARE and 1 <= job.step < job.total_steps == 6
    assert not (store.get_comparison(long)["result"] or {}).get("rows")  # no half grid shown as a result
    assert worker.poll() is None  # the worker goes on


def test_a_killed_comparison_is_interrupted_and_resumes(env):
    store = env.store
    run_id = finished_run(store, steps=1)
    prompts = [f"a green triangle {i}" for i in range(15)]
    cid = start_comparison(store, "killed", entries(store, run_id, 4), prompts, list(range(2)))
    job_id = store.get_comparison(cid)["job_id"]
    env.start_worker()
    wait_for(lambda: store.get_run(job_id).pgid is not None and store.get_run(job_id).step >= 1, 300,
             "the comparison to start", log=env.logs)
    os.killpg(store.get_run(job_id).pgid, signal.SIGKILL)
    wait_for(lambda: store.status(job_id) == s.INTERRUPTED, 60, "the worker to see the kill", log=env.logs)
    status, error, _ = status_of(store, store.get_comparison(cid))
    assert status == s.INTERRUPTED and "SIGKILL" in error
    from jobs.runner import resume

    resume(store, job_id)  # Resume on the Runs page: it runs again, and this time to its end
    wait_for(lambda: store.status(job_id) == s.SUCCEEDED, 300, "the resumed comparison", log=env.logs)
    result = store.get_comparison(cid)["result"]
    assert len(result["rows"]) == 30 and len(result["rows"][0]["cells"]) == 4
    with pytest.raises(ValueError, match=r"steps: #\d+ is a compare job"):
        resume(store, job_id, steps=10)
    assert json.loads(json.dumps(result))  # the grid is plain JSON
