"""Overlay: any runs on one chart, the way W&B and trackio overlay runs: reward curves (raw and smoothed) and
the α each run applied, a colour per reward (the same on every page), a dash and marker per run. Live: the
timer appends the new steps of every picked run (incremental reads, as the Dashboard)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import gradio as gr

from app import context
from app.overlay_plots import OverlayRun, overlay_alpha, overlay_rewards
from app.series import RunSeries
from jobs.storage import RunNotFound

MAX_RUNS = 8  # beyond, dashes and markers repeat and the legend stops helping
HINT = "Pick two or more runs: their curves are drawn on one chart per reward."
ONE_RUN = "One run is drawn: pick another to overlay it on the same charts."


@dataclass
class OverlayState:
    """The picked runs in the order picked, each with its label and series cache."""

    run_ids: list[int] = field(default_factory=list)
    labels: dict[int, str] = field(default_factory=dict)
    data: dict[int, RunSeries] = field(default_factory=dict)

    def runs(self) -> list[OverlayRun]:
        return [OverlayRun(self.labels[r], self.data[r].names, self.data[r].series) for r in self.run_ids]


def pick(state: OverlayState | None, run_ids: list[Any] | None) -> tuple[OverlayState, str]:
    """The state for a new pick: runs kept from the last pick keep their cache, new ones are read (down-sampled);
    deleted runs are left out and named in the returned note."""
    old = state or OverlayState()
    new, gone = OverlayState(), []
    store = context.store()
    for rid in [int(r) for r in (run_ids or [])][:MAX_RUNS]:
        try:
            run = store.get_run(rid)
            new.data[rid] = old.data[rid] if rid in old.data else RunSeries.load(rid)
        except RunNotFound:
            gone.append(f"#{rid}")
            continue
        new.run_ids.append(rid)
        new.labels[rid] = f"#{rid} {run.name or run.strategy}"
    notes = []
    if len(run_ids or []) > MAX_RUNS:
        notes.append(f"{len(run_ids)} runs picked: the first {MAX_RUNS} are drawn (dashes and markers repeat beyond).")
    if gone:
        notes.append(f"Deleted, left out: {', '.join(gone)}.")
    return new, " ".join(notes)


def render(state: OverlayState, smoothing: float) -> tuple[Any, Any]:
    runs = state.runs()
    return overlay_rewards(runs, smoothing), overlay_alpha(runs)


def on_pick(state: OverlayState | None, run_ids: list[Any] | None, smoothing: float) -> tuple[Any, ...]:
    state, note = pick(state, run_ids)
    hint = HINT if not state.run_ids else ONE_RUN if len(state.run_ids) == 1 else ""
    return (state, *render(state, smoothing), note or hint)


def tick(state: OverlayState | None, smoothing: float) -> tuple[Any, ...]:
    """New steps of any picked run redraw both charts; otherwise nothing is sent."""
    skip = gr.skip()
    if state is None or not state.run_ids:
        return state, skip, skip, skip
    changed, gone = False, []
    store = context.store()
    for rid in list(state.run_ids):
        try:
            store.status(rid)  # a deleted run's reads come back empty, not as an error: ask
            changed |= state.data[rid].update()
        except RunNotFound:
            gone.append(rid)
    if gone:
        state.run_ids = [r for r in state.run_ids if r not in gone]
        return (state, *render(state, smoothing),
                f"Deleted while shown, left out: {', '.join(f'#{r}' for r in gone)}.")
    if not changed:
        return state, skip, skip, skip
    return (state, *render(state, smoothing), skip)


def build(timer: gr.Timer) -> dict:
    state = gr.State(None)
    with gr.Row():
        runs = gr.Dropdown(choices=[], multiselect=True, label="Runs to overlay", elem_id="overlay-runs", scale=4)
        smoothing = gr.Slider(0, 0.98, value=0.6, step=0.02, label="Reward smoothing", scale=2,
                              info="Exponential moving average of the per-step means (0: raw).")
        reload_btn = gr.Button("Reload runs", scale=1, elem_id="overlay-reload")
    note = gr.Markdown(HINT, elem_id="overlay-note")
    rewards = gr.Plot(label="Rewards across runs", elem_id="plot-overlay-rewards")
    alpha = gr.Plot(label="α across runs", elem_id="plot-overlay-alpha")
    gr.Markdown("A reward has the same colour here as on the Dashboard, the Study and Replay. α is the weight each "
                "reward's advantage had in the step's update (1/K for every reward is equal weighting).",
                elem_classes=["help-line"])
    outs = [state, rewards, alpha, note]
    reload_btn.click(lambda: gr.update(choices=context.run_choices()), None, runs)
    runs.change(on_pick, [state, runs, smoothing], outs)
    smoothing.release(lambda st, s: (st, *render(st or OverlayState(), s), gr.skip()), [state, smoothing], outs)
    timer.tick(tick, [state, smoothing], outs, show_progress="hidden")
    return {"runs": runs}
