"""Replay: re-solve ᾱ offline from a run's stored Gram matrices with another ρ, N or normalization."""

from __future__ import annotations

import json

import gradio as gr

from app import context, plots
from app.forms import md_literal
from app.replay import replay
from jobs.storage import RunNotFound


EMPTY = "Pick a run: its stored Gram matrices are re-solved here with the ρ, N and normalization above."


def _json_object(label: str, text: str | None) -> dict:
    try:
        value = json.loads(text or "{}")
    except json.JSONDecodeError:
        value = None
    if not isinstance(value, dict):
        raise ValueError(f"{label}={text!r}: must be a JSON object, e.g. {{}} or {{\"general\": [\"a\", \"b\"]}}")
    return value


def render(run_id, rho: float, harmonize_every: float | None, normalize: bool, alpha_floor: float | None = 0.0,
           groups: str | None = "{}", weights: str | None = "{}"):
    if run_id is None:
        return plots.empty_figure("Replay", EMPTY), ""
    if harmonize_every is None or harmonize_every != int(harmonize_every) or harmonize_every < 1:
        msg = f"N={harmonize_every}: write a whole number of steps ≥ 1"
        return plots.empty_figure("Replay", msg), f"`{msg}`"
    try:
        knobs = (float(alpha_floor or 0.0), _json_object("reward groups", groups),
                 _json_object("group weights", weights))
    except ValueError as e:
        return plots.empty_figure("Replay", str(e)), f"`{e}`"
    try:
        run = context.store().get_run(int(run_id))
    except RunNotFound as e:  # deleted since the picker was filled
        return plots.empty_figure("Replay", f"{e}: press Reload runs."), ""
    names = [r["name"] for r in run.config["rewards"]]
    rows = context.store().balance(int(run_id))
    try:
        res = replay(rows, names, float(rho), int(harmonize_every), bool(normalize), *knobs)
    except ValueError as e:
        return plots.empty_figure("Replay", str(e)), f"`{e}`"
    label = f"ρ={rho:g}, N={int(harmonize_every)}, {'normalized' if normalize else 'raw'}"
    label += f", floor {alpha_floor:g}" if alpha_floor else ""
    label += ", grouped" if knobs[1] else ""
    fig = plots.replay_figure(res.steps, res.recorded, res.replayed, names, label)
    note = (f"{len(res.steps)} stored Gram matrices; the replay solved at {len(res.solves)} of them. "
            "Replay solves only where the run stored a Gram matrix (full and diagnostic steps).")
    return fig, note


def build() -> dict:
    gr.Markdown("What would the balancing coefficients have been with another EMA ρ, refresh period N or without "
                "gradient normalization? Replay re-runs MARBLE's solver over a run's stored per-reward Gram "
                "matrices (full and diagnostic steps) and draws the replayed ᾱ next to the recorded one. "
                "Nothing is retrained.")
    with gr.Row():
        run = gr.Dropdown(choices=[], label="Run", elem_id="replay-run", scale=3)
        reload_btn = gr.Button("Reload runs", scale=1, elem_id="replay-reload")
    with gr.Row():
        rho = gr.Slider(0, 0.95, value=0.7, step=0.05, label="ρ (EMA)", elem_id="replay-rho",
                        info=md_literal("ᾱ ← ρ·ᾱ + (1−ρ)·α*: how much of the past ᾱ each solve keeps "
                                        "(0: use each solve's α* as is; near 1: ᾱ moves slowly)"))
        every = gr.Number(value=10, label="N (solve every N steps)", elem_id="replay-n")
        normalize = gr.Checkbox(value=True, label="Normalize gradients", elem_id="replay-normalize")
    with gr.Row():  # the release's optional knobs (config/base.py pareto.*), off by default
        floor = gr.Number(value=0.0, label="α floor", elem_id="replay-floor")
        groups = gr.Textbox(value="{}", label="Reward groups (JSON: group → rewards)", elem_id="replay-groups")
        weights = gr.Textbox(value="{}", label="Group weights (JSON: group or reward → weight)",
                             elem_id="replay-weights")
    fig = gr.Plot(plots.empty_figure("Replay", EMPTY), elem_id="plot-replay")
    note = gr.Markdown(elem_id="replay-note")
    reload_btn.click(lambda: gr.update(choices=context.run_choices()), None, run)
    for comp in (run, rho, every, normalize, floor, groups, weights):
        comp.change(render, [run, rho, every, normalize, floor, groups, weights], [fig, note])
    return {"run": run}
