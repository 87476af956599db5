"""Static figures as PNG files, drawn with matplotlib: the study's α trajectories, worst-cosine and seed plots
(``python -m core.evaluate --study``) and the α trajectory of an exported model card (jobs/hub_export.py).

Two kinds of chart, each a builder that returns a matplotlib ``Figure`` (what tests inspect) and a thin
wrapper that saves it:

- :func:`line_figure` / :func:`line_panels`: a grid of panels, each with named series of (x, y) points;
  a series name keeps its colour in every panel and appears once in the shared legend.
- :func:`strip_figure` / :func:`strip_panels`: one column per category, one dot per value, a bar at the
  mean with the standard error ("one dot per seed, one column per strategy").

matplotlib is imported inside the functions, never at module import: the job and web processes import
their callers (core.evaluate, jobs.hub_export) without paying for it. Figures are built as
``matplotlib.figure.Figure`` on an Agg canvas, never through pyplot: no display, no global figure
registry, safe in the web process's worker threads. Sizes are in inches, saved at :data:`DPI`.
"""

from __future__ import annotations

import math
import textwrap
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from matplotlib.figure import Figure

# matplotlib's "tab10", a palette that stays distinguishable for the common colour-vision deficiencies
COLORS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22",
          "#17becf"]
DPI = 150
PANEL_SIZE = (4.6, 3.0)  # inches per panel: two panels side by side fill a README column at 150 dpi
_PANEL_LIMITS = (1.0, 20.0)  # inches; catches sizes still given in pixels

Series = dict[str, list[tuple[float, float | None]]]


def series_colors(names: list[str]) -> dict[str, str]:
    """One palette colour per name, in order of first appearance (cycling after ten)."""
    return {n: COLORS[i % len(COLORS)] for i, n in enumerate(dict.fromkeys(names))}


def literal(text: str) -> str:
    """``text`` shown as written: its dollar signs escaped, so matplotlib never reads it as mathtext.
    Titles and axis labels are markup (``r"$\\alpha_k$"``); wrap names that come from users in this."""
    return text.replace("$", r"\$")


def save_png(fig: Figure, path: str | Path, dpi: int = DPI) -> Path:
    """Save ``fig`` as a PNG at ``path`` (parent folders made) on a white background; returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi, format="png", facecolor="white")
    return path


def _validate(panels: list, columns: int, panel_size: tuple[float, float]) -> None:
    if not panels:
        raise ValueError("panels=[]: a figure needs at least one (title, data) panel")
    if columns < 1:
        raise ValueError(f"columns={columns!r}: must be at least 1")
    lo, hi = _PANEL_LIMITS
    if len(panel_size) != 2 or not all(lo <= s <= hi for s in panel_size):
        raise ValueError(f"panel_size={tuple(panel_size)!r}: must be (width, height) in inches, each between "
                         f"{lo:g} and {hi:g}")


def _grid(n_panels: int, columns: int, panel_size: tuple[float, float], title: str, extra_height: float = 0.0):
    """A constrained-layout figure with a rows × cols grid of axes for ``n_panels`` (spare cells hidden)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    cols = min(columns, n_panels)
    rows = math.ceil(n_panels / cols)
    width, height = cols * panel_size[0], rows * panel_size[1] + extra_height + (0.4 if title else 0.0)
    fig = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)  # the Agg canvas, explicitly: no display, independent of matplotlib.use()
    grid = fig.subplots(rows, cols, squeeze=False)
    axes = [ax for row in grid for ax in row]
    for ax in axes[n_panels:]:
        ax.set_visible(False)
    if title:
        fig.suptitle(_wrap(title, width, 11), fontsize=11)
    return fig, axes[:n_panels], cols


def _wrap(text: str, width_in: float, fontsize: float) -> str:
    """Wrap ``text`` to the width of ``width_in`` inches (about 0.55 em per character)."""
    return textwrap.fill(text, max(20, int(width_in * 72 / (fontsize * 0.55))))


def _as_float(v) -> float:
    return math.nan if v is None else float(v)


def line_figure(panels: list[tuple[str, Series]], ylabel: str = "", xlabel: str = "step",
                y_range: tuple[float, float] | None = None, hline: float | None = None, columns: int = 2,
                panel_size: tuple[float, float] = PANEL_SIZE, title: str = "") -> Figure:
    """A grid of line charts: ``panels`` is [(panel title, {series name: [(x, y), ...]}), ...].

    A point whose x or y is None or not finite breaks its line; a point with no finite neighbour is drawn
    as a dot, so sparse series (α* only on the steps that solve the QP) stay visible. ``y_range`` fixes
    the y axis of every panel (else each fits its data); ``hline`` adds a dashed reference line (e.g. 0
    for cosines). The series names form one legend below the panels.
    """
    _validate(panels, columns, panel_size)
    if y_range is not None and not (math.isfinite(y_range[0]) and math.isfinite(y_range[1])
                                    and y_range[0] < y_range[1]):
        raise ValueError(f"y_range={tuple(y_range)!r}: must be (low, high) with finite low < high")
    import numpy as np
    from matplotlib.lines import Line2D

    color = series_colors([n for _, s in panels for n in s])
    fig, axes, cols = _grid(len(panels), columns, panel_size, title, extra_height=0.35 * math.ceil(len(color) / 4))
    for i, (ax, (ptitle, series)) in enumerate(zip(axes, panels)):
        ax.set_title(_wrap(ptitle, panel_size[0], 10), fontsize=10)
        ax.grid(True, color="0.9", linewidth=0.8)
        ax.set_axisbelow(True)
        if hline is not None:
            ax.axhline(hline, color="black", linestyle="--", linewidth=0.9, gid="hline")
        for name, points in series.items():
            xy = np.array([(_as_float(x), _as_float(y)) for x, y in points], dtype=float).reshape(-1, 2)
            x, y = xy[:, 0], xy[:, 1]
            ok = np.isfinite(x) & np.isfinite(y)
            y = np.where(ok, y, np.nan)  # matplotlib breaks a line at NaN
            ax.plot(x, y, color=color[name], linewidth=1.6, label=name, gid=f"line:{name}")
            neighbour = np.zeros_like(ok)
            neighbour[1:] |= ok[:-1]
            neighbour[:-1] |= ok[1:]
            lone = ok & ~neighbour
            if lone.any():
                ax.plot(x[lone], y[lone], linestyle="none", marker="o", markersize=3, color=color[name],
                        label=f"_{name} (lone points)", gid=f"dots:{name}")
        if y_range is not None:
            ax.set_ylim(*y_range)
        if i + cols >= len(panels):  # nothing below it: the bottom of its column
            ax.set_xlabel(xlabel)
        if i % cols == 0 and ylabel:
            ax.set_ylabel(ylabel)
    handles = [Line2D([], [], color=c, linewidth=2) for c in color.values()]
    if handles:  # series names are data, not markup
        fig.legend(handles, [literal(n) for n in color], loc="outside lower center", ncols=min(4, len(handles)),
                   frameon=False)
    return fig


def line_panels(panels: list[tuple[str, Series]], path: str | Path, **options) -> Path:
    """:func:`line_figure` saved as a PNG at ``path``; returns the path."""
    return save_png(line_figure(panels, **options), path)


def strip_figure(panels: list[tuple[str, dict[str, list[float]]]], ylabel: str = "", hline: float | None = 0.0,
                 columns: int = 2, panel_size: tuple[float, float] = PANEL_SIZE, title: str = "") -> Figure:
    """Strip charts: ``panels`` is [(panel title, {category: [values]}), ...], one column per category.

    Each value is a dot, spread sideways so equal values stay visible; a black bar marks the mean of the
    category's finite values and a black error bar ± its standard error (when it has two or more).
    Categories keep their colour across panels; None and non-finite values are skipped. ``hline`` adds a
    dashed reference line (0 by default: "no change").
    """
    _validate(panels, columns, panel_size)
    import numpy as np

    color = series_colors([n for _, cats in panels for n in cats])
    fig, axes, cols = _grid(len(panels), columns, panel_size, title)
    for i, (ax, (ptitle, cats)) in enumerate(zip(axes, panels)):
        ax.set_title(_wrap(ptitle, panel_size[0], 10), fontsize=10)
        ax.grid(True, axis="y", color="0.9", linewidth=0.8)
        ax.set_axisbelow(True)
        if hline is not None:
            ax.axhline(hline, color="black", linestyle="--", linewidth=0.9, gid="hline")
        for j, (name, values) in enumerate(cats.items()):
            v = np.array([_as_float(x) for x in values], dtype=float)
            v = v[np.isfinite(v)]
            if len(v) == 0:
                continue
            spread = min(0.08, 0.5 / len(v))  # the whole group stays within half a column
            dx = (np.arange(len(v)) - (len(v) - 1) / 2) * spread
            ax.scatter(j + dx, v, s=30, color=color[name], edgecolors="white", linewidths=0.6, zorder=3,
                       label=name, gid=f"dots:{name}")
            mean = float(v.mean())
            ax.hlines(mean, j - 0.3, j + 0.3, color="black", linewidth=2, zorder=2, gid=f"mean:{name}")
            if len(v) > 1:
                sem = float(v.std(ddof=1) / math.sqrt(len(v)))
                ax.vlines(j, mean - sem, mean + sem, color="black", linewidth=1, zorder=2, gid=f"sem:{name}")
        names = list(cats)
        ax.set_xlim(-0.6, len(names) - 0.4)
        ax.set_xticks(range(len(names)), [literal(n) for n in names], fontsize=9)
        if i % cols == 0 and ylabel:
            ax.set_ylabel(ylabel)
    _slant_clashing_labels(fig, axes)
    return fig


def _slant_clashing_labels(fig: Figure, axes) -> None:
    """Slant the category labels of any panel where, laid out, two neighbours would touch (long strategy names in
    narrow columns); measured on the laid-out figure rather than guessed from character counts."""
    fig.draw_without_rendering()
    renderer = fig.canvas.get_renderer()
    for ax in axes:
        labels = [t for t in ax.get_xticklabels() if t.get_text()]
        boxes = [t.get_window_extent(renderer) for t in labels]
        if any(a.x1 + 2 > b.x0 for a, b in zip(boxes, boxes[1:])):
            for t in labels:
                t.set_rotation(25)
                t.set_horizontalalignment("right")


def strip_panels(panels: list[tuple[str, dict[str, list[float]]]], path: str | Path, **options) -> Path:
    """:func:`strip_figure` saved as a PNG at ``path``; returns the path."""
    return save_png(strip_figure(panels, **options), path)
