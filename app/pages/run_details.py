"""The Runs page's panel about one run: its config, the diff of its config with another run's (only the fields
that differ, as dotted paths, both values), and its tags and notes (editable, stored with the run)."""

from __future__ import annotations

import json
from typing import Any

import gradio as gr
import pandas as pd

from app import context
from jobs.storage import RunNotFound

ABSENT = "(absent)"  # a field one config has and the other does not (a run from before the field existed)


def flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    """A nested config as {dotted path: leaf}: dicts by key (``balance.ema_rho``), lists by index
    (``rewards[1].name``); an empty dict or list is a leaf of its own."""
    if isinstance(value, dict) and value:
        out: dict[str, Any] = {}
        for k, v in value.items():
            out.update(flatten(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    if isinstance(value, list) and value:
        out = {}
        for i, v in enumerate(value):
            out.update(flatten(v, f"{prefix}[{i}]"))
        return out
    return {prefix: value}


def config_diff(a: dict, b: dict) -> list[tuple[str, Any, Any]]:
    """(dotted path, value in a, value in b) for every leaf that differs, in a's field order then b's extra
    fields; a field only one side has shows ABSENT on the other."""
    fa, fb = flatten(a), flatten(b)
    paths = list(fa) + [p for p in fb if p not in fa]
    return [(p, fa.get(p, ABSENT), fb.get(p, ABSENT)) for p in paths
            if p not in fa or p not in fb or fa[p] != fb[p]]


def _label(run: Any) -> str:
    return f"#{run.id} {run.name or run.strategy}"


def _cell(v: Any) -> str:
    return v if v == ABSENT else json.dumps(v)


def diff_table(run_a: Any, run_b: Any) -> tuple[pd.DataFrame, str]:
    """The diff of two runs' configs as a table (field, run a's value, run b's value) and a one-line summary."""
    if run_a is None or run_b is None:
        return pd.DataFrame({"field": []}), "Pick a run above and another run to diff its config with."
    store = context.store()
    try:
        a, b = store.get_run(int(run_a)), store.get_run(int(run_b))
    except RunNotFound as e:
        return pd.DataFrame({"field": []}), f"{e}: pick another run."
    for job in (a, b):  # an evaluate or compare job's "config" is its request, not a training config
        if job.kind != "train":
            return pd.DataFrame({"field": []}), (f"{context.a_job_of_its_kind(job)}: configs are diffed between "
                                                 f"training runs; pick one above.")
    rows = config_diff(a.config, b.config)
    if int(run_a) == int(run_b):
        return pd.DataFrame({"field": []}), f"{_label(a)} is picked on both sides: pick another run to diff with."
    la, lb = _label(a), _label(b)
    if la == lb:
        lb += " (other)"
    df = pd.DataFrame([[p, _cell(x), _cell(y)] for p, x, y in rows], columns=["field", la, lb])
    same = len(flatten(a.config)) - sum(1 for _, x, _ in rows if x != ABSENT)
    summary = (f"{len(rows)} {'fields differ' if len(rows) != 1 else 'field differs'}, {same} are the same." if rows
               else f"The two configs are identical ({same} fields).")
    return df, summary


def config_text(run_id: Any) -> str:
    if run_id is None:
        return ""
    try:
        return json.dumps(context.store().get_run(int(run_id)).config, indent=2)
    except RunNotFound:
        return ""


def parse_tags(text: str | None) -> list[str]:
    """'baseline, lr sweep' -> ['baseline', 'lr sweep'] (a comma separates tags; blanks are dropped)."""
    return [t.strip() for t in (text or "").split(",") if t.strip()]


def annotations(run_id: Any) -> tuple[str, str]:
    """(tags as 'a, b', notes) of a run for the two boxes; blank for none or a run that is gone."""
    if run_id is None:
        return "", ""
    try:
        run = context.store().get_run(int(run_id))
    except RunNotFound:
        return "", ""
    return ", ".join(run.tags), run.notes or ""


def save_annotations(run_id: Any, tags_text: str, notes: str) -> str:
    """Save's click: the message says what was stored, or which value broke which rule (nothing stored)."""
    if run_id is None:
        return "Pick a run first."
    rid = int(run_id)
    try:
        context.store().set_annotations(rid, parse_tags(tags_text), notes)
    except (ValueError, RunNotFound) as e:
        return f"Run #{rid}: not saved: {e}"
    run = context.store().get_run(rid)
    tags = ", ".join(run.tags) or "no tags"
    return f"Run #{rid}: saved ({tags}; notes {len(run.notes or '')} characters)."


def editing_note(run_id: Any) -> str:
    """The line under the boxes once a run is picked: whose tags and notes they show (Save stores them there)."""
    if run_id is None:
        return ""
    try:
        run = context.store().get_run(int(run_id))
    except RunNotFound:
        return ""
    return f"Showing the tags and notes of {_label(run)}; edit them and press Save to store them with the run."


def all_tags() -> list[str]:
    """Every tag in use, sorted (the Runs page's filter choices)."""
    return sorted({t for r in context.store().list_runs() for t in r.tags})


def build(pick: gr.Dropdown) -> dict:
    """The panel under the Runs page's actions; ``pick`` is the page's run picker."""
    with gr.Accordion("Tags, notes and config", open=True, elem_id="run-details"):
        with gr.Row():
            tags = gr.Textbox(label="Tags (comma-separated)", placeholder="baseline, lr sweep", elem_id="run-tags",
                              scale=2)
            notes = gr.Textbox(label="Notes", lines=2, elem_id="run-notes", scale=4)
            save = gr.Button("Save tags and notes", elem_id="run-annotate", scale=1)
        saved = gr.Markdown(elem_id="run-annotate-message")
        with gr.Row():
            other = gr.Dropdown(choices=[], label="Diff this run's config with", elem_id="run-diff-with", scale=3)
            diff_note = gr.Markdown("Pick a run above and another run to diff its config with.",
                                    elem_id="run-diff-note")
        diff = gr.Dataframe(pd.DataFrame({"field": []}), label="Config fields that differ (dotted path, both values)",
                            interactive=False, wrap=True, elem_id="run-diff")
        with gr.Accordion("Config of the picked run", open=False):
            config = gr.Code(language="json", label="config", elem_id="run-config", interactive=False)

    def on_pick(run_id, other_id):
        t, n = annotations(run_id)
        table, note = diff_table(run_id, other_id)
        return (t, n, editing_note(run_id), config_text(run_id), gr.update(choices=context.run_choices()), table,
                note)

    pick.change(on_pick, [pick, other], [tags, notes, saved, config, other, diff, diff_note])
    other.change(diff_table, [pick, other], [diff, diff_note])
    save.click(save_annotations, [pick, tags, notes], saved)
    return {"saved": save}
