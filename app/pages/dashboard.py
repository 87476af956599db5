"""Run dashboard, live while the run trains: one timer, incremental reads, figures replaced only when
new rows arrived (so nothing flickers), ``uirevision`` keeps the user's zoom."""

from __future__ import annotations

import math
from typing import Any

import gradio as gr

from app import context, plots
from app.pages import evaluate as evaluation
from jobs.storage import RunNotFound

MAX_POINTS = 600  # per metric key (~1 point per 2 px of a wide plot): beyond, the series is re-read down-sampled
REFRESH_SECONDS = 2.0
PICK = "Pick a run. Runs appear here as soon as they are queued (start one in New run, then Reload runs)."


# ---- incremental cache ----------------------------------------------------------------------------

def new_cache(run_id: int | None) -> dict:
    return {"run_id": run_id, "series": {}, "last_step": 0, "balance": [], "last_balance": 0, "points": 0}


def refresh_cache(cache: dict | None, run_id: int) -> tuple[dict, bool]:
    """Read what is new since the last refresh; returns (cache, changed). The first read of a long run
    is down-sampled to MAX_POINTS steps per key; later reads append only the new steps."""
    store = context.store()
    if not cache or cache.get("run_id") != run_id:
        cache = new_cache(run_id)
        series = store.metrics(run_id, keys=plotted_keys(run_id), max_points=MAX_POINTS)
        cache["series"] = {k: (list(x), list(y)) for k, (x, y) in series.by_key().items()}
        cache["last_step"] = series.last_step
        cache["balance"] = store.balance(run_id, max_points=MAX_POINTS)
        cache["last_balance"] = cache["balance"][-1]["step"] if cache["balance"] else 0
        cache["points"] = max((len(x) for x, _ in cache["series"].values()), default=0)
        return cache, True
    series = store.metrics(run_id, since_step=cache["last_step"], keys=plotted_keys(run_id))
    rows = store.balance(run_id, since_step=cache["last_balance"])
    if not series.rows and not rows:
        return cache, False
    for key, (xs, ys) in series.by_key().items():
        old = cache["series"].setdefault(key, ([], []))
        old[0].extend(xs)
        old[1].extend(ys)
    cache["last_step"] = max(cache["last_step"], series.last_step)
    cache["balance"].extend(rows)
    if rows:
        cache["last_balance"] = rows[-1]["step"]
    cache["points"] = max((len(x) for x, _ in cache["series"].values()), default=0)
    if cache["points"] > 2 * MAX_POINTS:  # keep the browser light on very long runs
        return refresh_cache(None, run_id)
    return cache, True


def plotted_keys(run_id: int) -> list[str]:
    """The metric keys the dashboard draws: each reward's mean and its applied α."""
    return [f"{prefix}/{n}" for n in reward_names(run_id) for prefix in ("reward", "alpha")]


def reward_names(run_id: int) -> list[str]:
    return [r["name"] for r in context.store().get_run(run_id).config.get("rewards", [])]


def header(run_id: int) -> str:
    r = context.store().get_run(run_id)
    pct = 100 * r.progress
    eta = f" · ETA {context.fmt_seconds(r.eta_seconds)}" if r.eta_seconds is not None else ""
    err = f"\n\n**Error:** `{r.error.strip().splitlines()[-1]}`" if r.error else ""
    bar = (f"<div class='progress-outer'><div class='progress-inner' style='width:{pct:.1f}%'></div></div>")
    return (f"### #{r.id} {r.name or ''} — {r.status}\n{r.strategy} · step {r.step}/{r.total_steps} "
            f"({pct:.0f}%){eta} · {r.device or 'device n/a'}{err}\n\n{bar}")


def figures(cache: dict, names: list[str], smoothing: float, cos_index: int | None) -> tuple[Any, ...]:
    rows = cache["balance"]
    cos_row = rows[-1] if rows and cos_index is None else (rows[min(cos_index, len(rows) - 1)] if rows else None)
    return (plots.reward_curves(cache["series"], names, smoothing),
            plots.alpha_trajectories(rows, cache["series"], names),
            plots.cosine_heatmap(cos_row),
            plots.conflict_panels(rows, names))


def gallery_items(run_id: int, step: int | None) -> tuple[list, Any]:
    """The gallery's (image, caption) items and the specialist-structure heatmap of one sample step
    (the newest when ``step`` is not one of the run's sample steps)."""
    store = context.store()
    steps = store.sample_steps(run_id)
    if not steps:
        return [], plots.empty_figure("Specialist structure",
                                      "No samples stored yet: a run saves them every sample_every steps.")
    step = step if step in steps else steps[-1]
    samples = store.samples(run_id, step=step)
    names = reward_names(run_id)
    items = []
    for s in samples:
        scores = " · ".join(f"{n[:10]} {v:.3g}" for n in names
                            if isinstance(v := (s.get("rewards") or {}).get(n), (int, float)) and math.isfinite(v))
        items.append((s["image"], f"{s['prompt']} (seed {s['seed']})\n{scores}"))
    return items, plots.specialist_structure(samples, names)


def sample_view(cache: dict, run_id: int) -> tuple[Any, Any, Any]:
    """(sample-step dropdown, gallery, specialist plot). New sample steps (or another run) move all three to
    the newest step; unchanged ones leave them alone (no reload). The gallery is filled here, not by the
    dropdown's change event: a run whose newest sample step has the same number as the last run's would
    not change the dropdown's value, and the old run's images would stay."""
    steps = context.store().sample_steps(run_id)
    if steps == cache.get("sample_steps"):
        return gr.skip(), gr.skip(), gr.skip()
    cache["sample_steps"] = steps
    newest = steps[-1] if steps else None
    return (gr.update(choices=steps, value=newest), *gallery_items(run_id, newest))


def _empty_state(head: str, message: str, cache: dict | None = None) -> tuple[Any, ...]:
    empty = plots.empty_figure("", message)
    return (cache, head, empty, empty, empty, empty, gr.update(), gr.update(choices=[], value=None), [],
            plots.empty_figure("Specialist structure", message))


def _gone(run_id: int) -> tuple[Any, ...]:
    """The empty state for a run that no longer exists; the cache remembers it so later ticks send nothing."""
    return _empty_state(f"Run #{run_id} no longer exists (deleted). Pick another run.",
                        f"Run #{run_id} was deleted.", {"gone": run_id})


def select_run(run_id: int | None, smoothing: float) -> tuple[Any, ...]:
    """Everything the dashboard shows for a newly picked run (or the empty state for none), in the order of
    its outputs: cache, header, the four plots, the cosine slider, sample step, gallery, specialist plot."""
    if run_id is None:
        return _empty_state(PICK, "No run selected.")
    try:
        cache, _ = refresh_cache(None, int(run_id))
        return _render(cache, int(run_id), smoothing)
    except RunNotFound:
        return _gone(int(run_id))


def tick(cache: dict | None, smoothing: float) -> tuple[Any, ...]:
    """A timer tick: only what changed since the last one (same order as ``select_run``). The run and the
    cosine step come from the cache, not from the picker and the slider: a tick that took them as inputs
    raced their updates (Gradio checked the new value against the old choices / maximum and raised)."""
    skip = gr.skip()
    run_id = (cache or {}).get("run_id")
    if run_id is None:  # nothing picked, or the picked run was deleted (already said)
        return (cache, *[skip] * 9)
    try:
        cache, changed = refresh_cache(cache, int(run_id))
        if not changed:
            return (cache, header(int(run_id)), *[skip] * 8)
        return _render(cache, int(run_id), smoothing)
    except RunNotFound:  # deleted from the Runs page (or another tab) while shown here
        return _gone(int(run_id))


def _render(cache: dict, run_id: int, smoothing: float) -> tuple[Any, ...]:
    """Everything shown for the cached run (order of ``select_run``). The cosine heatmap and its slider
    follow the newest diagnosed step unless the user moved the slider away (``on_cos`` records it)."""
    n = len(cache["balance"])
    at_end = cache.get("cos_follow", True)
    figs = figures(cache, reward_names(run_id), smoothing, None if at_end else cache.get("cos_index", 0))
    slider = gr.update(maximum=max(n - 1, 1), value=max(n - 1, 0)) if at_end else gr.update(maximum=max(n - 1, 1))
    return (cache, header(run_id), *figs, slider, *sample_view(cache, run_id))


# ---- layout --------------------------------------------------------------------------------------

def build(timer: gr.Timer) -> dict:
    cache = gr.State(None)
    with gr.Row():
        run_box = gr.Dropdown(choices=[], label="Run", elem_id="dash-run", scale=3)
        smoothing = gr.Slider(0, 0.98, value=0.6, step=0.02, label="Reward smoothing", scale=2)
        reload_btn = gr.Button("Reload runs", scale=1, elem_id="dash-reload")
    head = gr.Markdown(PICK, elem_id="dash-header")
    evaluation.build(run_box, timer)  # the held-out evaluation panel: Evaluate, its progress, the stored scores
    reward_plot = gr.Plot(label="Rewards", elem_id="plot-rewards")
    alpha_plot = gr.Plot(label="α", elem_id="plot-alpha")
    with gr.Row():
        cos_plot = gr.Plot(label="Cosines", elem_id="plot-cosine")
        cos_step = gr.Slider(0, 1, value=0, step=1, label="Diagnosed step (index; right = latest)",
                             elem_id="cos-step")
    conflict_plot = gr.Plot(label="Conflicts", elem_id="plot-conflict")
    with gr.Row():
        sample_step = gr.Dropdown(choices=[], label="Sample step", elem_id="sample-step")
    spec_plot = gr.Plot(label="Specialist structure", elem_id="plot-specialist")
    gallery = gr.Gallery(label="Samples (per-reward scores in captions)", columns=8, height=360,
                         elem_id="gallery")

    def load_choices():
        return follow_new_runs(True, None)

    def on_cos(run_id, cache_state, idx):
        if run_id is None or not cache_state or not cache_state.get("balance"):
            return cache_state, gr.skip()
        rows = cache_state["balance"]
        cache_state["cos_follow"] = int(idx) >= len(rows) - 1  # back at the right end: follow again
        cache_state["cos_index"] = int(idx)
        return cache_state, plots.cosine_heatmap(rows[min(int(idx), len(rows) - 1)])

    def on_smooth(run_id, cache_state, smooth):
        if run_id is None or not cache_state or "series" not in cache_state:
            return gr.skip()
        return plots.reward_curves(cache_state["series"], reward_names(int(run_id)), smooth)

    outs = [cache, head, reward_plot, alpha_plot, cos_plot, conflict_plot, cos_step, sample_step, gallery, spec_plot]
    reload_btn.click(load_choices, None, run_box)
    run_box.change(select_run, [run_box, smoothing], outs)
    timer.tick(tick, [cache, smoothing], outs, show_progress="hidden")
    cos_step.release(on_cos, [run_box, cache, cos_step], [cache, cos_plot])
    smoothing.release(on_smooth, [run_box, cache, smoothing], reward_plot)
    # the user's choice of step only: a new run or new samples fill the gallery themselves (sample_view)
    sample_step.input(lambda r, s: gallery_items(int(r), s) if r is not None else ([], gr.skip()),
                      [run_box, sample_step], [gallery, spec_plot])
    return {"run": run_box, "load_choices": load_choices}


def follow_new_runs(select_newest: bool, current: Any) -> Any:
    """The run picker's update: every run as a choice; the newest picked when ``select_newest`` (page load,
    a run just started from New run), else the current pick kept."""
    choices = context.run_choices()
    ids = [rid for _, rid in choices]
    value = (ids[0] if ids else None) if select_newest else (current if current in ids else None)
    return gr.update(choices=choices, value=value)
