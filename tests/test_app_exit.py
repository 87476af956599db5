"""Stopping the app (issue 18 item 5): with nothing queued or running the worker it started stops with it;
otherwise the app says which runs keep going and how to stop them; ``python -m jobs worker --stop`` stops a
worker from a shell."""

import os
import subprocess
import sys
import time
from pathlib import Path

from jobs.runner import worker_pid
from jobs.storage import Store

ROOT = Path(__file__).resolve().parents[1]


def _start_worker(home: Path) -> subprocess.Popen:
    env = {**os.environ, "MARBLE_HOME": str(home), "MARBLE_POLL_SECONDS": "0.2", "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "jobs", "worker"], cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.time() + 60
    while worker_pid(home) != proc.pid:
        assert proc.poll() is None and time.time() < deadline, "the worker did not start"
        time.sleep(0.1)
    return proc


def test_the_app_stops_its_idle_worker_and_names_the_runs_that_keep_going(tmp_path):
    from app.__main__ import farewell

    with Store.open(tmp_path) as store:
        proc = _start_worker(tmp_path)
        try:
            assert farewell(store, ours=False) == "MARBLE Studio stopped."  # a worker started by hand: left alone
            assert proc.poll() is None
            message = farewell(store, ours=True)
            assert message == f"MARBLE Studio stopped, and its idle worker with it (worker {proc.pid} stopped)."
            assert proc.wait(timeout=20) == 0 and worker_pid(tmp_path) is None
        finally:
            if proc.poll() is None:
                proc.kill()
        run_id = store.create_run({}, strategy="marble", total_steps=20, name="keeps going")
        message = farewell(store, ours=True)
        assert f"#{run_id} keeps going (queued 0/20)" in message
        assert "python -m jobs worker --stop" in message and "python -m jobs cancel RUN" in message


def test_jobs_worker_stop_stops_the_worker_of_a_data_directory(tmp_path, capsys):
    from jobs.cli import main

    proc = _start_worker(tmp_path)
    try:
        assert main(["--home", str(tmp_path), "worker", "--stop"]) == 0
        assert capsys.readouterr().out.strip() == f"worker {proc.pid} stopped"
        assert proc.wait(timeout=20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert main(["--home", str(tmp_path), "worker", "--stop"]) == 0
    assert capsys.readouterr().out.strip() == f"no worker serves {tmp_path}"
