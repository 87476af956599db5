"""Figures of several runs on one chart (the Overlay page): a reward keeps its colour from
:func:`app.plots.reward_colour`; runs are told apart by dash (and marker symbol); the legend names run and
reward. Plain data in, a Plotly figure out."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import plotly.graph_objects as go

from app.plots import (RUN_DASHES, RUN_SYMBOLS, _arr, _layout, _uniform_line, alpha_range, ema, empty_figure,
                       reward_colour, subplot_grid)

Series = dict[str, tuple[list[int], list[float | None]]]


@dataclass
class OverlayRun:
    label: str  # "#12 name"
    names: list[str]  # its rewards
    series: Series  # "reward/<name>" and "alpha/<name>" -> (steps, values)


def _style(j: int) -> tuple[str, str]:
    return RUN_DASHES[j % len(RUN_DASHES)], RUN_SYMBOLS[j % len(RUN_SYMBOLS)]


def union_names(runs: Sequence[OverlayRun]) -> list[str]:
    out: list[str] = []
    for r in runs:
        out += [n for n in r.names if n not in out]
    return out


def overlay_rewards(runs: Sequence[OverlayRun], smoothing: float = 0.6) -> go.Figure:
    """One panel per reward (every reward of any run); in it each run that has the reward: its raw per-step mean
    (faint) and its smoothed curve (in the legend as "run · reward")."""
    names = [n for n in union_names(runs) if any(f"reward/{n}" in r.series for r in runs)]
    if not runs:
        return empty_figure("Rewards across runs", "Pick two or more runs above.")
    if not names:
        return empty_figure("Rewards across runs", "None of the picked runs has recorded a step yet.")
    fig, axes = subplot_grid(1, len(names), names, hspace=0.05, x_title="step")
    for j, run in enumerate(runs):
        dash, symbol = _style(j)
        for i, name in enumerate(names):
            if f"reward/{name}" not in run.series:
                continue
            steps, values = run.series[f"reward/{name}"]
            c, x = reward_colour(name), _arr(steps)
            group = f"{run.label} · {name}"
            fig.add_trace(go.Scatter(x=x, y=_arr(values), mode="lines", line=dict(color=c, width=1, dash=dash),
                                     opacity=0.3, name=f"{group} (raw)", legendgroup=group, showlegend=False,
                                     **axes(1, i + 1)))
            fig.add_trace(go.Scatter(x=x, y=_arr(ema(values, smoothing)), mode="lines+markers",
                                     line=dict(color=c, width=2.5, dash=dash),
                                     marker=dict(symbol=symbol, size=7, color=c, maxdisplayed=12), name=group,
                                     legendgroup=group, **axes(1, i + 1)))
    n_runs = f"{len(runs)} run{'' if len(runs) == 1 else 's'}"
    fig = _layout(fig, f"Mean reward per step, {n_runs} (colour: reward; dash and marker: run; "
                       f"smoothing {smoothing:g})", "overlay-rewards", height=480)
    fig.update_layout(margin=dict(b=120),  # the legend under the axes' "step" titles
                      legend=dict(orientation="h", yanchor="top", y=-0.3, xanchor="left", x=0.0))
    return fig


def overlay_alpha(runs: Sequence[OverlayRun]) -> go.Figure:
    """The α each run applied on every step, per reward, with 1/K of every K among the runs."""
    if not runs:
        return empty_figure("α across runs", "Pick two or more runs above.")
    fig = go.Figure()
    drawn: list[np.ndarray] = []
    for j, run in enumerate(runs):
        dash, symbol = _style(j)
        for name in run.names:
            if f"alpha/{name}" not in run.series:
                continue
            steps, values = run.series[f"alpha/{name}"]
            drawn.append(_arr(values))
            c = reward_colour(name)
            fig.add_trace(go.Scatter(x=_arr(steps), y=drawn[-1], mode="lines+markers",
                                     line=dict(color=c, width=2, dash=dash),
                                     marker=dict(symbol=symbol, size=7, color=c, maxdisplayed=12),
                                     name=f"{run.label} · {name}"))
    if not fig.data:
        return empty_figure("α across runs", "None of the picked runs has recorded a step yet.")
    ks = sorted({len(r.names) for r in runs if r.names})
    for k in ks:
        _uniform_line(fig, 1 / k)
    fig.update_yaxes(title_text="α applied", range=alpha_range(drawn, 1 / ks[0] if ks else None) if len(ks) <= 1
                     else alpha_range(drawn + [np.array([1 / k for k in ks])], None))
    fig.update_xaxes(title_text="step")
    fig = _layout(fig, "α applied per step (colour: reward; dash and marker: run)", "overlay-alpha", height=480)
    fig.update_layout(margin=dict(r=90, b=120), legend=dict(orientation="h", yanchor="top", y=-0.3, xanchor="left",
                                                            x=0.0))
    return fig
