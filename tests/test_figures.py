"""Static figures (core/figures.py): what the matplotlib figures hold — lines, dots, means, colours, axes —
checked on the Figure objects, and that the saved PNG is a real image of the promised size."""

import math

import numpy as np
import pytest
from matplotlib.colors import to_hex
from PIL import Image

from core.figures import (COLORS, DPI, PANEL_SIZE, line_figure, line_panels, literal, strip_figure,
                          strip_panels)


def visible_axes(fig):
    return [ax for ax in fig.axes if ax.get_visible()]


def by_gid(ax, gid):
    found = [a for a in ax.get_children() if a.get_gid() == gid]
    assert len(found) <= 1, f"{gid}: {len(found)} artists"
    return found[0] if found else None


def ramp(lo, hi):
    return [(0, lo), (1, (lo + hi) / 2), (2, hi)]


def test_line_figure_gives_each_series_one_colour_in_every_panel_and_one_legend_entry():
    panels = [("first", {"a": ramp(0.1, 0.2), "b": ramp(0.5, 0.6)}),
              ("second", {"b": ramp(0.3, 0.4), "c": ramp(0.9, 0.8)}),
              ("third", {"c": ramp(0.0, 0.1), "a": ramp(0.7, 0.7)})]
    fig = line_figure(panels, ylabel="alpha", columns=2)
    axes = visible_axes(fig)
    assert [ax.get_title() for ax in axes] == ["first", "second", "third"]  # 2 columns: the 4th cell hidden
    assert len(fig.axes) == 4
    colour = {}
    for ax, (_, series) in zip(axes, panels):
        for name, points in series.items():
            line = by_gid(ax, f"line:{name}")
            np.testing.assert_allclose(line.get_ydata(), [y for _, y in points])
            assert colour.setdefault(name, to_hex(line.get_color())) == to_hex(line.get_color()), name
    assert colour == {"a": COLORS[0], "b": COLORS[1], "c": COLORS[2]}  # first appearance order, distinct
    (legend,) = fig.legends
    assert [t.get_text() for t in legend.get_texts()] == ["a", "b", "c"]
    assert [to_hex(h.get_color()) for h in legend.legend_handles] == [COLORS[0], COLORS[1], COLORS[2]]
    assert [ax.get_ylabel() for ax in axes] == ["alpha", "", "alpha"]  # the left column
    assert [ax.get_xlabel() for ax in axes] == ["", "step", "step"]  # the bottom of each column


def test_line_figure_fixes_the_y_range_only_when_asked():
    panels = [("p", {"a": [(0, 0.2), (1, 0.4)]}), ("q", {"a": [(0, 5.0), (1, 7.0)]})]
    for ax in visible_axes(line_figure(panels, y_range=(-1.0, 1.0))):
        assert ax.get_ylim() == (-1.0, 1.0)
    fitted = [ax.get_ylim() for ax in visible_axes(line_figure(panels))]
    assert fitted[0][0] <= 0.2 and 0.4 <= fitted[0][1] < 1.0  # each panel fits its own data
    assert 4.0 < fitted[1][0] <= 5.0 and fitted[1][1] >= 7.0


def test_a_missing_or_nan_point_breaks_the_line_and_a_lone_point_stays_visible():
    points = [(0, 1.0), (1, None), (2, 3.0), (3, float("nan")), (4, 5.0), (5, 6.0), (None, 7.0), (7, math.inf)]
    ax = visible_axes(line_figure([("p", {"a": points})]))[0]
    line = by_gid(ax, "line:a")
    y = np.asarray(line.get_ydata(), dtype=float)
    np.testing.assert_array_equal(np.isnan(y), [False, True, False, True, False, False, True, True])
    np.testing.assert_allclose(y[[0, 2, 4, 5]], [1.0, 3.0, 5.0, 6.0])
    # 1 and 3 have no finite neighbour: a line would not draw them, so they are also dots; 5-6 is a segment
    dots = by_gid(ax, "dots:a")
    np.testing.assert_allclose(dots.get_xdata(), [0, 2])
    np.testing.assert_allclose(dots.get_ydata(), [1.0, 3.0])
    assert to_hex(dots.get_color()) == to_hex(line.get_color())
    assert by_gid(visible_axes(line_figure([("p", {"a": ramp(0, 1)})]))[0], "dots:a") is None


def test_line_figure_draws_the_dashed_reference_line_when_asked():
    ax = visible_axes(line_figure([("p", {"a": ramp(0.2, 0.5)})], hline=0.0))[0]
    ref = by_gid(ax, "hline")
    assert ref.get_linestyle() == "--" and list(ref.get_ydata()) == [0.0, 0.0]
    assert ax.get_ylim()[0] <= 0.0  # a fitted axis keeps the reference line in view
    assert by_gid(visible_axes(line_figure([("p", {"a": ramp(0.2, 0.5)})]))[0], "hline") is None


def test_strip_figure_puts_one_dot_per_value_in_its_column_and_a_bar_at_the_mean():
    panels = [("p", {"a": [1.0], "b": [-1.0, 0.5, None, float("nan")], "c": [0.3, 0.3, 0.3]}),
              ("q", {"c": [0.0], "a": [0.2, 0.4, 0.9]})]
    fig = strip_figure(panels, ylabel="z")
    p, q = visible_axes(fig)
    assert [t.get_text() for t in p.get_xticklabels()] == ["a", "b", "c"]
    assert [t.get_text() for t in q.get_xticklabels()] == ["c", "a"]
    assert all(t.get_rotation() == 0 for t in p.get_xticklabels())  # short labels stay level

    a = by_gid(p, "dots:a").get_offsets()
    b = by_gid(p, "dots:b").get_offsets()
    c = by_gid(p, "dots:c").get_offsets()
    np.testing.assert_allclose(a, [[0.0, 1.0]])
    np.testing.assert_allclose(b[:, 1], [-1.0, 0.5])  # None and NaN skipped
    assert np.all(np.abs(b[:, 0] - 1) < 0.3) and np.all(np.abs(c[:, 0] - 2) < 0.3)  # within their column
    assert len(set(c[:, 0])) == 3  # equal values are spread sideways, all three visible

    (bar,) = by_gid(p, "mean:b").get_segments()
    np.testing.assert_allclose(bar[:, 1], [-0.25, -0.25])
    assert bar[0, 0] < 1 < bar[1, 0]
    (sem,) = by_gid(p, "sem:b").get_segments()  # ± standard error: std 1.0607 (ddof 1) / sqrt(2) = 0.75
    np.testing.assert_allclose(sorted(sem[:, 1]), [-1.0, 0.5])
    np.testing.assert_allclose(sem[:, 0], [1.0, 1.0])
    assert by_gid(p, "sem:a") is None  # one value: no spread to show
    (qbar,) = by_gid(q, "mean:a").get_segments()
    np.testing.assert_allclose(qbar[:, 1], [0.5, 0.5])  # the mean, not the median (0.4)
    assert by_gid(p, "hline").get_ydata() == [0.0, 0.0]

    # a category keeps its colour in every panel, whatever its column there
    face = lambda ax, n: to_hex(by_gid(ax, f"dots:{n}").get_facecolor()[0])  # noqa: E731
    assert face(p, "a") == face(q, "a") == COLORS[0] and face(p, "c") == face(q, "c") == COLORS[2]
    assert face(p, "b") == COLORS[1]


def test_the_png_is_written_at_the_promised_size(tmp_path):
    panels = [("p", {"a": ramp(0, 1)}), ("q", {"b": ramp(1, 0)}), ("r", {"a": ramp(0.5, 0.5)})]
    path = line_panels(panels, tmp_path / "deep" / "lines.png", y_range=(0, 1), title="three panels")
    with Image.open(path) as img:
        assert img.format == "PNG" and img.size[0] == round(2 * PANEL_SIZE[0] * DPI)
        assert img.size[1] > round(2 * PANEL_SIZE[1] * DPI)  # two rows, plus title and legend
        pixels = np.asarray(img.convert("RGB"))
    tab_blue = np.array([int(COLORS[0][i:i + 2], 16) for i in (1, 3, 5)])
    assert (np.abs(pixels.astype(int) - tab_blue).sum(axis=2) < 10).sum() > 100  # series a is drawn
    path = strip_panels([("p", {"a": [0.1, 0.2]})], tmp_path / "strip.png", panel_size=(3.0, 2.0))
    with Image.open(path) as img:
        assert img.size == (round(3.0 * DPI), round(2.0 * DPI))


def test_names_from_users_are_shown_literally_not_as_mathtext(tmp_path):
    name = "cost $1 vs $2_a"  # two dollars: matplotlib would parse "$1 vs $" as mathtext
    fig = line_figure([(literal(name), {name: ramp(0, 1)})], title=r"$\alpha_k$ per step")
    (legend,) = fig.legends
    assert legend.get_texts()[0].get_text() == literal(name) == r"cost \$1 vs \$2_a"
    line_panels([(literal(name), {name: ramp(0, 1)})], tmp_path / "names.png")  # renders without error
    strip_panels([("p", {name: [1.0]})], tmp_path / "names_strip.png")


@pytest.mark.parametrize("kwargs, message", [
    ({"panels": []}, r"panels=\[\]: a figure needs at least one"),
    ({"panel_size": (760, 360)},
     r"panel_size=\(760, 360\): must be \(width, height\) in inches, each between 1 and 20"),
    ({"columns": 0}, r"columns=0: must be at least 1"),
    ({"y_range": (1.0, 0.0)}, r"y_range=\(1.0, 0.0\): must be \(low, high\) with finite low < high"),
])
def test_bad_arguments_are_refused_by_name(kwargs, message):
    kwargs = {"panels": [("p", {"a": ramp(0, 1)})], **kwargs}
    with pytest.raises(ValueError, match=message):
        line_figure(**kwargs)
    if "y_range" not in kwargs:
        with pytest.raises(ValueError, match=message):
            strip_figure(**{**kwargs, "panels": [("p", {"a": [1.0]})] if kwargs["panels"] else []})


def test_strip_figure_slants_category_labels_only_where_they_would_touch():
    """The object study's five strategy names in a two-column grid: "sequential" and "weighted_sum" ran into each
    other; slanted, no two laid-out labels overlap."""
    names = ["equal", "marble_full", "marble", "sequential", "weighted_sum"]
    fig = strip_figure([("wide names", {n: [0.1, 0.2] for n in names}), ("short", {"a": [1.0], "b": [2.0]})])
    crowded, roomy = visible_axes(fig)
    assert all(t.get_rotation() == 25 and t.get_horizontalalignment() == "right" for t in crowded.get_xticklabels())
    assert all(t.get_rotation() == 0 for t in roomy.get_xticklabels())
    fig.draw_without_rendering()
    renderer = fig.canvas.get_renderer()
    boxes = [t.get_window_extent(renderer) for t in crowded.get_xticklabels()]
    assert all(a.x0 < b.x0 for a, b in zip(boxes, boxes[1:]))  # still in order, left to right
