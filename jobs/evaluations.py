"""Held-out evaluations in the store: ``core.evaluate``'s result for a run's checkpoint becomes one row of the
evaluations table, so the app reads one source for them (the dashboard's evaluation panel and the Study; the run's
folder keeps eval_<split>.json, and ``jobs import`` records the ones core.evaluate wrote for a CLI run).

    python -m jobs evaluate RUN [--checkpoint STEP] [--prompts test] [--prompts-per-source 16] [--seeds 4]
                                [--weights ema|raw] [--queue]

An evaluation is a job of the queue (kind ``evaluate``: :func:`queue`, run by the worker through :func:`run_job`,
cancelled and reconciled like a training run), or runs inline from the CLI (:func:`evaluate`); both check the same
rule first (:func:`check_evaluable`: a finished training run and one of its recorded checkpoints) and store the
result with :func:`record`.

Each row: ``scores`` = {reward: the checkpoint's mean}; ``details`` = per reward the base model's mean and std,
the improvement in base-std units z = (mean − base mean) / base std and its standard error, the sample count
and whether the run trained on it; the composites; the settings, weights and checkpoint.

The standard error of z treats the base std as known: se = sqrt(s_run²/n + s_base²/n) / s_base (base and run
are scored on the same n prompts × seeds). It is the sampling noise of one evaluation, not the spread over
seeds of training (the Study's by-strategy summary gives that).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from pathlib import Path
from typing import Any, Callable

from jobs import schema as s
from jobs.storage import RunDetail, RunNotFound, Store

log = logging.getLogger("jobs.evaluations")
PHASES = 2  # an evaluate job's progress: 1 = the base model is scored, 2 = the checkpoint is scored and recorded


def z_standard_error(row: dict[str, Any]) -> float | None:
    """The standard error of one reward's z (see the module docstring); None when it is undefined."""
    n, bs, rs = row.get("n") or 0, row.get("base_std"), row.get("std")
    if n < 2 or not bs or not _finite(bs) or bs <= 1e-12 or not _finite(rs):
        return None
    return math.sqrt(rs ** 2 / n + bs ** 2 / n) / bs


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def _clean(x: Any) -> float | None:
    return float(x) if _finite(x) else None  # JSON columns hold no NaN


def record(store: Store, run_id: int, result: dict, checkpoint_step: int | None = None,
           extra: dict | None = None) -> int:
    """Store ``core.evaluate.evaluate_run``'s result as an evaluation of ``run_id``; returns the row id. ``extra``
    goes into the details as is (the job that made it, or the file it was imported from)."""
    rewards = result["rewards"]
    details = {
        "rewards": {n: {"base_mean": _clean(r["base_mean"]), "base_std": _clean(r["base_std"]),
                        "mean": _clean(r["mean"]), "std": _clean(r["std"]), "z": _clean(r["z"]),
                        "z_se": z_standard_error(r), "n": int(r["n"]), "trained_on": bool(r["trained_on"])}
                    for n, r in rewards.items()},
        "composite_train": _clean(result.get("composite_train")), "composite_all": _clean(result.get("composite_all")),
        "settings": result.get("settings"), "weights": result.get("weights"), "checkpoint": result.get("checkpoint"),
        "images": result.get("images"), **(extra or {}),
    }
    split = (result.get("settings") or {}).get("split", "test")
    return store.add_evaluation(run_id, f"held-out {split}", {n: _clean(r["mean"]) for n, r in rewards.items()},
                                checkpoint_step=checkpoint_step, details=details)


def latest(store: Store, run_id: int) -> dict | None:
    """The run's newest evaluation row that carries per-reward z (rows written by :func:`record`)."""
    rows = [e for e in store.evaluations(run_id) if (e.get("details") or {}).get("rewards")]
    return max(rows, key=lambda e: (e["created_at"], e["id"])) if rows else None


def check_evaluable(store: Store, run_id: Any, checkpoint_step: int | None = None,
                    field: str = "--checkpoint") -> tuple[RunDetail, int, Path]:
    """(the run, the checkpoint's step, its folder) when ``run_id`` is a finished training run with that recorded
    checkpoint (its newest when ``checkpoint_step`` is None); else ValueError naming the field, value and rule. An
    unfinished run is refused: its scores would read as a finished run's."""
    if isinstance(run_id, bool) or not isinstance(run_id, int) or run_id < 1:
        raise ValueError(f"run={run_id!r}: run ids are integers >= 1 (see `python -m jobs list`)")
    try:
        run = store.get_run(run_id)
    except RunNotFound:
        raise ValueError(f"run={run_id}: no such run (see `python -m jobs list`)") from None
    if run.kind != s.TRAIN:
        raise ValueError(f"run={run_id}: #{run_id} is an {run.kind} job, not a training run; only a training "
                         f"run can be evaluated" if run.kind[0] in "aeiou" else
                         f"run={run_id}: #{run_id} is a {run.kind} job, not a training run; only a training run "
                         f"can be evaluated")
    if run.status != s.SUCCEEDED:
        how = ("wait until it finishes" if run.status in s.ACTIVE else
               "resume it to the end first (Resume / `python -m jobs resume`)")
        raise ValueError(f"run={run_id}: run #{run_id} is {run.status} at step {run.step}/{run.total_steps}; only a "
                         f"finished (succeeded) run can be evaluated, so its scores are not read as a finished "
                         f"run's: {how}")
    recorded = {c["step"]: c for c in store.checkpoints(run_id) if c["exists"]}
    if not recorded:
        raise ValueError(f"run={run_id}: run #{run_id} has no checkpoint to evaluate (it saves one every "
                         f"checkpoint_every steps and at its end)")
    step = max(recorded) if checkpoint_step is None else checkpoint_step
    if step not in recorded:
        raise ValueError(f"{field}={step}: run {run_id} has no checkpoint at that step (its checkpoints: "
                         f"{', '.join(map(str, sorted(recorded)))})")
    return run, step, Path(recorded[step]["path"])


def evaluate(store: Store, run_id: int, settings: Any, checkpoint_step: int | None = None, *,
             progress: Callable[[int], None] | None = None, should_stop: Callable[[], bool] | None = None,
             extra: dict | None = None) -> tuple[int | None, dict | None]:
    """Evaluate a finished run's checkpoint (its newest, or the one at ``checkpoint_step``) on held-out prompts
    with ``core.evaluate`` and record it; returns (evaluation id, result), or (None, None) when ``should_stop``
    said so between the base model and the checkpoint. ``progress(k)``: k of :data:`PHASES` phases done."""
    from core.config import TrainConfig
    from core.evaluate import evaluate_base, evaluate_run

    settings.validate()
    run, step, folder = check_evaluable(store, run_id, checkpoint_step)
    base = evaluate_base(TrainConfig.load(run.run_dir / "config.json"), settings)
    if progress:
        progress(1)
    if should_stop and should_stop():
        return None, None
    result = evaluate_run(run.run_dir, settings, base=base, checkpoint=folder)
    eval_id = record(store, run_id, result, checkpoint_step=step, extra=extra)
    if progress:
        progress(PHASES)
    return eval_id, result


# ---- the evaluate job ---------------------------------------------------------------------------------------

def queue(store: Store, run_id: Any, checkpoint_step: int | None = None, settings: Any = None,
          field: str = "checkpoint") -> int:
    """Queue an evaluate job for a finished run's checkpoint (its newest unless ``checkpoint_step``); returns the
    job's id. Refused (ValueError naming the field, value and rule): an unknown, unfinished or non-training run, a
    checkpoint it does not have, bad settings, or the same checkpoint already queued or being evaluated."""
    from core.evaluate import EvalSettings

    settings = settings or EvalSettings()
    settings.validate()
    run, step, _ = check_evaluable(store, run_id, checkpoint_step, field=field)
    for other in store.list_runs(status=list(s.ACTIVE), kind=s.EVALUATE):
        if other.subject_id == run.id and store.get_run(other.id).config.get("checkpoint_step") == step:
            raise ValueError(f"run={run.id}: its checkpoint {step} is already being evaluated by job #{other.id} "
                             f"({other.status})")
    request = {"run_id": run.id, "checkpoint_step": step, "settings": dataclasses.asdict(settings)}
    return store.create_run(request, strategy="-", total_steps=PHASES, kind=s.EVALUATE, subject_id=run.id,
                            name=f"evaluate #{run.id} {run.name or run.strategy} at step {step}")


def run_job(control: Any) -> bool:
    """The body of an evaluate job (jobs.job): True when the evaluation is recorded, False when stopped."""
    from core.evaluate import EvalSettings

    request = control.run.config
    settings = EvalSettings(**request["settings"])
    control.progress(0, PHASES)
    log.info("evaluating run %s checkpoint %s on the %s prompts (%d per source, %d seeds)", request["run_id"],
             request["checkpoint_step"], settings.split, settings.prompts_per_source, settings.seeds_per_prompt)
    eval_id, result = evaluate(control.store, request["run_id"], settings, request["checkpoint_step"],
                               progress=control.progress, should_stop=control.should_stop,
                               extra={"job_id": control.run.id})
    if eval_id is None:
        return False
    from core.evaluate import run_table

    log.info("recorded as evaluation %d of run %s\n%s", eval_id, request["run_id"], run_table(result))
    return True


def active_job(store: Store, run_id: int) -> Any:
    """The run's newest queued or running evaluate job (a RunSummary), or None."""
    jobs = [j for j in store.list_runs(status=list(s.ACTIVE), kind=s.EVALUATE) if j.subject_id == run_id]
    return jobs[0] if jobs else None
