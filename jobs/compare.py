"""Side-by-side comparisons of checkpoints (and base models) on prompts, generated in a background job.

``start_comparison`` stores the request as a comparison row (status "queued") and starts
``python -m jobs.compare ID`` in a new session, so the web page never blocks and the job outlives it.
The job generates every (prompt, seed) with every entry using the training sampler, scores each image
with the runs' rewards, saves the grid under ``$MARBLE_HOME/comparisons/NNNNNN/`` and writes the result
(status "done" or "failed" with the error) back to the row; it can be reopened at any time.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

from jobs.paths import DATABASE_URL_ENV, HOME_ENV
from jobs.storage import Store

REPO_ROOT = Path(__file__).resolve().parents[1]


def comparison_dir(store: Store, comparison_id: int) -> Path:
    return store.home / "comparisons" / f"{comparison_id:06d}"


def validate_request(entries: list[dict], prompts: list[str], seeds: list[int]) -> None:
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
                     num_steps: int = 10, guidance_scale: float = 1.0, spawn: bool = True) -> int:
    """Queue a comparison. ``entries``: ``{"label", "model", "lora" (checkpoint folder or None),
    "run_id" (or None), "rewards": [reward configs], optional "weights": "ema" (default: the checkpoint's
    parameter EMA) or "raw"}``. Returns the comparison id."""
    validate_request(entries, prompts, seeds)
    settings = {"entries": entries, "prompts": prompts, "seeds": seeds, "num_steps": int(num_steps),
                "guidance_scale": float(guidance_scale)}
    run_ids = sorted({e["run_id"] for e in entries if e.get("run_id") is not None})
    cid = store.add_comparison(name, run_ids, settings=settings, result={"status": "queued"})
    if spawn:
        env = dict(os.environ, **{HOME_ENV: str(store.home), DATABASE_URL_ENV: store.url})
        comparison_dir(store, cid).mkdir(parents=True, exist_ok=True)
        with open(comparison_dir(store, cid) / "job.log", "ab") as log:
            subprocess.Popen([sys.executable, "-m", "jobs.compare", str(cid)], cwd=REPO_ROOT, env=env,
                             stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    return cid


def run_comparison(store: Store, comparison_id: int) -> dict:
    """Generate, score and save the grid; the result is written to the comparison row and returned."""
    import torch

    from core.config import RewardConfig
    from core.models import load_lora, load_pipeline
    from core.rewards import make_reward
    from core.sampling import generate_images, to_pil

    row = store.get_comparison(comparison_id)
    st = row["settings"]
    out = comparison_dir(store, comparison_id)
    out.mkdir(parents=True, exist_ok=True)
    store.update_comparison(comparison_id, {"status": "running", "started_at": time.time()})
    started = time.time()
    prompts, seeds = st["prompts"], st["seeds"]
    pairs = [(p, s) for p in prompts for s in seeds]
    reward_cfgs = {}
    for e in st["entries"]:
        for r in e.get("rewards", []):
            reward_cfgs.setdefault(r["name"], RewardConfig(**r))
    rewards = {n: make_reward(c.name, **c.kwargs) for n, c in reward_cfgs.items()}
    cells: list[list[dict]] = [[] for _ in pairs]
    for j, entry in enumerate(st["entries"]):
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
    result = {"status": "done", "seconds": time.time() - started,
              "rows": [{"prompt": p, "seed": s, "cells": cells[i]} for i, (p, s) in enumerate(pairs)]}
    store.update_comparison(comparison_id, result)
    return result


def _finite(x: float) -> float | None:
    return x if x == x and abs(x) != float("inf") else None


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or not args[0].isdigit():
        print("usage: python -m jobs.compare COMPARISON_ID", file=sys.stderr)
        return 2
    store = Store.open()
    cid = int(args[0])
    try:
        run_comparison(store, cid)
    except Exception as e:  # noqa: BLE001 - any failure is stored on the row, verbatim
        traceback.print_exc()
        store.update_comparison(cid, {"status": "failed", "error": f"{type(e).__name__}: {e}"})
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
