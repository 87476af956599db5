"""Study: several runs side by side — a Table-1 style table (per-reward means, composite improvement),
a Pareto scatter of any two rewards, ᾱ trajectories overlaid; CSV export (PNG: each plot's camera
button)."""

from __future__ import annotations

import math
from typing import Any

import gradio as gr
import pandas as pd

from app import context, plots
from core.evaluate import mean_pm_se, reward_spread, strategy_findings, unpoolable
from jobs.storage import RunNotFound

WINDOW = 0.1  # share of a run's steps averaged for its start and end values


def _window_mean(xs: list[int], ys: list[float | None], last: bool) -> float | None:
    pairs = [(x, y) for x, y in zip(xs, ys) if y is not None and math.isfinite(y)]
    if not pairs:
        return None
    n = max(1, int(len(pairs) * WINDOW))
    chosen = pairs[-n:] if last else pairs[:n]
    return sum(y for _, y in chosen) / len(chosen)


def study_table(run_ids: list[int]) -> tuple[pd.DataFrame, list[dict]]:
    """Per run: the mean of each reward over the last 10% of steps, its change from the first 10% in
    units of the first steps' within-batch std, and the composite (sum over rewards) — the paper's
    Table 1 on training prompts; held-out evaluations (core.evaluate) are added where stored.

    Runs of different lengths are compared at the same step: every run's series is cut at the last step of
    the shortest finished run (of the shortest run when none has finished; ``attrs["common_step"]``). A run without steps yet has no scores (blank,
    not 0); a run that has not finished is marked in the ``state`` column (``attrs["unfinished"]``)."""
    store = context.store()
    runs = []
    for rid in run_ids:
        try:
            runs.append(store.get_run(rid))
        except RunNotFound:  # deleted since the picker was filled: left out
            continue
    finished = [r.step for r in runs if r.status == "succeeded" and r.step > 0]
    common = min(finished or [r.step for r in runs if r.step > 0] or [0])  # unfinished runs do not set it
    rows, points, designs = [], [], []
    for run in runs:
        rid = run.id
        names = [r["name"] for r in run.config["rewards"]]
        series = store.metrics(rid, keys=[f"reward/{n}" for n in names] + [f"reward_std/{n}" for n in names],
                               max_points=2000).by_key()
        state = "finished" if run.status == "succeeded" else (
            "not started" if run.step == 0 else f"unfinished: {run.status} at {run.step}/{run.total_steps}")
        row: dict[str, Any] = {"run": f"#{rid} {run.name or ''}".strip(), "strategy": run.strategy,
                               "seed": run.config.get("seed"), "state": state, "steps": min(run.step, common)}
        composite, scores = None, {}
        for n in names:
            xs, ys = _cut(series.get(f"reward/{n}", ([], [])), common)
            end, start = _window_mean(xs, ys, True), _window_mean(xs, ys, False)
            sx, sy = _cut(series.get(f"reward_std/{n}", ([], [])), common)
            std = _window_mean(sx, sy, False)
            row[n] = end
            scores[n] = end
            if end is not None and start is not None and std:
                delta = (end - start) / std
                row[f"Δ{n} (σ)"] = delta
                composite = (composite or 0.0) + delta
        row["composite (σ)"] = composite
        row.update(held_out_columns(store, rid))
        rows.append(row)
        points.append({"label": row["run"], "scores": scores, "balance": store.balance(rid, max_points=500)})
        if state == "finished":
            designs.append((row["run"], run.strategy, run.config))
    df = pd.DataFrame(rows)
    df.attrs["not_pooled"] = unpoolable(designs)
    df.attrs["common_step"] = common
    df.attrs["lengths"] = sorted(set(finished or [r.step for r in runs if r.step > 0]))
    df.attrs["unfinished"] = [row["run"] for row in rows if row["state"] != "finished"]
    return df, points


def held_out_columns(store: Any, run_id: int) -> dict[str, str]:
    """The run's newest held-out evaluation (jobs.evaluations): per reward the change over the base model in
    units of the base model's std, ± its standard error; then the composite over the training rewards."""
    from jobs.evaluations import latest

    ev = latest(store, run_id)
    if ev is None:
        return {}
    d = ev["details"]
    out = {"held-out at step": str(ev["checkpoint_step"]) if ev["checkpoint_step"] is not None else ""}
    for n, r in d["rewards"].items():
        if r["z"] is None:
            continue
        se = f" ± {r['z_se']:.2f}" if r.get("z_se") is not None else ""
        out[f"held-out Δ{n} (base σ)"] = f"{r['z']:+.2f}{se}"
    if d.get("composite_train") is not None:
        out["held-out composite (base σ)"] = f"{d['composite_train']:+.2f}"
    return out


def _cut(series: tuple[list[int], list[float | None]], step: int) -> tuple[list[int], list[float | None]]:
    xs, ys = series
    keep = [i for i, x in enumerate(xs) if x <= step]
    return [xs[i] for i in keep], [ys[i] for i in keep]


def study_note(df: pd.DataFrame) -> str:
    """What the table compares, said on the page: the common step, and which runs are not results yet."""
    if df.empty:
        return ""
    parts = []
    lengths, common = df.attrs.get("lengths", []), df.attrs.get("common_step", 0)
    if len(lengths) > 1:
        parts.append(f"The runs have different lengths ({', '.join(map(str, lengths))} steps): every run is "
                     f"compared at step **{common}**, the shortest finished one's last step (means of its last 10% of "
                     f"steps up to there).")
    if df.attrs.get("unfinished"):
        parts.append(f"Not finished, so not results yet and left out of the by-strategy summary: "
                     f"{', '.join(df.attrs['unfinished'])}.")
    return " ".join(parts)


def by_strategy(df: pd.DataFrame) -> pd.DataFrame:
    """One row per strategy: how many runs, and mean ± standard error over them of every improvement column
    (Δ per reward and the composite) — the uncertainty over seeds that one run per strategy cannot show, in the
    units two strategies are compared in. A strategy whose runs are not seeds of one design
    (``core.evaluate.unpoolable``: a seed picked twice, or another budget, model or reward set) gets no pooled
    numbers, only the reason; a single run's numbers are its own, without a spread."""
    not_pooled = df.attrs.get("not_pooled", {})
    if not df.empty and "state" in df:
        df = df[df["state"] == "finished"]
    if df.empty or "strategy" not in df:
        return pd.DataFrame()
    cols = [c for c in df.columns if c.startswith("Δ") or c == "composite (σ)"]
    rows = []
    for strategy, group in df.groupby("strategy", sort=False):
        row: dict[str, Any] = {"strategy": strategy, "runs": len(group)}
        if strategy in not_pooled:
            row["note"] = f"not pooled: {not_pooled[strategy]}"
        else:
            for c in cols:
                row[c] = mean_pm_se(pd.to_numeric(group[c], errors="coerce"), digits=3, empty="")
            row["note"] = "one run: no spread over seeds" if len(group) == 1 else f"{len(group)} seeds"
        rows.append(row)
    return pd.DataFrame(rows).fillna("")


def findings(df: pd.DataFrame) -> str:
    """What the finished runs' seeds support on the training prompts, by the one-standard-error rule of
    ``core.evaluate.strategy_findings``: per strategy, the rewards up, down or within one standard error of 0, and
    whose worst reward it beats. Empty until some strategy has two finished runs."""
    if df.empty or "strategy" not in df:
        return ""
    not_pooled = df.attrs.get("not_pooled", {})
    if "state" in df:
        df = df[df["state"] == "finished"]
    cols = [c for c in df.columns if c.startswith("Δ") and c.endswith(" (σ)")]
    stats = {}
    for strategy, group in df.groupby("strategy", sort=False):
        if strategy in not_pooled:
            continue
        rewards, worst = reward_spread({c[1:-4]: pd.to_numeric(group[c], errors="coerce").tolist() for c in cols})
        stats[strategy] = {"runs": len(group), "rewards": rewards, "worst": worst, "mean_alpha": {}}
    text = strategy_findings(stats)
    left_out = " ".join(f"**{s}** is left out: {why}." for s, why in not_pooled.items())
    if not text:
        return f"**What the seeds support:** nothing yet. {left_out}" if left_out else ""
    return (f"**What the seeds support** (training prompts, Δ in σ units; finished runs only). "
            f"{left_out + ' ' if left_out else ''}{text}")


EMPTY_HINT = "Pick two or more runs above (e.g. a study's strategies and seeds; New run → Start study queues them)."


def _placeholder_tables() -> tuple[pd.DataFrame, pd.DataFrame]:
    """What the two tables show while no run is picked (an empty frame renders as bare "1 2 3" headers)."""
    return pd.DataFrame({"runs": [EMPTY_HINT]}), pd.DataFrame({"strategies": ["(none picked yet)"]})


def study_csv_path(run_ids: list[int]) -> str:
    """One CSV per set of runs in the data directory's exports/ folder, rewritten by each render (a temp file per
    render piled up in the system's temp folder, one per timer tick and pick)."""
    import hashlib

    folder = context.store().home / "exports"
    folder.mkdir(exist_ok=True)
    key = ",".join(str(r) for r in sorted(set(run_ids)))
    label = key if len(key) <= 40 else hashlib.sha1(key.encode()).hexdigest()[:12]
    return str(folder / f"study_{label.replace(',', '-')}.csv")


def render(run_ids: list[int], x_reward: str | None, y_reward: str | None):
    if not run_ids:
        empty = plots.empty_figure("Study", EMPTY_HINT)
        no_table, no_summary = _placeholder_tables()
        # the axis pickers lose their value with their choices: a value left outside the (empty) choices made the
        # next pick fail in Gradio's input check ("Value: clean_background is not in the list of choices: []")
        return (no_table, no_summary, "", empty, empty, gr.update(choices=[], value=None),
                gr.update(choices=[], value=None), None, "")
    df, points = study_table([int(r) for r in run_ids])
    names = sorted({k for p in points for k in p["scores"]})
    x = x_reward if x_reward in names else (names[0] if names else None)
    y = y_reward if y_reward in names else (names[1] if len(names) > 1 else x)
    pareto = plots.pareto_scatter(points, x, y) if x else plots.empty_figure("Pareto", "No rewards.")
    overlay = plots.alpha_overlay(points, names)
    path = study_csv_path([int(r) for r in run_ids])
    df.to_csv(path, index=False)
    summary, supported = by_strategy(df), findings(df)
    if summary.empty:
        summary = pd.DataFrame({"strategies": ["(no finished run picked: the summary pools finished runs only)"]})
    return (df.round(4), summary, supported, pareto, overlay, gr.update(choices=names, value=x),
            gr.update(choices=names, value=y), path, study_note(df))


def build() -> dict:
    with gr.Row():
        runs = gr.Dropdown(choices=[], multiselect=True, label="Runs", elem_id="study-runs", scale=4)
        reload_btn = gr.Button("Reload runs", scale=1, elem_id="study-reload")
    no_table, no_summary = _placeholder_tables()
    table = gr.Dataframe(no_table,
                         label="Per-reward means (last 10% of steps) and improvement in σ units",
                         interactive=False, elem_id="study-table")
    note = gr.Markdown(elem_id="study-note")
    gr.Markdown("**σ units**: a change divided by the reward's spread (its within-batch standard deviation over the "
                "first 10% of steps; held-out columns: the base model's std over the test images), so rewards on "
                "different scales compare: +1 means the mean moved by one typical difference between two images. "
                "**composite**: the sum of those changes over the run's rewards (higher is better; one reward's "
                "large gain can hide another's loss, hence the per-reward columns).", elem_id="study-help",
                elem_classes=["help-line"])
    summary = gr.Dataframe(no_summary,
                           label="By strategy: the chosen runs of each strategy pooled (e.g. a study's seeds), "
                                 "mean ± standard error (std / √runs) of each improvement",
                           interactive=False, elem_id="study-summary")
    supported = gr.Markdown(elem_id="study-findings")
    with gr.Row():
        x_pick = gr.Dropdown(choices=[], label="Pareto x", elem_id="study-x")
        y_pick = gr.Dropdown(choices=[], label="Pareto y", elem_id="study-y")
        csv = gr.File(label="CSV export", elem_id="study-csv")
    pareto = gr.Plot(plots.empty_figure("Pareto", EMPTY_HINT), label="Pareto", elem_id="plot-pareto")
    overlay = gr.Plot(plots.empty_figure("ᾱ overlay", EMPTY_HINT), label="ᾱ overlay", elem_id="plot-overlay")
    reload_btn.click(lambda: gr.update(choices=context.run_choices()), None, runs)
    outs = [table, summary, supported, pareto, overlay, x_pick, y_pick, csv, note]
    runs.change(render, [runs, x_pick, y_pick], outs)
    x_pick.input(render, [runs, x_pick, y_pick], outs)
    y_pick.input(render, [runs, x_pick, y_pick], outs)
    return {"runs": runs}
