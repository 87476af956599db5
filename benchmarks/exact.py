"""Exact MARBLE on every step: the whole step harmonized (marble_full, harmonize_scope "step") over weighted-sum
training on the default preset (mini-marble), per-reward gradients from per-sample gradients (two backward
passes, core/per_sample.py) or from one backward pass per reward; and the per-sample path's cost at K = 8
against K = 4 (four weight-free rewards added), where the K-backward path's grows with K."""

from __future__ import annotations

import statistics
import tempfile
import time

EXTRA_REWARDS = ("contrast", "gray_entropy", "sharpness", "brightness")  # < 1 ms per image each


def _config(strategy: str, gradients: str, k8: bool, steps: int):
    from core.config import preset

    cfg = preset("mini-marble")
    sets = {"balance.strategy": strategy, "balance.harmonize_scope": "step", "balance.gradients": gradients,
            "balance.diagnose_every": 0, "steps": steps, "sample_every": 0, "checkpoint_every": 0}
    if k8:
        sets["rewards"] = [{"name": r.name} for r in cfg.rewards] + [{"name": n} for n in EXTRA_REWARDS]
    return cfg.with_overrides(sets)


VARIANTS = {  # name -> (strategy, gradients, K = 8)
    "weighted_sum": ("weighted_sum", "per_reward", False),
    "exact_per_reward": ("marble_full", "per_reward", False),
    "exact_per_sample": ("marble_full", "per_sample", False),
    "exact_per_reward_k8": ("marble_full", "per_reward", True),
    "exact_per_sample_k8": ("marble_full", "per_sample", True),
}


def bench_exact_harmonization(steps: int) -> dict:
    """Interleaved: step s of every variant runs before step s+1 of any, in an order that rotates each step;
    step 0 (warm-up, QP compile) is dropped. CPU time of this process is the measure (a shared machine's
    waiting does not count)."""
    from core.trainer import Trainer

    trainers = {name: Trainer(_config(*v, steps=steps + 1), tempfile.mkdtemp(prefix=f"bench_{name}_"))
                for name, v in VARIANTS.items()}
    assert trainers["exact_per_sample"].gradient_path == "per_sample"
    cpu: dict[str, list[float]] = {n: [] for n in trainers}
    names = list(trainers)
    for step in range(steps + 1):
        shift = step % len(names)
        for name in names[shift:] + names[:shift]:
            c0 = time.process_time()
            trainers[name].train_step(step)
            if step > 0:
                cpu[name].append(time.process_time() - c0)
    mean = {n: statistics.fmean(v) for n, v in cpu.items()}
    base = mean["weighted_sum"]
    return {"bench": "exact_harmonization", "model": "mini-world", "preset": "mini-marble", "steps": steps,
            "measure": "CPU seconds per step, whole step harmonized every step",
            "cpu_seconds_per_step": {n: round(v, 4) for n, v in mean.items()},
            "ratio_exact_per_sample_over_weighted_sum": round(mean["exact_per_sample"] / base, 4),
            "ratio_exact_per_reward_over_weighted_sum": round(mean["exact_per_reward"] / base, 4),
            "target_exact_ratio": 1.3,
            "ratio_per_sample_k8_over_k4": round(mean["exact_per_sample_k8"] / mean["exact_per_sample"], 4),
            "ratio_per_reward_k8_over_k4": round(mean["exact_per_reward_k8"] / mean["exact_per_reward"], 4),
            "target_k8_over_k4": 1.1}
