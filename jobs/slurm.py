"""Hand queued runs to a Slurm cluster through submitit: ``python -m jobs worker --executor slurm ...``.

A :class:`SlurmWorker` is the job runner's :class:`~jobs.runner.Worker` with one difference: where the local
worker starts ``python -m jobs.job RUN`` as a child process, it submits that job to Slurm (one node or
several, ``run.num_processes`` GPUs per node, a partition and a time limit). Everything else is the runner's:
the store's states (queued -> running -> succeeded | failed | cancelled | interrupted), the job's heartbeat,
its stop flag and the run's job.log, so the app shows a cluster run's status, log and cancel like a local one.

- On the allocation :func:`run_on_node` runs once per node (``tasks_per_node=1``) and starts the job: plain
  ``python -m jobs.job`` for one process, else ``torchrun`` with this node's rank (``SLURM_NODEID``) and the
  first node of the allocation as the rendezvous (core.launch.torchrun_command). Its output goes to the run's
  job.log: the data directory must be on a file system every node sees.
- While Slurm has not started the job yet (no pid recorded), the worker stamps the run's heartbeat so that
  waiting in Slurm's queue is not taken for a dead job.
- Cancel: the stop flag first (the job saves a checkpoint and ends cancelled); a job that does not stop within
  ``cancel_grace`` (or still waits in Slurm's queue) is cancelled through Slurm (``scancel``) and ends
  cancelled.
- A Slurm job that ends without the job recording an end (time limit, node failure) leaves the run
  interrupted with Slurm's state and the tail of job.log; ``python -m jobs resume RUN`` continues it.

``executor="local"`` is submitit's LocalExecutor (the tests, and a machine without Slurm). submitit keeps its
own files — the submitted call, which submitit pickles here and unpickles on the node — in a private folder
(``ClusterSettings.folder``, default ``~/.marble-studio/submitit``) that must be owned by this user and
writable by no one else, and may not lie inside the data directory: the web app serves files from there, and
nothing a user can reach is ever unpickled. MARBLE Studio never reads them back (no ``job.result()``): the
outcome is what the job wrote to the store.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
import hashlib
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jobs import schema as s
from jobs.paths import DATABASE_URL_ENV, HOME_ENV
from jobs.runner import REPO_ROOT, RunnerSettings, Worker, mark_dead
from jobs.storage import Store

log = logging.getLogger("jobs.slurm")

EXECUTORS = ("slurm", "local")


@dataclass
class ClusterSettings:
    """What every Slurm job of this worker asks for (nodes and GPUs per node come from each run)."""

    executor: str = "slurm"  # "slurm", or "local" (submitit's LocalExecutor)
    partition: str | None = None
    time_limit_min: int = 24 * 60
    cpus_per_gpu: int = 8
    mem_gb: int | None = None
    account: str | None = None
    qos: str | None = None
    constraint: str | None = None
    folder: str | None = None  # submitit's private folder (module docstring); on a filesystem the nodes see

    def submitit_root(self) -> Path:
        return Path(self.folder).expanduser() if self.folder else Path.home() / ".marble-studio" / "submitit"

    def validate(self) -> None:
        if self.executor not in EXECUTORS:
            raise ValueError(f"executor={self.executor!r}: valid choices: {', '.join(EXECUTORS)}")
        if not (isinstance(self.time_limit_min, int) and self.time_limit_min >= 1):
            raise ValueError(f"time_limit_min={self.time_limit_min!r}: must be an integer >= 1 (minutes)")
        if not (isinstance(self.cpus_per_gpu, int) and self.cpus_per_gpu >= 1):
            raise ValueError(f"cpus_per_gpu={self.cpus_per_gpu!r}: must be an integer >= 1")
        if self.mem_gb is not None and not (isinstance(self.mem_gb, int) and self.mem_gb >= 1):
            raise ValueError(f"mem_gb={self.mem_gb!r}: must be an integer >= 1 (GB per node), or left out")


def private_folder(path: Path, data_dir: Path) -> Path:
    """Create (mode 0700) or check submitit's folder: outside the data directory the web app serves, owned by
    this user, group- and world-unwritable — the pickles in it run as code on the nodes."""
    path, data_dir = path.resolve(), data_dir.resolve()
    if path == data_dir or data_dir in path.parents:
        raise ValueError(f"submitit folder {str(path)!r}: must not lie inside the data directory {str(data_dir)!r} "
                         f"(the web app serves files from there); pick one with --submitit-folder")
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    info = path.stat()
    if info.st_uid != os.getuid() or info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise ValueError(f"submitit folder {str(path)!r}: must be owned by this user and writable by no one else "
                         f"(mode {stat.filemode(info.st_mode)}); submitit runs the files in it as code on the nodes "
                         f"(chmod 700 it, or pick another with --submitit-folder)")
    return path


def node_command(run_id: int, home: str, db_url: str, num_processes: int, num_nodes: int, node_rank: int,
                 master_addr: str | None, python: str = sys.executable) -> list[str]:
    """This node's command: ``python -m jobs.job RUN``, under torchrun when the run has several processes."""
    job = ["jobs.job", str(run_id), "--home", home, "--db", db_url]
    if num_processes <= 1 and num_nodes <= 1:
        return [python, "-m", *job]
    from core.launch import torchrun_command

    return torchrun_command(num_processes, num_nodes, node_rank, master_addr if num_nodes > 1 else None,
                            module_args=job, python=python)


def run_on_node(run_id: int, home: str, db_url: str, num_processes: int, num_nodes: int, log_path: str) -> int:
    """The call submitit runs on each node of the allocation (one task per node)."""
    import submitit

    env = submitit.JobEnvironment()
    node_rank = int(os.environ.get("SLURM_NODEID", env.node))
    master = env.hostnames[0] if num_nodes > 1 else None
    cmd = node_command(run_id, home, db_url, num_processes, num_nodes, node_rank, master)
    child_env = dict(os.environ, **{HOME_ENV: home, DATABASE_URL_ENV: db_url})
    child_env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT)] + ([child_env["PYTHONPATH"]] if child_env.get("PYTHONPATH") else []))
    with open(log_path, "ab") as out:
        out.write(f"=== slurm job {env.job_id} node {node_rank}/{num_nodes}: {' '.join(cmd)}\n".encode())
        out.flush()
        code = subprocess.run(cmd, cwd=REPO_ROOT, env=child_env, stdin=subprocess.DEVNULL, stdout=out,
                              stderr=subprocess.STDOUT).returncode
    if code != 0:
        raise RuntimeError(f"run {run_id}: the job exited with code {code} on node {node_rank} (see {log_path})")
    return code


def slurm_parameters(run, cluster: ClusterSettings) -> dict:
    """submitit's AutoExecutor parameters of one run: its nodes, one task per node (torchrun starts the
    processes), ``run.num_processes`` GPUs per node, CPUs per GPU, the time limit and the partition."""
    gpus = run.num_processes
    extra = {"slurm_partition": cluster.partition, "slurm_account": cluster.account, "slurm_qos": cluster.qos,
             "slurm_constraint": cluster.constraint, "mem_gb": cluster.mem_gb}
    return {"name": f"marble-run-{run.id}", "nodes": run.num_nodes, "tasks_per_node": 1, "gpus_per_node": gpus,
            "cpus_per_task": max(1, gpus) * cluster.cpus_per_gpu, "timeout_min": cluster.time_limit_min,
            **{k: v for k, v in extra.items() if v is not None}}


class SlurmWorker(Worker):
    """The runner's worker, starting each claimed run as a submitit job instead of a local process."""

    def __init__(self, store: Store, cluster: ClusterSettings, slots: int = 64,
                 settings: RunnerSettings | None = None):
        cluster.validate()
        private_folder(cluster.submitit_root(), store.home)  # refused here, before a run is claimed
        super().__init__(store, slots=slots, settings=settings)
        self.gpus = []  # GPUs are Slurm's to hand out, not this machine's
        self.cluster = cluster
        self.jobs: dict[int, Any] = {}  # run id -> submitit Job (the local worker's `children`)
        self._slurm_cancelled: set[int] = set()

    def executor(self, run):
        import submitit

        c = self.cluster
        home_key = hashlib.sha1(str(self.store.home.resolve()).encode()).hexdigest()[:12]  # one data dir each
        folder = private_folder(c.submitit_root(), self.store.home) / home_key / f"run_{run.id:06d}"
        if c.executor == "local":  # this machine's devices, as the local worker uses them
            if run.num_nodes > 1:
                raise ValueError(f"num_nodes={run.num_nodes}: submitit's local executor runs one node; use Slurm")
            ex = submitit.LocalExecutor(folder=folder)
            ex.update_parameters(timeout_min=c.time_limit_min, tasks_per_node=1)
            return ex
        ex = submitit.AutoExecutor(folder=folder, cluster="slurm")
        ex.update_parameters(**slurm_parameters(run, c))
        return ex

    def _watched(self) -> set[int]:
        """The runner's round (``Worker.tick``) with the submitted jobs in place of child processes."""
        return set(self.jobs)

    def _start(self, run_id: int) -> None:
        run = self.store.get_run(run_id)
        run.run_dir.mkdir(parents=True, exist_ok=True)
        try:
            job = self.executor(run).submit(run_on_node, run.id, str(self.store.home), self.store.url,
                                            run.num_processes, run.num_nodes, str(run.log_path))
        except Exception as e:  # noqa: BLE001 - sbatch missing or refused: the run fails with the reason
            self.store.finish(run_id, s.FAILED, error=f"could not submit to {self.cluster.executor}: {e}")
            return
        self.jobs[run_id] = job
        with open(run.log_path, "ab") as out:
            out.write(f"=== attempt {run.attempt}: submitted as {self.cluster.executor} job {job.job_id}\n".encode())
        log.info("run %d attempt %d submitted: %s job %s", run_id, run.attempt, self.cluster.executor, job.job_id)

    def _reap(self) -> None:
        for run_id, job in list(self.jobs.items()):
            run = self.store.get_run(run_id)
            if not job.done():
                if run.status == s.RUNNING and run.pid is None:  # still waiting in Slurm's queue
                    self.store.heartbeat(run_id)
                continue
            del self.jobs[run_id]
            run = self.store.get_run(run_id)
            if run.status == s.RUNNING:  # it ended without recording how
                mark_dead(self.store, run, f"the {self.cluster.executor} job {job.job_id} ended ({job.state}) "
                                           f"without recording an end")

    def _escalate_cancels(self) -> None:
        now = time.time()
        for run_id, job in list(self.jobs.items()):
            run = self.store.get_run(run_id)
            if run.cancel_requested and run.cancel_requested_at is not None and run_id not in self._slurm_cancelled:
                waiting = run.pid is None  # never started: nothing to wait for
                if waiting or now - run.cancel_requested_at > self.settings.cancel_grace:
                    log.warning("run %d: cancelling %s job %s", run_id, self.cluster.executor, job.job_id)
                    job.cancel(check=False)
                    self._slurm_cancelled.add(run_id)
