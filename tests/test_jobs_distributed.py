"""A job that asks for two processes runs under torchrun through the worker (gloo on the CPU)."""

import subprocess
import sys

import pytest

from jobs import schema as s
from jobs.storage import Store
from tests.helpers import small_config
from tests.jobs_support import subprocess_env

pytestmark = pytest.mark.slow


def test_a_two_process_job_trains_to_success_through_the_worker(tmp_path):
    store = Store.open(tmp_path)
    from jobs.runner import submit

    cfg = small_config("marble", steps=2, checkpoint_every=1, **{"balance.harmonize_every": 2})
    run_id = submit(store, cfg, name="ddp", num_processes=2)
    proc = subprocess.run([sys.executable, "-m", "jobs", "--home", str(tmp_path), "worker", "--once"],
                          env=subprocess_env(tmp_path), capture_output=True, text=True, timeout=600)
    run = store.get_run(run_id)
    log = store.log_tail(run_id, 80)
    assert proc.returncode == 0 and run.status == s.SUCCEEDED, (run.status, run.error, log, proc.stderr[-2000:])
    assert [row["step"] for row in store.steps(run_id)] == [1, 2]  # rank 0 alone records, each step once
    assert [c["step"] for c in store.checkpoints(run_id)] == [1, 2]
    assert "rank 1 of run" in log  # the second rank trained its share
    store.close()
