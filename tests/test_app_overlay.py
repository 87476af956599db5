"""Several runs on one chart (the Overlay page), one colour per reward on every figure, and the α plot's range
and 1/K label: handlers on a real SQLite store, figures checked trace by trace."""

import dataclasses

import gradio as gr
import numpy as np
import pytest

from jobs.writer import EventWriter
from tests.jobs_support import REWARDS, balance_event, start_event, step_event


@pytest.fixture
def store(web_store):
    return web_store


def make_run(store, name: str, steps: int, rewards=REWARDS) -> tuple[int, EventWriter]:
    run_id = store.create_run({"rewards": [{"name": n} for n in rewards]}, strategy="marble", total_steps=100,
                              name=name)
    writer = EventWriter(store, run_id, store.run_dir(run_id))
    writer(start_event(100))
    for step in range(1, steps + 1):
        event = step_event(step, phase="harmonized" if step == 1 else "amortized")
        if rewards != REWARDS:  # the run's own rewards
            event = dataclasses.replace(event, rewards={n: 0.1 * step for n in rewards},
                                        alpha={n: 1 / len(rewards) for n in rewards})
        writer(event)
        if step == 1 and rewards == REWARDS:
            writer(balance_event(step))
    writer.flush()
    return run_id, writer


def test_two_runs_overlaid_share_reward_colours_and_differ_by_dash_with_a_legend_naming_both(store):
    from app.pages.overlay import on_pick
    from app.plots import reward_colour

    a, _ = make_run(store, "alpha", 6)
    b, _ = make_run(store, "beta", 4)
    state, rewards, alpha, note = on_pick(None, [a, b], 0.6)
    assert note == "" and state.run_ids == [a, b]
    legend = [t for t in rewards.data if t.showlegend is not False]
    assert {t.name for t in legend} == {f"#{r} {n} · {k}" for r, n in ((a, "alpha"), (b, "beta")) for k in REWARDS}
    for t in rewards.data:  # each reward in its own colour, whichever run
        assert t.line.color == reward_colour(t.name.split(" · ")[1].removesuffix(" (raw)"))
    dash = {t.name.split(" · ")[0]: t.line.dash for t in legend}
    assert dash[f"#{a} alpha"] != dash[f"#{b} beta"]
    raw = [t for t in rewards.data if t.name.endswith("(raw)")]
    assert len(raw) == 6 and all(t.opacity < 1 for t in raw)  # raw and smoothed both drawn
    assert len(next(t for t in legend if t.name == f"#{a} alpha · brightness").x) == 6
    assert {t.name for t in alpha.data} == {t.name for t in legend}  # α of every run and reward


def test_the_overlay_follows_new_steps_and_leaves_out_a_deleted_run(store):
    from app.pages.overlay import on_pick, tick
    from jobs import schema as s

    a, writer = make_run(store, "live", 3)
    b, _ = make_run(store, "done", 3)
    state, *_ = on_pick(None, [a, b], 0.6)
    assert tick(state, 0.6)[1:] == (gr.skip(),) * 3  # nothing new: nothing sent
    writer(step_event(4))
    writer.flush()
    state, rewards, _, _ = tick(state, 0.6)
    assert len(next(t for t in rewards.data if t.name == f"#{a} live · brightness").x) == 4
    store.claim(b)
    store.finish(b, s.SUCCEEDED)
    store.delete_run(b)
    state, rewards, _, note = tick(state, 0.6)
    assert state.run_ids == [a] and note == f"Deleted while shown, left out: #{b}."
    assert all(t.name.startswith(f"#{a} ") for t in rewards.data)


def test_runs_with_different_rewards_get_a_panel_per_reward_and_one_picked_run_asks_for_more(store):
    from app.pages.overlay import HINT, ONE_RUN, on_pick

    a, _ = make_run(store, "three", 2)
    b, _ = make_run(store, "two", 2, rewards=["colorfulness", "sharpness"])
    _, rewards, alpha, _ = on_pick(None, [a, b], 0.6)
    titles = [x.text for x in rewards.layout.annotations]
    assert titles == [*REWARDS, "sharpness"]
    uniform = sorted(x.text for x in alpha.layout.annotations if x.text.startswith("1/K"))
    assert uniform == ["1/K = 0.333", "1/K = 0.5"]
    _, one, _, note = on_pick(None, [a], 0.6)
    assert note == ONE_RUN and "1 run (colour" in one.layout.title.text  # not "1 runs", not "pick two" over a drawn run
    assert on_pick(None, [], 0.6)[3] == HINT
    assert "Pick two or more runs" in on_pick(None, [], 0.6)[1].layout.annotations[0].text


def test_every_reward_has_its_own_colour_and_keeps_it_on_every_figure():
    from app.plots import alpha_trajectories, conflict_panels, reward_colour, reward_curves
    from core.rewards import available_rewards

    names = list(available_rewards())
    assert len({reward_colour(n) for n in names}) == len(names)  # no two known rewards share a colour
    assert reward_colour("some_new_reward") == reward_colour("some_new_reward")
    order = ["brightness", "colorfulness"]  # another order than REWARDS: colours follow the name, not the place
    series = {f"reward/{n}": ([1, 2], [0.1, 0.2]) for n in order} | {f"alpha/{n}": ([1, 2], [0.5, 0.5]) for n in order}
    row = {"step": 1, "phase": "harmonized", "alpha_ema": {n: 0.5 for n in order}, "alpha_raw": {n: 0.5 for n in order},
           "cos_to_update": {n: 0.3 for n in order}, "cosine": {"names": order, "matrix": [[1, 0], [0, 1]]}}
    for fig in (reward_curves(series, order), alpha_trajectories([row], series, order), conflict_panels([row], order)):
        for t in fig.data:
            reward = next((n for n in order if t.name.startswith(n)), None)
            if reward:
                drawn = t.line.color if t.mode != "markers" else t.marker.color  # a markers-only trace: its marker
                assert drawn == reward_colour(reward), (fig.layout.title.text, t.name)


def test_the_alpha_plot_fits_its_values_and_puts_the_1_over_k_label_outside_the_lines():
    from app.plots import alpha_trajectories

    names = ["a", "b", "c", "d"]
    rows = [{"step": s, "phase": "harmonized", "alpha_ema": {n: 0.25 + 0.01 * i for i, n in enumerate(names)},
             "alpha_raw": {n: 0.24 + 0.02 * i for i, n in enumerate(names)}} for s in (1, 11, 21)]
    fig = alpha_trajectories(rows, {}, names)
    lo, hi = fig.layout.yaxis.range
    values = np.array([v for t in fig.data for v in t.y if v is not None])
    assert lo < values.min() and hi > values.max() and hi - lo < 0.2  # fitted, not [0, 1]
    label = next(a for a in fig.layout.annotations if a.text.startswith("1/K"))
    assert label.text == "1/K = 0.25" and label.xref == "paper" and label.x >= 1.0  # in the right margin
