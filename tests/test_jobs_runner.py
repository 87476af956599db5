"""The runner end to end: real training of the tiny model in real job processes, real SQLite files.

No timed assertions: every wait has a generous deadline and fails only when the feature is broken.
"""

import json
import os
import signal
import socket
import sqlite3
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
from sqlalchemy import select

from jobs import schema as s
from jobs.job import process_key
from jobs.runner import (RunnerSettings, Worker, cancel, ensure_worker, gpu_count, job_command, process_alive,
                         reconcile, resume, submit, worker_pid)
from jobs.storage import Batch, Store
from tests.helpers import small_config
from tests.jobs_support import (KEYS_PER_STEP, REPO, database_urls, jobs_cli, kill_group, run_cli,
                                stop_everything, subprocess_env, wait_for)

pytestmark = pytest.mark.slow
PY = sys.executable


@pytest.fixture
def env(tmp_path):
    """A data directory with its SQLite store; workers started here are stopped, and job processes
    killed, at the end whatever happens."""
    home = tmp_path / "home"
    store = Store.open(home)
    workers: list = []

    def start_worker(*args: str, **extra_env: str) -> subprocess.Popen:
        log = open(tmp_path / f"worker{len(workers)}.log", "ab")
        proc = subprocess.Popen([PY, "-m", "jobs", "worker", "--poll", "0.2", *args], cwd=REPO,
                                env=subprocess_env(home, **extra_env), stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        log.close()
        workers.append(proc)
        return proc

    def worker_log() -> str:
        return "\n".join((tmp_path / f"worker{i}.log").read_text()[-3000:] for i in range(len(workers)))

    ns = SimpleNamespace(home=home, store=store, start_worker=start_worker, worker_log=worker_log, extra_pids=[])
    yield ns
    stop_everything(store, workers, ns.extra_pids)


def _dump(store: Store) -> dict:
    """Every row of every table, in a stable order."""
    out = {}
    with store._read.connect() as conn:
        for table in s.metadata.sorted_tables:
            rows = conn.execute(select(table).order_by(*table.primary_key.columns)).all()
            out[table.name] = [dict(r._mapping) for r in rows]
    return out


def _ids(rows) -> list[int]:
    return [r["step"] for r in rows]


# ---- immediate mode -------------------------------------------------------------------------------------

@pytest.fixture(params=["sqlite", "postgresql"])
def inline_store(request, tmp_path):
    for url in database_urls(tmp_path, request.param):
        st = Store(url, tmp_path / "home")
        yield st
        st.close()


def test_immediate_mode_trains_inline_and_stores_every_kind_of_row(inline_store):
    store = inline_store
    cfg = small_config("marble", steps=3, checkpoint_every=2, sample_every=2)
    run_id = submit(store, cfg, preset="tiny", name="inline", immediate=True)
    run = store.get_run(run_id)
    assert (run.status, run.step, run.attempt, run.error) == (s.SUCCEEDED, 3, 1, None)
    assert run.pid == os.getpid() and run.pgid is None  # never signal the caller's process group
    assert run.config == cfg.to_dict() and run.code_version and run.device == "cpu"
    assert _ids(store.steps(run_id)) == [1, 2, 3]
    assert len(store.metrics(run_id).rows) == 3 * KEYS_PER_STEP
    assert [b["step"] for b in store.balance(run_id)] == [1] and store.balance(run_id)[0]["phase"] == "harmonized"
    assert store.sample_steps(run_id) == [1, 2]
    sample = store.samples(run_id, step=2)[0]
    assert os.path.isfile(sample["image"]) and set(sample["rewards"]) == set(cfg.reward_names)
    assert [c["step"] for c in store.checkpoints(run_id)] == [2, 3]
    assert all(c["exists"] for c in store.checkpoints(run_id))
    assert "run %d succeeded" % run_id in store.log_tail(run_id)

    # extend the finished run: it continues from its last checkpoint, earlier rows untouched
    before = store.metrics(run_id).rows
    resume(store, run_id, steps=4, immediate=True)
    run = store.get_run(run_id)
    assert (run.status, run.step, run.total_steps, run.attempt) == (s.SUCCEEDED, 4, 4, 2)
    assert _ids(store.steps(run_id)) == [1, 2, 3, 4]
    assert store.metrics(run_id, since_step=0).rows[:len(before)] == before
    assert len(store.metrics(run_id).rows) == 4 * KEYS_PER_STEP

    from jobs.export import export_metrics

    import pandas as pd

    csv = pd.read_csv(export_metrics(store, run_id, "csv"))
    parquet = pd.read_parquet(export_metrics(store, run_id, "parquet"))
    assert list(csv["step"]) == [1, 2, 3, 4] and list(parquet["step"]) == [1, 2, 3, 4]
    assert list(csv["phase"])[0] == "harmonized" and "reward/colorfulness" in csv.columns
    assert parquet["loss"].tolist() == pytest.approx(csv["loss"].tolist())


# ---- the worker: submit -> running -> succeeded; a failing job touches nothing else ------------------------

def test_worker_runs_jobs_in_their_own_processes_and_a_failing_job_touches_nothing_else(env, tmp_path):
    store = env.store
    cfg_file = tmp_path / "config.json"
    small_config("marble", steps=4, checkpoint_every=2, sample_every=2, **{"balance.harmonize_every": 3}).save(cfg_file)
    out = jobs_cli(env.home, "submit", "--config", str(cfg_file), "--name", "good")
    assert out.returncode == 0, out.stderr
    good = int(out.stdout.strip().splitlines()[-1])
    assert store.status(good) == s.QUEUED

    code, _, err = run_cli(env.home, "submit", "--preset", "tiny", "--set", "balance.ema_rho=2")
    assert code == 2 and "balance.ema_rho=2.0: must be a number in [0, 1)" in err
    assert [r.id for r in store.list_runs()] == [good]  # rejected at submit: nothing queued

    worker = env.start_worker("--once")
    seen, pids = [], set()
    while worker.poll() is None:
        run = store.get_run(good)
        if not seen or seen[-1] != run.status:
            seen.append(run.status)
        if run.pid:
            pids.add((run.pid, run.pgid))
        time.sleep(0.1)
    assert worker.returncode == 0, env.worker_log()
    final = store.get_run(good)
    assert seen[-2:] == [s.RUNNING, s.SUCCEEDED] and final.status == s.SUCCEEDED, (seen, final.error)
    (pid, pgid), = pids
    assert pid != os.getpid() and pgid == pid  # its own process and process group
    assert _ids(store.steps(good)) == [1, 2, 3, 4] and len(store.metrics(good).rows) == 4 * KEYS_PER_STEP
    balance = store.balance(good)
    assert _ids(balance) == [1, 4] and all(b["solver"] and b["cosine"]["matrix"] for b in balance)
    assert store.sample_steps(good) == [1, 2, 4] and [c["step"] for c in store.checkpoints(good)] == [2, 4]
    listed = json.loads(run_cli(env.home, "list", "--json")[1])
    assert listed[0]["status"] == s.SUCCEEDED and listed[0]["name"] == "good" and listed[0]["progress"] == 1.0
    shown = json.loads(run_cli(env.home, "show", str(good), "--json")[1])
    assert shown["config"]["steps"] == 4 and [c["step"] for c in shown["checkpoints"]] == [2, 4]

    # a config that validates but cannot train: failed, with the error text, and nothing else changed
    # (queued as a model folder deleted after submit would be: submit itself refuses a model it cannot find)
    gone = small_config("marble", steps=4, **{"model.name": "no-such-model"})
    failing = store.create_run(gone.to_dict(), strategy="marble", total_steps=4)
    before = _dump(store)
    worker = env.start_worker("--once")
    assert worker.wait(timeout=180) == 0, env.worker_log()
    after = _dump(store)
    run = store.get_run(failing)
    assert run.status == s.FAILED and run.error.startswith("ModelNotFoundError: ") and "no-such-model" in run.error
    assert "Traceback" in store.log_tail(failing, 200)  # the full traceback is in the job's log
    for table in after:
        if table == "runs":
            assert [r for r in after[table] if r["id"] != failing] == [r for r in before[table] if r["id"] != failing]
        else:
            assert after[table] == before[table], table
    assert not any(r.get("run_id") == failing for rows in after.values() for r in rows)


# ---- cancel -------------------------------------------------------------------------------------------

def test_jobs_outlive_their_worker_and_cancel_stops_them_cooperatively(env):
    store = env.store
    run_id = submit(store, small_config("marble", steps=200))
    pid = ensure_worker(store, ["--poll", "0.2"])  # what the web app calls: a detached worker
    env.extra_pids.append(pid)
    wait_for(lambda: worker_pid(env.home) == pid, 60, "the worker to take its lock")
    assert ensure_worker(store) == pid  # one worker per data directory
    code, _, err = run_cli(env.home, "worker", "--once")
    assert code == 2 and f"another worker (pid {pid})" in err

    wait_for(lambda: store.get_run(run_id).step >= 1, 180, "the first step")
    job_pid = store.get_run(run_id).pid
    os.kill(pid, signal.SIGTERM)  # the worker goes (as when the web process that started it restarts) ...
    wait_for(lambda: not process_alive(pid), 60, "the worker to exit")
    assert worker_pid(env.home) is None
    step = store.get_run(run_id).step
    wait_for(lambda: store.get_run(run_id).step > step, 180, "a step after the worker left")  # ... the job goes on
    assert process_alive(job_pid) and store.status(run_id) == s.RUNNING

    code, out, err = run_cli(env.home, "cancel", str(run_id))  # grace periods: the defaults (30 s, 15 s)
    assert code == 0 and out.strip() == f"run {run_id} cancelled", out + err
    run = store.get_run(run_id)
    assert run.status == s.CANCELLED and run.error is None and run.exit_code is None  # no signal was needed
    assert 1 <= run.step < 200
    assert store.latest_checkpoint(run_id)["step"] == run.step  # the job saved where it stopped
    wait_for(lambda: not process_alive(job_pid), 60, "the job process to exit")


@pytest.mark.parametrize("ignores_sigterm", [False, True])
def test_cancel_escalates_to_sigterm_then_sigkill(tmp_path, ignores_sigterm):
    store = Store.open(tmp_path)
    run_id = store.create_run({}, strategy="marble", total_steps=10)
    store.claim(run_id)
    handler = "signal.signal(signal.SIGTERM, signal.SIG_IGN); " if ignores_sigterm else ""
    proc = subprocess.Popen([PY, "-c", f"import signal, time; {handler}print('ready', flush=True); time.sleep(120)"],
                            stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        store.set_process(run_id, pid=proc.pid, pgid=proc.pid, host=socket.gethostname(),
                          proc_key=process_key(proc.pid))
        status = cancel(store, run_id, settings=RunnerSettings(cancel_grace=0.5, kill_grace=0.5))
        assert status == s.CANCELLED
        assert proc.wait(timeout=30) == -(signal.SIGKILL if ignores_sigterm else signal.SIGTERM)
    finally:
        kill_group(proc.pid)
        proc.wait()
    store.close()


# ---- dead jobs ----------------------------------------------------------------------------------------

def test_reconcile_marks_dead_and_silent_jobs(tmp_path):
    store = Store.open(tmp_path)
    now = time.time()
    ids = {}
    procs = {}
    for name in ("crashed", "stopped", "hung", "healthy", "elsewhere"):
        ids[name] = store.create_run({}, strategy="marble", total_steps=10)
        store.claim(ids[name])
        if name == "elsewhere":  # on another machine: only its heartbeat can tell
            store.set_process(ids[name], pid=1, pgid=1, host="another-host", proc_key=None)
            continue
        procs[name] = subprocess.Popen([PY, "-c", "import time; time.sleep(120)"], start_new_session=True)
        store.set_process(ids[name], pid=procs[name].pid, pgid=procs[name].pid, host=socket.gethostname(),
                          proc_key=process_key(procs[name].pid))
    store.run_dir(ids["crashed"]).mkdir(parents=True)
    (store.run_dir(ids["crashed"]) / "job.log").write_text("step 1\nstep 2\nRuntimeError: CUDA out of memory\n")
    store.request_cancel(ids["stopped"])
    try:
        for name in ("crashed", "stopped"):
            procs[name].kill()
            procs[name].wait()
        later = now + 600
        store.write_batch(ids["healthy"], Batch(run={"heartbeat_at": later - 1}))
        marked = reconcile(store, RunnerSettings(stale_after=60), now=later)
        assert sorted(marked) == sorted([ids["crashed"], ids["stopped"], ids["hung"], ids["elsewhere"]])
        crashed = store.get_run(ids["crashed"])
        assert crashed.status == s.INTERRUPTED and "is gone" in crashed.error
        assert "RuntimeError: CUDA out of memory" in crashed.error  # the last lines of its log
        assert store.status(ids["stopped"]) == s.CANCELLED  # a stop was requested: it ended as asked
        hung = store.get_run(ids["hung"])
        assert hung.status == s.INTERRUPTED and "no heartbeat for" in hung.error
        assert procs["hung"].wait(timeout=30) == -signal.SIGKILL  # a hung job on this host is killed
        assert "no heartbeat" in store.get_run(ids["elsewhere"]).error
        assert store.status(ids["healthy"]) == s.RUNNING and procs["healthy"].poll() is None
    finally:
        for proc in procs.values():
            kill_group(proc.pid)
            proc.wait()
    store.close()


def test_kill_9_marks_interrupted_and_resume_continues_from_the_checkpoint(env):
    from core.checkpoint import load_state

    store = env.store
    rho = 0.7
    total = 9  # full steps at 1, 4, 7 (N=3): one after any checkpoint (2, 4, 6, 8) the kill can follow
    cfg = small_config("marble", steps=total, checkpoint_every=2, sample_every=3,
                       **{"balance.harmonize_every": 3, "balance.ema_rho": rho})
    run_id = submit(store, cfg)
    # The kill must land while step rows after a checkpoint are in the database and the next checkpoint is
    # not: from the flush of step c+1 (the next heartbeat) to checkpoint c+2, about one step. A fast
    # heartbeat makes that window nearly a full step (~0.5 s here) at each of checkpoints 2, 4 and 6.
    env.start_worker(MARBLE_HEARTBEAT_SECONDS="0.05")

    def logs() -> str:
        return f"job log:\n{store.log_tail(run_id, 60)}\nworker log:\n{env.worker_log()}"

    def checkpoint_and_later_rows():
        ck, run = store.latest_checkpoint(run_id), store.get_run(run_id)
        if run.status not in (s.QUEUED, s.RUNNING):
            raise AssertionError(f"run ended ({run.status}) before the kill could follow a checkpoint\n{logs()}")
        return run.status == s.RUNNING and ck is not None and run.step > ck["step"]

    wait_for(checkpoint_and_later_rows, 240, "a checkpoint and rows after it", interval=0.02, log=logs)
    os.kill(store.get_run(run_id).pid, signal.SIGKILL)
    wait_for(lambda: store.status(run_id) == s.INTERRUPTED, 60, "the worker to see the dead job", log=env.worker_log)
    run = store.get_run(run_id)
    assert "SIGKILL" in run.error and run.exit_code == -signal.SIGKILL
    ckpt = store.latest_checkpoint(run_id)
    c = ckpt["step"]
    assert run.step > c and _ids(store.steps(run_id)) == list(range(1, run.step + 1))
    kept = [row for row in store.metrics(run_id).rows if row[0] <= c]
    _, saved = load_state(ckpt["path"])  # safetensors + JSON: nothing is unpickled
    names = cfg.reward_names
    saved_alpha = dict(zip(names, saved["balancer"]["alpha_ema"]))
    last_full = [b for b in store.balance(run_id) if b["step"] <= c][-1]
    assert last_full["alpha_ema"] == pytest.approx(saved_alpha, abs=1e-12)  # the database agrees with the file

    code, out, err = run_cli(env.home, "resume", str(run_id))
    assert code == 0, err
    wait_for(lambda: store.status(run_id) not in (s.QUEUED, s.RUNNING), 240, "the resumed run to end")
    run = store.get_run(run_id)
    assert (run.status, run.step, run.attempt) == (s.SUCCEEDED, total, 2), run.error
    assert f"resuming from {ckpt['path']}" in store.log_tail(run_id, 400)

    steps = store.steps(run_id)
    assert _ids(steps) == list(range(1, total + 1))  # none lost, none twice
    rows = store.metrics(run_id).rows
    assert len(rows) == total * KEYS_PER_STEP
    assert [row for row in rows if row[0] <= c] == kept  # rows up to the checkpoint are the original ones
    assert store.sample_steps(run_id) == [1, 3, 6, 9]
    assert [x["step"] for x in store.checkpoints(run_id)] == [2, 4, 6, 8, 9]

    # the balancer state came back: ᾱ continues from the saved one
    alpha_at = {row[1].split("/", 1)[1]: row[2] for row in rows if row[0] == c + 1 and row[1].startswith("alpha/")}
    if steps[c]["phase"] == "amortized":
        assert alpha_at == pytest.approx(saved_alpha, abs=1e-9)
    first_full = next(b for b in store.balance(run_id) if b["step"] > c and b["phase"] == "harmonized")
    expected = {n: rho * saved_alpha[n] + (1 - rho) * first_full["alpha_raw"][n] for n in names}
    assert first_full["alpha_ema"] == pytest.approx(expected, abs=1e-9)

    with sqlite3.connect(store.home / "marble.db") as conn:
        assert conn.execute("PRAGMA integrity_check").fetchall() == [("ok",)]


# ---- two jobs and several readers ---------------------------------------------------------------------

READER = r"""
import json, sys, time
from jobs.storage import Store
home, ids = sys.argv[1], [int(x) for x in sys.argv[2].split(",")]
store = Store.open(home, migrate=False)
seen = {i: 0 for i in ids}; last = {i: 0 for i in ids}; steps = {i: [] for i in ids}
errors, reads = [], 0
deadline = time.monotonic() + 240
while time.monotonic() < deadline:
    try:
        runs = {r.id: r for r in store.list_runs()}
        for i in ids:
            series = store.metrics(i, since_step=last[i])
            seen[i] += len(series.rows)
            steps[i] += sorted({row[0] for row in series.rows})
            last[i] = series.last_step
            store.balance(i, since_step=0, max_points=50); store.samples(i, since_step=0)
            store.checkpoints(i); store.get_run(i); store.steps(i, since_step=max(0, last[i] - 5))
        reads += 1
        if all(runs[i].status not in ("queued", "running") for i in ids):
            break
    except Exception as e:
        errors.append(f"{type(e).__name__}: {e}")
    time.sleep(0.1)
print(json.dumps({"errors": errors, "reads": reads, "rows": seen, "steps": steps}))
"""


def test_two_jobs_and_several_readers_at_once(env):
    store = env.store
    total = 8
    ids = [submit(store, small_config(strategy, steps=total, checkpoint_every=4, sample_every=4))
           for strategy in ("marble", "weighted_sum")]
    env.start_worker("--slots", "2")
    readers = [subprocess.Popen([PY, "-c", READER, str(env.home), ",".join(map(str, ids))], cwd=REPO,
                                env=subprocess_env(env.home), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, start_new_session=True) for _ in range(3)]
    env.extra_pids.extend(r.pid for r in readers)
    most_running = 0
    while any(r.poll() is None for r in readers):
        most_running = max(most_running, store.count_runs(s.RUNNING))
        time.sleep(0.2)
    reports = []
    for r in readers:
        out, err = r.communicate(timeout=30)
        assert r.returncode == 0, err
        reports.append(json.loads(out))
    for rep in reports:
        assert rep["errors"] == [] and rep["reads"] > 0  # no "database is locked", no other error
    assert most_running == 2  # both jobs ran at the same time
    for run_id in ids:
        run = store.get_run(run_id)
        assert run.status == s.SUCCEEDED, (run.error, env.worker_log())
        assert _ids(store.steps(run_id)) == list(range(1, total + 1))
        assert len(store.metrics(run_id).rows) == total * KEYS_PER_STEP
        for rep in reports:  # incremental reads saw every row exactly once, in whole steps
            assert rep["rows"][str(run_id)] == total * KEYS_PER_STEP
            assert rep["steps"][str(run_id)] == list(range(1, total + 1))
    with sqlite3.connect(store.home / "marble.db") as conn:
        assert conn.execute("PRAGMA integrity_check").fetchall() == [("ok",)]


# ---- small pieces -------------------------------------------------------------------------------------

def test_slots_follow_the_visible_gpus_and_multi_process_jobs_use_torchrun(tmp_path, monkeypatch):
    store = Store.open(tmp_path)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    assert gpu_count() == 2 and Worker(store).slots == 2
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert gpu_count() == 0 and Worker(store).slots == 1
    one = store.get_run(store.create_run({}, strategy="marble", total_steps=1))
    assert job_command(one, store, "py") == ["py", "-m", "jobs.job", str(one.id), "--home", str(store.home),
                                             "--db", store.url]
    many = store.get_run(store.create_run({}, strategy="marble", total_steps=1, num_processes=4, num_nodes=2))
    monkeypatch.setenv("MARBLE_MASTER_ADDR", "node0")
    assert job_command(many, store, "py") == ["py", "-m", "torch.distributed.run", "--nproc-per-node=4",
                                              "--nnodes=2", "--node-rank=0", "--master-addr=node0",
                                              "--master-port=29500", "-m", "jobs.job", str(many.id), "--home",
                                              str(store.home), "--db", store.url]
    two = store.get_run(store.create_run({}, strategy="marble", total_steps=1, num_processes=2))
    assert job_command(two, store, "py")[:6] == ["py", "-m", "torch.distributed.run", "--nproc-per-node=2",
                                                 "--standalone", "--nnodes=1"]
    with pytest.raises(ValueError, match="num_processes=0: must be an integer >= 1"):
        submit(store, small_config(), num_processes=0)
    store.close()
