"""The Evaluate action and the dashboard's evaluation panel on a real SQLite store (no worker here: the job is
queued, then its progress and a recorded result are written as the job would write them)."""

import pytest

from jobs import schema as s


@pytest.fixture
def store(web_store, monkeypatch):
    import jobs.runner

    monkeypatch.setattr(jobs.runner, "ensure_worker", lambda store: None)  # queued only
    return web_store


def finished(store, steps=2, status=s.SUCCEEDED, checkpoints=(1, 2)) -> int:
    from tests.helpers import small_config

    cfg = small_config("marble", steps=steps)
    run_id = store.create_run(cfg.to_dict(), strategy="marble", total_steps=steps, name="done")
    store.claim(run_id)
    from jobs.storage import Batch

    for step in checkpoints:
        (store.run_dir(run_id) / "checkpoints" / f"step_{step:06d}").mkdir(parents=True)
    store.write_batch(run_id, Batch(checkpoints=[{"step": k, "path": f"checkpoints/step_{k:06d}", "created_at": 0.0}
                                                 for k in checkpoints], run={"step": steps}))
    store.finish(run_id, status)
    return run_id


RESULT = {"rewards": {
    "colorfulness": {"base_mean": 0.5, "base_std": 0.1, "mean": 0.62, "std": 0.1, "delta": 0.12, "z": 1.2, "n": 8,
                     "trained_on": True},
    "sharpness": {"base_mean": 3.0, "base_std": 1.0, "mean": 2.5, "std": 1.0, "delta": -0.5, "z": -0.5, "n": 8,
                  "trained_on": False}},
    "composite_train": 1.2, "composite_all": 0.7, "settings": {"split": "test", "prompts_per_source": 2,
                                                              "seeds_per_prompt": 4},
    "weights": "ema", "checkpoint": "/x/checkpoints/step_000002", "images": 8}


def test_evaluate_queues_a_job_and_the_panel_follows_it_to_the_scores(store):
    from app.pages.evaluate import NOT_YET, panel, queue
    from jobs.evaluations import record

    run_id = finished(store)
    text, table, key = panel(run_id)
    assert text == NOT_YET and table == ""  # the empty state says what to do
    message = queue(run_id, None, 2, 4)
    job = store.list_runs(kind=s.EVALUATE)[0]
    assert f"job **#{job.id}**" in message and job.subject_id == run_id and job.status == s.QUEUED
    assert store.get_run(job.id).config == {"run_id": run_id, "checkpoint_step": 2, "settings": {
        "split": "test", "prompts_per_source": 2, "seeds_per_prompt": 4, "num_steps": None, "guidance_scale": None,
        "weights": "ema"}}
    text, _, key2 = panel(run_id)
    assert f"job **#{job.id}** is **queued**" in text and "waiting for a free worker slot" in text and key2 != key
    store.claim(job.id)
    store.write_batch(job.id, __import__("jobs.storage").storage.Batch(run={"step": 1}))
    text, _, key3 = panel(run_id)
    assert "is **running** (1/2: scoring the checkpoint)" in text and key3 != key2
    assert panel(run_id)[2] == key3  # nothing changed: the tick sends nothing
    record(store, run_id, RESULT, checkpoint_step=2, extra={"job_id": job.id})
    store.finish(job.id, s.SUCCEEDED)
    text, table, _ = panel(run_id)
    assert text.startswith("Held-out evaluation")
    assert "<td>colorfulness</td><td>✓</td><td>0.5000</td><td>0.6200</td><td class='eval-up'>+1.20 ± 0.50</td>" in table
    assert "<td>sharpness</td><td></td>" in table and "-0.50 ± 0.50" in table
    assert "step <b>2</b>" in table and "composite over the training rewards <b>+1.20</b>" in table
    # the composite carries the bound its parts give (only colorfulness is trained on here) ...
    assert "<b>+1.20</b> (standard error at most 0.50, the sum of its parts'" in table
    # ... and the prompts are counted from the images: 8 images / 4 seeds = 2 prompts, whatever was asked
    assert "(2 prompts × 4 seeds; up to 2 per source asked)" in table


def test_evaluate_refuses_bad_requests_naming_field_value_and_rule(store):
    from app.pages.evaluate import cancel, panel, queue

    run_id = finished(store)
    stopped = finished(store, steps=5, status=s.CANCELLED, checkpoints=(1,))
    assert queue(None) == "Pick a run first."
    assert "`run=999: no such run" in queue(999)
    said = queue(stopped)
    assert said.startswith("**Not queued.**") and f"run #{stopped} is cancelled at step 5/5" in said
    assert "only a finished (succeeded) run can be evaluated" in said
    assert panel(stopped)[0].startswith(f"Run #{stopped} was **cancelled**: a held-out evaluation needs a finished run")
    assert "`checkpoint step=7: run" in queue(run_id, 7) and "(its checkpoints: 1, 2)" in queue(run_id, 7)
    assert "`prompts per source=0: must be a whole number in [1, 10000]`" in queue(run_id, None, 0, 4)
    assert "`seeds per prompt=1.5: must be a whole number" in queue(run_id, None, 2, 1.5)
    assert store.list_runs(kind=s.EVALUATE) == []  # nothing queued by a refused request
    assert "nothing to cancel" in cancel(run_id)
    queue(run_id, 1, 2, 2)
    assert "already being evaluated" in queue(run_id, 1, 2, 2)
    assert "cancelled before it started" in cancel(run_id)
    job = store.list_runs(kind=s.EVALUATE)[0]
    assert job.status == s.CANCELLED
    text, _, _ = panel(run_id)
    assert f"job #{job.id}) ended **cancelled**" in text and "Press Evaluate to try again" in text


def test_the_runs_page_cancels_an_evaluate_job_in_its_own_words(store):
    from app.pages.runs import act
    from jobs.evaluations import queue

    job = queue(store, finished(store))
    store.claim(job)
    said = act("cancel", job)
    assert said.startswith(f"Job #{job}: stop requested") and "checkpoint" not in said
    assert store.get_run(job).cancel_requested and store.status(job) == s.RUNNING  # the job stops itself


def test_a_source_with_fewer_prompts_than_asked_is_not_overstated():
    """New-user pass: the tiny source has 7 held-out prompts; asked for 16 per source, the table said
    "(16 per source × 4 seeds)" over 28 images."""
    from app.pages.evaluate import scores_table

    details = {**RESULT, "images": 28, "settings": {"split": "test", "prompts_per_source": 16, "seeds_per_prompt": 4},
               "rewards": {n: {**r, "z_se": 0.27} for n, r in RESULT["rewards"].items()}}
    table = scores_table({"checkpoint_step": 20, "details": details})
    assert "28 images per model on the test prompts (7 prompts × 4 seeds; up to 16 per source asked)" in table
    assert "16 per source ×" not in table
