"""The Runs page's handlers on a real SQLite store: delete asks first, and nothing is deleted without the
confirmation for the same run."""

import gradio as gr
import pytest

from jobs import schema as s


@pytest.fixture
def store(web_store):
    return web_store


def finished_run(store, name: str) -> int:
    run_id = store.create_run({}, strategy="marble", total_steps=3, name=name)
    assert store.claim(run_id) == run_id
    store.finish(run_id, s.SUCCEEDED)
    store.run_dir(run_id).mkdir(parents=True, exist_ok=True)
    (store.run_dir(run_id) / "job.log").write_text("step 1\nstep 2\n")
    return run_id


def test_delete_asks_first_and_deletes_only_the_confirmed_run(store):
    from app.pages.runs import ask_delete, confirm_delete

    keep, doomed = finished_run(store, "keep"), finished_run(store, "doomed")
    message, button, pending = ask_delete(doomed)
    assert "cannot be undone" in message and button["visible"] is True and pending == doomed
    assert {r.id for r in store.list_runs()} == {keep, doomed}  # asking deletes nothing

    message, button, pending, picker = confirm_delete(doomed, keep)  # the pick moved to another run meanwhile
    assert "Nothing deleted" in message and button["visible"] is False and pending is None
    assert {r.id for r in store.list_runs()} == {keep, doomed}

    folder = store.run_dir(doomed)
    message, button, pending, picker = confirm_delete(doomed, doomed)
    assert message == f"Run #{doomed} deleted with its folder." and button["visible"] is False and pending is None
    assert [r.id for r in store.list_runs()] == [keep] and not folder.exists()
    assert picker["value"] is None and [c[1] for c in picker["choices"]] == [keep]


def test_delete_refuses_a_queued_run_and_a_missing_pick(store):
    from app.pages.runs import _log, ask_delete

    queued = store.create_run({}, strategy="marble", total_steps=3, name="waiting")
    message, button, pending = ask_delete(queued)
    assert message == f"Run #{queued} is queued: cancel it before deleting it." and pending is None
    assert button["visible"] is False and store.status(queued) == s.QUEUED
    assert ask_delete(None)[0] == "Pick a run first."
    assert "does not exist" in ask_delete(queued + 1)[0]
    assert _log(queued + 1) == ""  # a run deleted in another tab: the log is empty, not an error every tick


def test_resume_extends_a_finished_run_to_the_steps_asked(store, monkeypatch):
    import jobs.runner
    from app.pages.runs import act
    from core.config import preset

    started = []
    monkeypatch.setattr(jobs.runner, "ensure_worker", lambda st: started.append(st))  # no training here
    run_id = store.create_run(preset("tiny").with_overrides({"steps": 3}).to_dict(), strategy="marble",
                              total_steps=3, name="done")
    store.claim(run_id)
    (store.run_dir(run_id) / "checkpoints" / "step_000003").mkdir(parents=True)
    store.write_batch(run_id, _checkpoint_batch(3))
    store.finish(run_id, s.SUCCEEDED)

    assert "resume needs one of" in act("resume", run_id)  # finished at its configured 3 steps
    assert act("resume", run_id, 3) == (f"Run #{run_id}: steps=3: run {run_id} resumes from its checkpoint at "
                                       f"step 3; ask for more steps than that")
    assert "steps=-1" in act("resume", run_id, -1) and store.status(run_id) == s.SUCCEEDED and not started
    assert "resume needs one of" in act("resume", run_id, 0)  # the box's resting 0: as configured
    assert act("resume", run_id, 5) == f"Run #{run_id} queued again; it continues from its last checkpoint up to step 5."
    run = store.get_run(run_id)
    assert (run.status, run.total_steps, run.config["steps"]) == (s.QUEUED, 5, 5) and len(started) == 1


def _checkpoint_batch(step: int):
    from jobs.storage import Batch

    batch = Batch()
    batch.run.update(step=step)
    batch.checkpoints.append({"step": step, "path": f"checkpoints/step_{step:06d}", "created_at": 0.0})
    return batch


def test_cancel_says_what_happened_and_is_offered_only_for_active_runs(store):
    """Issue 18 item 4: a finished run is not 'cancel requested (now succeeded)'; a running one is not
    'now running'; the button is disabled unless the picked run is queued or running."""
    from app.pages.runs import act, cancel_state

    done = finished_run(store, "done")
    assert act("cancel", done) == f"Run #{done} already succeeded: there is nothing to cancel."
    assert store.get_run(done).cancel_requested is False
    assert cancel_state(done)["interactive"] is False and cancel_state(None)["interactive"] is False

    queued = store.create_run({}, strategy="marble", total_steps=3, name="waiting")
    assert cancel_state(queued)["interactive"] is True
    assert act("cancel", queued) == f"Run #{queued} cancelled before it started."
    assert store.status(queued) == s.CANCELLED and cancel_state(queued)["interactive"] is False

    running = store.create_run({}, strategy="marble", total_steps=3, name="busy")
    store.claim(running)
    message = act("cancel", running)
    assert "stop requested" in message and "now running" not in message and "cancelled" in message
    assert store.get_run(running).cancel_requested is True


def test_the_table_shows_each_runs_duration_and_a_row_click_picks_it(store):
    import time

    import gradio as gr

    from app.pages.runs import COLUMNS, row_pick, runs_table

    done = finished_run(store, "done")
    with store._tx() as conn:  # a 2 min 5 s attempt
        from sqlalchemy import update

        conn.execute(update(s.runs).where(s.runs.c.id == done).values(started_at=time.time() - 500,
                                                                       finished_at=time.time() - 375))
    store.create_run({}, strategy="marble", total_steps=3, name="waiting")
    df = runs_table()
    rows = {r["name"]: r for r in df.to_dict("records")}
    assert "duration" in COLUMNS and rows["done"]["duration"] == "2m05s" and rows["waiting"]["duration"] == ""

    class Event:  # what gr.SelectData carries for a click on a row
        row_value = [done, "done", "succeeded"]

    assert row_pick(Event())["value"] == done
    Event.row_value = ["", "No runs yet: start one in New run."]
    assert row_pick(Event()) is gr.skip() or row_pick(Event()) == gr.skip()


def test_duplicate_fills_new_run_from_a_training_run_and_refuses_any_other_job(store):
    from app.forms import config_form_values, form_fields
    from app.pages.runs import duplicate
    from core.config import preset

    fields = form_fields(preset("tiny"))
    cfg = preset("tiny").with_overrides({"balance.ema_rho": 0.5, "seed": 3})
    train = store.create_run(cfg.to_dict(), strategy="marble", total_steps=3, name="base", preset="tiny")
    n = 2 + len(config_form_values(cfg, fields))  # preset, name, the fields, then rewards, stages, sources...
    out = duplicate(train, fields, n, "tab-new")
    assert len(out) == n + 2
    assert out[:2] == ["tiny", "base (copy)"] and out[-1].selected == "tab-new"
    values = dict(zip([f.path for f in fields], out[2:n]))
    assert values["balance.ema_rho"] == 0.5 and values["seed"] == 3
    assert "copy of run" in out[-2]
    ev = store.create_run({"run_id": train}, strategy="-", total_steps=2, kind=s.EVALUATE, subject_id=train)
    out = duplicate(ev, fields, n, "tab-new")  # an evaluate job has no training config: nothing is filled
    assert out[:n] == [gr.skip()] * n and out[-1] == gr.skip()
    assert out[-2] == f"#{ev} is an evaluate job, not a training run: only a training run has a config to " \
                      "duplicate into New run."
    from app.pages.runs import export_for_hub

    assert export_for_hub(ev) == f"#{ev} is an evaluate job, not a training run: only a training run has a LoRA " \
                                 "to export."
    assert duplicate(None, fields, n, "tab-new")[-2] == "Pick a run first."
    assert "does not exist" in duplicate(ev + 1, fields, n, "tab-new")[-2]
