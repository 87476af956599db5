"""A study repeated over seeds: "Start study" queues strategies × seeds into a real SQLite store, and the
Study page's per-strategy summary gives mean ± std over each strategy's runs."""

import pandas as pd
import pytest

from app.forms import config_form_values, form_fields
from core.config import preset


@pytest.fixture
def store(web_store, monkeypatch):
    import jobs.runner

    started = []
    monkeypatch.setattr(jobs.runner, "ensure_worker", lambda store: started.append(store))  # no training here
    return web_store, started


def start(seeds, strategies=("marble", "weighted_sum")):
    from app.pages.new_run import start_study

    fields = form_fields(preset("tiny"))
    *values, rewards, weights, stages, single, sources = config_form_values(preset("tiny"), fields)
    return start_study("tiny", "seeds", rewards, weights, stages, single, sources, list(strategies), seeds, fields,
                       values)


def test_a_study_over_seeds_queues_every_strategy_with_consecutive_seeds(store):
    st, started = store
    error, status = start(3.0)  # gr.Number sends a float
    assert error == "" and "3 seeds per strategy" in status
    runs = sorted(st.list_runs(), key=lambda r: r.id)
    assert len(runs) == 6 and len(started) == 1
    got = {(st.get_run(r.id).config["balance"]["strategy"], st.get_run(r.id).config["seed"]) for r in runs}
    assert got == {(s, k) for s in ("marble", "weighted_sum") for k in (0, 1, 2)}
    assert {r.name for r in runs} >= {"seeds · marble · seed 0", "seeds · weighted_sum · seed 2"}
    for r in runs:  # apart from strategy and seed, one config
        cfg = st.get_run(r.id).config
        assert {k: v for k, v in cfg.items() if k not in ("balance", "seed")} == \
            {k: v for k, v in st.get_run(runs[0].id).config.items() if k not in ("balance", "seed")}


def test_one_seed_keeps_the_plain_names(store):
    st, _ = store
    error, status = start(1)
    assert error == "" and "one per strategy" in status
    assert sorted(r.name for r in st.list_runs()) == ["seeds · marble", "seeds · weighted_sum"]


@pytest.mark.parametrize("seeds", [0, 2.5, None, 17])
def test_a_bad_seed_count_is_refused_and_queues_nothing(store, seeds):
    st, started = store
    error, status = start(seeds)
    assert "seeds per strategy" in error and "integer from 1 to 16" in error and status == ""
    assert st.list_runs() == [] and started == []


def test_by_strategy_gives_mean_and_sample_std_over_each_strategys_runs():
    from app.pages.study import by_strategy

    df = pd.DataFrame([
        {"run": "#1", "strategy": "marble", "Δa (σ)": 1.0, "Δb (σ)": -1.0, "composite (σ)": 0.0},
        {"run": "#2", "strategy": "marble", "Δa (σ)": 3.0, "Δb (σ)": None, "composite (σ)": 2.0},
        {"run": "#3", "strategy": "weighted_sum", "Δa (σ)": 0.5, "Δb (σ)": 0.25, "composite (σ)": 0.75},
    ])
    out = by_strategy(df).set_index("strategy")
    assert out.loc["marble", "runs"] == 2 and out.loc["weighted_sum", "runs"] == 1
    assert out.loc["marble", "Δa (σ)"] == "+2.000 ± 1.414"  # sample std of 1 and 3
    assert out.loc["marble", "Δb (σ)"] == "-1.000"  # the missing value is left out, not counted as 0
    assert out.loc["weighted_sum", "composite (σ)"] == "+0.750"
    assert by_strategy(pd.DataFrame()).empty


def test_study_page_says_what_to_do_before_any_run_is_picked():
    """With nothing picked the tables and plots carry the hint, not Gradio's bare "1 2 3" headers."""
    from app.pages.study import EMPTY_HINT, render

    table, summary, pareto, overlay, *_ = render([], None, None)
    assert table.iloc[0, 0] == EMPTY_HINT and list(summary.columns) == ["strategies"]
    assert EMPTY_HINT in pareto.layout.annotations[0].text and EMPTY_HINT in overlay.layout.annotations[0].text


def test_a_run_deleted_since_the_picker_was_filled_is_left_out_of_the_study(store):
    from app.pages.study import study_table

    st, _ = store
    kept = st.create_run(preset("tiny").to_dict(), strategy="marble", total_steps=3, name="kept")
    df, points = study_table([kept, kept + 1])
    assert list(df["run"]) == ["#%d kept" % kept] and [p["label"] for p in points] == ["#%d kept" % kept]
