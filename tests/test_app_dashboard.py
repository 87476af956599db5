"""The dashboard's handlers on a real SQLite store: picking a run, timer ticks, and the sample gallery
following the picked run (written through the job's own EventWriter, as a training job writes)."""

import gradio as gr
import pytest

from jobs.writer import EventWriter
from tests.jobs_support import REWARDS, balance_event, sample_event, start_event, step_event

from app.pages.dashboard import View  # noqa: E402  (the outputs' names, in order)

OUTPUTS = View.names()


@pytest.fixture
def store(web_store):
    return web_store


def make_run(store, name: str, sample_steps: list[int], total: int = 10) -> tuple[int, EventWriter]:
    """A run with steps 1..max(sample_steps) and a sample event at each of ``sample_steps``; every image is a
    distinct file of its own run."""
    run_id = store.create_run({"rewards": [{"name": n} for n in REWARDS]}, strategy="marble",
                              total_steps=total, name=name)
    writer = EventWriter(store, run_id, store.run_dir(run_id))
    writer(start_event(total))
    for step in range(1, max(sample_steps) + 1):
        writer(step_event(step, phase="harmonized" if step == 1 else "amortized"))
        if step == 1:
            writer(balance_event(step))
        if step in sample_steps:
            add_samples(store, writer, run_id, step)
    writer.flush()
    return run_id, writer


def add_samples(store, writer, run_id: int, step: int) -> None:
    event = sample_event(step)
    for item in event.items:
        path = store.run_dir(run_id) / item["path"]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(f"run {run_id} step {step} {item['path']}".encode())
    writer(event)


def shown(out) -> dict:
    return dict(zip(OUTPUTS, out, strict=True))


def test_switching_runs_shows_the_new_runs_samples_even_at_the_same_step_number(store):
    from app.pages.dashboard import select_run

    a, _ = make_run(store, "a", [1, 3])
    b, _ = make_run(store, "b", [2, 3])  # newest sample step 3, as a's: the step dropdown's value does not change
    first = shown(select_run(a, 0.6))
    assert first["sample_step"]["value"] == 3 and first["sample_step"]["choices"] == [1, 3]
    assert [img for img, _ in first["gallery"]] == [s["image"] for s in store.samples(a, step=3)]
    second = shown(select_run(b, 0.6))
    assert second["sample_step"]["value"] == 3 and second["sample_step"]["choices"] == [2, 3]
    images = [img for img, _ in second["gallery"]]
    assert images == [s["image"] for s in store.samples(b, step=3)] and all(f"run_{b:06d}" in i for i in images)
    assert "step 3" in second["spec"].layout.title.text and len(second["spec"].data[0].y) == len(images)


def test_a_tick_moves_the_gallery_to_new_samples_and_leaves_it_alone_otherwise(store):
    from app.pages.dashboard import select_run, tick

    run_id, writer = make_run(store, "live", [1])
    out = shown(select_run(run_id, 0.6))
    writer(step_event(2))
    writer.flush()
    out = shown(tick(out["state"], 0.6))  # a new step, no new samples: the gallery is not re-sent
    assert out["rewards"] != gr.skip() and all(out[k] == gr.skip() for k in ("sample_step", "gallery", "spec", "strip"))
    writer(step_event(3))
    add_samples(store, writer, run_id, 3)
    writer.flush()
    out = shown(tick(out["state"], 0.6))
    assert out["sample_step"]["value"] == 3 and out["sample_step"]["choices"] == [1, 3]
    assert [img for img, _ in out["gallery"]] == [s["image"] for s in store.samples(run_id, step=3)]


def test_empty_states_say_what_is_missing(store):
    from app.pages.dashboard import select_run

    out = shown(select_run(None, 0.6))
    assert out["header"].startswith("Pick a run.") and "New run" in out["header"] and out["gallery"] == []
    for key in ("rewards", "alpha", "cosine", "conflict", "spec"):
        assert "No run selected." in out[key].layout.annotations[0].text
    run_id = store.create_run({"rewards": [{"name": n} for n in REWARDS]}, strategy="marble", total_steps=5)
    out = shown(select_run(run_id, 0.6))  # queued: nothing recorded yet
    assert out["gallery"] == [] and "No samples stored yet" in out["spec"].layout.annotations[0].text
    assert "No steps recorded yet" in out["rewards"].layout.annotations[0].text


def test_a_run_deleted_while_shown_gets_a_message_once_not_an_error_every_tick(store):
    from app.pages.dashboard import select_run, tick
    from jobs import schema as s

    run_id, writer = make_run(store, "doomed", [1])
    out = shown(select_run(run_id, 0.6))
    store.claim(run_id)
    store.finish(run_id, s.SUCCEEDED)
    store.delete_run(run_id)
    out = shown(tick(out["state"], 0.6))
    assert out["header"].startswith(f"Run #{run_id} no longer exists") and out["gallery"] == []
    assert f"Run #{run_id} was deleted." in out["rewards"].layout.annotations[0].text
    again = tick(out["state"], 0.6)
    assert all(x == gr.skip() for x in again[1:])  # said once; later ticks send nothing
    assert shown(select_run(run_id, 0.6))["header"].startswith(f"Run #{run_id} no longer exists")


def test_the_run_picker_follows_new_runs_only_when_asked(store):
    from app.pages.dashboard import follow_new_runs

    assert follow_new_runs(True, None) == {"__type__": "update", "choices": [], "value": None}
    old = store.create_run({}, strategy="marble", total_steps=3, name="old")
    new = store.create_run({}, strategy="marble", total_steps=3, name="new")
    started = follow_new_runs(True, old)  # a run was just started: it is picked
    assert started["value"] == new and [rid for _, rid in started["choices"]] == [new, old]
    refused = follow_new_runs(False, old)  # the form refused the start: the current pick stays
    assert refused["value"] == old and len(refused["choices"]) == 2
    assert follow_new_runs(False, old + 100)["value"] is None  # a pick that no longer exists is dropped


@pytest.mark.parametrize("rows,cols,hspace,vspace,shared", [(1, 4, 0.06, 0.1, False), (2, 2, 0.08, 0.14, True),
                                                            (1, 1, 0.05, 0.1, False), (3, 2, 0.1, 0.05, True)])
def test_the_subplot_grid_lays_out_the_axes_as_plotlys_make_subplots(rows, cols, hspace, vspace, shared):
    from plotly.subplots import make_subplots

    from app.plots import subplot_grid

    titles = [f"panel {i}" for i in range(rows * cols)]
    ours, axes = subplot_grid(rows, cols, titles, hspace=hspace, vspace=vspace, shared_x=shared, x_title="step")
    ref = make_subplots(rows=rows, cols=cols, subplot_titles=titles, horizontal_spacing=hspace,
                        vertical_spacing=vspace, shared_xaxes=shared)
    for r in range(1, rows + 1):
        for c in range(1, cols + 1):
            cell = axes(r, c)
            x, y = ours.layout[cell["xaxis"].replace("x", "xaxis")], ours.layout[cell["yaxis"].replace("y", "yaxis")]
            rx, ry = ref.get_subplot(r, c).xaxis, ref.get_subplot(r, c).yaxis
            assert x.domain == pytest.approx(rx.domain) and y.domain == pytest.approx(ry.domain)
            assert (x.anchor, y.anchor) == (rx.anchor, ry.anchor) and x.matches == rx.matches
            assert (x.title.text == "step") == (r == rows)
    assert [(a.text, round(a.x, 6), round(a.y, 6)) for a in ours.layout.annotations] == \
           [(a.text, round(a.x, 6), round(a.y, 6)) for a in ref.layout.annotations]
