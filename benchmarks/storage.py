"""Storage overhead per training step, and read latency on a long run.

Two trainers of the same config train step by step, interleaved (step s of both before step s+1 of
either, so machine drift hits both alike): one writes its events to a SQLite store through the job's
batched :class:`~jobs.writer.EventWriter` with its heartbeat thread flushing every second, exactly as a
job does; the other has no observer. Reported:
- ``overhead_fraction``: seconds spent inside the writer (event conversion on the training thread plus
  every flush on the heartbeat thread, including flushes that ran during the other trainer's steps, so
  an upper bound) over the writer-side trainer's step seconds. Target: < 0.02.
- ``cpu_overhead_fraction``: the writer's CPU time alone over the same step seconds.
- ``paired_overhead_fraction``: mean step time with the writer over mean step time without, minus 1:
  the end-to-end effect, noisy at this size (it can come out negative).
- ``reads_ms``: what the web app's polls cost on a synthetic 20,000-step run (best of 3).
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path


def _config(steps: int):
    """The tiny model at about a second a step (2 prompts x 4 images, 4 denoising steps): a short step
    makes the writer's share larger, so the fraction measured here bounds the one of slower runs."""
    from core.config import preset

    return preset("tiny").with_overrides({
        "steps": steps, "sample_every": 5, "checkpoint_every": 10, "num_threads": 1, "sampling.num_steps": 4,
        "sampling.prompts_per_step": 2, "sampling.images_per_prompt": 4, "nft.micro_batch_size": 4})


def _train_step(trainer, step: int) -> float:
    t0 = time.perf_counter()
    trainer.train_step(step)
    every = trainer.config.checkpoint_every
    if every and trainer.step % every == 0:
        trainer.save_checkpoint()
    return time.perf_counter() - t0


def _best_ms(fn, repeats: int = 3) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return round(best * 1e3, 3)


def bench_reads(store, steps: int = 20_000) -> dict:
    """Fill a synthetic run (3 rewards: 16 metric rows a step, balance rows every 10 steps, 16 samples
    every 100 steps) and time the reads a dashboard makes."""
    from core.events import BalanceEvent, StepEvent
    from jobs.storage import Batch
    from jobs.writer import step_rows

    names = ["jpeg_compressibility", "colorfulness", "brightness"]
    run_id = store.create_run({}, strategy="marble", total_steps=steps)
    store.claim(run_id)
    t0 = time.perf_counter()
    for start in range(1, steps + 1, 1000):
        batch = Batch()
        for t in range(start, min(start + 1000, steps + 1)):
            ev = StepEvent(step=t, rewards={n: 0.5 for n in names}, alpha={n: 1 / 3 for n in names}, seconds=1.0,
                           loss=0.1, kl=0.0, grad_norm=1.0, phase="harmonized" if t % 10 == 1 else "amortized",
                           valid_counts={n: 16 for n in names}, reward_std={n: 0.1 for n in names})
            row, metrics = step_rows(ev.to_dict())
            batch.steps.append(row)
            batch.metrics.extend(metrics)
            if t % 10 == 1:
                b = BalanceEvent(step=t, alpha_raw={n: 1 / 3 for n in names}, alpha_ema={n: 1 / 3 for n in names},
                                 cosine={"names": names, "matrix": [[1.0] * 3] * 3},
                                 cos_to_update={n: 0.5 for n in names}, grad_norms={n: 1.0 for n in names},
                                 valid={n: True for n in names}, solver="cvxpy-OSQP", phase="harmonized").to_dict()
                b.pop("event")
                batch.balance.append(b)
            if t % 100 == 0:
                batch.samples.extend({"step": t, "idx": i, "prompt": "a red circle", "source": "tiny", "seed": i,
                                      "group_id": i // 4, "path": f"samples/step_{t:06d}/{i:03d}.png",
                                      "rewards": {n: 0.5 for n in names}, "advantages": {n: 0.0 for n in names}}
                                     for i in range(16))
        batch.run.update(step=min(start + 999, steps), headline={n: 0.5 for n in names}, seconds_per_step=1.0)
        store.write_batch(run_id, batch)
    fill = time.perf_counter() - t0
    last = steps - 10
    return {"metric_rows": steps * 16, "fill_seconds": round(fill, 2), "reads_ms": {
        "list_runs": _best_ms(store.list_runs),
        "metrics_since_step_poll": _best_ms(lambda: store.metrics(run_id, since_step=last)),
        "metrics_whole_run_max_points_1000": _best_ms(lambda: store.metrics(run_id, max_points=1000)),
        "metrics_one_key_max_points_1000": _best_ms(
            lambda: store.metrics(run_id, keys=["reward/colorfulness"], max_points=1000)),
        "balance_since_step_poll": _best_ms(lambda: store.balance(run_id, since_step=last)),
        "balance_max_points_500": _best_ms(lambda: store.balance(run_id, max_points=500)),
        "samples_of_one_step": _best_ms(lambda: store.samples(run_id, step=steps)),
    }}


def bench_storage(steps: int = 20) -> dict:
    with tempfile.TemporaryDirectory(prefix="bench_storage_") as tmp:
        return _bench_storage(steps, Path(tmp))


def _bench_storage(steps: int, tmp: Path) -> dict:
    from core.trainer import Trainer
    from jobs.job import Heartbeat
    from jobs.storage import Store
    from jobs.writer import EventWriter

    home = tmp / "home"
    home.mkdir()
    store = Store(f"sqlite:///{home / 'marble.db'}", home)
    cfg = _config(steps + 1)
    run_id = store.create_run(cfg.to_dict(), strategy=cfg.balance.strategy, total_steps=cfg.steps)
    store.claim(run_id)
    run_dir = store.run_dir(run_id)
    writer = EventWriter(store, run_id, run_dir)
    heartbeat = Heartbeat(writer, 1.0)
    with_writer = Trainer(cfg, run_dir, on_event=writer, should_stop=heartbeat.should_stop)
    without = Trainer(cfg, tmp / "without_writer")
    heartbeat.start()
    seconds: dict[str, list[float]] = {"with": [], "without": []}
    busy0 = cpu0 = 0.0
    for step in range(steps + 1):  # step 0 warms up and is dropped
        if step == 1:
            busy0, cpu0 = writer.busy_seconds, writer.cpu_seconds
        t_with = _train_step(with_writer, step)
        t_without = _train_step(without, step)
        if step > 0:
            seconds["with"].append(t_with)
            seconds["without"].append(t_without)
    heartbeat.close()
    writer.flush()
    busy, cpu = writer.busy_seconds - busy0, writer.cpu_seconds - cpu0
    stored = store.metrics(run_id)
    mean_with, mean_without = statistics.fmean(seconds["with"]), statistics.fmean(seconds["without"])
    record = {
        "bench": "storage", "model": "tiny", "steps": steps, "database": "sqlite (WAL)",
        "seconds_per_step": {"with_writer": round(mean_with, 4), "without_writer": round(mean_without, 4)},
        "writer_ms_per_step": round(busy / steps * 1e3, 3), "writer_cpu_ms_per_step": round(cpu / steps * 1e3, 3),
        "flushes": writer.flushes,
        "overhead_fraction": round(busy / sum(seconds["with"]), 5),
        "cpu_overhead_fraction": round(cpu / sum(seconds["with"]), 5),
        "paired_overhead_fraction": round(mean_with / mean_without - 1, 4),
        "target_fraction": 0.02, "rows_stored": len(stored.rows),
    }
    record["reads_20000_steps"] = bench_reads(store)
    store.close()
    return record
