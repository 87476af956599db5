"""Figure builders: plain data in (what jobs.storage returns), a Plotly figure out. No I/O, no state.

Every builder returns a figure with a clear title; with no data it returns an empty figure whose
annotation says why (an empty state, never a blank box). ``uirevision`` keeps the user's zoom when a
live refresh replaces the figure.
"""

from __future__ import annotations

import functools
import math
import zlib
from typing import Any, Callable, Iterable, Sequence

import numpy as np
import plotly.graph_objects as go
import plotly.io as pio

PALETTE = ("#4C78A8", "#F58518", "#54A24B", "#E45756", "#72B7B2", "#B279A2", "#EECA3B", "#9D755D", "#BAB0AC")

# A harmonized step's balance rows; "full" is the name runs stored before the two were one word.
HARMONIZED_PHASES = ("harmonized", "full")


def colour(i: int) -> str:
    """The i-th colour of the palette: for things that are not rewards (runs in a scatter, strategies)."""
    return PALETTE[i % len(PALETTE)]


# Every reward has one colour on every page (dashboard, overlay, study, replay): its place in REWARD_ORDER, then
# in the reward registry (core.rewards, rewards added since), picks it from REWARD_PALETTE. Rewards that train
# together come first and get the most distinct colours; a name the registry does not know gets a colour from its
# CRC (stable across processes, may repeat one).
REWARD_ORDER = ("color_fidelity", "count_accuracy", "spatial_relation", "colorfulness", "jpeg_compressibility",
                "brightness", "pickscore", "hpsv2", "clipscore", "ocr", "geneval", "aesthetic", "imagereward",
                "contrast", "sharpness", "gray_entropy", "jpeg_incompressibility", "world_geneval", "remote")
REWARD_PALETTE = PALETTE[:8] + ("#FF9DA6", "#393B79", "#637939", "#8C6D31", "#843C39", "#7B4173", "#17BECF",
                                "#BCBD22", "#5254A3", "#BAB0AC", "#D6616B", "#E7BA52", "#A55194", "#6B6ECF",
                                "#31A354", "#E6550D", "#3182BD", "#CEDB9C", "#DE9ED6", "#756BB1", "#9C9EDE",
                                "#AD494A")


@functools.lru_cache(maxsize=1)
def _reward_places() -> dict[str, int]:
    from core.rewards import available_rewards  # the registry of names only (no torch)

    order = list(REWARD_ORDER) + [n for n in available_rewards() if n not in REWARD_ORDER]
    return {n: i for i, n in enumerate(order)}


def reward_colour(name: str) -> str:
    """The colour of reward ``name``, the same on every figure of every page."""
    place = _reward_places().get(name)
    if place is None:
        place = zlib.crc32(name.encode())
    return REWARD_PALETTE[place % len(REWARD_PALETTE)]


RUN_DASHES = ("solid", "dash", "dot", "dashdot", "longdash", "longdashdot")
RUN_SYMBOLS = ("circle", "square", "diamond", "triangle-up", "x", "star", "cross", "triangle-down")
"""Runs on one overlay are told apart by dash (lines) and marker symbol; the reward keeps its colour."""


_GRID = "#EBF0F8"
TEMPLATE = go.layout.Template(layout=dict(
    paper_bgcolor="white", plot_bgcolor="white", font=dict(color="#2a3f5f"), hovermode="closest", colorway=PALETTE,
    xaxis=dict(gridcolor=_GRID, linecolor=_GRID, zerolinecolor=_GRID, ticks="", automargin=True,
               exponentformat="power"),
    yaxis=dict(gridcolor=_GRID, linecolor=_GRID, zerolinecolor=_GRID, ticks="", automargin=True,
               exponentformat="power")))
"""plotly_white's look in the few properties these figures use: a figure deep-copies its template, and
plotly_white's copy was ~12 ms per figure, a third of a long run's first dashboard load. Small values are
written as powers of ten: plotly's default SI prefixes wrote a cosine variance of 2e-11 as "20p"."""
pio.templates["marble"] = TEMPLATE
pio.templates.default = "marble"
"""Every figure of the app starts from it: with plotly's own default a new figure first deep-copied that big
template and then swapped it for this one, ~8 ms per figure (half of what :func:`_layout` cost)."""


def _layout(fig: go.Figure, title: str, revision: Any = "keep", height: int = 360) -> go.Figure:
    fig.update_layout(title=dict(text=title, x=0.01, font=dict(size=15)), height=height, template=TEMPLATE,
                      margin=dict(l=50, r=20, t=50, b=40), uirevision=revision,
                      legend=dict(orientation="h", yanchor="bottom", y=1.0, xanchor="right", x=1.0))
    if _few_whole_xs(fig):  # early in a run plotly ticked steps 1.5, 2.5: there are no half steps
        fig.update_xaxes(dtick=1)
    return fig


def _few_whole_xs(fig: go.Figure, most: int = 10) -> bool:
    """True when every trace's x values are whole numbers spanning fewer than ``most`` units (a run's first
    steps), so the x axes can tick every unit; False for categories, fractions or a wider span."""
    lo, hi, seen = math.inf, -math.inf, False
    for trace in fig.data:
        xs = getattr(trace, "x", None)
        if xs is None:
            continue
        for v in xs:
            if v is None:  # a gap in a series
                continue
            if isinstance(v, (str, bool)):  # categories
                return False
            try:
                f = float(v)
            except (TypeError, ValueError):
                return False
            if math.isnan(f):
                continue
            if not f.is_integer():
                return False
            lo, hi, seen = min(lo, f), max(hi, f), True
            if hi - lo >= most:  # a long run: stop at the first wide gap instead of reading every point
                return False
    return seen and hi - lo < most


def subplot_grid(rows: int, cols: int, titles: Sequence[str], hspace: float = 0.06, vspace: float = 0.1,
                 shared_x: bool = False, x_title: str | None = None) -> tuple[go.Figure, Callable[[int, int], dict]]:
    """A rows × cols grid of axes with a title over each, laid out as plotly's make_subplots does, and ``axes(r,
    c)``: the xaxis/yaxis keywords that put a trace in cell (r, c), 1-based. Built as one layout dict:
    make_subplots validated every property it set (a 2 × 2 grid took ~35 ms, a tenth of a long run's first
    dashboard load) and add_trace(row=, col=) looked the grid up again for every trace. ``shared_x``: every
    column's axes follow its bottom one (tick labels only at the bottom); ``x_title`` on the bottom row."""
    w, h = (1 - hspace * (cols - 1)) / cols, (1 - vspace * (rows - 1)) / rows

    def suffix(r: int, c: int) -> str:
        n = (r - 1) * cols + c
        return "" if n == 1 else str(n)

    layout: dict[str, Any] = {}
    annotations = []
    for r in range(1, rows + 1):
        for c in range(1, cols + 1):
            s, x0, y1 = suffix(r, c), (c - 1) * (w + hspace), 1 - (r - 1) * (h + vspace)
            xaxis: dict[str, Any] = dict(domain=[max(x0, 0.0), min(x0 + w, 1.0)], anchor=f"y{s}")
            if shared_x and r < rows:
                xaxis.update(matches=f"x{suffix(rows, c)}", showticklabels=False)
            if x_title and r == rows:
                xaxis["title"] = dict(text=x_title)
            layout[f"xaxis{s}"] = xaxis  # clamped: float rounding put a bottom edge at -6e-17
            layout[f"yaxis{s}"] = dict(domain=[max(y1 - h, 0.0), min(y1, 1.0)], anchor=f"x{s}")
            if (r - 1) * cols + c <= len(titles):
                annotations.append(dict(text=titles[(r - 1) * cols + c - 1], x=x0 + w / 2, y=y1, xref="paper",
                                        yref="paper", xanchor="center", yanchor="bottom", showarrow=False,
                                        font=dict(size=16)))
    fig = go.Figure(layout=dict(layout, annotations=annotations))
    return fig, lambda r, c: dict(xaxis=f"x{suffix(r, c)}", yaxis=f"y{suffix(r, c)}")


def zero_line(fig: go.Figure, cell: dict) -> None:
    """A dashed y = 0 across the cell whose axes ``cell`` names (an ``axes(r, c)`` of :func:`subplot_grid`)."""
    fig.add_shape(type="line", xref=f"{cell['xaxis']} domain", x0=0, x1=1, yref=cell["yaxis"], y0=0, y1=0,
                  line=dict(color="#999", width=1, dash="dash"))


def empty_figure(title: str, message: str) -> go.Figure:
    fig = go.Figure()
    fig.add_annotation(text=message, showarrow=False, xref="paper", yref="paper", x=0.5, y=0.5,
                       font=dict(size=14, color="#666"))
    fig.update_xaxes(visible=False)
    fig.update_yaxes(visible=False)
    return _layout(fig, title, revision=None, height=300)


def _finite(values: Iterable[float | None]) -> list[float | None]:
    return [v if v is not None and math.isfinite(v) else None for v in values]


def _arr(values: Iterable[float | None]) -> np.ndarray:
    """A float array with NaN for missing or non-finite values (a gap in the line, as ``_finite``'s None).
    Plotly validates a Python list element by element and takes an array as it is: ~5x faster on long runs."""
    a = np.asarray([np.nan if v is None else v for v in values], dtype=float)
    a[~np.isfinite(a)] = np.nan
    return a


def ema(values: Sequence[float | None], weight: float) -> list[float | None]:
    """Bias-corrected exponential moving average (TensorBoard-style smoothing); None values are skipped."""
    out: list[float | None] = []
    acc, norm = 0.0, 0.0
    for v in values:
        if v is None or not math.isfinite(v):
            out.append(None)
            continue
        acc = weight * acc + (1 - weight) * v
        norm = weight * norm + (1 - weight)
        out.append(acc / norm)
    return out


# ---- per-run dashboards --------------------------------------------------------------------------

def reward_curves(series: dict[str, tuple[list[int], list[float | None]]], reward_names: Sequence[str],
                  smoothing: float = 0.6, revision: Any = "rewards") -> go.Figure:
    """One panel per reward: the raw per-step mean (faint) and its smoothed curve."""
    names = [n for n in reward_names if f"reward/{n}" in series]
    if not names:
        return empty_figure("Rewards", "No steps recorded yet: rewards appear after the first training step.")
    fig, axes = subplot_grid(1, len(names), names, hspace=0.06, x_title="step")
    for i, name in enumerate(names):
        steps, values = series[f"reward/{name}"]
        c = reward_colour(name)
        fig.add_trace(go.Scatter(x=_arr(steps), y=_arr(values), mode="lines", line=dict(color=c, width=1),
                                 opacity=0.35, name=f"{name} (raw)", showlegend=False, **axes(1, i + 1)))
        fig.add_trace(go.Scatter(x=_arr(steps), y=_arr(ema(values, smoothing)), mode="lines",
                                 line=dict(color=c, width=2.5), name=name, showlegend=False, **axes(1, i + 1)))
    return _layout(fig, f"Mean reward per step (smoothing {smoothing:g})", revision)


def alpha_trajectories(balance_rows: Sequence[dict], applied: dict[str, tuple[list[int], list[float | None]]],
                       reward_names: Sequence[str], revision: Any = "alpha") -> go.Figure:
    """α* of every solve (markers), ᾱ (EMA, line), the α applied on each step (dotted), and 1/K."""
    if not balance_rows and not any(f"alpha/{n}" in applied for n in reward_names):
        return empty_figure("Balancing coefficients α",
                            "No coefficients yet: they appear after the first harmonized step.")
    fig = go.Figure()
    full = [r for r in balance_rows if r.get("phase") in HARMONIZED_PHASES]
    drawn: list[np.ndarray] = []
    for name in reward_names:
        c = reward_colour(name)
        if f"alpha/{name}" in applied:
            steps, values = applied[f"alpha/{name}"]
            drawn.append(_arr(values))
            fig.add_trace(go.Scatter(x=_arr(steps), y=drawn[-1], mode="lines",
                                     line=dict(color=c, width=1, dash="dot"), name=f"{name} applied",
                                     legendgroup=name, showlegend=False))
        if full:
            xs = _arr(r["step"] for r in full)
            drawn += [_arr(r["alpha_ema"].get(name) for r in full), _arr(r["alpha_raw"].get(name) for r in full)]
            fig.add_trace(go.Scatter(x=xs, y=drawn[-2], mode="lines",
                                     line=dict(color=c, width=2.5), name=f"{name} ᾱ (EMA)", legendgroup=name))
            fig.add_trace(go.Scatter(x=xs, y=drawn[-1], mode="markers",
                                     marker=dict(color=c, size=7, symbol="circle-open"), name=f"{name} α* (solve)",
                                     legendgroup=name, showlegend=False))
    k = len(reward_names)
    uniform = 1 / k if k else None
    if uniform is not None:
        _uniform_line(fig, uniform)
    fig.update_yaxes(title_text="α", range=alpha_range(drawn, uniform))
    fig.update_xaxes(title_text="step")
    fig = _layout(fig, "Balancing coefficients: α* per solve (circles), ᾱ (lines), applied (dotted)", revision)
    fig.update_layout(margin=dict(r=90))  # room for the 1/K label right of the plot, clear of every line
    return fig


def alpha_range(arrays: Sequence[np.ndarray], uniform: float | None) -> list[float]:
    """The α axis fitted to the values drawn and 1/K, with 8% headroom each side (α near 1/K is the usual
    case: a fixed [0, 1] axis flattened every trajectory into one line), kept within [-0.02, 1.02]."""
    vals = [a[np.isfinite(a)] for a in arrays if len(a)]
    finite = np.concatenate(vals) if vals else np.array([])
    points = list(finite) + ([uniform] if uniform is not None else [])
    if not points:
        return [-0.02, 1.02]
    lo, hi = float(min(points)), float(max(points))
    pad = max(0.08 * (hi - lo), 0.02)
    return [max(lo - pad, -0.02), min(hi + pad, 1.02)]


def _uniform_line(fig: go.Figure, uniform: float) -> None:
    """The 1/K reference: a dashed line, its label in the right margin (never over a trajectory)."""
    fig.add_hline(y=uniform, line=dict(color="#888", dash="dash", width=1))
    fig.add_annotation(text=f"1/K = {uniform:.3g}", xref="paper", x=1.0, xanchor="left", yref="y", y=uniform,
                       showarrow=False, font=dict(size=11, color="#666"))


def cosine_heatmap(row: dict | None, revision: Any = "cos") -> go.Figure:
    """The K×K cosine matrix of the per-reward gradients at one diagnosed step."""
    if not row or not row.get("cosine"):
        return empty_figure("Gradient cosines", "No diagnosed step yet: cosines appear after the first full or "
                                                "diagnostic step.")
    names = row["cosine"]["names"]
    z = [[None if v is None or not math.isfinite(v) else v for v in r] for r in row["cosine"]["matrix"]]
    text = [["n/a" if v is None else f"{v:+.2f}" for v in r] for r in z]
    fig = go.Figure(go.Heatmap(z=z, x=names, y=names, zmin=-1, zmax=1, colorscale="RdBu", text=text,
                               texttemplate="%{text}", hovertemplate="%{y} · %{x}: %{z:.3f}<extra></extra>",
                               colorbar=dict(title="cos")))
    fig.update_yaxes(autorange="reversed")
    return _layout(fig, f"Cosine between reward gradients at step {row['step']} ({row.get('phase', '')})", revision,
                   height=380)


ATTRIBUTION_EMPTY = ("Recorded on the per-sample gradient path (balance.gradients = per_sample) at harmonized and "
                     "diagnostic steps; none at this step.")


def conflict_attribution(att: dict | None, step: int | None, revision: Any = "attr") -> go.Figure:
    """Which samples drive the worst conflict of a diagnosed step: each sample's share of cos(g_k, g_l) for the
    pair with the lowest cosine (the shares sum to it), one bar per sample, most negative first, coloured by its
    prompt source; the hover names its prompt, seed and σ."""
    title = "Who drives the worst conflict"
    if not att or not att.get("samples"):
        return empty_figure(title, ATTRIBUTION_EMPTY)
    rows = sorted(att["samples"], key=lambda s: s["share"])
    sources = list(dict.fromkeys(s.get("source") or "?" for s in rows))
    fig = go.Figure()
    for i, src in enumerate(sources):
        mine = [(n, s) for n, s in enumerate(rows) if (s.get("source") or "?") == src]
        fig.add_trace(go.Bar(
            x=[n for n, _ in mine], y=[s["share"] for _, s in mine], name=src, marker_color=colour(i),
            customdata=[[s["prompt"], s.get("seed"), s.get("sigma")] for _, s in mine],
            hovertemplate="%{customdata[0]}<br>seed %{customdata[1]} · σ %{customdata[2]:.2f}<br>share "
                          "%{y:+.3f}<extra>%{fullData.name}</extra>"))
    fig.add_hline(y=0, line=dict(color="#888", width=1))
    k, l = att["pair"]
    fig.update_xaxes(title="samples of the unit, most negative share first", showticklabels=False)
    fig.update_yaxes(title=f"share of cos({k}, {l})")
    # showlegend: the help says the colours are prompt sources, and plotly hides the legend of a lone trace
    fig.update_layout(legend_title_text="prompt source", bargap=0.15, showlegend=True)
    where = (f"in the step's last unit (the step was solved whole; the heatmap shows its cosines)"
             if att.get("scope") == "unit" else f"on the {len(rows)} samples of the solved unit")
    return _layout(fig, f"{title} at step {step}: cos({k}, {l}) = {att['cosine']:+.2f} {where}", revision,
                   height=380)


def conflict_panels(balance_rows: Sequence[dict], reward_names: Sequence[str],
                    revision: Any = "conflict") -> go.Figure:
    """Each reward's cosine with the applied update over steps, and min / mean / variance across rewards,
    with the conflict rate: the share of diagnosed steps where some reward's cosine is negative."""
    rows = [r for r in balance_rows if r.get("cos_to_update")]
    if not rows:
        return empty_figure("Conflicts with the update", "No diagnosed step yet.")
    stats = conflict_stats(rows, reward_names)
    fig, axes = subplot_grid(2, 2, ("cos(g_k, update) solid · cos(g_k, Σg/K) dotted", "min over rewards",
                                    "mean over rewards", "variance over rewards"), hspace=0.08, vspace=0.14,
                             shared_x=True)
    xs = _arr(stats["steps"])
    k = len(reward_names)
    for i, name in enumerate(reward_names):
        # rewards often share a cosine (α* ≈ 1/K): each has its own marker, and the lines narrow from the first
        # reward to the last, so a line drawn over another leaves the one below visible at its edges
        c, width = reward_colour(name), 1.2 + 2.4 * (k - 1 - i) / max(k - 1, 1)
        fig.add_trace(go.Scatter(x=xs, y=_arr(r["cos_to_update"].get(name) for r in rows), mode="lines+markers",
                                 marker=dict(size=7, symbol=RUN_SYMBOLS[i % len(RUN_SYMBOLS)] + "-open", color=c),
                                 line=dict(color=c, width=width), opacity=0.85, name=name, legendgroup=name,
                                 **axes(1, 1)))
        if any(cos_to_mean(r) for r in rows):  # the paper's Fig. S2 reference direction, labelled apart
            fig.add_trace(go.Scatter(x=xs, y=_arr(cos_to_mean(r).get(name) for r in rows), mode="lines",
                                     line=dict(color=c, dash="dot", width=1.2), name=f"{name} vs Σg/K",
                                     legendgroup=name, **axes(1, 1)))
    for values, label, (r_, c_) in ((stats["min"], "min", (1, 2)), (stats["mean"], "mean", (2, 1)),
                                    (stats["var"], "variance", (2, 2))):  # across rewards: neutral, not a reward's
        fig.add_trace(go.Scatter(x=xs, y=_arr(values), mode="lines+markers", marker=dict(size=4),
                                 line=dict(color="#444"), name=label, showlegend=False, **axes(r_, c_)))
    for r, c in ((1, 1), (1, 2), (2, 1)):
        zero_line(fig, axes(r, c))
    rate = stats["conflict_rate"]
    # the rate is against the update, not between rewards: a heatmap full of negative pairwise cosines can sit
    # beside a 0% rate when the min-norm update still agrees with every reward
    title = ("Reward gradients vs the applied update — conflict rate "
             f"{'n/a' if rate is None else f'{100 * rate:.0f}%'} of {len(xs)} diagnosed steps "
             "(a reward's gradient against it)")
    paper_rate = conflict_stats(rows, reward_names, "mean")["conflict_rate"]
    if paper_rate is not None:
        title += f" (vs Σg/K: {100 * paper_rate:.0f}%)"
    fig = _layout(fig, title, revision, height=540)
    fig.update_layout(legend=dict(orientation="h", yanchor="top", y=-0.08, xanchor="left", x=0.0))
    return fig


def cos_to_mean(row: dict) -> dict:
    """A balance row's cos(g_k, (1/K)·Σ_j g_j) by reward (the paper's Fig. S2 direction), {} when not recorded."""
    cosine = row.get("cosine")
    return (cosine.get("to_mean") or {}) if isinstance(cosine, dict) else {}


def conflict_stats(rows: Sequence[dict], reward_names: Sequence[str], reference: str = "update") -> dict:
    """Per diagnosed step: min, mean and variance over the valid rewards of cos(g_k, update) (``reference``
    "update") or of cos(g_k, (1/K)·Σ g_j) ("mean", the paper's Fig. S2), and the conflict rate (share of
    steps whose min is negative)."""
    steps, mins, means, variances = [], [], [], []
    for r in rows:
        cos = r["cos_to_update"] if reference == "update" else cos_to_mean(r)
        vals = [v for n in reward_names if (v := cos.get(n)) is not None and math.isfinite(v)]
        steps.append(r["step"])
        if not vals:
            mins.append(None), means.append(None), variances.append(None)
            continue
        m = sum(vals) / len(vals)
        mins.append(min(vals))
        means.append(m)
        variances.append(sum((v - m) ** 2 for v in vals) / len(vals))
    known = [m for m in mins if m is not None]
    rate = (sum(m < 0 for m in known) / len(known)) if known else None
    return {"steps": steps, "min": mins, "mean": means, "var": variances, "conflict_rate": rate}


def specialist_structure(samples: Sequence[dict], reward_names: Sequence[str], revision: Any = "spec") -> go.Figure:
    """Samples × rewards heatmap of the advantages (blank where a reward does not apply): which
    sample is informative for which reward (the paper's Fig. 2)."""
    if not samples:
        return empty_figure("Specialist structure", "No samples stored for this step (see sample_every).")
    z, labels = [], []
    for s in samples:
        adv = s.get("advantages") or {}
        z.append([None if (v := adv.get(n)) is None or not math.isfinite(v) else v for n in reward_names])
        labels.append(f"#{s.get('idx', len(labels))} {s.get('prompt', '')[:40]}")
    fig = go.Figure(go.Heatmap(z=z, x=list(reward_names), y=labels, zmid=0, colorscale="RdBu",
                               colorbar=dict(title="A"),
                               hovertemplate="%{y}<br>%{x}: A = %{z:.2f}<extra></extra>"))
    fig.update_yaxes(autorange="reversed", showticklabels=len(samples) <= 48)
    step = samples[0].get("step")
    return _layout(fig, f"Advantages per sample and reward at step {step} (blank = not applicable)", revision,
                   height=max(320, min(900, 16 * len(samples) + 120)))


# ---- studies across runs -------------------------------------------------------------------------

def pareto_scatter(points: Sequence[dict], x_reward: str, y_reward: str) -> go.Figure:
    """One point per run (or checkpoint): its mean of two rewards, labelled by run; the Pareto front
    (no other point better on both) is joined by a line."""
    pts = [p for p in points if _num(p["scores"].get(x_reward)) is not None
           and _num(p["scores"].get(y_reward)) is not None]
    if not pts:
        return empty_figure("Pareto view", f"No run has both {x_reward} and {y_reward} scores yet.")
    xs = [p["scores"][x_reward] for p in pts]
    ys = [p["scores"][y_reward] for p in pts]
    front = sorted((i for i in range(len(pts)) if not any(
        xs[j] >= xs[i] and ys[j] >= ys[i] and (xs[j] > xs[i] or ys[j] > ys[i]) for j in range(len(pts)))),
        key=lambda i: xs[i])
    fig = go.Figure()
    fig.add_trace(go.Scatter(x=[xs[i] for i in front], y=[ys[i] for i in front], mode="lines",
                             line=dict(color="#999", dash="dash"), name="Pareto front"))
    for i, p in enumerate(pts):
        fig.add_trace(go.Scatter(x=[xs[i]], y=[ys[i]], mode="markers+text", text=[p["label"]],
                                 textposition="top center", marker=dict(size=12, color=colour(i)), name=p["label"]))
    fig.update_xaxes(title_text=x_reward)
    fig.update_yaxes(title_text=y_reward)
    return _layout(fig, f"{y_reward} vs {x_reward} (higher is better on both)", None, height=420)


def alpha_overlay(runs: Sequence[dict], reward_names: Sequence[str]) -> go.Figure:
    """ᾱ trajectories of several runs overlaid: one colour per reward, one dash style per run."""
    fig = go.Figure()
    for j, run in enumerate(runs):
        rows = [r for r in run["balance"] if r.get("alpha_ema")]
        for name in reward_names:
            if not rows:
                continue
            fig.add_trace(go.Scatter(x=[r["step"] for r in rows], y=_finite(r["alpha_ema"].get(name) for r in rows),
                                     # a run with one solve is one point: a line alone draws nothing
                                     mode="lines+markers" if len(rows) < 2 else "lines",
                                     line=dict(color=reward_colour(name), dash=RUN_DASHES[j % len(RUN_DASHES)]),
                                     marker=dict(size=8, symbol=RUN_SYMBOLS[j % len(RUN_SYMBOLS)]),
                                     name=f"{run['label']} · {name}"))
    if not fig.data:
        return empty_figure("α across runs", "None of the selected runs has balancing rows yet.")
    fig.update_yaxes(title_text="ᾱ", range=[-0.02, 1.02])
    fig.update_xaxes(title_text="step")
    return _layout(fig, "ᾱ per reward (colour) and run (dash)", None, height=420)


def replay_figure(steps: Sequence[int], recorded: Sequence[Sequence[float]], replayed: Sequence[Sequence[float]],
                  reward_names: Sequence[str], label: str) -> go.Figure:
    """Recorded ᾱ (thin) against the ᾱ a re-solve with other settings would have produced (thick)."""
    if not steps:
        return empty_figure("Replay", "This run has no stored Gram matrices (no full or diagnostic steps yet).")
    fig = go.Figure()
    for i, name in enumerate(reward_names):
        c = reward_colour(name)
        fig.add_trace(go.Scatter(x=list(steps), y=[r[i] for r in recorded], mode="lines",
                                 line=dict(color=c, width=1.2, dash="dot"), name=f"{name} recorded"))
        fig.add_trace(go.Scatter(x=list(steps), y=[r[i] for r in replayed], mode="lines+markers",
                                 marker=dict(size=5), line=dict(color=c, width=2.5), name=f"{name} {label}"))
    fig.update_yaxes(title_text="ᾱ", range=[-0.02, 1.02])
    fig.update_xaxes(title_text="step")
    return _layout(fig, f"Replay: recorded ᾱ (dotted) vs {label} (solid)", None, height=420)


def _num(x: Any) -> float | None:
    return float(x) if isinstance(x, (int, float)) and math.isfinite(x) else None
