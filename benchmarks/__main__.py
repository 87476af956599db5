"""``python -m benchmarks [--steps N] [--only NAME ...]``: JSON lines, one per measurement.

Each line compares against a baseline measured in the same run on the same machine, so the ratios
carry over between machines even though the seconds do not:
- step_time: seconds per training step of amortized MARBLE (N=10) and of marble_full, each over
  weighted-sum training, on the tiny model (steps interleaved so drift hits all three alike);
- min_norm_qp: median time of one min_norm_weights solve for K=5 (target <= 1 ms);
- peak_memory: training memory above the loaded model (peak RSS growth, one process per strategy);
- reward_speed: milliseconds per 64x64 image of each offline reward, per image it applies to (world
  prompts with their specs, quoted text for OCR);
- storage: the job writer's overhead per training step as a fraction of step time (benchmarks/storage.py);
- exact: the whole step harmonized on every step over weighted sum on mini-marble, per-sample against
  per-reward gradients, and K = 8 against K = 4 (benchmarks/exact.py; --exact-steps, default 4);
- checkpoint: size and seconds to write, verify and load a checkpoint on the tiny and mini presets
  (benchmarks/checkpoint.py; figures in docs/reliability.md).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from benchmarks.checkpoint import bench_checkpoint
from benchmarks.dashboard import bench_dashboard_refresh, bench_dashboard_soak
from benchmarks.exact import bench_exact_harmonization
from benchmarks.storage import bench_storage

STRATEGIES = ("weighted_sum", "marble", "marble_full")
NEURAL_OFFLINE_REWARDS = ("ocr",)


def _config(strategy: str, steps: int):
    from core.config import preset

    return preset("tiny").with_overrides({"balance.strategy": strategy, "steps": steps, "sample_every": 0,
                                          "checkpoint_every": 0, "balance.harmonize_every": 10,
                                          "balance.diagnose_every": 0})


def bench_step_time(steps: int) -> dict:
    """Interleaved: step s of every strategy runs before step s+1 of any, in an order that rotates each
    step, so drift and load hit all three alike. Step 0 (warm-up, compile) is dropped."""
    import tempfile

    from core.trainer import Trainer

    trainers = {s: Trainer(_config(s, steps + 1), tempfile.mkdtemp(prefix=f"bench_{s}_")) for s in STRATEGIES}
    seconds: dict[str, list[float]] = {s: [] for s in STRATEGIES}
    cpu: dict[str, list[float]] = {s: [] for s in STRATEGIES}
    names = list(trainers)
    for step in range(steps + 1):
        for name in names[step % 3:] + names[:step % 3]:
            trainer = trainers[name]
            t0, c0 = time.perf_counter(), time.process_time()
            trainer.train_step(step)
            if step > 0:
                seconds[name].append(time.perf_counter() - t0)
                cpu[name].append(time.process_time() - c0)
    # Amortized MARBLE's cost includes its 1-in-N harmonized steps: a plain mean over whole N-step windows.
    # CPU time (all threads of this process) is the ratio's measure: waiting for a core while other
    # processes run does not count, which keeps the ratio stable on a shared machine.
    mean = {s: statistics.fmean(v) for s, v in cpu.items()}
    wall = {s: statistics.fmean(v) for s, v in seconds.items()}
    base = mean["weighted_sum"]
    return {"bench": "step_time", "model": "tiny", "steps": steps, "harmonize_every": 10,
            "cpu_seconds_per_step": {s: round(v, 4) for s, v in mean.items()},
            "wall_seconds_per_step": {s: round(v, 4) for s, v in wall.items()},
            "ratio_marble_over_weighted_sum": round(mean["marble"] / base, 4),
            "ratio_marble_full_over_weighted_sum": round(mean["marble_full"] / base, 4),
            "target_marble_ratio": 1.05, "paper_marble_ratio_speed": 0.97}


def bench_qp(k: int = 5, repeats: int = 300) -> dict:
    import numpy as np

    from core.balancing import min_norm_weights

    rng = np.random.default_rng(0)
    times = []
    min_norm_weights(np.eye(k))  # compile once (cached per K)
    for _ in range(repeats):
        g = rng.normal(size=(k, 64))
        gram = g @ g.T
        t0 = time.perf_counter()
        min_norm_weights(gram)
        times.append(time.perf_counter() - t0)
    med = statistics.median(times)
    return {"bench": "min_norm_qp", "K": k, "median_ms": round(med * 1e3, 4),
            "p95_ms": round(sorted(times)[int(0.95 * len(times))] * 1e3, 4), "target_ms": 1.0,
            "ratio_to_target": round(med * 1e3 / 1.0, 4)}


def _rss_kb(field: str) -> int:
    """VmRSS (now) or VmHWM (peak since the last reset) of this process, in KiB (Linux)."""
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def _memory_child(strategy: str, steps: int) -> None:
    import tempfile

    from core.trainer import Trainer

    trainer = Trainer(_config(strategy, steps), tempfile.mkdtemp(prefix="bench_mem_"))
    # Loading peaks higher than training on the tiny model, so the lifetime peak (ru_maxrss) would hide
    # training altogether: reset the kernel's high-water mark (clear_refs 5) and read it afterwards.
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = _rss_kb("VmRSS")
    for step in range(steps):
        trainer.train_step(step)
    print(json.dumps({"before_kb": before, "peak_kb": _rss_kb("VmHWM")}))


def bench_memory(steps: int) -> dict:
    growth = {}
    for s in STRATEGIES:
        out = subprocess.run([sys.executable, "-m", "benchmarks", "--memory-child", s, "--steps", str(steps)],
                             capture_output=True, text=True, check=True)
        rec = json.loads(out.stdout.strip().splitlines()[-1])
        growth[s] = rec["peak_kb"] - rec["before_kb"]
    base = growth["weighted_sum"]
    if base <= 0:
        raise RuntimeError(f"peak_memory: weighted-sum training grew RSS by {base} KiB; nothing to compare against")
    return {"bench": "peak_memory", "model": "tiny", "measure": "peak RSS growth during training (KiB)",
            "growth_kb": growth, "ratio_marble_over_weighted_sum": round(growth["marble"] / base, 4),
            "ratio_marble_full_over_weighted_sum": round(growth["marble_full"] / base, 4),
            "paper_marble_ratio_memory": 1.14}


def _reward_batch(batch: int):
    """Prompts each offline reward applies to: the four mini-world sources (their specs as metadata)
    and quoted-text prompts for OCR, so specialists score real work instead of returning NaN."""
    from core.prompts import load_source
    from core.world.prompts import SOURCES

    per = batch // (len(SOURCES) + 1)
    items = [it for src in SOURCES for it in load_source(src).test[:per]]
    prompts = [it.text for it in items] + ['a sign that says "marble"'] * (batch - len(items))
    metadata = [dict(it.metadata) for it in items] + [{}] * (batch - len(items))
    return prompts, metadata


def bench_rewards(batch: int = 64) -> dict:
    import torch

    from core.rewards import EXTERNAL_REWARDS, available_rewards, make_reward

    images = torch.rand(batch, 3, 64, 64, generator=torch.Generator().manual_seed(0))
    prompts, metadata = _reward_batch(batch)
    ms = {}
    for name in sorted(set(available_rewards()) - set(EXTERNAL_REWARDS)):  # model / server rewards need weights
        reward = make_reward(name)
        best, scored = float("inf"), 0
        for _ in range(3):
            t0 = time.perf_counter()
            scored = int(torch.isfinite(reward(images, prompts, metadata)).sum())
            best = min(best, time.perf_counter() - t0)
        ms[name] = round(best / max(scored, 1) * 1e3, 4)  # per image the reward applies to
    # The 1 ms target is for image statistics and the world checker; OCR runs a neural model (ONNX).
    analytic = {n: v for n, v in ms.items() if n not in NEURAL_OFFLINE_REWARDS}
    return {"bench": "reward_speed", "ms_per_64px_image_scored": ms, "target_ms": 1.0,
            "ratio_worst_analytic_to_target": round(max(analytic.values()) / 1.0, 4)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--only", nargs="*", choices=["step_time", "qp", "memory", "rewards", "storage",
                                                      "dashboard", "soak", "exact", "checkpoint"])
    parser.add_argument("--exact-steps", type=int, default=4, help="mini-marble steps per variant (exact)")
    parser.add_argument("--soak-seconds", type=float, default=120.0)
    parser.add_argument("--memory-child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.memory_child:
        _memory_child(args.memory_child, args.steps)
        return 0
    chosen = args.only or ["qp", "rewards", "step_time", "memory", "storage", "exact", "checkpoint", "dashboard",
                           "soak"]
    runs = {"qp": bench_qp, "rewards": bench_rewards, "step_time": lambda: bench_step_time(args.steps),
            "memory": lambda: bench_memory(min(args.steps, 12)),
            "storage": lambda: bench_storage(args.steps),
            "exact": lambda: bench_exact_harmonization(args.exact_steps), "checkpoint": bench_checkpoint,
            "dashboard": bench_dashboard_refresh, "soak": lambda: bench_dashboard_soak(args.soak_seconds)}
    for name in chosen:
        print(json.dumps(runs[name]()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
