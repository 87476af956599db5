"""Runs: the list with status, progress, ETA, strategy and headline rewards; cancel / resume / delete /
duplicate-with-changes; the job's log."""

from __future__ import annotations

import math
import time
from typing import Any

import gradio as gr
import pandas as pd

from app import context
from app.pages import evaluate, run_details
from app.forms import FormField, config_form_values
from jobs import schema as s
from jobs.storage import RunNotFound, TransitionError

# A newly picked run's log opens at its newest line (the textbox's own autoscroll follows only later changes).
SCROLL_LOG_TO_END = "() => { const t = document.querySelector('#run-log textarea'); if (t) t.scrollTop = t.scrollHeight; }"
ALL_TAGS = "(all runs)"
COLUMNS = ["id", "name", "status", "progress", "ETA", "duration", "strategy", "rewards (latest mean)", "tags",
           "created"]


def duration(r: Any, now: float | None = None) -> str:
    """Wall time of the run's latest attempt: start to end, or to now while it runs; blank before it starts."""
    if r.started_at is None or r.status == "queued":
        return ""
    end = r.finished_at if r.finished_at is not None and r.status != "running" else (now or time.time())
    text = context.fmt_seconds(max(0.0, end - r.started_at))
    return text + (f" (attempt {r.attempt})" if r.attempt > 1 else "")


def runs_table(tag: str | None = None) -> pd.DataFrame:
    """Every run, newest first; only those tagged ``tag`` when one is given."""
    rows, now = [], time.time()
    for r in context.store().list_runs():
        if tag and tag not in r.tags:
            continue
        rewards = ", ".join(f"{k} {v:.3g}" for k, v in (r.headline or {}).items()
                            if isinstance(v, (int, float)) and math.isfinite(v))
        rows.append([r.id, r.name or "", r.status, f"{r.step}/{r.total_steps} ({100 * r.progress:.0f}%)",
                     context.fmt_seconds(r.eta_seconds) if r.status == "running" else "", duration(r, now),
                     r.strategy if r.kind == "train" else r.kind, rewards, ", ".join(r.tags),
                     time.strftime("%m-%d %H:%M", time.localtime(r.created_at))])
    return pd.DataFrame(rows, columns=COLUMNS)


def act(action: str, run_id: Any, steps: float | None = None) -> str:
    """Cancel / resume / delete; returns a message naming what happened or why not. ``steps`` (resume
    only) extends the run to that many steps; 0 or blank resumes to the configured count."""
    from jobs import runner

    if run_id is None:
        return "Pick a run first."
    store = context.store()
    rid = int(run_id)
    try:
        if action == "cancel":
            before = store.status(rid)
            if before not in ("queued", "running"):
                return f"Run #{rid} already {before}: there is nothing to cancel."
            status = runner.cancel(store, rid, wait=False)
            if status == "cancelled":
                return f"Run #{rid} cancelled before it started."
            if status == "running" and store.get_run(rid).kind != "train":  # an evaluation or a comparison
                return (f"Job #{rid}: stop requested. It stops after the model or column it is working on and then "
                        f"shows as cancelled (Resume runs it again).")
            if status == "running":
                return (f"Run #{rid}: stop requested. It saves a checkpoint at the next micro-batch and then shows "
                        f"as cancelled (Resume continues it).")
            return f"Run #{rid} already {status}: there is nothing to cancel."
        if action == "resume":
            if steps is not None and steps != int(steps):
                return f"Run #{rid}: steps={steps}: write a whole number of steps"
            target = int(steps) if steps else None  # 0 (the box's resting value) or blank: as configured
            runner.resume(store, rid, steps=target)
            runner.ensure_worker(store)
            to = "" if target is None else f" up to step {target}"
            return f"Run #{rid} queued again; it continues from its last checkpoint{to}."
        if action == "delete":
            store.delete_run(rid)
            return f"Run #{rid} deleted with its folder."
    except (TransitionError, RunNotFound, ValueError) as e:
        return f"Run #{rid}: {e}"
    return f"unknown action {action!r}"


def ask_delete(run_id: Any) -> tuple[str, Any, Any]:
    """Delete's first click: (message, confirm button, pending run). Nothing is deleted until the confirm
    button is pressed for the same run; a run that is still queued or running is refused at once."""

    hidden = gr.update(visible=False)
    if run_id is None:
        return "Pick a run first.", hidden, None
    rid = int(run_id)
    try:
        run = context.store().get_run(rid)
    except RunNotFound as e:
        return f"Run #{rid}: {e}", hidden, None
    if run.status in s.ACTIVE:
        return f"Run #{rid} is {run.status}: cancel it before deleting it.", hidden, None
    return (f"Delete run #{rid} {run.name or ''} ({run.status}, step {run.step}) with its folder — checkpoints, "
            f"samples, log? This cannot be undone. Press **Delete for good** to confirm.",
            gr.update(visible=True, value=f"Delete #{rid} for good"), rid)


def confirm_delete(pending: Any, run_id: Any) -> tuple[str, Any, Any, Any]:
    """Delete's confirmation: (message, confirm button, pending run, run picker)."""
    hidden = gr.update(visible=False)
    if pending is None or run_id is None or int(pending) != int(run_id):
        return "Nothing deleted: the picked run changed. Press Delete again.", hidden, None, gr.skip()
    message = act("delete", pending)
    choices = context.job_choices()
    deleted = all(rid != int(pending) for _, rid in choices)
    return message, hidden, None, gr.update(choices=choices, value=None) if deleted else gr.skip()


def duplicate_values(run_id: Any, fields: list[FormField]) -> list[Any]:
    """A training run's preset, a name for the copy, and its config as New-run form values."""
    from core.config import TrainConfig

    run = context.store().get_run(int(run_id))
    return [run.preset, f"{run.name or 'run ' + str(run.id)} (copy)",
            *config_form_values(TrainConfig.from_dict(run.config), fields)]


def not_a_training_run(run: Any, action: str) -> str | None:
    """Why ``action`` does not apply to ``run`` (an evaluate or compare job), or None for a training run."""
    if run.kind == s.TRAIN:
        return None
    return f"{context.a_job_of_its_kind(run)}, not a training run: only a training run {action}."


def duplicate(run_id: Any, fields: list[FormField], n_outputs: int, new_tab: str) -> list[Any]:
    """Duplicate's click: the New-run form filled from a training run (its ``n_outputs`` values), the Runs
    message, and the tab switch to New run; for anything else nothing is filled and the message says why."""
    from core.config import ConfigError

    def refuse(text: str) -> list[Any]:
        return [gr.skip()] * n_outputs + [text, gr.skip()]

    if run_id is None:
        return refuse("Pick a run first.")
    rid = int(run_id)
    try:
        run = context.store().get_run(rid)
    except RunNotFound as e:
        return refuse(f"Run #{rid}: {e}")
    if why := not_a_training_run(run, "has a config to duplicate into New run"):
        return refuse(why)
    try:
        values = duplicate_values(rid, fields)
    except ConfigError as e:  # a config this version cannot read (an older run with a field since removed)
        return refuse(f"Run #{rid}'s config cannot be loaded into the form: {e}")
    return [*values, f"New run holds a copy of run #{rid}'s config: change what you want and press Start.",
            gr.Tabs(selected=new_tab)]


def export_for_hub(run_id: Any, repo_id: str | None = None) -> str:
    """Export's click: the newest checkpoint as a Hub-ready folder under the run's folder
    (exports/hub-step_N, or -2, -3 ... when that exists), then a push when a repo id is given."""
    from jobs.hub_export import ExportError, PushError, export_hub, push_folder

    if run_id is None:
        return "Pick a run first."
    rid = int(run_id)
    repo = (repo_id or "").strip() or None
    store = context.store()
    try:
        if why := not_a_training_run(store.get_run(rid), "has a LoRA to export"):
            return why
        ckpt = store.latest_checkpoint(rid)
        step = ckpt["step"] if ckpt else 0
        root = store.run_dir(rid) / "exports"
        out, n = root / f"hub-step_{step}", 1
        while out.exists():
            n += 1
            out = root / f"hub-step_{step}-{n}"
        done = export_hub(store, rid, out, repo_id=repo)
    except (ExportError, RunNotFound, ValueError) as e:
        return f"Run #{rid}: {e}"
    message = (f"Run #{rid}: checkpoint {done.checkpoint_step} exported{' with its EMA' if done.has_ema else ''} "
               f"to `{done.folder}` (LoRA, model card, config, figures).")
    if repo:
        try:
            message += f" Pushed to {push_folder(done.folder, repo)}."
        except PushError as e:
            message += f" {str(e)[0].upper()}{str(e)[1:]}."
    return message


def _log(run_id: Any) -> str:
    """The job log's last 60 lines; a run deleted meanwhile (here or in another tab) has none."""
    try:
        return context.store().log_tail(int(run_id), 60)
    except RunNotFound:
        return ""


def cancel_state(run_id: Any) -> Any:
    """Cancel is offered only for a queued or running run (a finished one has nothing to stop)."""
    if run_id is None:
        return gr.update(interactive=False)
    try:
        return gr.update(interactive=context.store().status(int(run_id)) in ("queued", "running"))
    except RunNotFound:
        return gr.update(interactive=False)


def row_pick(evt: gr.SelectData) -> Any:
    """A click anywhere on a row of the table picks that row's run (its id is the first cell)."""
    row = evt.row_value or []
    if not row or not str(row[0]).strip().isdigit():  # the "No runs yet" placeholder
        return gr.skip()
    return gr.update(value=int(row[0]))


def build(timer: gr.Timer, new_run: dict, tabs: gr.Tabs, new_tab_id: str) -> dict:
    last = gr.State("")
    with gr.Row():
        tag_filter = gr.Dropdown(choices=[ALL_TAGS], value=ALL_TAGS, label="Show runs tagged",
                                 elem_id="runs-tag-filter", scale=1)
        gr.Markdown("Tag runs below the actions (Tags, notes and config); pick a tag here to list only its runs.",
                    elem_id="runs-tag-hint")
    table = gr.Dataframe(value=None, headers=COLUMNS, interactive=False, elem_id="runs-table", wrap=True)
    with gr.Row():
        pick = gr.Dropdown(choices=[], label="Run", elem_id="runs-pick", scale=3)
        cancel_btn = gr.Button("Cancel", elem_id="run-cancel", variant="stop", scale=1,
                               interactive=False)
        resume_btn = gr.Button("Resume", elem_id="run-resume", scale=1)
        resume_to = gr.Number(value=0, label="Resume up to step (0: as configured)",
                              elem_id="run-resume-steps", scale=1)
        dup_btn = gr.Button("Duplicate with changes", elem_id="run-duplicate", scale=1)
        delete_btn = gr.Button("Delete", elem_id="run-delete", scale=1)
    with gr.Row():
        eval_btn = gr.Button("Evaluate", elem_id="run-evaluate", scale=1)  # held-out scores: app/pages/evaluate.py
        export_btn = gr.Button("Export for the Hub", elem_id="run-export", scale=1)
        export_repo = gr.Textbox(label="Push to Hub repo (optional, needs a token): user/name", elem_id="run-export-repo",
                                 scale=3)
    with gr.Row():
        message = gr.Markdown(elem_id="runs-message")
        confirm_btn = gr.Button("Delete for good", elem_id="run-delete-confirm", variant="stop", visible=False,
                                scale=0, min_width=220)
    pending = gr.State(None)
    log = gr.Textbox(label="Job log (last 60 lines)", lines=12, max_lines=12, interactive=False, elem_id="run-log")

    def on_tick(previous, run_id, tag):
        tag = None if tag in (None, ALL_TAGS) else tag
        df = runs_table(tag)
        key = f"{tag}:{df.to_json()}"
        log_text = _log(run_id) if run_id is not None else gr.skip()
        if key == previous:
            return previous, gr.skip(), gr.skip(), log_text, gr.skip(), gr.skip()
        empty = df.empty
        # the picker's choices carry status and step: re-sent so its shown label follows the table
        choices = context.job_choices()  # every job: an evaluation or a comparison is cancelled and read here too
        # the value is sent only to drop a run that is gone: a tick that re-sent the pick from the State raced a
        # fresh pick (its change event had not reached the State yet) and cleared it
        gone = run_id is not None and run_id not in [c[1] for c in choices]
        none = f"No run is tagged {tag!r}." if tag else "No runs yet: start one in New run."
        tags = run_details.all_tags()
        return (key, df if not empty else pd.DataFrame([["", none, *[""] * (len(COLUMNS) - 2)]], columns=COLUMNS),
                gr.update(choices=choices, value=None) if gone else gr.update(choices=choices), log_text,
                cancel_state(run_id),
                gr.update(choices=[ALL_TAGS, *tags]) if tag is None or tag in tags else
                gr.update(choices=[ALL_TAGS, *tags], value=ALL_TAGS))

    # the tick reads the pick from a State: a dropdown input is checked against its choices, and a tick
    # racing a choices update (a run just deleted) raised "not in the list of choices"
    picked = gr.State(None)
    tag_picked = gr.State(ALL_TAGS)  # the filter, read by the tick from a State for the same reason
    tick_outputs = [last, table, pick, log, cancel_btn, tag_filter]
    timer.tick(on_tick, [last, picked, tag_picked], tick_outputs, show_progress="hidden")
    tag_filter.input(lambda t: (t, ""), tag_filter, [tag_picked, last])  # the next tick redraws the table
    details = run_details.build(pick)
    details["saved"].click(lambda: "", None, last)  # a saved tag shows in the table and the filter at the next tick
    table.select(row_pick, None, pick)  # a click on a row picks its run
    cancel_btn.click(lambda r: act("cancel", r), pick, message)
    resume_btn.click(lambda r, n: act("resume", r, n), [pick, resume_to], message)
    delete_btn.click(ask_delete, pick, [message, confirm_btn, pending])
    export_btn.click(export_for_hub, [pick, export_repo], message)
    eval_btn.click(lambda r: evaluate.queue(r), pick, message)
    confirm_btn.click(confirm_delete, [pending, pick], [message, confirm_btn, pending, pick])
    dup_outputs = [new_run["preset"], new_run["name"], *new_run["widgets"], *new_run["extras"]]
    dup_btn.click(lambda r: duplicate(r, new_run["fields"], len(dup_outputs), new_tab_id), pick,
                  [*dup_outputs, message, tabs])
    # another pick withdraws a pending delete
    pick.change(lambda r: (_log(r) if r is not None else "", gr.update(visible=False), None, r, cancel_state(r)),
                pick, [log, confirm_btn, pending, picked, cancel_btn]).then(None, None, None, js=SCROLL_LOG_TO_END)
    return {"pick": pick}
