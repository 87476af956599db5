"""A study repeated over seeds: "Start study" queues strategies × seeds into a real SQLite store, and the
Study page's per-strategy summary gives mean ± standard error over each strategy's runs."""

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


def test_by_strategy_gives_mean_and_standard_error_over_each_strategys_runs():
    from app.pages.study import by_strategy

    df = pd.DataFrame([
        {"run": "#1", "strategy": "marble", "Δa (σ)": 1.0, "Δb (σ)": -1.0, "composite (σ)": 0.0},
        {"run": "#2", "strategy": "marble", "Δa (σ)": 3.0, "Δb (σ)": None, "composite (σ)": 2.0},
        {"run": "#3", "strategy": "weighted_sum", "Δa (σ)": 0.5, "Δb (σ)": 0.25, "composite (σ)": 0.75},
    ])
    out = by_strategy(df).set_index("strategy")
    assert out.loc["marble", "runs"] == 2 and out.loc["weighted_sum", "runs"] == 1
    assert out.loc["marble", "Δa (σ)"] == "+2.000 ± 1.000"  # 1 and 3: sample std 1.414, over √2 runs
    assert out.loc["marble", "Δb (σ)"] == "-1.000"  # the missing value is left out, not counted as 0
    assert out.loc["weighted_sum", "composite (σ)"] == "+0.750"
    assert out.loc["weighted_sum", "note"] == "one run: no spread over seeds" and out.loc["marble", "note"] == "2 seeds"
    assert by_strategy(pd.DataFrame()).empty


def test_runs_that_are_not_seeds_of_one_design_are_not_pooled_and_say_why():
    """Two runs of one seed are one measurement counted twice (a standard error of about 0 made "up by > 1 SE"
    findings out of a 2-step and a 20-step run of seed 0): such a strategy gets the reason, not numbers."""
    from app.pages.study import by_strategy, findings

    df = pd.DataFrame([
        {"run": "#1", "strategy": "marble", "state": "finished", "Δa (σ)": 0.5, "composite (σ)": 0.5},
        {"run": "#4", "strategy": "marble", "state": "finished", "Δa (σ)": 0.5, "composite (σ)": 0.5},
        {"run": "#2", "strategy": "weighted_sum", "state": "finished", "Δa (σ)": 2.0, "composite (σ)": 2.0},
        {"run": "#3", "strategy": "weighted_sum", "state": "finished", "Δa (σ)": 2.2, "composite (σ)": 2.2},
    ])
    df.attrs["not_pooled"] = {"marble": "seed 0 is picked 2 times (#1, #4)"}
    out = by_strategy(df).set_index("strategy")
    assert out.loc["marble", "runs"] == 2 and out.loc["marble", "Δa (σ)"] == ""
    assert out.loc["marble", "note"] == "not pooled: seed 0 is picked 2 times (#1, #4)"
    assert out.loc["weighted_sum", "Δa (σ)"] == "+2.100 ± 0.100"
    text = findings(df)
    assert "**marble** is left out: seed 0 is picked 2 times (#1, #4)." in text
    assert not any(line.startswith("| marble |") for line in text.splitlines())
    assert any(line.startswith("| weighted_sum |") for line in text.splitlines())
    df = df.iloc[:2].copy()
    df.attrs["not_pooled"] = {"marble": "seed 0 is picked 2 times (#1, #4)"}
    assert findings(df) == "**What the seeds support:** nothing yet. **marble** is left out: seed 0 is picked 2 " \
                           "times (#1, #4)."


def test_findings_say_which_differences_the_finished_seeds_support():
    from app.pages.study import findings

    df = pd.DataFrame([
        {"run": "#1", "strategy": "marble", "state": "finished", "Δa (σ)": 1.0, "Δb (σ)": 0.9},
        {"run": "#2", "strategy": "marble", "state": "finished", "Δa (σ)": 3.0, "Δb (σ)": 1.1},
        {"run": "#3", "strategy": "weighted_sum", "state": "finished", "Δa (σ)": 2.0, "Δb (σ)": -1.0},
        {"run": "#4", "strategy": "weighted_sum", "state": "finished", "Δa (σ)": 2.2, "Δb (σ)": -1.2},
        {"run": "#5", "strategy": "weighted_sum", "state": "unfinished: running at 3/10", "Δa (σ)": 9.0,
         "Δb (σ)": 9.0},
    ])
    text = findings(df)
    assert text.startswith("**What the seeds support** (training prompts")
    rows = {line.split(" | ")[0][2:]: line.split(" | ") for line in text.splitlines() if line.startswith("| ")}
    # marble: a +2 ± 1, b +1 ± 0.1, both up, worst b; weighted sum (the unfinished run left out): a up, b down
    assert rows["marble"][1:5] == ["a, b", "—", "—", "b +1.00 ± 0.10"]
    assert rows["weighted_sum"][1:5] == ["a", "b", "—", "b -1.10 ± 0.10"]
    assert rows["marble"][5] == "weighted_sum (+2.10 ± 0.14)"
    assert findings(df.iloc[[0, 2]]) == ""  # one run per strategy: nothing a seed spread could support


def test_study_page_says_what_to_do_before_any_run_is_picked():
    """With nothing picked the tables and plots carry the hint, not Gradio's bare "1 2 3" headers."""
    from app.pages.study import EMPTY_HINT, render

    table, summary, supported, pareto, overlay, x_pick, y_pick, *_ = render([], "clean_background", "palette_purity")
    assert table.iloc[0, 0] == EMPTY_HINT and list(summary.columns) == ["strategies"] and supported == ""
    # every run unpicked: the axis pickers are emptied with their values, or the next pick fails Gradio's check
    assert x_pick["choices"] == [] and x_pick["value"] is None and y_pick["value"] is None
    assert EMPTY_HINT in pareto.layout.annotations[0].text and EMPTY_HINT in overlay.layout.annotations[0].text


def test_a_run_deleted_since_the_picker_was_filled_is_left_out_of_the_study(store):
    from app.pages.study import study_table

    st, _ = store
    kept = st.create_run(preset("tiny").to_dict(), strategy="marble", total_steps=3, name="kept")
    df, points = study_table([kept, kept + 1])
    assert list(df["run"]) == ["#%d kept" % kept] and [p["label"] for p in points] == ["#%d kept" % kept]


def _trained(st, name: str, status: str, steps: int, total: int, reward=lambda k: float(k)) -> int:
    """A run of the tiny preset (reward brightness etc.) with ``steps`` steps of metrics: reward k at step k."""
    from jobs import schema as sch
    from jobs.storage import Batch

    cfg = preset("tiny").to_dict()
    run_id = st.create_run(cfg, strategy=cfg["balance"]["strategy"], total_steps=total, name=name)
    if status == sch.QUEUED:
        return run_id
    st.claim(run_id)
    batch = Batch()
    for k in range(1, steps + 1):
        for r in cfg["rewards"]:
            batch.metrics += [{"step": k, "key": f"reward/{r['name']}", "value": reward(k)},
                              {"step": k, "key": f"reward_std/{r['name']}", "value": 1.0}]
    batch.run.update(step=steps)
    st.write_batch(run_id, batch)
    if status != sch.RUNNING:
        st.finish(run_id, status)
    return run_id


def test_unfinished_runs_are_marked_and_runs_are_compared_at_the_same_step(store):
    """Issue 18 item 2: a queued run has no composite (not +0.000), a run cut short is not a result, and runs of
    20 and 10 steps are compared at step 10, said on the page."""
    from app.pages.study import by_strategy, render, study_table

    st, _ = store
    long_ = _trained(st, "long", "succeeded", 20, 20)
    short = _trained(st, "short", "succeeded", 10, 10)
    partial = _trained(st, "partial", "running", 4, 20, reward=lambda k: 100.0 * k)  # best by far, unfinished
    queued = _trained(st, "waiting", "queued", 0, 20)
    df, _ = study_table([long_, short, partial, queued])
    rows = df.set_index("run")
    name = preset("tiny").reward_names[0]
    # reward k at step k: over steps 1..10 the last 10% is step 10, the first 10% step 1 -> Δ = 9 (std 1)
    assert rows.loc[f"#{long_} long", f"Δ{name} (σ)"] == 9.0 == rows.loc[f"#{short} short", f"Δ{name} (σ)"]
    assert rows.loc[f"#{long_} long", "steps"] == 10 and rows.loc[f"#{long_} long", name] == 10.0
    assert rows.loc[f"#{queued} waiting", "state"] == "not started"
    assert pd.isna(rows.loc[f"#{queued} waiting", "composite (σ)"])  # blank, not +0.000
    assert rows.loc[f"#{partial} partial", "state"] == "unfinished: running at 4/20"
    assert rows.loc[f"#{long_} long", "state"] == "finished"
    summary = by_strategy(df)
    assert summary.loc[0, "runs"] == 2  # the two finished runs only
    # ...and they are one seed twice, not two seeds: not pooled
    assert list(df["seed"]) == [0, 0, 0, 0]
    assert summary.loc[0, "note"] == f"not pooled: seed 0 is picked 2 times (#{long_} long, #{short} short)"
    *_, note = render([long_, short, partial, queued], None, None)
    assert "compared at step **10**" in note and "#%d partial" % partial in note and "#%d waiting" % queued in note


def test_a_recorded_held_out_evaluation_shows_as_base_std_units_with_standard_errors(store):
    """jobs.evaluations.record stores core.evaluate's result; the Study shows Δ / base std ± its standard error."""
    import math

    from app.pages.study import study_table
    from core.evaluate import compare
    from jobs.evaluations import latest, record

    st, _ = store
    run_id = _trained(st, "evaluated", "succeeded", 4, 4)
    base = {"a": [0.0, 1.0, 2.0, 3.0], "b": [float("nan")] * 4}
    run = {"a": [1.0, 2.0, 3.0, 5.0], "b": [float("nan")] * 4}
    result = {**compare(base, run, train_rewards=["a"]), "settings": {"split": "test"}, "weights": "ema",
              "checkpoint": "/x/step_000004", "images": 4}
    eval_id = record(st, run_id, result, checkpoint_step=4)
    ev = latest(st, run_id)
    assert ev["id"] == eval_id and ev["name"] == "held-out test" and ev["scores"] == {"a": 2.75, "b": None}
    a = ev["details"]["rewards"]["a"]
    sb, sr = math.sqrt(5 / 3), math.sqrt(((1 - 2.75) ** 2 + (2 - 2.75) ** 2 + (3 - 2.75) ** 2 + (5 - 2.75) ** 2) / 3)
    assert a["z"] == pytest.approx(1.25 / sb) and a["z_se"] == pytest.approx(math.sqrt(sr ** 2 / 4 + sb ** 2 / 4) / sb)
    df, _ = study_table([run_id])
    row = df.iloc[0]
    assert row["held-out Δa (base σ)"] == f"{1.25 / sb:+.2f} ± {a['z_se']:.2f}"
    assert row["held-out at step"] == "4" and row["held-out composite (base σ)"] == f"{1.25 / sb:+.2f}"
    assert "held-out Δb (base σ)" not in row  # applied to no held-out prompt: no column, not a zero
