"""Side-by-side comparisons of checkpoints (and base models) on prompts: a job of the queue like any other.

``start_comparison`` stores the request as a comparisons row and queues a job of kind ``compare`` for it (one worker
slot; cancelled, reconciled after a crash and resumed like a training run, with the same status words). The job
(:func:`run_job`, dispatched by jobs.job) generates every (prompt, seed) with every entry using the training sampler,
scores each image with the runs' rewards, saves the grid under ``$MARBLE_HOME/comparisons/NNNNNN/`` and writes it to
the row, which can be reopened at any time; its log is the job's (``python -m jobs logs JOB``). It reports its progress
as entries done out of entries and stops between entries when a cancel asks it to.

Why a row of the runs table and not a process of its own (as before): one queue, one worker and one set of states
for everything that runs in the background, so a comparison waits for a free slot instead of competing with a
training run for the same CPU or GPU, can be cancelled, and is marked interrupted when its process dies.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

from jobs import schema
from jobs.storage import RunNotFound, Store


def comparison_dir(store: Store, comparison_id: int) -> Path:
    return store.home / "comparisons" / f"{comparison_id:06d}"


MAX_COMPARE_STEPS = 1000


def validate_request(entries: list[dict], prompts: list[str], seeds: list[int], num_steps: Any = 10,
                     guidance_scale: Any = 1.0) -> None:
    if not (isinstance(num_steps, (int, float)) and not isinstance(num_steps, bool) and math.isfinite(num_steps)
            and num_steps == int(num_steps) and 1 <= num_steps <= MAX_COMPARE_STEPS):
        raise ValueError(f"compare: denoising steps={num_steps!r}: must be a whole number from 1 to "
                         f"{MAX_COMPARE_STEPS}")
    if not (isinstance(guidance_scale, (int, float)) and not isinstance(guidance_scale, bool)
            and math.isfinite(guidance_scale) and guidance_scale >= 1.0):
        raise ValueError(f"compare: guidance scale={guidance_scale!r}: must be a number >= 1.0 (1.0 = no guidance), "
                         f"as for training")
    if len(entries) < 2:
        raise ValueError(f"compare: pick at least two checkpoints or base models (got {len(entries)})")
    if not prompts or any(not p.strip() for p in prompts):
        raise ValueError("compare: enter at least one prompt, one per line")
    if not seeds or len(seeds) > 16 or any(not isinstance(s, int) or s < 0 for s in seeds):
        raise ValueError(f"compare: seeds must be 1-16 integers >= 0 (got {seeds!r})")
    for e in entries:
        if e.get("weights", "ema") not in ("ema", "raw"):
            raise ValueError(f"compare: entry {e.get('label')!r} weights={e.get('weights')!r}: valid choices: ema, raw")
    if len(prompts) * len(seeds) * len(entries) > 512:
        raise ValueError("compare: at most 512 images per comparison (prompts x seeds x entries)")


def start_comparison(store: Store, name: str, entries: list[dict], prompts: list[str], seeds: list[int],
                     num_steps: int = 10, guidance_scale: float = 1.0) -> int:
    """Queue a comparison. ``entries``: ``{"label", "model", "lora" (checkpoint folder or None),
    "run_id" (or None), "rewards": [reward configs], optional "weights": "ema" (default: the checkpoint's
    parameter EMA) or "raw"}``. Returns the comparison id; its job is ``get_comparison(id)["job_id"]``
    (start a worker, e.g. ``jobs.runner.ensure_worker``, for it to run)."""
    from core.limits import check_name

    check_name("name", name, "a comparison name")
    validate_request(entries, prompts, seeds, num_steps, guidance_scale)
    settings = {"entries": entries, "prompts": prompts, "seeds": seeds, "num_steps": int(num_steps),
                "guidance_scale": float(guidance_scale)}
    run_ids = sorted({e["run_id"] for e in entries if e.get("run_id") is not None})
    cid = store.add_comparison(name, run_ids, settings=settings)
    job_id = store.create_run({"comparison_id": cid}, strategy="-", total_steps=len(entries), kind=schema.COMPARE,
                              name=f"compare #{cid}: {name}"[:200])
    store.update_comparison(cid, job_id=job_id)
    return cid


def status_of(store: Store, row: dict) -> tuple[str, str | None, Any]:
    """(status, error, job) of a comparisons row: its job's, in the runs' status words; a comparison whose job was
    deleted keeps the status its job left in the result."""
    job = None
    if row.get("job_id") is not None:
        try:
            job = store.get_run(int(row["job_id"]))
        except RunNotFound:
            job = None
    if job is not None:
        return job.status, job.error, job
    result = row.get("result") or {}
    if result.get("status"):
        return result["status"], result.get("error"), None
    return schema.INTERRUPTED, "its job was deleted before the grid was made", None


def cancel_comparison(store: Store, comparison_id: int) -> str:
    """Stop a comparison's job (queued: at once; running: the stop flag, then the worker's SIGTERM / SIGKILL);
    returns the job's status. ValueError when there is nothing to cancel."""
    from jobs.runner import cancel

    row = store.get_comparison(comparison_id)
    status, _, job = status_of(store, row)
    if job is None or status not in schema.ACTIVE:
        raise ValueError(f"comparison #{comparison_id} is {status}: there is nothing to cancel")
    return cancel(store, job.id, wait=False)


def run_job(control: Any) -> bool:
    """The body of a compare job (jobs.job): True when the grid is written, False when stopped on request."""
    return run_comparison(control.store, int(control.run.config["comparison_id"]), control) is not None


def run_comparison(store: Store, comparison_id: int, control: Any = None) -> dict | None:
    """Generate, score and save the grid; the result is written to the comparison row and returned (None when
    ``control`` asked to stop between two entries)."""
    import torch

    from core.config import RewardConfig
    from core.models import load_lora, load_pipeline
    from core.rewards import make_reward
    from core.sampling import generate_images, to_pil

    row = store.get_comparison(comparison_id)
    st = row["settings"]
    out = comparison_dir(store, comparison_id)
    out.mkdir(parents=True, exist_ok=True)
    started = time.time()
    prompts, seeds = st["prompts"], st["seeds"]
    pairs = [(p, s) for p in prompts for s in seeds]
    reward_cfgs = {}
    for e in st["entries"]:
        for r in e.get("rewards", []):
            reward_cfgs.setdefault(r["name"], RewardConfig(**r))
    rewards = {n: make_reward(c.name, **c.kwargs) for n, c in reward_cfgs.items()}
    cells: list[list[dict]] = [[] for _ in pairs]
    if control is not None:
        control.progress(0, len(st["entries"]))
    for j, entry in enumerate(st["entries"]):
        if control is not None and control.should_stop():
            return None
        pipe = load_pipeline(entry["model"], "float32", "cuda" if torch.cuda.is_available() else "cpu")
        if entry.get("lora"):
            load_lora(pipe, entry["lora"], entry.get("weights", "ema"))  # the parameter EMA unless "raw"
        images = generate_images(pipe, [p for p, _ in pairs], [s for _, s in pairs], st["num_steps"],
                                 st["guidance_scale"], entry.get("resolution", 64),
                                 entry.get("max_sequence_length", 8))
        meta = [{"source": "compare"} for _ in pairs]
        scores = {n: r(images, [p for p, _ in pairs], meta).tolist() for n, r in rewards.items()}
        for i, (img, (prompt, seed)) in enumerate(zip(to_pil(images), pairs)):
            path = out / f"e{j:02d}_p{prompts.index(prompt):03d}_s{seed}.png"
            img.save(path)
            cells[i].append({"label": entry["label"], "path": str(path),
                             "scores": {n: _finite(v[i]) for n, v in scores.items()}})
        del pipe
        if control is not None:
            control.progress(j + 1)
    result = {"status": schema.SUCCEEDED, "seconds": time.time() - started,
              "rows": [{"prompt": p, "seed": s, "cells": cells[i]} for i, (p, s) in enumerate(pairs)]}
    store.update_comparison(comparison_id, result)
    return result


def _finite(x: float) -> float | None:
    return x if x == x and abs(x) != float("inf") else None
