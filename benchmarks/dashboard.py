"""Dashboard benchmarks (make bench): server time of a refresh on a 20,000-step run, and a bounded soak
of the dashboard polling a live run (memory must stay flat).

Both drive the dashboard's own handlers (app.pages.dashboard) against a real SQLite store, so what is
measured is what a browser's timer tick costs the server.
"""

from __future__ import annotations

import math
import os
import statistics
import tempfile
import time
import tracemalloc
from typing import Any

REWARDS = ["jpeg_compressibility", "colorfulness", "brightness"]


def _synthetic_run(store, steps: int, diagnose_every: int = 10) -> int:
    """A stored run with ``steps`` step events and a balance event every ``diagnose_every`` steps,
    written through the job's own EventWriter."""
    from core.config import preset
    from core.events import BalanceEvent, StartEvent, StepEvent
    from jobs.writer import EventWriter

    cfg = preset("tiny").with_overrides({"steps": steps})
    run_id = store.create_run(cfg.to_dict(), strategy="marble", total_steps=steps, name="bench")
    writer = EventWriter(store, run_id, store.run_dir(run_id), max_pending_steps=500)
    writer(StartEvent(step=0, total_steps=steps, reward_names=REWARDS, strategy="marble", trainable_parameters=1,
                      device="cpu"))
    for s in range(1, steps + 1):
        wave = [math.sin(s / 300 + k) for k in range(3)]
        writer(StepEvent(step=s, rewards={n: w for n, w in zip(REWARDS, wave)},
                         alpha={n: 1 / 3 for n in REWARDS}, seconds=1.0, loss=1.0, kl=0.0, grad_norm=1.0,
                         phase="harmonized" if s % diagnose_every == 1 else "amortized",
                         valid_counts={n: 16 for n in REWARDS}, reward_std={n: 0.1 for n in REWARDS}))
        if s % diagnose_every == 1:
            writer(BalanceEvent(step=s, alpha_raw={n: 1 / 3 for n in REWARDS}, alpha_ema={n: 1 / 3 for n in REWARDS},
                                cosine={"names": REWARDS, "matrix": [[1.0, -0.2, 0.1], [-0.2, 1.0, 0.3],
                                                                     [0.1, 0.3, 1.0]]},
                                cos_to_update={n: 0.2 for n in REWARDS}, grad_norms={n: 1.0 for n in REWARDS},
                                valid={n: True for n in REWARDS}, solver="cvxpy:OSQP:optimal", phase="harmonized"))
    writer.flush()
    return run_id


def _open_store(home: str):
    os.environ["MARBLE_HOME"] = home
    from app import context

    context.store.cache_clear()
    return context.store()


def bench_dashboard_refresh(steps: int = 20_000, repeats: int = 5) -> dict:
    """Server time of the dashboard on a long run through its own handlers: the first load (``select_run``:
    down-sampled read, every figure, samples, conflict attribution) with the evaluation panel's read, and a timer
    tick (``tick``) with the evaluation panel's read (what it costs while an evaluation runs; idle, the panel
    reads every 5th tick), both when nothing is new and when one new step is. The Overlay page shares the timer:
    its first draw of two such runs and its tick are measured too, and ``tick_with_overlay_ms`` is what one
    timer tick costs the server with every live panel."""
    from app.pages import dashboard, overlay
    from app.pages import evaluate as evaluation
    from core.events import StepEvent
    from jobs.writer import EventWriter

    store = _open_store(tempfile.mkdtemp(prefix="bench_dash_"))
    t0 = time.perf_counter()
    run_id = _synthetic_run(store, steps)
    write_s = time.perf_counter() - t0
    other = _synthetic_run(store, steps)
    writer = EventWriter(store, run_id, store.run_dir(run_id), max_pending_steps=1)
    first, tick, over_first, over_tick, tick_new, over_tick_new = [], [], [], [], [], []

    def timed(fn, into: list) -> Any:
        t = time.perf_counter()
        out = fn()
        into.append(time.perf_counter() - t)
        return out

    def first_load():
        state = dashboard.select_run(run_id, 0.6)[0]
        evaluation.panel(run_id)
        evaluation.checkpoint_choices(run_id)
        return state

    def dash_tick(state):
        out = dashboard.tick(state, 0.6)
        evaluation.panel(run_id)
        return out[0]

    for i in range(repeats):
        state = timed(first_load, first)
        over = timed(lambda: overlay.on_pick(None, [run_id, other], 0.6)[0], over_first)
        state = timed(lambda: dash_tick(state), tick)  # the common tick: nothing new since the last one
        timed(lambda: overlay.tick(over, 0.6), over_tick)
        # a tick that finds one new step (a live run): incremental read and every figure redrawn
        writer(StepEvent(step=steps + 1 + i, rewards={n: 0.5 for n in REWARDS}, alpha={n: 1 / 3 for n in REWARDS},
                         seconds=1.0, loss=1.0, kl=0.0, grad_norm=1.0, phase="amortized"))
        writer.flush()
        state = timed(lambda: dash_tick(state), tick_new)
        timed(lambda: overlay.tick(over, 0.6), over_tick_new)

    def ms(xs: list) -> float:
        return round(statistics.median(xs) * 1e3, 1)

    first_ms = statistics.median(first) * 1e3
    return {"bench": "dashboard_refresh", "steps": steps, "first_load_ms": round(first_ms, 1), "tick_ms": ms(tick),
            "target_ms": 300, "tick_target_ms": 10, "ratio_first_load_to_target": round(first_ms / 300, 3),
            "tick_new_step_ms": ms(tick_new), "overlay_first_draw_ms_2_runs": ms(over_first),
            "overlay_tick_ms_2_runs": ms(over_tick), "overlay_tick_new_step_ms_2_runs": ms(over_tick_new),
            "tick_with_overlay_ms": round(ms(tick) + ms(over_tick), 1), "write_seconds": round(write_s, 1)}


def bench_dashboard_soak(seconds: float = 120.0, steps_per_second: float = 5.0) -> dict:
    """A writer thread appends steps as a live run would while the dashboard's tick polls every 0.1 s
    for ``seconds``; memory is compared between the end of the first and of the last quarter."""
    import threading

    from app.pages import dashboard
    from core.events import StepEvent
    from jobs.writer import EventWriter

    store = _open_store(tempfile.mkdtemp(prefix="bench_soak_"))
    run_id = _synthetic_run(store, 200)
    names = dashboard.reward_names(run_id)
    stop = threading.Event()

    def live_writer():
        writer = EventWriter(store, run_id, store.run_dir(run_id), max_pending_steps=5)
        s = 200
        while not stop.is_set():
            s += 1
            writer(StepEvent(step=s, rewards={n: math.sin(s / 50 + k) for k, n in enumerate(names)},
                             alpha={n: 1 / 3 for n in names}, seconds=0.2, loss=1.0, kl=0.0, grad_norm=1.0,
                             phase="amortized"))
            time.sleep(1 / steps_per_second)
        writer.flush()

    thread = threading.Thread(target=live_writer, daemon=True)
    thread.start()
    tracemalloc.start()
    state, ticks, samples = dashboard.load(run_id), 0, []
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        changed = dashboard.refresh(state)
        dashboard.header(run_id)
        if changed:
            dashboard.figures(state, 0.6)
        ticks += 1
        samples.append((time.perf_counter() - start, tracemalloc.get_traced_memory()[0]))
        time.sleep(0.1)
    stop.set()
    thread.join(timeout=10)
    tracemalloc.stop()
    q = seconds / 4
    early = max(m for t, m in samples if t <= q)
    late = max(m for t, m in samples if t >= 3 * q)
    points = state.data.points if state.data else 0
    return {"bench": "dashboard_soak", "seconds": seconds, "ticks": ticks, "points_in_view": points,
            "python_heap_mb_first_quarter": round(early / 2**20, 2),
            "python_heap_mb_last_quarter": round(late / 2**20, 2),
            "ratio_last_to_first_quarter": round(late / early, 3),
            "note": "heap grows only with the new points shown (bounded by down-sampling past 3000)"}
