"""The Compare page's handlers on a real SQLite store: a saved grid, its A/B slider, and the timer tick that
follows a comparison from queued to done or failed."""

import gradio as gr
import pytest



@pytest.fixture
def store(web_store):
    return web_store


def done_result(tag: str, prompts=("a red circle", "a blue square"), columns=("base", "step 2")) -> dict:
    return {"status": "succeeded", "seconds": 1.5, "rows": [
        {"prompt": p, "seed": 0, "cells": [{"label": c, "path": f"/grids/{tag}/p{i}_c{j}.png",
                                            "scores": {"colorfulness": 0.1 * j, "brightness": float("nan")}}
                                           for j, c in enumerate(columns)]}
        for i, p in enumerate(prompts)]}


def test_each_comparison_fills_its_own_slider_even_with_the_same_row_labels(store):
    from app.pages.compare import grid, slider_pair

    first = store.add_comparison("first", [], result=done_result("first"))
    second = store.add_comparison("second", [], result=done_result("second"))
    md, items, labels, rows, pair, col_a, col_b = grid(first, 0, 1)
    assert labels == ["1: a red circle (seed 0)", "2: a blue square (seed 0)"] and rows["value"] == labels[0]
    assert pair == ("/grids/first/p0_c0.png", "/grids/first/p0_c1.png")
    # the A/B pickers name each column by number and checkpoint, not a bare index
    assert col_a["choices"] == [("1. base", 0), ("2. step 2", 1)] and (col_a["value"], col_b["value"]) == (0, 1)
    *_, kept_a, kept_b = grid(first, 1, 7)  # a picked column is kept; one the grid lacks falls back to the second
    assert (kept_a["value"], kept_b["value"]) == (1, 1)
    assert items.count("<img ") == 4 and "2 prompt×seed rows × 2 columns" in md and "base, step 2" in md
    # issue 18 item 3: column headers, full reward names with their scores beside the images, NaN left out
    assert "<thead><tr><th>prompt · seed</th><th>base</th><th>step 2</th></tr></thead>" in items
    assert "<td>colorfulness</td><td>0.100</td>" in items and "brightness" not in items
    assert "src='gradio_api/file=/grids/first/p0_c1.png'" in items and "max-width:128px" in items
    _, _, labels2, rows2, pair2, *_ = grid(second, 0, 1)
    assert labels2 == labels and rows2["value"] == rows["value"]  # the row dropdown's value does not change ...
    assert pair2 == ("/grids/second/p0_c0.png", "/grids/second/p0_c1.png")  # ... the slider does
    assert slider_pair(second, labels[1], 1, 7) == ("/grids/second/p1_c1.png", "/grids/second/p1_c1.png")  # clamped


def test_unfinished_failed_and_missing_comparisons_clear_the_grid(store):
    from app.pages.compare import grid

    running = store.add_comparison("running", [], result={"status": "running"})
    failed = store.add_comparison("failed", [], result={"status": "failed", "error": "OSError: no such model"})
    md, items, labels, rows, pair, col_a, _ = grid(running)
    assert "is **running**" in md and items == "" and labels == [] and pair is None and rows["value"] is None
    assert col_a["choices"] == [] and col_a["value"] is None
    md, _, labels, _, pair, *_ = grid(failed)
    assert md == "**Failed:** `` OSError: no such model ``" and labels == [] and pair is None
    assert "Pick two or more checkpoints" in grid(None)[0]  # what to do, not a blank page


def test_the_tick_sends_the_grid_once_per_state(store):
    from app.pages.compare import poll

    cid = store.add_comparison("live", [], result={"status": "queued"})
    skip = gr.skip()
    out = poll(cid, [], 0, 1)
    assert "is **queued**" in out[0] and out[7] == skip  # not finished: the saved list stays
    assert poll(cid, out[2], 0, 1)[:2] == (skip, skip)  # nothing new: nothing sent
    store.update_comparison(cid, {"status": "running"})
    out = poll(cid, out[2], 0, 1)
    assert "is **running**" in out[0]
    store.update_comparison(cid, done_result("live"))
    out = poll(cid, out[2], 0, 1)
    assert out[2] == ["1: a red circle (seed 0)", "2: a blue square (seed 0)"]
    assert out[4] == ("/grids/live/p0_c0.png", "/grids/live/p0_c1.png")
    assert out[7]["choices"] == [(f"comparison {cid}: live · succeeded", cid)]  # the saved list shows it done
    assert poll(cid, out[2], 0, 1) == (skip, skip, out[2], skip, skip, skip, skip, skip)
    failing = store.add_comparison("bad", [], result={"status": "failed", "error": "boom"})
    out = poll(failing, [], 0, 1)
    assert out[0].startswith("**Failed") and out[7] != skip
    assert poll(failing, out[2], 0, 1)[7] == skip  # reported once, not on every tick


def test_a_comparison_without_a_name_is_named_after_its_columns(store, monkeypatch):
    """Issue 18 item 3: not "Comparison #1 comparison"."""
    import json

    import jobs.runner
    from app.pages.compare import saved_choices, start

    monkeypatch.setattr(jobs.runner, "ensure_worker", lambda store: None)  # queued only: no generation here
    entries = [json.dumps({"label": label, "model": "tiny", "lora": None, "run_id": None, "rewards": []})
               for label in ("base tiny", "#3 marble · step 2")]
    md, saved = start("", entries, "a red circle", "0", 4, 1.0)
    cid = saved["value"]
    assert md.startswith(f"Comparison **#{cid}**")
    assert saved_choices()[0] == (f"comparison {cid}: base tiny vs #3 marble · step 2 · queued", cid)
    # its compare job is a row of the runs table, but not a run with checkpoints to pick
    from app.pages.compare import entry_choices
    from jobs import schema as s

    assert [r.kind for r in context_store().list_runs()] == [s.COMPARE] and entry_choices() == []


def context_store():
    from app import context

    return context.store()


@pytest.mark.parametrize("steps, guidance, rule", [
    (None, 1.0, "denoising steps=None: must be a whole number from 1 to 1000"),
    (-2, 1.0, "denoising steps=-2: must be a whole number from 1 to 1000"),
    (0, 1.0, "denoising steps=0: must be a whole number from 1 to 1000"),
    (2.5, 1.0, "denoising steps=2.5: must be a whole number from 1 to 1000"),
    (4, 0, "guidance scale=0: must be a number >= 1.0 (1.0 = no guidance)"),
    (4, None, "guidance scale=None: must be a number >= 1.0"),
])
def test_bad_steps_or_guidance_are_refused_by_name_and_nothing_is_queued(store, steps, guidance, rule):
    """New-user pass: a blank steps box raised a raw int(None) TypeError toast, -2 was queued and failed in the
    worker, 0 steps and guidance 0 'succeeded'."""
    import json

    from app.pages.compare import start

    entries = [json.dumps({"label": label, "model": "tiny", "lora": None, "run_id": None, "rewards": []})
               for label in ("base tiny", "base tiny again")]
    md, saved = start("", entries, "a red circle", "0", steps, guidance)
    assert md.startswith("**Not started.**") and rule in md and saved == gr.skip()
    assert store.comparisons() == [] and context_store().list_runs() == []
