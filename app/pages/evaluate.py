"""Held-out evaluation from the browser: the Evaluate action (Dashboard panel and Runs page) queues an evaluate job
(jobs.evaluations.queue: the worker's queue, a slot, cancel, interrupted after a crash, the runs' status words), and
the dashboard panel shows its progress, then the stored scores: per reward the change over the base model in units of
the base model's std, ± its standard error, the rewards the run trained on marked."""

from __future__ import annotations

import math
from html import escape
from typing import Any

import gradio as gr

from app import context
from jobs.storage import RunNotFound

IDLE_EVERY = 5  # timer ticks between two reads of a panel with no evaluation in progress (2 s ticks: 10 s)
EMPTY = "Pick a run above to see its held-out evaluation."
NOT_YET = ("**Not evaluated yet — press Evaluate.** It scores the checkpoint and the base model on the held-out "
           "(test) prompts with every reward, in the background (a job of the Runs page).")
HELP = ("Δ / base σ: the checkpoint's mean score minus the base model's, in units of the base model's standard "
        "deviation on the same prompts and seeds (the paper's Table 1); ± one standard error of that number "
        "(sampling noise of this evaluation, not the spread over training seeds). ✓ = a reward the run trained on; the "
        "others are held out.")


def checkpoint_choices(run_id: int | None) -> list[int]:
    """The run's checkpoint steps whose folders exist (none for no run or a deleted one)."""
    if run_id is None:
        return []
    try:
        return [c["step"] for c in context.store().checkpoints(int(run_id)) if c["exists"]]
    except RunNotFound:
        return []


def queue(run_id: Any, checkpoint: Any = None, prompts_per_source: Any = 16, seeds: Any = 4) -> str:
    """Evaluate's click: queue an evaluate job (and make sure a worker runs); returns what happened, or the rule a
    bad request breaks (field, value, rule)."""
    from core.evaluate import EvalSettings
    from jobs.evaluations import queue as queue_job
    from jobs.runner import ensure_worker

    if run_id is None:
        return "Pick a run first."
    values = {}
    for field, value, low in (("prompts per source", prompts_per_source, 1), ("seeds per prompt", seeds, 1)):
        if value is None or value != int(value) or not low <= int(value) <= 10_000:
            return f"**Not queued.** `{field}={value!r}: must be a whole number in [{low}, 10000]`"
        values[field] = int(value)
    step = None if checkpoint in (None, "") else int(checkpoint)
    store = context.store()
    try:
        job_id = queue_job(store, int(run_id), step, EvalSettings(prompts_per_source=values["prompts per source"],
                                                                   seeds_per_prompt=values["seeds per prompt"]),
                           field="checkpoint step")
    except ValueError as e:
        return f"**Not queued.** `{e}`"
    ensure_worker(store)
    return (f"Evaluation queued as job **#{job_id}** (Runs page: its log, cancel). The scores appear here when it "
            f"is done.")


def cancel(run_id: Any) -> str:
    from jobs.evaluations import active_job
    from jobs.runner import cancel as cancel_job

    if run_id is None:
        return "Pick a run first."
    job = active_job(context.store(), int(run_id))
    if job is None:
        return "No evaluation of this run is queued or running: nothing to cancel."
    status = cancel_job(context.store(), job.id, wait=False)
    return (f"Evaluation job #{job.id} cancelled before it started." if status == "cancelled" else
            f"Evaluation job #{job.id}: stop requested; it stops after the model it is scoring.")


def _prompt_count(images: Any, settings: dict) -> str:
    """How many prompts the images came from: a source with fewer held-out prompts than asked gives all it has,
    so "16 per source" would overstate a 7-prompt source."""
    seeds, asked = settings.get("seeds_per_prompt"), settings.get("prompts_per_source")
    if not (isinstance(images, int) and isinstance(seeds, int) and seeds > 0):
        shown = ["?" if v is None else v for v in (asked, seeds)]
        return f"{shown[0]} prompts per source × {shown[1]} seeds"
    return f"{images // seeds} prompts × {seeds} seeds; up to {asked} per source asked"


def _composite_text(comp: float | None, rewards: dict) -> str:
    """The composite with the bound its parts give: the rewards are scored on the same images, so their errors
    are not independent and √(Σ se²) would understate it; Σ se is an upper bound on its standard error."""
    if comp is None:
        return ""
    ses = [r.get("z_se") for r in rewards.values() if r.get("trained_on") and r.get("z") is not None]
    bound = (f" (standard error at most {sum(ses):.2f}, the sum of its parts': they share images)"
             if ses and all(se is not None for se in ses) else "")
    return f"; composite over the training rewards <b>{comp:+.2f}</b>{bound}"


def scores_table(ev: dict) -> str:
    """The stored evaluation as an HTML table: reward, trained on, base mean, checkpoint mean, Δ / base σ ± SE."""
    d = ev["details"]
    settings = d.get("settings") or {}
    rows = []
    for name, r in d["rewards"].items():
        if not r.get("n"):
            continue
        z, se = r.get("z"), r.get("z_se")
        zt = "n/a" if z is None else f"{z:+.2f}" + (f" ± {se:.2f}" if se is not None else "")
        cls = "" if z is None else (" class='eval-up'" if z > 0 else " class='eval-down'")

        def num(x):
            return "n/a" if x is None or not math.isfinite(x) else f"{x:.4f}"

        rows.append(f"<tr><td>{escape(name)}</td><td>{'✓' if r.get('trained_on') else ''}</td>"
                    f"<td>{num(r.get('base_mean'))}</td><td>{num(r.get('mean'))}</td><td{cls}>{zt}</td>"
                    f"<td>{r['n']}</td></tr>")
    comp = d.get("composite_train")
    head = (f"<p>Checkpoint at step <b>{ev['checkpoint_step']}</b> ({escape(str(d.get('weights') or ''))} weights), "
            f"{d.get('images')} images per model on the {escape(str(settings.get('split', '?')))} prompts "
            f"({_prompt_count(d.get('images'), settings)})" + _composite_text(comp, d["rewards"]) + ".</p>")
    return (head + "<table class='eval-table'><thead><tr><th>reward</th><th>trained on</th><th>base</th>"
            "<th>checkpoint</th><th>Δ / base σ ± SE</th><th>n</th></tr></thead><tbody>" + "".join(rows)
            + f"</tbody></table><p class='help-line'>{escape(HELP)}</p>")


def panel(run_id: int | None) -> tuple[str, str, tuple]:
    """(status markdown, scores HTML, key): what the panel shows for a run, and a key that changes when it does."""
    from jobs import schema as s
    from jobs.evaluations import PHASES, latest

    if run_id is None:
        return EMPTY, "", (None,)
    store = context.store()
    try:
        run = store.get_run(int(run_id))
    except RunNotFound:
        return f"Run #{run_id} no longer exists.", "", (run_id, "gone")
    jobs = [j for j in store.list_runs(kind=s.EVALUATE) if j.subject_id == run.id]  # newest first
    last = jobs[0] if jobs else None  # the newest evaluate job of this run, whatever its state
    job = next((j for j in jobs if j.status in s.ACTIVE), None)  # jobs.evaluations.active_job, without a query
    ev = latest(store, run.id)
    if job is not None:
        what = ("waiting for a free worker slot" if job.status == "queued" else
                "scoring the base model" if job.step == 0 else
                "scoring the checkpoint" if job.step < PHASES else "recording")
        status = (f"Evaluation job **#{job.id}** is **{job.status}** ({job.step}/{job.total_steps}: {what}). "
                  f"The table updates when it is done.")
    elif run.status != s.SUCCEEDED:
        # no step count here: this text is refreshed only when the run's status changes (the header has the step)
        said = {"queued": "is **queued**", "running": "is still **running**", "failed": "**failed**"}.get(
            run.status, f"was **{run.status}**")
        status = (f"Run #{run.id} {said}: a held-out evaluation needs a finished run (its scores would read as a "
                  f"finished run's).")
    elif last is not None and last.status in (s.FAILED, s.INTERRUPTED, s.CANCELLED) and (
            ev is None or (ev["details"] or {}).get("job_id") != last.id):
        why = f": `{last.error.strip().splitlines()[-1]}`" if last.error else ""
        status = f"The last evaluation (job #{last.id}) ended **{last.status}**{why}. Press Evaluate to try again."
    elif ev is None:
        status = NOT_YET
    else:
        status = "Held-out evaluation (newest):"
    table = scores_table(ev) if ev is not None else ""
    key = (run.id, run.status, job and (job.id, job.status, job.step), ev and ev["id"], last and (last.id, last.status))
    return status, table, key


def build(run_box: gr.Dropdown, timer: gr.Timer) -> dict:
    """The dashboard's evaluation panel, following ``run_box``."""
    shown = gr.State({"run": None, "key": None})
    with gr.Accordion("Held-out evaluation", open=True, elem_id="eval-panel"):
        with gr.Row():
            checkpoint = gr.Dropdown(choices=[], label="Checkpoint step (default: the newest)",
                                     elem_id="eval-checkpoint", scale=2)
            per_source = gr.Number(value=16, label="Prompts per source", elem_id="eval-prompts", scale=1)
            seeds = gr.Number(value=4, label="Seeds per prompt", elem_id="eval-seeds", scale=1)
            start_btn = gr.Button("Evaluate", variant="primary", elem_id="eval-start", scale=1)
            cancel_btn = gr.Button("Cancel evaluation", elem_id="eval-cancel", scale=1)
        status = gr.Markdown(EMPTY, elem_id="eval-status")
        table = gr.HTML("", elem_id="eval-table")
        message = gr.Markdown("", elem_id="eval-message")

    def on_pick(run_id):
        text, html, key = panel(run_id)
        steps = checkpoint_choices(run_id)
        return ({"run": run_id, "key": key}, text, html, "",
                gr.update(choices=steps, value=steps[-1] if steps else None))

    def on_tick(state):
        """While an evaluation of the shown run is queued or running, every tick; otherwise every IDLE_EVERY-th
        (an evaluation queued elsewhere, a run that finishes): the panel costs the dashboard's tick nothing most of
        the time."""
        run_id = (state or {}).get("run")
        if run_id is None:
            return state, gr.skip(), gr.skip(), gr.skip()
        key = state.get("key")
        active = bool(key and len(key) > 2 and key[2] and key[2][1] in ("queued", "running"))
        ticks = state.get("ticks", 0) + 1
        if not active and key is not None and ticks % IDLE_EVERY:
            return {**state, "ticks": ticks}, gr.skip(), gr.skip(), gr.skip()
        text, html, key = panel(run_id)
        if key == state.get("key"):
            return {**state, "ticks": ticks}, gr.skip(), gr.skip(), gr.skip()
        steps = checkpoint_choices(run_id)
        return {"run": run_id, "key": key, "ticks": ticks}, text, html, gr.update(choices=steps)

    run_box.change(on_pick, run_box, [shown, status, table, message, checkpoint])
    timer.tick(on_tick, shown, [shown, status, table, checkpoint], show_progress="hidden")
    start_btn.click(queue, [run_box, checkpoint, per_source, seeds], message).then(
        lambda st: {**(st or {}), "key": None}, shown, shown)  # the next tick shows the queued job
    cancel_btn.click(cancel, run_box, message).then(lambda st: {**(st or {}), "key": None}, shown, shown)
    return {"status": status, "table": table}
