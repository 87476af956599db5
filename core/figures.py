"""Line charts as PNG with PIL only (no matplotlib): the study's α trajectories and worst-cosine plots.

Small and dependency-free on purpose: the figures in docs/study/ are made by ``python -m core.evaluate
--study`` on any machine that can train. One function, :func:`line_panels`, draws a grid of panels,
each with several named series of (x, y) points, shared colours per series name, and a legend.
"""

from __future__ import annotations

import math
from pathlib import Path

from PIL import Image, ImageDraw

COLORS = [(31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40), (148, 103, 189), (140, 86, 75),
          (227, 119, 194), (127, 127, 127), (188, 189, 34), (23, 190, 207)]

Series = dict[str, list[tuple[float, float]]]


def _nice_ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    if hi <= lo:
        hi = lo + 1.0
    raw = (hi - lo) / n
    mag = 10 ** math.floor(math.log10(raw))
    step = min((m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw), default=10 * mag)
    first = math.ceil(lo / step) * step
    return [first + i * step for i in range(int((hi - first) / step + 1e-9) + 1)]


def _fmt(v: float) -> str:
    return f"{v:.0f}" if abs(v) >= 100 or float(v).is_integer() else f"{v:.2g}"


def line_panels(panels: list[tuple[str, Series]], path: str | Path, ylabel: str = "", xlabel: str = "step",
                y_range: tuple[float, float] | None = None, hline: float | None = None, columns: int = 2,
                panel_size: tuple[int, int] = (460, 300), title: str = "") -> Path:
    """Draw ``panels`` (title, {series name: [(x, y), ...]}) in a grid and save a PNG at ``path``.

    NaN/None points break a line. ``y_range`` fixes the y axis of every panel (else each panel fits its
    data); ``hline`` draws a dashed reference line (e.g. 0 for cosines).
    """
    names = list(dict.fromkeys(n for _, s in panels for n in s))
    color = {n: COLORS[i % len(COLORS)] for i, n in enumerate(names)}
    cols = max(1, min(columns, len(panels)))
    rows = max(1, math.ceil(len(panels) / cols))
    pw, ph = panel_size
    top = 30 if title else 8
    legend_h = 22 * math.ceil(len(names) / 4) + 8
    img = Image.new("RGB", (cols * pw, top + rows * ph + legend_h), "white")
    pen = ImageDraw.Draw(img)
    if title:
        pen.text((10, 8), title, fill="black")
    for i, (ptitle, series) in enumerate(panels):
        ox, oy = (i % cols) * pw, top + (i // cols) * ph
        left, right, up, down = ox + 58, ox + pw - 14, oy + 22, oy + ph - 36
        pts = [(x, y) for s in series.values() for x, y in s if y is not None and math.isfinite(y)]
        xs = [x for x, _ in pts] or [0.0, 1.0]
        x0, x1 = min(xs), max(xs) if max(xs) > min(xs) else min(xs) + 1
        if y_range is not None:
            y0, y1 = y_range
        else:
            ys = [y for _, y in pts] + ([hline] if hline is not None else []) or [0.0, 1.0]
            y0, y1 = min(ys), max(ys)
            pad = (y1 - y0) * 0.05 or 0.5
            y0, y1 = y0 - pad, y1 + pad
        sx = lambda x: left + (x - x0) / (x1 - x0) * (right - left)  # noqa: E731
        sy = lambda y: down - (y - y0) / (y1 - y0) * (down - up)  # noqa: E731
        pen.rectangle([left, up, right, down], outline=(90, 90, 90))
        pen.text((left, oy + 4), ptitle, fill="black")
        for t in _nice_ticks(y0, y1):
            pen.line([left - 4, sy(t), left, sy(t)], fill=(90, 90, 90))
            pen.line([left + 1, sy(t), right - 1, sy(t)], fill=(235, 235, 235))
            pen.text((ox + 4, sy(t) - 6), _fmt(t), fill=(60, 60, 60))
        for t in _nice_ticks(x0, x1):
            pen.line([sx(t), down, sx(t), down + 4], fill=(90, 90, 90))
            pen.text((sx(t) - 8, down + 6), _fmt(t), fill=(60, 60, 60))
        pen.text(((left + right) // 2 - 12, down + 20), xlabel, fill=(60, 60, 60))
        if ylabel:
            pen.text((left + 4, up + 2), ylabel, fill=(120, 120, 120))
        if hline is not None and y0 <= hline <= y1:
            for xa in range(int(left), int(right), 8):
                pen.line([xa, sy(hline), min(xa + 4, right), sy(hline)], fill=(0, 0, 0))
        for name, s in series.items():
            run: list[tuple[float, float]] = []
            for x, y in list(s) + [(None, None)]:
                if y is None or x is None or not math.isfinite(y):
                    if len(run) > 1:
                        pen.line(run, fill=color[name], width=2)
                    elif len(run) == 1:
                        px, py = run[0]
                        pen.ellipse([px - 2, py - 2, px + 2, py + 2], fill=color[name])
                    run = []
                else:
                    run.append((sx(x), sy(min(max(y, y0), y1))))
    ly = top + rows * ph + 6
    for j, n in enumerate(names):
        lx, lyy = 10 + (j % 4) * (cols * pw // 4), ly + 22 * (j // 4)
        pen.rectangle([lx, lyy + 4, lx + 18, lyy + 10], fill=color[n])
        pen.text((lx + 24, lyy), n, fill="black")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    img.save(path)
    return path


def strip_panels(panels: list[tuple[str, dict[str, list[float]]]], path: str | Path, ylabel: str = "",
                 hline: float | None = 0.0, columns: int = 2, panel_size: tuple[int, int] = (460, 300),
                 title: str = "") -> Path:
    """Draw ``panels`` (title, {category: [values]}) as strip charts and save a PNG at ``path``.

    Each category is a column: one dot per value (spread sideways so equal values stay visible) and a
    black bar at the mean. Categories keep their colour across panels; non-finite values are skipped.
    Made for "one dot per seed, one column per strategy".
    """
    names = list(dict.fromkeys(n for _, cats in panels for n in cats))
    color = {n: COLORS[i % len(COLORS)] for i, n in enumerate(names)}
    cols = max(1, min(columns, len(panels)))
    rows = max(1, math.ceil(len(panels) / cols))
    pw, ph = panel_size
    top = 30 if title else 8
    img = Image.new("RGB", (cols * pw, top + rows * ph), "white")
    pen = ImageDraw.Draw(img)
    if title:
        pen.text((10, 8), title, fill="black")
    for i, (ptitle, cats) in enumerate(panels):
        ox, oy = (i % cols) * pw, top + (i // cols) * ph
        left, right, up, down = ox + 58, ox + pw - 14, oy + 22, oy + ph - 36
        ys = [v for vals in cats.values() for v in vals if v is not None and math.isfinite(v)]
        ys += [hline] if hline is not None else []
        y0, y1 = (min(ys), max(ys)) if ys else (0.0, 1.0)
        pad = (y1 - y0) * 0.08 or 0.5
        y0, y1 = y0 - pad, y1 + pad
        sy = lambda y: down - (y - y0) / (y1 - y0) * (down - up)  # noqa: E731
        pen.rectangle([left, up, right, down], outline=(90, 90, 90))
        pen.text((left, oy + 4), ptitle, fill="black")
        for t in _nice_ticks(y0, y1):
            pen.line([left - 4, sy(t), left, sy(t)], fill=(90, 90, 90))
            pen.line([left + 1, sy(t), right - 1, sy(t)], fill=(235, 235, 235))
            pen.text((ox + 4, sy(t) - 6), _fmt(t), fill=(60, 60, 60))
        if ylabel:
            pen.text((left + 4, up + 2), ylabel, fill=(120, 120, 120))
        if hline is not None:
            for xa in range(int(left), int(right), 8):
                pen.line([xa, sy(hline), min(xa + 4, right), sy(hline)], fill=(0, 0, 0))
        width = (right - left) / max(1, len(cats))
        for j, (name, vals) in enumerate(cats.items()):
            cx = left + (j + 0.5) * width
            label = name if len(name) * 6 < width else name[: max(1, int(width / 6) - 1)] + "…"
            pen.text((cx - len(label) * 3, down + 8), label, fill=(60, 60, 60))
            finite = [v for v in vals if v is not None and math.isfinite(v)]
            if finite:  # the mean first, so the dots stay whole on top of it
                m = sum(finite) / len(finite)
                pen.line([cx - width * 0.3, sy(m), cx + width * 0.3, sy(m)], fill=(0, 0, 0), width=2)
            for k, v in enumerate(finite):
                dx = (k - (len(finite) - 1) / 2) * min(10.0, width * 0.5 / max(1, len(finite)))
                pen.ellipse([cx + dx - 4, sy(v) - 4, cx + dx + 4, sy(v) + 4], fill=color[name])
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    img.save(path)
    return path
