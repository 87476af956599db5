"""One writer per job: turns ``core.events`` into rows and writes them in batches.

Calling the writer (the trainer's ``on_event``) only converts the event and appends rows to a buffer;
the database is written by :meth:`EventWriter.flush`, which the job's heartbeat thread calls every
second or so. Three kinds of event flush at once, on the calling thread:
- ``start`` (the run row learns its device and total steps),
- ``checkpoint``: the checkpoint row goes in the same transaction as every buffered row before it, so a
  recorded checkpoint implies that all rows up to its step are stored (resume relies on it);
- ``end``.
A very fast run also flushes once ``max_pending_steps`` steps are buffered.

``busy_seconds`` adds up the wall time spent inside the writer on any thread (including waits for the
database and for the GIL), ``cpu_seconds`` the CPU time it used: the storage overhead that
benchmarks/storage.py reports as a fraction of step time.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

from jobs.storage import Batch, Store

# Per-reward dicts of a step event -> metric key prefix.
_PER_REWARD = (("rewards", "reward"), ("reward_std", "reward_std"), ("alpha", "alpha"), ("valid_counts", "valid"))
_SCALARS = ("loss", "kl", "grad_norm", "seconds")


def step_rows(ev: dict) -> tuple[dict, list[dict]]:
    """A step event's ``steps`` row and its long-form metric rows (None where not applicable)."""
    step = ev["step"]
    metrics = [{"step": step, "key": key, "value": _num(ev.get(key))} for key in _SCALARS]
    for field_name, prefix in _PER_REWARD:
        for name, value in (ev.get(field_name) or {}).items():
            metrics.append({"step": step, "key": f"{prefix}/{name}", "value": _num(value)})
    return {"step": step, "phase": ev["phase"], "stage": ev.get("stage"), "at": time.time()}, metrics


def _num(x) -> float | None:
    return None if x is None else float(x)


def event_batch(ev: dict, run_dir: Path) -> Batch:
    """The rows of one event (its ``to_dict()``, or a line of events.jsonl): steps and metrics, balance, samples,
    a checkpoint (path relative to ``run_dir`` when inside it) and the run row's updates. The job's writer and
    ``jobs import`` (jobs.importer) both turn events into rows here."""
    kind = ev["event"]
    batch = Batch()
    if kind == "step":
        row, metrics = step_rows(ev)
        batch.steps.append(row)
        batch.metrics.extend(metrics)
        batch.run.update(step=ev["step"], headline=ev.get("rewards") or {})
    elif kind == "balance":
        row = {k: ev.get(k) for k in (
            "step", "phase", "solver", "alpha_raw", "alpha_ema", "cosine", "cos_to_update", "grad_norms",
            "valid", "update_norm", "solve_seconds")}
        row["attribution"] = ev.get("attribution") or None
        if ev.get("cos_to_mean") and isinstance(row["cosine"], dict):  # kept with the cosines (no new column)
            row["cosine"] = {**row["cosine"], "to_mean": ev["cos_to_mean"]}
        batch.balance.append(row)
    elif kind == "samples":
        for i, item in enumerate(ev["items"]):
            batch.samples.append({
                "step": ev["step"], "idx": i, "prompt": item["prompt"], "source": item.get("source"),
                "seed": item.get("seed"), "group_id": item.get("group"), "path": item["path"],
                "rewards": item.get("rewards"), "advantages": item.get("advantages")})
    elif kind == "previews":
        for i, item in enumerate(ev["items"]):
            batch.previews.append({
                "step": ev["step"], "idx": i, "prompt": item["prompt"], "source": item.get("source"),
                "seed": item.get("seed"), "path": item["path"], "rewards": item.get("rewards")})
    elif kind == "checkpoint":
        path = Path(ev["path"])
        try:
            rel = str(path.resolve().relative_to(Path(run_dir).resolve()))
        except ValueError:
            rel = str(path)
        batch.checkpoints.append({"step": ev["step"], "path": rel, "created_at": time.time()})
    elif kind == "start":
        batch.run.update(total_steps=ev["total_steps"], device=ev.get("device"), step=ev["step"])
    return batch


class EventWriter:
    def __init__(self, store: Store, run_id: int, run_dir: str | Path, max_pending_steps: int = 50):
        self.store = store
        self.run_id = run_id
        self.run_dir = Path(run_dir)
        self.max_pending_steps = max_pending_steps
        self.busy_seconds = 0.0
        self.cpu_seconds = 0.0
        self.flushes = 0
        self._pending = Batch()
        self._lock = threading.Lock()  # guards _pending
        self._flush_lock = threading.Lock()  # one flush at a time, batches in order
        self._started_at: float | None = None  # wall time and step of this attempt's start event (for the ETA)
        self._start_step = 0

    # ---- the trainer's on_event ---------------------------------------------------------------------
    def __call__(self, event) -> None:
        t0, c0 = time.perf_counter(), time.thread_time()
        ev = event.to_dict()
        kind = ev["event"]
        batch = event_batch(ev, self.run_dir)
        if kind == "step" and self._started_at is not None and ev["step"] > self._start_step:
            batch.run["seconds_per_step"] = (time.time() - self._started_at) / (ev["step"] - self._start_step)
        elif kind == "start":
            self._started_at, self._start_step = time.time(), ev["step"]
        with self._lock:
            self._pending.extend(batch)
            urgent = kind in ("start", "checkpoint", "end") or len(self._pending.steps) >= self.max_pending_steps
        self.busy_seconds += time.perf_counter() - t0
        self.cpu_seconds += time.thread_time() - c0
        if urgent:
            self.flush()

    # ---- writing ------------------------------------------------------------------------------------
    def flush(self, heartbeat: bool = False) -> bool:
        """Write the buffered rows in one transaction (and stamp the heartbeat). Returns the stop flag.
        On a database error the rows go back to the front of the buffer for the next flush."""
        with self._flush_lock:
            t0, c0 = time.perf_counter(), time.thread_time()
            with self._lock:
                batch, self._pending = self._pending, Batch()
            if not len(batch) and not batch.run and not heartbeat:
                return False
            try:
                stop = self.store.write_batch(self.run_id, batch, heartbeat=heartbeat)
            except BaseException:
                with self._lock:
                    batch.extend(self._pending)
                    self._pending = batch
                raise
            finally:
                self.busy_seconds += time.perf_counter() - t0
                self.cpu_seconds += time.thread_time() - c0
            self.flushes += 1
            return stop

    def pending(self) -> int:
        with self._lock:
            return len(self._pending)
