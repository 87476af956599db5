"""One job: run a claimed job of the queue and record everything in the store.

``execute(store, run_id)`` is the whole job, whatever its kind (jobs.schema.KINDS): the worker runs it in a
process of its own (``python -m jobs.job RUN_ID``, its own process group, output to the job's job.log);
immediate mode calls it inline. Every kind gets the same frame: a heartbeat thread that flushes the writer,
stamps heartbeat_at and reads the stop flag (``JobControl.should_stop``); SIGTERM, a failure or the stop flag end
it cancelled / interrupted / failed with the error text; a failing job writes only its own row. The body differs:
- ``train``: ``core.trainer.train`` on the stored config (a config that no longer validates fails the job with the
  rule it breaks); a resumed attempt deletes the rows after the last recorded checkpoint and resumes from it;
  events go through one batched :class:`~jobs.writer.EventWriter`;
- ``evaluate``: ``jobs.evaluations.run_job`` (core.evaluate on a run's checkpoint, recorded in the evaluations table);
- ``compare``: ``jobs.compare.run_job`` (the side-by-side grid, written to its comparisons row).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import sys
import threading
import time
import traceback
from pathlib import Path

from core.checkpoint import CheckpointError, is_disk_full
from core.config import ConfigError
from jobs import schema as s
from jobs.paths import LOG_FILE
from jobs.storage import Batch, RunDetail, Store
from jobs.writer import EventWriter

log = logging.getLogger("jobs.job")

HEARTBEAT_ENV = "MARBLE_HEARTBEAT_SECONDS"
DEFAULT_HEARTBEAT_SECONDS = 1.0


class JobTerminated(BaseException):
    """SIGTERM reached the job (the runner's second step of a cancel, or a shutdown)."""


class Heartbeat(threading.Thread):
    """Every ``interval`` seconds: flush the writer, stamp heartbeat_at, read the stop flag."""

    def __init__(self, writer: EventWriter, interval: float):
        super().__init__(name=f"heartbeat-{writer.run_id}", daemon=True)
        self.writer = writer
        self.interval = interval
        self.stop_requested = threading.Event()
        self._done = threading.Event()
        self.failures = 0  # consecutive beats that could not reach the database

    def beat(self) -> None:
        try:
            stop = self.writer.flush(heartbeat=True)
        except Exception as e:  # noqa: BLE001 - a busy or unreachable database must not kill training
            self._failed("could not write the buffered rows; they stay buffered for the next beat", e)
            try:  # a batch the database refuses must not silence the heartbeat too
                stop = self.writer.store.heartbeat(self.writer.run_id)
            except Exception:  # noqa: BLE001 - counted above: one failed beat
                return
        else:
            if self.failures:
                log.warning("heartbeat: the database takes the rows again after %d failed beats", self.failures)
                self.failures = 0
        if stop:
            self.stop_requested.set()

    def _failed(self, what: str, exc: Exception) -> None:
        """The first failure with its traceback, then one line at the 2nd, 5th and every 20th: a database that
        stays down (a full disk) must not fill the job log with a traceback per beat."""
        self.failures += 1
        n = self.failures
        if n == 1:
            log.exception("heartbeat: %s", what)
        elif n in (2, 5) or n % 20 == 0:
            log.warning("heartbeat: %s (%d failed beats; last: %s: %s)", what, n, type(exc).__name__, exc)

    def run(self) -> None:
        while not self._done.wait(self.interval):
            self.beat()

    def should_stop(self) -> bool:
        return self.stop_requested.is_set()

    def close(self) -> None:
        self._done.set()
        if self.is_alive():
            self.join()


def process_key(pid: int) -> str | None:
    """Boot id + the process's start time: tells a live job from a new process that reuses its pid."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        stat = Path(f"/proc/{pid}/stat").read_text()
        return f"{boot}:{stat.rsplit(')', 1)[1].split()[19]}"
    except (OSError, IndexError):
        return None


def _log_event(event) -> None:
    if event.kind == "notice":
        log.warning("%s", event.message)
    elif event.kind == "step":
        rewards = " ".join(f"{k}={v:.4g}" for k, v in event.rewards.items() if v == v)
        log.info("step %d phase=%s loss=%.4g %s (%.2fs)", event.step, event.phase, event.loss, rewards, event.seconds)
    elif event.kind in ("start", "checkpoint", "end"):
        log.info("%s %s", event.kind, {k: v for k, v in event.to_dict().items() if k != "event"})


class JobControl:
    """What a job's body is handed: the stop flag, progress, the event writer, and what to close at the end."""

    def __init__(self, store: Store, run: RunDetail, writer: EventWriter, monitor: Heartbeat):
        self.store, self.run, self.writer, self.monitor = store, run, writer, monitor
        self.to_close: list = []  # objects with close(), closed when the job ends however it ends

    def should_stop(self) -> bool:
        return self.monitor.should_stop()

    def progress(self, step: int, total: int | None = None) -> None:
        """Record how far the job is (the runs list's step / total_steps); reads the stop flag on the way."""
        values = {"step": int(step), **({"total_steps": int(total)} if total is not None else {})}
        if self.store.write_batch(self.run.id, Batch(run=values), heartbeat=True):
            self.monitor.stop_requested.set()


def _train(control: JobControl) -> bool:
    """The body of a ``train`` job: True when it trained every step, False when it stopped on request."""
    store, run, writer, monitor = control.store, control.run, control.writer, control.monitor
    mirror = []  # the report_to trackers (jobs.trackers), started once the config is read

    def on_event(event) -> None:
        _log_event(event)
        writer(event)
        for observer in mirror:
            observer(event)  # queues only: never blocks nor raises

    from core.config import TrainConfig

    config = TrainConfig.from_dict(run.config)
    if config.report_to:
        from jobs.trackers import TrackerMirror

        mirror.append(TrackerMirror(config.report_to, run.run_dir, run.name or f"run-{run.id}", run.config))
        control.to_close.extend(mirror)
    resume_from = None
    if run.attempt > 1:  # a resume: continue from the last recorded checkpoint that verifies
        resume_from = _resume_point(store, run.id, on_event)
        after = 0 if resume_from is None else int(resume_from.name.removeprefix("step_"))
        dropped = store.truncate_after(run.id, after)
        log.info("attempt %d: resuming from %s (dropped %d rows after step %d)", run.attempt,
                 resume_from or "the start", dropped, after)
    from core.preflight import rewards_usable

    rewards_usable(config)  # weights present, servers named: refused here, before the model and first rollout
    from core.trainer import train

    result = train(config, run.run_dir, on_event=on_event, should_stop=monitor.should_stop, resume_from=resume_from)
    return result.status == "completed"


def _body(kind: str):
    """The body of a job of ``kind``: ``f(control) -> bool`` (True: done; False: stopped on request)."""
    if kind == s.EVALUATE:
        from jobs.evaluations import run_job

        return run_job
    if kind == s.COMPARE:
        from jobs.compare import run_job

        return run_job
    if kind == s.TRAIN:
        return _train
    raise ValueError(f"kind={kind!r}: valid choices: {', '.join(s.KINDS)}")


def execute(store: Store, run_id: int, heartbeat_seconds: float | None = None) -> str:
    """Run a claimed (running) job of any kind to its end; returns the final status."""
    run = store.get_run(run_id)
    if run.status != s.RUNNING:
        raise ValueError(f"run {run_id} is {run.status}; only a claimed (running) run can execute")
    interval = heartbeat_seconds or float(os.environ.get(HEARTBEAT_ENV, DEFAULT_HEARTBEAT_SECONDS))
    writer = EventWriter(store, run_id, run.run_dir)
    monitor = Heartbeat(writer, interval)
    monitor.beat()
    monitor.start()
    control = JobControl(store, run, writer, monitor)
    try:
        finished = _body(run.kind)(control)
        monitor.close()
        writer.flush(heartbeat=True)
        status = s.SUCCEEDED if finished else s.CANCELLED
        store.finish(run_id, status)
    except JobTerminated:
        monitor.close()
        cancelled = monitor.should_stop() or store.get_run(run_id).cancel_requested
        status = s.CANCELLED if cancelled else s.INTERRUPTED
        log.warning("terminated by SIGTERM: %s", status)
        _flush_quietly(writer)
        store.finish(run_id, status, error=None if cancelled else "terminated by SIGTERM", exit_code=-signal.SIGTERM)
    except Exception as e:  # noqa: BLE001 - every failure ends the job with its error text
        monitor.close()
        status = s.FAILED
        error = f"{type(e).__name__}: {e}"
        if is_disk_full(e):  # one clear line, not a traceback per write that failed
            said = e.strerror if isinstance(e, OSError) and isinstance(e.strerror, str) else ""
            error = said if said.startswith("no space left on device") else f"no space left on device: {error}"
            log.error("job failed: %s", error)
        elif isinstance(e, (CheckpointError, ConfigError)):  # says which file / field and why; a traceback adds nothing
            log.error("job failed: %s", error)
        else:
            log.error("job failed:\n%s", traceback.format_exc())
        _flush_quietly(writer)
        _finish_failed(store, run_id, error)
    finally:
        monitor.close()
        for observer in control.to_close:
            observer.close()
    log.info("%s %d %s", "run" if run.kind == s.TRAIN else f"{run.kind} job", run_id, status)
    return status


def _resume_point(store: Store, run_id: int, on_event) -> Path | None:
    """The newest recorded checkpoint whose files match its manifest; newer damaged or partial ones are
    skipped and reported (job log + a notice event). CheckpointError, naming the files, when none is good."""
    from core.checkpoint import pick
    from core.events import NoticeEvent

    recorded = [Path(c["path"]) for c in store.checkpoints(run_id) if c["exists"]]
    if not recorded:
        return None
    chosen, skipped = pick(recorded)
    for folder, reason in skipped:
        on_event(NoticeEvent(step=0, message=f"resume: skipped checkpoint {folder.name} ({reason}); "
                                             f"resuming from {chosen.name}"))
    return chosen


def _finish_failed(store: Store, run_id: int, error: str, tries: int = 5) -> None:
    """Record the failure, retrying briefly: on a full disk the database may need a moment (the failed
    checkpoint's temp folder is deleted first, which gives its space back)."""
    for i in range(tries):
        try:
            store.finish(run_id, s.FAILED, error=error)
            return
        except Exception as e:  # noqa: BLE001
            if i == tries - 1:
                raise
            log.warning("could not record the failure yet (%s); retrying", e)
            time.sleep(0.5 * 2 ** i)


def _flush_quietly(writer: EventWriter) -> None:
    try:
        writer.flush()
    except Exception:  # noqa: BLE001
        log.exception("could not write the last rows")


def _train_as_worker_rank(store: Store, run_id: int, rank: int) -> int:
    """A non-zero rank of a torchrun job trains its share of every step and writes nothing: rank 0's stop
    flag and resume checkpoint reach it through the process group (core.distributed)."""
    from core.config import TrainConfig
    from core.trainer import train

    run = store.get_run(run_id)
    log.info("rank %d of run %d: training its share", rank, run_id)
    try:
        train(TrainConfig.from_dict(run.config), run.run_dir)
    finally:
        store.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jobs.job", description="Run one claimed job (the worker "
                                     "starts this; use `python -m jobs worker`).")
    parser.add_argument("run_id", type=int)
    parser.add_argument("--home", help="the data directory (default: $MARBLE_HOME or ./runs)")
    parser.add_argument("--db", help="the database URL (default: the data directory's SQLite file)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr, force=True)
    logging.getLogger("alembic").setLevel(logging.WARNING)

    def _terminate(signum, frame):
        raise JobTerminated()

    signal.signal(signal.SIGTERM, _terminate)
    store = Store.open(args.home, args.db)
    rank = int(os.environ.get("RANK", "0"))
    if rank != 0:  # under torchrun (training only), rank 0 alone owns the run row, events, stop flag and resume path
        return _train_as_worker_rank(store, args.run_id, rank)
    run = store.get_run(args.run_id)
    if run.pid is None:  # started by hand rather than by a worker
        store.set_process(args.run_id, pid=os.getpid(), pgid=os.getpgid(0) if os.getsid(0) == os.getpid() else None,
                          host=socket.gethostname(), proc_key=process_key(os.getpid()))
    log.info("%s %d attempt %d in %s (pid %d; log %s)", "run" if run.kind == s.TRAIN else f"{run.kind} job",
             args.run_id, run.attempt, run.run_dir, os.getpid(), run.run_dir / LOG_FILE)
    status = execute(store, args.run_id)
    store.close()
    return 0 if status in (s.SUCCEEDED, s.CANCELLED) else 1


if __name__ == "__main__":
    sys.exit(main())
