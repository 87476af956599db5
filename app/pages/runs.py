"""Runs: the list with status, progress, ETA, strategy and headline rewards; cancel / resume / delete /
duplicate-with-changes; the job's log."""

from __future__ import annotations

import math
import time
from typing import Any

import gradio as gr
import pandas as pd

from app import context
from app.forms import FormField, config_form_values

COLUMNS = ["id", "name", "status", "progress", "ETA", "strategy", "rewards (latest mean)", "created"]


def runs_table() -> pd.DataFrame:
    rows = []
    for r in context.store().list_runs():
        rewards = ", ".join(f"{k} {v:.3g}" for k, v in (r.headline or {}).items()
                            if isinstance(v, (int, float)) and math.isfinite(v))
        rows.append([r.id, r.name or "", r.status, f"{r.step}/{r.total_steps} ({100 * r.progress:.0f}%)",
                     context.fmt_seconds(r.eta_seconds) if r.status == "running" else "", r.strategy, rewards,
                     time.strftime("%m-%d %H:%M", time.localtime(r.created_at))])
    return pd.DataFrame(rows, columns=COLUMNS)


def act(action: str, run_id: Any) -> str:
    """Cancel / resume / delete; returns a message naming what happened or why not."""
    from jobs import runner
    from jobs.storage import RunNotFound, TransitionError

    if run_id is None:
        return "Pick a run first."
    store = context.store()
    rid = int(run_id)
    try:
        if action == "cancel":
            status = runner.cancel(store, rid, wait=False)
            return f"Run #{rid}: cancel requested (now {status}); it stops at the next micro-batch."
        if action == "resume":
            runner.resume(store, rid)
            runner.ensure_worker(store)
            return f"Run #{rid} queued again; it continues from its last checkpoint."
        if action == "delete":
            store.delete_run(rid)
            return f"Run #{rid} deleted with its folder."
    except (TransitionError, RunNotFound, ValueError) as e:
        return f"Run #{rid}: {e}"
    return f"unknown action {action!r}"


def duplicate_values(run_id: Any, fields: list[FormField]) -> list[Any]:
    """A run's preset, a name for the copy, and its config as New-run form values."""
    from core.config import TrainConfig

    run = context.store().get_run(int(run_id))
    return [run.preset, f"{run.name or 'run ' + str(run.id)} (copy)",
            *config_form_values(TrainConfig.from_dict(run.config), fields)]


def build(timer: gr.Timer, new_run: dict, tabs: gr.Tabs, new_tab_id: str) -> dict:
    last = gr.State("")
    table = gr.Dataframe(value=None, headers=COLUMNS, interactive=False, elem_id="runs-table", wrap=True)
    with gr.Row():
        pick = gr.Dropdown(choices=[], label="Run", elem_id="runs-pick", scale=3)
        cancel_btn = gr.Button("Cancel", elem_id="run-cancel", variant="stop", scale=1)
        resume_btn = gr.Button("Resume", elem_id="run-resume", scale=1)
        dup_btn = gr.Button("Duplicate with changes", elem_id="run-duplicate", scale=1)
        delete_btn = gr.Button("Delete", elem_id="run-delete", scale=1)
    message = gr.Markdown(elem_id="runs-message")
    log = gr.Textbox(label="Job log (last 60 lines)", lines=12, max_lines=12, interactive=False, elem_id="run-log")

    def on_tick(previous, run_id):
        df = runs_table()
        key = df.to_json()
        choices = context.run_choices()
        log_text = context.store().log_tail(int(run_id), 60) if run_id is not None else gr.skip()
        if key == previous:
            return previous, gr.skip(), gr.skip(), log_text
        empty = df.empty
        return (key, df if not empty else pd.DataFrame([["", "No runs yet: start one in New run.", *[""] * 6]],
                                                       columns=COLUMNS),
                gr.update(choices=choices), log_text)

    timer.tick(on_tick, [last, pick], [last, table, pick, log], show_progress="hidden")
    for btn, action in ((cancel_btn, "cancel"), (resume_btn, "resume"), (delete_btn, "delete")):
        btn.click(lambda r, a=action: act(a, r), pick, message)
    dup_outputs = [new_run["preset"], new_run["name"], *new_run["widgets"], *new_run["extras"]]
    dup_btn.click(lambda r: duplicate_values(r, new_run["fields"]) if r is not None else [gr.skip()] * len(
        dup_outputs), pick, dup_outputs).then(lambda: gr.Tabs(selected=new_tab_id), None, tabs)
    pick.change(lambda r: context.store().log_tail(int(r), 60) if r is not None else "", pick, log)
    return {"pick": pick}
