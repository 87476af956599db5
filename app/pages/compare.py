"""Compare: checkpoints of any runs (and base models) side by side on prompts with fixed seeds, generated
by a job of the worker's queue (jobs.compare: a slot, Cancel, interrupted after a crash, the runs' status words);
per-image reward scores; an A/B image slider; saved grids can be reopened."""

from __future__ import annotations

import json
import math
from typing import Any

import gradio as gr

from app import context


EMPTY = ("Pick two or more checkpoints or base models (“Reload checkpoints” lists new ones), write prompts and "
         "seeds, and press “Generate side by side”: the grid is made in the background, every image scored by "
         "the runs' rewards. Earlier grids reopen from “Saved comparisons”.")


def entry_choices() -> list[tuple[str, str]]:
    """("#3 marble · step 200", json entry) for every checkpoint, plus each run model's base model."""
    store = context.store()
    choices, bases = [], {}
    for run in store.list_runs(kind="train"):  # evaluate and compare jobs have no checkpoints of their own
        detail = store.get_run(run.id)
        cfg = detail.config
        common = {"model": cfg["model"]["name"], "resolution": cfg["sampling"]["resolution"],
                  "max_sequence_length": cfg["sampling"]["max_sequence_length"], "rewards": cfg["rewards"]}
        bases.setdefault(common["model"], {**common, "label": f"base {common['model']}", "lora": None,
                                           "run_id": None})
        for ck in store.checkpoints(run.id):
            if ck["exists"]:
                label = f"#{run.id} {run.name or run.strategy} · step {ck['step']}"
                entry = {**common, "label": label, "lora": ck["path"], "run_id": run.id}
                choices.append((label, json.dumps(entry)))
    return [(b["label"], json.dumps(b)) for b in bases.values()] + choices


def saved_choices() -> list[tuple[str, int]]:
    from jobs.compare import status_of

    store = context.store()
    # "comparison N:" and not "#N": a default name starts with a run's "#id", which read as "#1 #1 newuser tiny"
    return [(f"comparison {c['id']}: {c['name']} · {status_of(store, c)[0]}", c["id"])
            for c in reversed(store.comparisons())]


def start(name: str, picked: list[str], prompts_text: str, seeds_text: str, steps: float,
          guidance: float) -> tuple[str, Any]:
    from jobs.compare import start_comparison
    from jobs.runner import ensure_worker

    try:
        seeds = [int(s) for s in seeds_text.replace(",", " ").split()]
    except ValueError:
        return f"**Not started.** `seeds={seeds_text!r}: write integers separated by commas, e.g. 0, 1`", gr.skip()
    prompts = [p.strip() for p in (prompts_text or "").splitlines() if p.strip()]
    entries = [json.loads(p) for p in picked or []]
    default = " vs ".join(e.get("label", "?") for e in entries)
    default = default if len(default) <= 200 else default[:197] + "..."
    try:
        cid = start_comparison(context.store(), (name or "").strip() or default, entries, prompts, seeds,
                               steps, guidance)
    except ValueError as e:
        return f"**Not started.** `{e}`", gr.skip()
    ensure_worker(context.store())
    return (f"Comparison **#{cid}** queued: the worker generates it (Cancel stops it).",
            gr.update(choices=saved_choices(), value=cid))


def cancel(comparison_id: Any) -> str:
    """Cancel's click: stop the shown comparison's job (queued: at once; running: after the entry it generates)."""
    from jobs.compare import cancel_comparison

    if comparison_id is None:
        return "Pick a saved comparison first."
    try:
        status = cancel_comparison(context.store(), int(comparison_id))
    except (ValueError, LookupError) as e:
        return f"**Not cancelled.** `{e}`"
    return (f"Comparison #{comparison_id} cancelled before it started." if status == "cancelled" else
            f"Comparison #{comparison_id}: stop requested; it stops after the column it is generating.")


def _columns(cells: list[dict] | None, a: Any, b: Any) -> tuple[Any, Any]:
    """The A and B column pickers: each column by its number and checkpoint label, the values kept where the grid
    has them (else the first two columns)."""
    if not cells:
        return gr.update(choices=[], value=None), gr.update(choices=[], value=None)
    choices = [(f"{i + 1}. {c['label']}", i) for i, c in enumerate(cells)]
    last = len(cells) - 1

    def keep(v: Any, default: int) -> int:
        return v if isinstance(v, int) and 0 <= v <= last else min(default, last)

    return gr.update(choices=choices, value=keep(a, 0)), gr.update(choices=choices, value=keep(b, 1))


def grid(comparison_id: Any, a: int | None = 0, b: int | None = 1) -> tuple[Any, ...]:
    """(status markdown, gallery items row-major, row labels, A/B row dropdown update, A/B slider pair, A column
    picker update, B column picker update).
    The slider is filled here for the first row, not by the row dropdown's change event: two comparisons
    with the same first prompt and seed have the same row label, so the dropdown's value would not change
    and the slider would keep the previous comparison's images."""
    if comparison_id is None:
        return EMPTY, "", [], gr.update(choices=[], value=None), None, *_columns(None, a, b)
    from jobs.compare import status_of

    store = context.store()
    row = store.get_comparison(int(comparison_id))
    result = row.get("result") or {}
    status, error, job = status_of(store, row)
    if status in ("failed", "interrupted"):
        last = (error or "").strip().splitlines()[:1]
        return (f"**{status.capitalize()}:** `` {last[0] if last else 'no reason recorded'} ``"
                + (f" (job #{job.id}'s log on the Runs page)" if job is not None else ""), "", [],
                gr.update(choices=[], value=None), None, *_columns(None, a, b))
    if status != "succeeded" or not result.get("rows"):
        progress = f" ({job.step}/{job.total_steps} columns)" if job is not None and status == "running" else ""
        after = ("Resume it on the Runs page to generate it." if status == "cancelled" else
                 "the grid appears when it is done.")
        return (f"Comparison #{row['id']} is **{status}**{progress} — {after}", "", [],
                gr.update(choices=[], value=None), None, *_columns(None, a, b))
    labels = [f"{i + 1}: {r['prompt']} (seed {r['seed']})" for i, r in enumerate(result["rows"])]  # from 1, as columns
    n = len(result["rows"][0]["cells"]) if result["rows"] else 1
    md = (f"Comparison #{row['id']} **{row['name']}**: {len(result['rows'])} prompt×seed rows × {n} columns "
          f"({result.get('seconds', 0):.1f} s). Columns: "
          + ", ".join(c["label"] for c in result["rows"][0]["cells"]))
    first = labels[0] if labels else None
    col_a, col_b = _columns(result["rows"][0]["cells"], a, b)
    return (md, grid_html(result["rows"]), labels, gr.update(choices=labels, value=first),
            slider_pair(comparison_id, first, col_a["value"], col_b["value"]), col_a, col_b)


IMAGE_PX = 128  # images are drawn at most this wide (2x a 64 px image, pixels kept sharp), never stretched


def grid_html(rows: list[dict]) -> str:
    """The grid as a table: a header row naming each column's checkpoint, one row per prompt and seed, each
    image at its own size (up to IMAGE_PX) with every reward's full name and score written under it."""
    from html import escape
    from urllib.parse import quote

    if not rows:
        return "<p>No rows.</p>"
    head = "".join(f"<th>{escape(c['label'])}</th>" for c in rows[0]["cells"])
    body = []
    for r in rows:
        cells = []
        for c in r["cells"]:
            scores = "".join(f"<tr><td>{escape(k)}</td><td>{v:.3f}</td></tr>" for k, v in c["scores"].items()
                             if isinstance(v, (int, float)) and math.isfinite(v))
            cells.append(f"<td><img src='gradio_api/file={quote(c['path'])}' alt='{escape(c['label'])}' "
                         f"style='max-width:{IMAGE_PX}px'><table class='cmp-scores'>{scores}</table></td>")
        body.append(f"<tr><th class='cmp-row'>{escape(r['prompt'])}<br><small>seed {r['seed']}</small></th>"
                    + "".join(cells) + "</tr>")
    return (f"<table class='cmp-grid'><thead><tr><th>prompt · seed</th>{head}</tr></thead>"
            f"<tbody>{''.join(body)}</tbody></table>")


def slider_pair(comparison_id: Any, row_label: str | None, a: int | None, b: int | None) -> Any:
    """The A and B columns' images of one row (columns past the last are clamped to it)."""
    if comparison_id is None or not row_label:
        return None
    result = context.store().get_comparison(int(comparison_id)).get("result") or {}
    if not result.get("rows"):
        return None
    cells = result["rows"][int(row_label.split(":", 1)[0]) - 1]["cells"]
    a, b = min(int(a or 0), len(cells) - 1), min(int(b or 0), len(cells) - 1)
    return (cells[a]["path"], cells[b]["path"])


def poll(comparison_id: Any, shown: Any, a: int | None, b: int | None) -> tuple[Any, ...]:
    """A timer tick on the shown comparison: (status, gallery, shown, row dropdown, slider, A and B column
    pickers, saved list). It
    re-sends the grid only when what it shows changed (queued -> running -> done or failed); ``shown`` is
    the rows once done, else the status line."""
    skip = gr.skip()
    if comparison_id is None:
        return skip, skip, shown, skip, skip, skip, skip, skip
    md, items, labels, rows, pair, col_a, col_b = grid(comparison_id, a, b)
    key = labels or md
    if key == shown:
        return skip, skip, shown, skip, skip, skip, skip, skip
    finished = bool(labels) or md.startswith(("**Failed", "**Interrupted")) or "is **cancelled**" in md
    return md, items, key, rows, pair, col_a, col_b, gr.update(choices=saved_choices()) if finished else skip


def build(timer: gr.Timer) -> dict:
    with gr.Row():
        with gr.Column(scale=2):
            picked = gr.Dropdown(choices=[], multiselect=True, label="Checkpoints and base models (two or more)",
                                 elem_id="compare-entries")
            refresh = gr.Button("Reload checkpoints", elem_id="compare-reload")
            prompts = gr.Textbox(label="Prompts (one per line)", lines=4, value="a red circle\na blue square",
                                 elem_id="compare-prompts")
        with gr.Column(scale=1):
            name = gr.Textbox(label="Name (optional)", value="", placeholder="default: the columns, e.g. "
                              "#3 marble · step 100 vs base mini-world", elem_id="compare-name")
            seeds = gr.Textbox(label="Seeds", value="0, 1", elem_id="compare-seeds")
            steps = gr.Number(label="Denoising steps", value=10)
            guidance = gr.Number(label="Guidance scale", value=1.0)
            go_btn = gr.Button("Generate side by side", variant="primary", elem_id="compare-start")
            cancel_btn = gr.Button("Cancel", variant="stop", elem_id="compare-cancel")
    status = gr.Markdown(EMPTY, elem_id="compare-status")
    message = gr.Markdown("", elem_id="compare-message")
    saved = gr.Dropdown(choices=[], label="Saved comparisons", elem_id="compare-saved")
    gallery = gr.HTML(label="Grid (one row per prompt and seed, one column per checkpoint)",
                      elem_id="compare-gallery")
    with gr.Row():
        row_pick = gr.Dropdown(choices=[], label="A/B row", elem_id="compare-row")
        a_idx = gr.Dropdown(choices=[], label="A: left of the slider (a column of the grid)", elem_id="compare-a")
        b_idx = gr.Dropdown(choices=[], label="B: right of the slider", elem_id="compare-b")
    slider = gr.ImageSlider(label="A/B", elem_id="compare-slider")
    done = gr.State(None)

    refresh.click(lambda: (gr.update(choices=entry_choices()), gr.update(choices=saved_choices())), None,
                  [picked, saved])
    go_btn.click(start, [name, picked, prompts, seeds, steps, guidance], [status, saved])
    cancel_btn.click(cancel, saved, message)
    outs = [status, gallery, done, row_pick, slider, a_idx, b_idx]
    saved.change(grid, [saved, a_idx, b_idx], outs)

    timer.tick(poll, [saved, done, a_idx, b_idx], [*outs, saved], show_progress="hidden")
    # the user's choices only: a newly shown comparison fills the slider itself (grid)
    row_pick.input(slider_pair, [saved, row_pick, a_idx, b_idx], slider)
    for comp in (a_idx, b_idx):
        comp.input(slider_pair, [saved, row_pick, a_idx, b_idx], slider)
    return {"entries": picked, "refresh": refresh, "saved": saved}
