"""Mirror a run to the experiment trackers researchers already use (``TrainConfig.report_to``).

The job process adds a :class:`TrackerMirror` as one more event observer (jobs.job). The trainer's thread only
turns an event into ``(step, scalars, images)`` and puts it on a bounded queue; a thread of the mirror
imports the trackers lazily, starts them and writes to them, so a slow or hung tracker never blocks a training
step (a full queue drops the record, said once in the log). A tracker that fails — missing package, refused
login, full disk — is logged once with its error and dropped; training goes on.

What is mirrored, at the event's step (the same numbers the dashboard shows):
- step events: ``reward/<r>``, ``reward_std/<r>``, ``alpha/<r>`` (the α applied on the step), ``loss``,
  ``kl``, ``grad_norm``, ``seconds``;
- balance events: ``alpha_raw/<r>`` (α*), ``alpha_ema/<r>`` (ᾱ), ``cos/<a>-vs-<b>`` (pairwise gradient
  cosines), ``cos_to_update/<r>``, ``reward_grad_norm/<r>`` (not ``grad_norm/<r>``: MLflow's file store keeps
  ``grad_norm`` as a file), ``update_norm``, and ``conflict/min_cos_to_update``
  and ``conflict/rate`` (share of diagnosed steps so far where some reward's gradient points against the
  update, the dashboard's conflict rate);
- sample events: the step's images (``samples``), captioned with their prompts.

Where each writes (offline by default, nothing leaves the machine unless the tracker is configured to):
- wandb: ``<run>/trackers/`` (``WANDB_DIR``), offline unless ``WANDB_MODE`` says otherwise or an API key is set;
- tensorboard: event files in ``<run>/trackers/tensorboard``;
- trackio: its local SQLite store (``TRACKIO_DIR``, default ~/.cache/huggingface/trackio), project
  ``marble-studio``; ``trackio show`` opens it;
- mlflow: ``MLFLOW_TRACKING_URI`` when set, else the file store ``file:<run>/trackers/mlruns`` (with
  ``MLFLOW_ALLOW_FILE_STORE=true``, the opt-in MLflow 3 asks for a file store).
"""

from __future__ import annotations

import logging
import math
import os
import queue
import threading
from pathlib import Path
from typing import Any

log = logging.getLogger("jobs.trackers")

PROJECT = "marble-studio"
MAX_IMAGES = 16  # per sample event


def _num(x: Any) -> float | None:
    try:
        v = float(x)
    except (TypeError, ValueError):
        return None
    return v if math.isfinite(v) else None


class ConflictRate:
    """Running share of diagnosed steps whose smallest cosine to the update (valid rewards) is negative."""

    def __init__(self):
        self.steps = 0
        self.conflicts = 0

    def add(self, cos_to_update: dict, valid: dict) -> tuple[float | None, float | None]:
        values = [v for k, v in (cos_to_update or {}).items() if (valid or {}).get(k, True) and _num(v) is not None]
        if not values:
            return None, None
        self.steps += 1
        self.conflicts += min(values) < 0
        return min(values), self.conflicts / self.steps


def event_record(event, conflicts: ConflictRate) -> tuple[int, dict[str, float], list[dict]] | None:
    """``(step, scalars, images)`` of one core event, or None for events that carry nothing to mirror."""
    kind = getattr(event, "kind", None)
    scalars: dict[str, float | None] = {}
    images: list[dict] = []
    if kind == "step":
        for name, prefix in (("rewards", "reward"), ("reward_std", "reward_std"), ("alpha", "alpha")):
            for r, v in (getattr(event, name) or {}).items():
                scalars[f"{prefix}/{r}"] = _num(v)
        for key in ("loss", "kl", "grad_norm", "seconds"):
            scalars[key] = _num(getattr(event, key))
    elif kind == "balance":
        for name, prefix in (("alpha_raw", "alpha_raw"), ("alpha_ema", "alpha_ema"),
                             ("cos_to_update", "cos_to_update"), ("grad_norms", "reward_grad_norm")):
            for r, v in (getattr(event, name) or {}).items():
                scalars[f"{prefix}/{r}"] = _num(v)
        names, matrix = (event.cosine or {}).get("names") or [], (event.cosine or {}).get("matrix") or []
        for i, a in enumerate(names):
            for j in range(i + 1, len(names)):
                scalars[f"cos/{a}-vs-{names[j]}"] = _num(matrix[i][j]) if i < len(matrix) and j < len(matrix[i]) else None
        scalars["update_norm"] = _num(event.update_norm)
        scalars["conflict/min_cos_to_update"], scalars["conflict/rate"] = conflicts.add(event.cos_to_update, event.valid)
    elif kind == "samples":
        images = [{"path": it.get("path"), "caption": str(it.get("prompt", ""))} for it in event.items[:MAX_IMAGES]]
    else:
        return None
    return int(event.step), {k: v for k, v in scalars.items() if v is not None}, images


# ---- one adapter per tracker: start(run_dir, name, config), log(step, scalars, images), finish() ---------

class WandbTracker:
    name = "wandb"

    def start(self, run_dir: Path, run_name: str, config: dict) -> None:
        import wandb

        mode = os.environ.get("WANDB_MODE") or ("online" if os.environ.get("WANDB_API_KEY") else "offline")
        out = Path(os.environ.get("WANDB_DIR") or run_dir / "trackers")
        out.mkdir(parents=True, exist_ok=True)
        self.wandb = wandb
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", PROJECT), name=run_name, dir=str(out),
                              mode=mode, config=config, reinit="create_new")

    def log(self, step: int, scalars: dict, images: list[dict]) -> None:
        data: dict[str, Any] = dict(scalars)
        if images:
            data["samples"] = [self.wandb.Image(i["path"], caption=i["caption"]) for i in images]
        self.run.log(data, step=step)

    def finish(self) -> None:
        self.run.finish()


class TensorboardTracker:
    name = "tensorboard"

    def start(self, run_dir: Path, run_name: str, config: dict) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(run_dir / "trackers" / "tensorboard"))
        self.writer.add_text("config", f"```\n{config}\n```", 0)

    def log(self, step: int, scalars: dict, images: list[dict]) -> None:
        import numpy as np
        from PIL import Image

        for key, value in scalars.items():
            self.writer.add_scalar(key, value, step)
        for i, im in enumerate(images):
            with Image.open(im["path"]) as img:
                self.writer.add_image(f"samples/{i}", np.asarray(img.convert("RGB")), step, dataformats="HWC")
        self.writer.flush()

    def finish(self) -> None:
        self.writer.close()


class TrackioTracker:
    name = "trackio"

    def start(self, run_dir: Path, run_name: str, config: dict) -> None:
        import trackio

        self.trackio = trackio
        self.run = trackio.init(project=os.environ.get("TRACKIO_PROJECT", PROJECT), name=run_name, config=config,
                                embed=False)

    def log(self, step: int, scalars: dict, images: list[dict]) -> None:
        data: dict[str, Any] = dict(scalars)
        for i, im in enumerate(images):
            data[f"samples/{i}"] = self.trackio.Image(im["path"], caption=im["caption"])
        self.run.log(data, step=step)

    def finish(self) -> None:
        self.run.finish()


class MlflowTracker:
    name = "mlflow"

    def start(self, run_dir: Path, run_name: str, config: dict) -> None:
        from mlflow.tracking import MlflowClient

        uri = os.environ.get("MLFLOW_TRACKING_URI")
        if not uri:  # the default: a file store in the run folder (MLflow 3 asks for this opt-in to use one)
            uri = (run_dir / "trackers" / "mlruns").resolve().as_uri()
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.client = MlflowClient(tracking_uri=uri)
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME", PROJECT)
        exp = self.client.get_experiment_by_name(name)
        exp_id = exp.experiment_id if exp else self.client.create_experiment(name)
        self.run_id = self.client.create_run(exp_id, run_name=run_name).info.run_id
        self.client.log_dict(self.run_id, config, "marble_config.json")

    def log(self, step: int, scalars: dict, images: list[dict]) -> None:
        import time

        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        if scalars:
            self.client.log_batch(self.run_id, metrics=[Metric(k, v, now, step) for k, v in scalars.items()])
        for im in images:
            self.client.log_artifact(self.run_id, im["path"], artifact_path=f"samples/step_{step:06d}")

    def finish(self) -> None:
        self.client.set_terminated(self.run_id)


TRACKER_CLASSES = {c.name: c for c in (WandbTracker, TensorboardTracker, TrackioTracker, MlflowTracker)}


class TrackerMirror:
    """The observer: ``mirror(event)`` never raises and never waits; ``close()`` drains and finishes."""

    def __init__(self, names: list[str], run_dir: str | Path, run_name: str, config: dict,
                 trackers: dict[str, Any] | None = None, max_queue: int = 10_000):
        self.run_dir = Path(run_dir)
        self.run_name = run_name
        self.config = config
        factories = trackers or TRACKER_CLASSES
        self.trackers = {n: factories[n]() for n in names}
        self.failed: dict[str, str] = {}  # tracker -> its first error (it is then dropped)
        self.dropped = 0
        self._conflicts = ConflictRate()
        self._queue: queue.Queue = queue.Queue(maxsize=max_queue)
        self._thread = threading.Thread(target=self._work, name="trackers", daemon=True)
        self._thread.start()

    def __call__(self, event) -> None:
        try:
            record = event_record(event, self._conflicts)
            if record is None or not self.trackers:
                return
            step, scalars, images = record
            images = [{**im, "path": str(self.run_dir / im["path"])} for im in images if im.get("path")]
            self._queue.put_nowait((step, scalars, images))
        except queue.Full:
            if not self.dropped:
                log.warning("trackers fall behind: records are dropped (training goes on)")
            self.dropped += 1
        except Exception:  # noqa: BLE001 - a mirror must never stop training
            log.exception("trackers: could not read a %s event; training goes on", getattr(event, "kind", "?"))

    def _fail(self, name: str, what: str, error: BaseException) -> None:
        self.failed[name] = f"{type(error).__name__}: {error}"
        log.error("tracker %s failed to %s (%s); it is dropped for this run, training goes on", name, what,
                  self.failed[name])
        self.trackers.pop(name, None)

    def _work(self) -> None:
        for name, tracker in list(self.trackers.items()):
            try:
                tracker.start(self.run_dir, self.run_name, self.config)
                log.info("tracker %s started", name)
            except Exception as e:  # noqa: BLE001 - ImportError included: the package is optional
                hint = " (pip install -r requirements-trackers.txt)" if isinstance(e, ImportError) else ""
                self._fail(name, "start" + hint, e)
        while True:
            item = self._queue.get()
            if item is None:
                break
            for name, tracker in list(self.trackers.items()):
                try:
                    tracker.log(*item)
                except Exception as e:  # noqa: BLE001
                    self._fail(name, f"log step {item[0]}", e)

    def close(self, timeout: float = 120.0) -> None:
        """Write what is queued (up to ``timeout`` seconds), then finish every tracker."""
        try:
            self._queue.put(None, timeout=timeout)
        except queue.Full:
            log.warning("trackers: queue still full after %.0f s; the rest is dropped", timeout)
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.warning("trackers: still writing after %.0f s; leaving them", timeout)
            return
        for name, tracker in list(self.trackers.items()):
            try:
                tracker.finish()
            except Exception as e:  # noqa: BLE001
                self._fail(name, "finish", e)
