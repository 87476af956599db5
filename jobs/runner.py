"""The job runner: a queue in the database, a worker that starts each job in a process of its own.

One queue for every kind of job (jobs.schema.KINDS): training runs, held-out evaluations (jobs.evaluations.queue) and
comparisons (jobs.compare.start_comparison) are rows of the same table with the same states; each takes a worker slot,
is cancelled, reconciled and resumed the same way. ``python -m jobs.job`` dispatches on the kind.

States: queued -> running -> succeeded | failed | cancelled | interrupted (jobs.schema).
- ``submit`` stores a validated config as a queued run; ``immediate=True`` runs it inline (huey's
  immediate mode: tests and scripts without a worker).
- ``Worker`` (``python -m jobs worker``) starts queued jobs while fewer than ``slots`` run (one per GPU,
  one on CPU). Each job is ``python -m jobs.job RUN`` (``torchrun`` when it asks for more than one
  process) in a new session, so it keeps running when the worker or the web process exits; a new
  worker adopts the jobs it finds running. One worker per data directory (a lock file).
- ``cancel``: the stop flag first (the job polls it between micro-batches, saves a checkpoint and ends
  cancelled), then SIGTERM to the job's process group after ``cancel_grace`` seconds, then SIGKILL after
  ``kill_grace`` more.
- ``reconcile``: a running job whose process is gone (crash, kill -9, reboot) or whose heartbeat is older
  than ``stale_after`` is marked interrupted, with the exit code or reason and the tail of its log.
- ``resume``: back to queued; the job continues from the last recorded checkpoint (jobs.job).

This module never imports torch: the web process uses it to submit, cancel and watch.
"""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jobs import schema as s
from jobs.job import HEARTBEAT_ENV, process_key
from jobs.paths import DATABASE_URL_ENV, HOME_ENV, LOG_FILE, WORKER_LOCK
from jobs.storage import RunDetail, Store, TransitionError

log = logging.getLogger("jobs.runner")

REPO_ROOT = Path(__file__).resolve().parents[1]
_detached: list[subprocess.Popen] = []  # workers started by ensure_worker (kept so they are reaped quietly)


@dataclass
class RunnerSettings:
    """Timing of the runner; each can be set by an environment variable (in seconds)."""

    heartbeat_seconds: float = 1.0  # MARBLE_HEARTBEAT_SECONDS: the job's flush + heartbeat + stop-flag period
    stale_after: float = 120.0  # MARBLE_STALE_AFTER: no heartbeat for this long -> interrupted
    poll_seconds: float = 1.0  # MARBLE_POLL_SECONDS: the worker's loop period
    cancel_grace: float = 30.0  # MARBLE_CANCEL_GRACE: stop flag -> SIGTERM
    kill_grace: float = 15.0  # MARBLE_KILL_GRACE: SIGTERM -> SIGKILL

    @classmethod
    def from_env(cls, **overrides: float) -> "RunnerSettings":
        names = {"heartbeat_seconds": HEARTBEAT_ENV, "stale_after": "MARBLE_STALE_AFTER",
                 "poll_seconds": "MARBLE_POLL_SECONDS", "cancel_grace": "MARBLE_CANCEL_GRACE",
                 "kill_grace": "MARBLE_KILL_GRACE"}
        values: dict[str, float] = {}
        for name, env in names.items():
            raw = os.environ.get(env)
            if raw is not None:
                try:
                    values[name] = float(raw)
                except ValueError:
                    raise ValueError(f"{env}={raw!r}: must be a number of seconds") from None
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)


# ---- submitting ---------------------------------------------------------------------------------------

def code_version() -> str:
    """``git describe`` of this checkout, or "unknown"."""
    try:
        out = subprocess.run(["git", "-C", str(REPO_ROOT), "describe", "--always", "--dirty", "--tags"],
                             capture_output=True, text=True, timeout=10)
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def submit(store: Store, config: Any, *, preset: str | None = None, name: str | None = None,
           num_processes: int = 1, num_nodes: int = 1, immediate: bool = False) -> int:
    """Queue a run of ``config`` (a validated ``core.config.TrainConfig``); returns its id. With
    ``immediate`` the job runs inline before this returns."""
    for field_name, value in (("num_processes", num_processes), ("num_nodes", num_nodes)):
        if not (isinstance(value, int) and value >= 1):
            raise ValueError(f"{field_name}={value!r}: must be an integer >= 1")
    from core.limits import check_name
    from core.preflight import check_run

    if name is not None:
        check_name("name", name)
    check_run(config, world_size=num_processes * num_nodes)  # memory, rewards vs prompts, reward servers
    run_id = store.create_run(config.to_dict(), strategy=config.balance.strategy, total_steps=config.steps,
                              preset=preset, name=name, code_version=code_version(), num_processes=num_processes,
                              num_nodes=num_nodes)
    if immediate:
        run_immediately(store, run_id)
    return run_id


def run_immediately(store: Store, run_id: int) -> str:
    """Claim a queued run and execute it in this process; returns the final status."""
    from jobs.job import execute

    if store.claim(run_id) is None:
        raise TransitionError(f"run {run_id} is {store.status(run_id)}; only a queued run can start")
    store.set_process(run_id, pid=os.getpid(), pgid=None, host=socket.gethostname(),
                      proc_key=process_key(os.getpid()))
    run_dir = store.run_dir(run_id)
    run_dir.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(run_dir / LOG_FILE)  # the job's log, as a worker-started job has it
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    loggers = [logging.getLogger(name) for name in ("jobs", "core")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.addHandler(handler)
        if lg.getEffectiveLevel() > logging.INFO:
            lg.setLevel(logging.INFO)
    try:
        return execute(store, run_id)
    finally:
        for lg, level in zip(loggers, levels):
            lg.removeHandler(handler)
            lg.setLevel(level)
        handler.close()


def resume(store: Store, run_id: int, *, steps: int | None = None, from_step: int | None = None,
           immediate: bool = False) -> int:
    """Queue a stopped run again; it continues from its last recorded checkpoint that verifies, or from the
    one at ``from_step`` (checked now; the rows after it are dropped). ``steps`` extends the run (the only
    config change allowed). An evaluate or compare job is simply run again (it has no steps to extend)."""
    config = None
    if (steps is not None or from_step is not None) and store.get_run(run_id).kind != s.TRAIN:
        kind = store.get_run(run_id).kind
        raise ValueError(f"{'steps' if steps is not None else 'from_step'}: #{run_id} is a {kind} job; only a "
                         f"training run resumes to more steps or from a checkpoint (Resume alone runs the job again)")
    if from_step is not None:
        _check_from_step(store, run_id, from_step)
    if steps is not None:
        from core.config import TrainConfig

        ckpt = store.latest_checkpoint(run_id)
        start = from_step if from_step is not None else (ckpt["step"] if ckpt else 0)
        if steps <= start:
            raise ValueError(f"steps={steps}: run {run_id} resumes from its checkpoint at step {start}; "
                             f"ask for more steps than that")
        config = TrainConfig.from_dict(store.get_run(run_id).config).with_overrides({"steps": steps}).to_dict()
    store.requeue(run_id, config=config, total_steps=steps, from_step=from_step)
    if immediate:
        run_immediately(store, run_id)
    return run_id


def _check_from_step(store: Store, run_id: int, step: int) -> None:
    """``--from-step``: a recorded checkpoint at that step whose files match its manifest."""
    from core.checkpoint import verify

    if isinstance(step, bool) or not isinstance(step, int) or step < 1:
        raise ValueError(f"from_step={step!r}: must be the step of one of the run's checkpoints (an integer >= 1)")
    recorded = {c["step"]: c for c in store.checkpoints(run_id) if c["exists"]}
    if step not in recorded:
        have = ", ".join(map(str, sorted(recorded))) or "none"
        raise ValueError(f"from_step={step}: run {run_id} has no checkpoint at step {step} (its checkpoints: {have})")
    verify(recorded[step]["path"])  # CheckpointError (a ValueError) names the damaged file


# ---- processes ----------------------------------------------------------------------------------------

def process_alive(pid: int | None, proc_key: str | None = None) -> bool:
    """Whether ``pid`` is a live (not zombie) process, and the same one as ``proc_key`` when given."""
    if not pid:
        return False
    if Path("/proc/self/stat").exists():  # Linux: also tells zombies and reused pids apart
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            return False
        if stat.rsplit(")", 1)[1].split()[0] in ("Z", "X"):
            return False
        return proc_key is None or process_key(pid) in (None, proc_key)
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _signal_group(run: RunDetail, sig: int) -> bool:
    """Send ``sig`` to the job's own process group. Never to a job without one (immediate mode), on
    another host, or whose pid now belongs to another process."""
    if not run.pgid or run.host != socket.gethostname() or not process_alive(run.pid, run.proc_key):
        return False
    try:
        os.killpg(run.pgid, sig)
        return True
    except ProcessLookupError:
        return False


def cancel(store: Store, run_id: int, *, wait: bool = True, settings: RunnerSettings | None = None) -> str:
    """Stop a run: queued -> cancelled at once; running -> the stop flag, and with ``wait`` the caller
    escalates to SIGTERM and SIGKILL after the grace periods (without ``wait`` the worker does). Returns
    the status (the final one when waiting)."""
    settings = settings or RunnerSettings.from_env()
    status = store.request_cancel(run_id)
    if status != s.RUNNING or not wait:
        return status
    for sig, grace in ((None, settings.cancel_grace), (signal.SIGTERM, settings.kill_grace),
                       (signal.SIGKILL, 10.0)):
        run = store.get_run(run_id)
        if sig is not None:
            if run.status != s.RUNNING:
                break
            log.warning("run %d did not stop within the grace period: %s", run_id, signal.Signals(sig).name)
            _signal_group(run, sig)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            run = store.get_run(run_id)
            if run.status != s.RUNNING:
                return run.status
            if run.pgid and not process_alive(run.pid, run.proc_key):
                break  # it died without writing its status: reconcile below
            time.sleep(0.2)
    reconcile(store, settings)
    return store.status(run_id)


def job_command(run: RunDetail, store: Store, python: str = sys.executable) -> list[str]:
    """The job's command line: ``python -m jobs.job RUN``, or under ``torchrun`` for several processes
    (one node: a standalone rendezvous on a free port, so several jobs can share a host; several nodes:
    this machine is node 0 at $MARBLE_MASTER_ADDR or its host name, and each other node runs the same
    command with its --node-rank, see docs/distributed.md)."""
    job = ["jobs.job", str(run.id), "--home", str(store.home), "--db", store.url]
    if run.num_processes <= 1 and run.num_nodes <= 1:
        return [python, "-m", *job]
    from core.launch import torchrun_command

    master = os.environ.get("MARBLE_MASTER_ADDR", socket.gethostname()) if run.num_nodes > 1 else None
    return torchrun_command(run.num_processes, run.num_nodes, 0, master, module_args=job, python=python)


def _exit_reason(code: int | None) -> str:
    if code is None:
        return "the job's process is gone"
    if code < 0:
        try:
            return f"the job's process was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"the job's process was killed by signal {-code}"
    return f"the job's process exited with code {code} without recording an end"


def mark_dead(store: Store, run: RunDetail, reason: str, exit_code: int | None = None) -> bool:
    """A running job that is no longer running: cancelled if a stop was requested, else interrupted;
    the error holds the reason and the tail of the job's log."""
    status = s.CANCELLED if run.cancel_requested else s.INTERRUPTED
    tail = store.log_tail(run.id, 30)
    if not run.cancel_requested and "no space left on device" in tail.rsplit("=== attempt", 1)[-1].lower():
        status, reason = s.FAILED, f"no space left on device: {reason}"  # the job could not record it itself
    error = reason + (f"\n--- last lines of {LOG_FILE} ---\n{tail}" if tail else "")
    done = store.finish(run.id, status, error=error, exit_code=exit_code)
    if done:
        log.warning("run %d %s: %s", run.id, status, reason)
    return done


def reconcile(store: Store, settings: RunnerSettings | None = None, skip: set[int] | frozenset = frozenset(),
              now: float | None = None) -> list[int]:
    """Mark running jobs that died (process gone, or no heartbeat for ``stale_after``) as interrupted
    (cancelled if a stop was requested). A hung job on this host is killed first. Returns their ids."""
    settings = settings or RunnerSettings.from_env()
    now = time.time() if now is None else now
    host = socket.gethostname()
    marked = []
    for summary in store.list_runs(status=s.RUNNING):
        if summary.id in skip:
            continue
        run = store.get_run(summary.id)
        reason = None
        if run.host == host and run.pid is not None and not process_alive(run.pid, run.proc_key):
            reason = f"the job's process {run.pid} is gone (crash, kill -9 or restart)"
        else:
            last = max(run.heartbeat_at or 0.0, run.started_at or 0.0)
            if now - last > settings.stale_after:
                reason = f"no heartbeat for {now - last:.0f} s (limit {settings.stale_after:.0f} s)"
                _signal_group(run, signal.SIGKILL)
        if reason and mark_dead(store, run, reason):
            marked.append(run.id)
    return marked


# ---- the worker ---------------------------------------------------------------------------------------

class WorkerBusy(RuntimeError):
    pass


def gpu_count() -> int:
    """GPUs visible to jobs, without importing torch: CUDA_VISIBLE_DEVICES, else ``nvidia-smi -L``."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip() and d.strip() != "-1"])
    smi = shutil.which("nvidia-smi")
    if not smi:
        return 0
    try:
        out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(1 for line in out.stdout.splitlines() if line.startswith("GPU "))


def worker_pid(home: str | Path) -> int | None:
    """The pid of the worker that serves ``home``, or None when none does."""
    path = Path(home) / WORKER_LOCK
    if not path.exists():
        return None
    with open(path, "a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            text = f.read().strip()
            return int(text) if text.isdigit() else -1
        fcntl.flock(f, fcntl.LOCK_UN)
    return None


def ensure_worker(store: Store, extra_args: list[str] | None = None) -> int:
    """Start a detached worker for the store's data directory unless one runs; returns its pid. The web
    process calls this: the worker (and its jobs) outlive it."""
    pid = worker_pid(store.home)
    if pid:
        return pid
    env = dict(os.environ, **{HOME_ENV: str(store.home), DATABASE_URL_ENV: store.url})
    with open(store.home / "worker.log", "ab") as out:
        proc = subprocess.Popen([sys.executable, "-m", "jobs", "worker", *(extra_args or [])], cwd=REPO_ROOT,
                                env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    _detached.append(proc)
    return proc.pid


def stop_worker(home: str | Path, timeout: float = 30.0) -> str:
    """Ask the worker of ``home`` to stop (SIGTERM: it finishes its round and leaves; running jobs go on, in
    their own process groups) and wait until it has let go of its lock. Returns what happened, in a sentence."""
    pid = worker_pid(home)
    if not pid or pid < 0:
        return f"no worker serves {home}"
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return f"no worker serves {home} (pid {pid} is gone)"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if worker_pid(home) is None:
            return f"worker {pid} stopped"
        time.sleep(0.1)
    raise TimeoutError(f"worker {pid} did not stop within {timeout:.0f} s; `kill {pid}` stops it")


def active_runs_line(store: Store) -> str | None:
    """The runs a worker still owes (queued or running), as '#3 name (running 40/200), ...', or None."""
    active = store.list_runs(status=list(s.ACTIVE))
    if not active:
        return None
    return ", ".join(f"#{r.id} {r.name or r.strategy} ({r.status} {r.step}/{r.total_steps})" for r in active)


class Worker:
    """Runs the queue: ``tick()`` reaps, reconciles, escalates cancels and starts jobs; ``run()`` loops."""

    def __init__(self, store: Store, slots: int | None = None, settings: RunnerSettings | None = None,
                 python: str = sys.executable):
        self.store = store
        self.settings = settings or RunnerSettings.from_env()
        gpus = gpu_count()
        self.gpus = [str(i) for i in range(gpus)]
        self.slots = slots if slots is not None else max(1, gpus)
        if self.slots < 1:
            raise ValueError(f"slots={self.slots}: must be >= 1")
        self.python = python
        self.children: dict[int, subprocess.Popen] = {}
        self._terminated: dict[int, float] = {}  # run id -> when SIGTERM was sent
        self._stopping = False
        self._lock_file = None

    # ---- one round --------------------------------------------------------------------------------
    def tick(self) -> None:
        self._reap()
        reconcile(self.store, self.settings, skip=self._watched())  # runs this worker watches itself
        self._escalate_cancels()
        while not self._stopping and self.store.count_runs(s.RUNNING) < self.slots:
            run_id = self.store.claim(slots=self.slots)
            if run_id is None:
                break
            self._start(run_id)

    def _watched(self) -> set[int]:
        """The runs whose end this worker sees itself (its child processes)."""
        return set(self.children)

    def _reap(self) -> None:
        for run_id, proc in list(self.children.items()):
            code = proc.poll()
            if code is None:
                continue
            del self.children[run_id]
            self._terminated.pop(run_id, None)
            run = self.store.get_run(run_id)
            if run.status == s.RUNNING:  # it ended without recording how
                mark_dead(self.store, run, _exit_reason(code), exit_code=code)

    def _escalate_cancels(self) -> None:
        now = time.time()
        for summary in self.store.list_runs(status=s.RUNNING):
            run = self.store.get_run(summary.id)
            if not run.cancel_requested or run.cancel_requested_at is None:
                continue
            sent = self._terminated.get(run.id)
            if sent is None and now - run.cancel_requested_at > self.settings.cancel_grace:
                if _signal_group(run, signal.SIGTERM):
                    log.warning("run %d ignored the stop flag for %.0f s: SIGTERM", run.id, self.settings.cancel_grace)
                self._terminated[run.id] = now
            elif sent is not None and now - sent > self.settings.kill_grace:
                if _signal_group(run, signal.SIGKILL):
                    log.warning("run %d survived SIGTERM for %.0f s: SIGKILL", run.id, self.settings.kill_grace)

    def _free_gpu(self) -> str | None:
        if not self.gpus:
            return None
        used = {r.devices for r in (self.store.get_run(x.id) for x in self.store.list_runs(status=s.RUNNING))}
        free = [g for g in self.gpus if g not in used]
        return free[0] if free else None

    def _start(self, run_id: int) -> None:
        run = self.store.get_run(run_id)
        run.run_dir.mkdir(parents=True, exist_ok=True)
        devices = self._free_gpu() if run.num_processes <= 1 else None
        env = dict(os.environ, **{HOME_ENV: str(self.store.home), DATABASE_URL_ENV: self.store.url,
                                  HEARTBEAT_ENV: str(self.settings.heartbeat_seconds)})
        env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
        if devices is not None:
            env["CUDA_VISIBLE_DEVICES"] = devices
        cmd = job_command(run, self.store, self.python)
        try:
            with open(run.log_path, "ab") as out:
                out.write(f"=== attempt {run.attempt}: {' '.join(cmd)}\n".encode())
                out.flush()
                proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdin=subprocess.DEVNULL, stdout=out,
                                        stderr=subprocess.STDOUT, start_new_session=True)
        except OSError as e:
            self.store.finish(run_id, s.FAILED, error=f"could not start the job: {e}")
            return
        self.children[run_id] = proc
        self.store.set_process(run_id, pid=proc.pid, pgid=proc.pid, host=socket.gethostname(),
                               proc_key=process_key(proc.pid), devices=devices)
        log.info("run %d attempt %d started: pid %d", run_id, run.attempt, proc.pid)

    # ---- the loop ---------------------------------------------------------------------------------
    def _acquire_lock(self) -> None:
        path = self.store.home / WORKER_LOCK
        f = open(path, "a+")
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            other = f.read().strip()
            f.close()
            raise WorkerBusy(f"another worker (pid {other or '?'}) already serves {self.store.home}") from None
        f.seek(0)
        f.truncate()
        f.write(str(os.getpid()))
        f.flush()
        self._lock_file = f

    def _release_lock(self) -> None:
        if self._lock_file is not None:
            self._lock_file.truncate(0)
            fcntl.flock(self._lock_file, fcntl.LOCK_UN)
            self._lock_file.close()
            self._lock_file = None

    def _backoff(self, failures: int) -> float:
        """The loop's wait: the poll period, doubling per failed round in a row up to 60 s."""
        if not failures:
            return self.settings.poll_seconds
        return min(max(60.0, self.settings.poll_seconds), self.settings.poll_seconds * 2 ** min(failures, 16))

    def stop(self, *_: Any) -> None:
        """Stop starting jobs and leave the loop; running jobs go on (a later worker adopts them)."""
        self._stopping = True

    def run(self, once: bool = False) -> None:
        """Serve the queue until stopped (SIGTERM / Ctrl-C); ``once``: until nothing is queued or running."""
        self._acquire_lock()
        previous = {sig: signal.signal(sig, self.stop) for sig in (signal.SIGTERM, signal.SIGINT)}
        log.info("worker %d serves %s with %d slot(s)", os.getpid(), self.store.home, self.slots)
        failures = 0  # consecutive failed rounds: the wait grows, and only the first logs a traceback
        try:
            while not self._stopping:
                try:
                    self.tick()
                    if failures:
                        log.info("worker: rounds succeed again after %d failed", failures)
                    failures = 0
                except Exception as e:  # noqa: BLE001 - e.g. the database is briefly unreachable: retry
                    failures += 1
                    if failures == 1:
                        log.exception("worker: this round failed; trying again")
                    elif failures in (2, 5) or failures % 20 == 0:
                        log.warning("worker: %d rounds in a row failed (%s: %s); next try in %.0f s", failures,
                                    type(e).__name__, e, self._backoff(failures))
                if once and self.store.count_runs(s.ACTIVE) == 0:
                    break
                time.sleep(self._backoff(failures))
        finally:
            alive = sum(proc.poll() is None for proc in self.children.values())  # also reaps ended jobs
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            self._release_lock()
        log.info("worker %d stops%s", os.getpid(), f"; {alive} job(s) keep running" if alive else "")
