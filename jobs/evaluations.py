"""Held-out evaluations in the store: ``core.evaluate``'s result for a run's checkpoint becomes one row of the
evaluations table, so the app reads one source for them (the Study; the run's folder keeps eval_<split>.json).

    python -m jobs evaluate RUN [--prompts test] [--prompts-per-source 16] [--seeds 4] [--weights ema|raw]

Each row: ``scores`` = {reward: the checkpoint's mean}; ``details`` = per reward the base model's mean and std,
the improvement in base-std units z = (mean − base mean) / base std and its standard error, the sample count
and whether the run trained on it; the composites; the settings, weights and checkpoint.

The standard error of z treats the base std as known: se = sqrt(s_run²/n + s_base²/n) / s_base (base and run
are scored on the same n prompts × seeds). It is the sampling noise of one evaluation, not the spread over
seeds of training (the Study's by-strategy summary gives that).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from jobs.storage import Store


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


def record(store: Store, run_id: int, result: dict, checkpoint_step: int | None = None) -> int:
    """Store ``core.evaluate.evaluate_run``'s result as an evaluation of ``run_id``; returns the row id."""
    rewards = result["rewards"]
    details = {
        "rewards": {n: {"base_mean": _clean(r["base_mean"]), "base_std": _clean(r["base_std"]),
                        "mean": _clean(r["mean"]), "std": _clean(r["std"]), "z": _clean(r["z"]),
                        "z_se": z_standard_error(r), "n": int(r["n"]), "trained_on": bool(r["trained_on"])}
                    for n, r in rewards.items()},
        "composite_train": _clean(result.get("composite_train")), "composite_all": _clean(result.get("composite_all")),
        "settings": result.get("settings"), "weights": result.get("weights"), "checkpoint": result.get("checkpoint"),
        "images": result.get("images"),
    }
    split = (result.get("settings") or {}).get("split", "test")
    return store.add_evaluation(run_id, f"held-out {split}", {n: _clean(r["mean"]) for n, r in rewards.items()},
                                checkpoint_step=checkpoint_step, details=details)


def latest(store: Store, run_id: int) -> dict | None:
    """The run's newest evaluation row that carries per-reward z (rows written by :func:`record`)."""
    rows = [e for e in store.evaluations(run_id) if (e.get("details") or {}).get("rewards")]
    return max(rows, key=lambda e: (e["created_at"], e["id"])) if rows else None


def evaluate(store: Store, run_id: int, settings: Any, checkpoint_step: int | None = None) -> tuple[int, dict]:
    """Evaluate a run's checkpoint (its newest, or the one at ``checkpoint_step``) on held-out prompts with
    ``core.evaluate`` and record it; returns (evaluation id, result)."""
    from core.evaluate import evaluate_run

    run = store.get_run(run_id)
    recorded = {c["step"]: c for c in store.checkpoints(run_id) if c["exists"]}
    if not recorded:
        raise ValueError(f"run {run_id} has no checkpoint to evaluate (it saves one every checkpoint_every steps "
                         f"and at its end)")
    step = max(recorded) if checkpoint_step is None else checkpoint_step
    if step not in recorded:
        raise ValueError(f"--checkpoint={step}: run {run_id} has no checkpoint at that step (its checkpoints: "
                         f"{', '.join(map(str, sorted(recorded)))})")
    result = evaluate_run(run.run_dir, settings, checkpoint=Path(recorded[step]["path"]))
    return record(store, run_id, result, checkpoint_step=step), result
