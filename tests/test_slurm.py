"""Slurm dispatch (jobs.slurm) through submitit's LocalExecutor: a run goes queued -> running -> succeeded in the
store with its job log, and a running one can be cancelled; the node command is torchrun with the node's rank."""

import stat
import sys
import time

import pytest

from jobs import schema as s
from jobs.runner import RunnerSettings, cancel, submit
from jobs.slurm import ClusterSettings, SlurmWorker, node_command, private_folder, slurm_parameters
from jobs.storage import Store
from tests.helpers import small_config


def _drive(worker, store, run_id, until, timeout=300.0):
    """Tick the worker (as its loop does) until ``until(run)``; returns the statuses seen, in order."""
    seen, deadline = [store.status(run_id)], time.monotonic() + timeout
    while True:
        worker.tick()
        run = store.get_run(run_id)
        if run.status != seen[-1]:
            seen.append(run.status)
        if until(run):
            return seen
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out; statuses {seen}; log:\n{store.log_tail(run_id, 40)}")
        time.sleep(0.3)


@pytest.fixture
def setup(tmp_path, monkeypatch):
    monkeypatch.setenv("MARBLE_HEARTBEAT_SECONDS", "0.3")
    store = Store.open(tmp_path / "home")
    worker = SlurmWorker(store, ClusterSettings(executor="local", time_limit_min=10, folder=str(tmp_path / "private")),
                         settings=RunnerSettings(cancel_grace=60.0))
    yield store, worker
    for job in worker.jobs.values():
        job.cancel(check=False)
    store.close()


@pytest.mark.slow
def test_a_dispatched_run_goes_queued_running_succeeded(setup):
    store, worker = setup
    run_id = submit(store, small_config(steps=2), name="on-slurm")
    seen = _drive(worker, store, run_id, lambda r: r.status in s.FINAL)
    assert seen == [s.QUEUED, s.RUNNING, s.SUCCEEDED], store.log_tail(run_id, 40)
    run = store.get_run(run_id)
    assert run.step == 2 and run.error is None and run.pid is not None  # the job recorded its own process
    log = store.log_tail(run_id, 200)
    assert "submitted as local job" in log and "=== slurm job" in log and f"run {run_id} succeeded" in log
    deadline = time.monotonic() + 120  # submitit's process ends after the job: the worker then forgets it
    while worker.jobs and time.monotonic() < deadline:
        worker.tick()
        time.sleep(0.3)
    assert worker.jobs == {} and store.status(run_id) == s.SUCCEEDED
    # submitit's pickles (run as code on the node) live in the private folder, none in the served data dir
    assert not [p for p in store.home.rglob("*.pkl")]
    pickles = list((store.home.parent / "private").rglob("*.pkl"))
    assert pickles and stat.S_IMODE((store.home.parent / "private").stat().st_mode) == 0o700


def test_the_submitit_folder_is_private_and_outside_the_data_directory(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    with pytest.raises(ValueError, match="must not lie inside the data directory"):
        private_folder(home / "submitit", home)
    made = private_folder(tmp_path / "a" / "b", home)
    assert stat.S_IMODE(made.stat().st_mode) == 0o700
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(ValueError, match=r"writable by no one else \(mode drwxrwxrwx\)"):
        private_folder(shared, home)
    # the worker refuses such a folder when it starts, before it claims a run (exit 2, one line)
    store = Store.open(home)
    try:
        with pytest.raises(ValueError, match="must not lie inside the data directory"):
            SlurmWorker(store, ClusterSettings(executor="local", folder=str(home / "submitit")))
    finally:
        store.close()
    from jobs.cli import main as jobs_main

    code = jobs_main(["--home", str(home), "worker", "--once", "--executor", "submitit-local",
                      "--submitit-folder", str(shared)])
    assert code == 2


@pytest.mark.slow
def test_a_dispatched_run_can_be_cancelled(setup):
    store, worker = setup
    run_id = submit(store, small_config(steps=500), name="cancel-me")
    _drive(worker, store, run_id, lambda r: r.status == s.RUNNING and r.step >= 1)
    assert cancel(store, run_id, wait=False) == s.RUNNING  # the stop flag; the job saves and ends
    seen = _drive(worker, store, run_id, lambda r: r.status in s.FINAL)
    assert seen[-1] == s.CANCELLED and store.get_run(run_id).step < 500
    assert store.latest_checkpoint(run_id) is not None  # the cancelled run saved where it stopped


def test_node_command_is_torchrun_with_the_node_rank_and_bad_settings_are_named():
    one = node_command(3, "/data", "sqlite:///x.db", 1, 1, 0, None, python="py")
    assert one == ["py", "-m", "jobs.job", "3", "--home", "/data", "--db", "sqlite:///x.db"]
    multi = node_command(3, "/data", "sqlite:///x.db", 8, 2, 1, "node-a", python="py")
    assert multi[:3] == ["py", "-m", "torch.distributed.run"]
    assert {"--nproc-per-node=8", "--nnodes=2", "--node-rank=1", "--master-addr=node-a"} <= set(multi)
    assert multi[-7:] == ["-m", "jobs.job", "3", "--home", "/data", "--db", "sqlite:///x.db"]
    for bad, message in (({"executor": "pbs"}, "executor='pbs': valid choices: slurm, local"),
                         ({"time_limit_min": 0}, "time_limit_min=0: must be an integer >= 1")):
        with pytest.raises(ValueError, match=message):
            ClusterSettings(**bad).validate()


def test_slurm_parameters_follow_the_run(tmp_path):
    store = Store.open(tmp_path / "home")
    run_id = submit(store, small_config(steps=1), num_processes=8, num_nodes=2)
    params = slurm_parameters(store.get_run(run_id), ClusterSettings(partition="gpu", time_limit_min=90, cpus_per_gpu=4))
    assert params == {"name": f"marble-run-{run_id}", "nodes": 2, "tasks_per_node": 1, "gpus_per_node": 8,
                      "cpus_per_task": 32, "timeout_min": 90, "slurm_partition": "gpu"}
    store.close()
