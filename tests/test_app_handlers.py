"""The web app's handlers without a browser: plot builders, form conversion, replay, runs table."""

import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from app import plots
from app.forms import build_config, form_fields, parse_stages, parse_weights
from app.replay import gram_from_row, replay
from core.config import ConfigError, preset

ROOT = Path(__file__).resolve().parents[1]
NAMES = ["a", "b", "c"]


def balance_row(step, cos, norms, alpha_raw, alpha_ema, cos_up, phase="harmonized"):
    return {"step": step, "phase": phase, "alpha_raw": dict(zip(NAMES, alpha_raw)),
            "alpha_ema": dict(zip(NAMES, alpha_ema)), "cosine": {"names": NAMES, "matrix": cos},
            "grad_norms": dict(zip(NAMES, norms)), "cos_to_update": dict(zip(NAMES, cos_up)),
            "valid": {n: True for n in NAMES}, "solver": "cvxpy:OSQP:optimal"}


def test_web_modules_do_not_import_torch():
    code = ("import sys; import app.main, app.pages.dashboard, jobs.runner, jobs.compare; "
            "bad = [m for m in ('torch', 'diffusers', 'transformers', 'cvxpy') if m in sys.modules]; "
            "print(bad); sys.exit(1 if bad else 0)")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_reward_curves_have_raw_and_smoothed_traces_per_reward():
    series = {"reward/a": ([1, 2, 3], [0.0, 1.0, None]), "reward/b": ([1, 2, 3], [1.0, 1.0, 1.0])}
    fig = plots.reward_curves(series, ["a", "b", "missing"], smoothing=0.5)
    assert len(fig.data) == 4  # raw + smoothed for a and b; "missing" has no data
    smoothed = fig.data[1].y  # a float array: a missing value is NaN, a gap in the line
    assert list(smoothed[:2]) == [0.0, pytest.approx(2 / 3)] and math.isnan(smoothed[2])  # EMA skips missing
    assert fig.layout.uirevision == "rewards"
    spiky = plots.reward_curves({"reward/a": ([1, 2], [float("inf"), 1.0])}, ["a"])
    assert math.isnan(spiky.data[0].y[0]) and spiky.data[0].y[1] == 1.0  # non-finite -> a gap, not a spike
    empty = plots.reward_curves({}, ["a"])
    assert not empty.data and "No steps recorded yet" in empty.layout.annotations[0].text


def test_ema_is_bias_corrected():
    assert plots.ema([2.0, 2.0, 2.0], 0.9) == pytest.approx([2.0, 2.0, 2.0])
    assert plots.ema([0.0, 1.0], 0.0) == [0.0, 1.0]


def test_alpha_trajectories_show_solves_ema_applied_and_uniform_line():
    rows = [balance_row(1, np.eye(3).tolist(), [1, 1, 1], [0.2, 0.3, 0.5], [0.2, 0.3, 0.5], [0.5, 0.5, 0.5]),
            balance_row(11, np.eye(3).tolist(), [1, 1, 1], [0.6, 0.2, 0.2], [0.32, 0.27, 0.41], [0.4, 0.4, 0.4])]
    applied = {f"alpha/{n}": ([1, 2], [0.3, 0.3]) for n in NAMES}
    fig = plots.alpha_trajectories(rows, applied, NAMES)
    assert len(fig.data) == 9  # applied + EMA + solves per reward
    ema_a = next(t for t in fig.data if t.name == "a ᾱ (EMA)")
    assert list(ema_a.y) == [0.2, 0.32]
    assert any(abs(s.y0 - 1 / 3) < 1e-12 for s in fig.layout.shapes)
    for row in rows:  # balance rows stored before "full" and "harmonized" became one word draw the same
        row["phase"] = "full"
    old = plots.alpha_trajectories(rows, applied, NAMES)
    assert [list(t.y) for t in old.data] == [list(t.y) for t in fig.data]


def test_cosine_heatmap_marks_invalid_entries():
    cos = [[1.0, -0.5, None], [-0.5, 1.0, None], [None, None, None]]
    fig = plots.cosine_heatmap(balance_row(7, cos, [1, 1, 0], [0.5, 0.5, 0], [0.5, 0.5, 0], [0.1, 0.1, None]))
    z = fig.data[0].z
    assert z[0][1] == -0.5 and z[2][2] is None and fig.data[0].text[2][2] == "n/a"
    assert "step 7" in fig.layout.title.text


def test_conflict_stats_and_rate():
    rows = [balance_row(1, None, [1] * 3, [0] * 3, [0] * 3, [0.5, -0.1, 0.2]),
            balance_row(2, None, [1] * 3, [0] * 3, [0] * 3, [0.5, 0.1, 0.2]),
            balance_row(3, None, [1] * 3, [0] * 3, [0] * 3, [None, math.nan, 0.3])]
    stats = plots.conflict_stats(rows, NAMES)
    assert stats["min"] == [-0.1, 0.1, 0.3]
    assert stats["mean"][0] == pytest.approx(0.2)
    assert stats["var"][2] == 0.0
    assert stats["conflict_rate"] == pytest.approx(1 / 3)
    fig = plots.conflict_panels(rows, NAMES)
    assert "conflict rate 33%" in fig.layout.title.text
    assert "vs Σg/K" not in fig.layout.title.text  # not recorded: not shown


def test_conflicts_with_the_papers_weighted_sum_direction_are_shown_and_labelled_beside_the_update():
    rows = [balance_row(1, None, [1] * 3, [0] * 3, [0] * 3, [0.5, 0.1, 0.2]),
            balance_row(2, None, [1] * 3, [0] * 3, [0] * 3, [0.5, 0.1, 0.2])]
    rows[0]["cosine"]["to_mean"] = dict(zip(NAMES, [0.9, -0.2, 0.4]))
    rows[1]["cosine"]["to_mean"] = dict(zip(NAMES, [0.9, 0.2, 0.4]))
    paper = plots.conflict_stats(rows, NAMES, "mean")
    assert paper["min"] == [-0.2, 0.2] and paper["conflict_rate"] == pytest.approx(0.5)
    assert plots.conflict_stats(rows, NAMES)["conflict_rate"] == 0.0
    fig = plots.conflict_panels(rows, NAMES)
    assert "conflict rate 0%" in fig.layout.title.text and "(vs Σg/K: 50%)" in fig.layout.title.text
    names = [t.name for t in fig.data]
    assert "a" in names and "a vs Σg/K" in names


def test_specialist_structure_is_samples_by_rewards_with_blanks():
    samples = [{"step": 4, "idx": 0, "prompt": "p", "advantages": {"a": 1.0, "b": None, "c": 0.5}},
               {"step": 4, "idx": 1, "prompt": "q", "advantages": {"a": -1.0, "b": 2.0, "c": math.nan}}]
    fig = plots.specialist_structure(samples, NAMES)
    assert [list(r) for r in fig.data[0].z] == [[1.0, None, 0.5], [-1.0, 2.0, None]]


def test_pareto_front_excludes_dominated_runs():
    pts = [{"label": "A", "scores": {"x": 1.0, "y": 1.0}}, {"label": "B", "scores": {"x": 2.0, "y": 0.5}},
           {"label": "C", "scores": {"x": 0.5, "y": 0.5}}]
    fig = plots.pareto_scatter(pts, "x", "y")
    front = fig.data[0]
    assert list(front.x) == [1.0, 2.0] and list(front.y) == [1.0, 0.5]  # C is dominated by A


def test_form_fields_cover_the_config_and_carry_help():
    fields = {f.path: f for f in form_fields(preset("tiny"))}
    assert fields["balance.ema_rho"].kind == "float" and fields["balance.ema_rho"].default == 0.7
    assert fields["balance.harmonize_every"].kind == "int"
    assert fields["balance.strategy"].kind == "choice" and "marble" in fields["balance.strategy"].choices
    assert "N: a harmonized step" in fields["balance.harmonize_every"].help
    assert fields["balance.normalize"].kind == "bool"
    # issue 15's knobs: choices for the amortized combination and the rollout sampler, the parameter EMA's decay
    assert fields["balance.amortized_combination"].choices == ("masked", "authors")
    assert fields["balance.gradients"].choices == ("per_sample", "per_reward")
    assert fields["sampling.sampler"].kind == "choice" and fields["sampling.sampler"].choices == ("euler", "dpm2")
    assert fields["optim.ema_decay"].kind == "float" and "EMAModuleWrapper" in fields["optim.ema_decay"].help


def test_form_values_become_a_validated_config_or_the_exact_error():
    values = {"balance.ema_rho": 0.5, "steps": 7.0, "balance.strategy": "weighted_sum"}
    cfg = build_config("tiny", values, ["colorfulness", "brightness"], "colorfulness=2", "", None, ["tiny"])
    assert cfg.balance.ema_rho == 0.5 and cfg.steps == 7 and isinstance(cfg.steps, int)
    assert [(r.name, r.weight) for r in cfg.rewards] == [("colorfulness", 2.0), ("brightness", 1.0)]
    with pytest.raises(ConfigError, match=r"balance.ema_rho=1.5: must be a number in \[0, 1\)"):
        build_config("tiny", {"balance.ema_rho": 1.5}, ["colorfulness"], "", "", None, ["tiny"])
    with pytest.raises(ConfigError, match="select at least one reward"):
        build_config("tiny", {}, [], "", "", None, ["tiny"])
    with pytest.raises(ConfigError, match="is not a selected reward"):
        parse_weights("sharpness=2", ["colorfulness"])
    assert parse_stages("a:3; b+c:4") == [{"rewards": ["a"], "steps": 3, "sources": []},
                                          {"rewards": ["b", "c"], "steps": 4, "sources": []}]
    assert parse_stages("a:3@world-color+world-count")[0]["sources"] == ["world-color", "world-count"]
    from app.forms import format_stages
    cfg = preset("mini-sequential")
    assert parse_stages(format_stages(cfg.balance.stages)) == [
        {"rewards": st.rewards, "steps": st.steps, "sources": st.sources} for st in cfg.balance.stages]
    with pytest.raises(ConfigError, match="must be an integer"):
        parse_stages("a:x")


def test_replay_reconstructs_grams_and_reproduces_the_recorded_ema():
    rng = np.random.default_rng(0)
    rows = []
    from core.balancing import min_norm_weights

    ema = None
    for step in (1, 11, 21):
        g = rng.normal(size=(3, 8))
        norms = np.linalg.norm(g, axis=1)
        cos = (g @ g.T) / np.outer(norms, norms)
        alpha = min_norm_weights(cos)
        ema = alpha if ema is None else 0.7 * ema + 0.3 * alpha
        rows.append(balance_row(step, cos.tolist(), norms.tolist(), alpha.tolist(), ema.tolist(), [0, 0, 0]))
        np.testing.assert_allclose(gram_from_row(rows[-1], NAMES), g @ g.T, atol=1e-9)
    same = replay(rows, NAMES, ema_rho=0.7, harmonize_every=10)
    np.testing.assert_allclose(same.replayed, same.recorded, atol=1e-6)
    no_ema = replay(rows, NAMES, ema_rho=0.0, harmonize_every=10)
    np.testing.assert_allclose(no_ema.replayed[-1], [r["alpha_raw"][n] for n in NAMES for r in rows[-1:]],
                               atol=1e-6)
    sparse = replay(rows, NAMES, ema_rho=0.7, harmonize_every=20)
    assert sparse.solves == [1, 21]
    # the release's knobs replay too: every replayed α respects the floor; a group splits its α equally
    floored = replay(rows, NAMES, ema_rho=0.0, harmonize_every=10, alpha_floor=0.2)
    assert np.min(floored.replayed) >= 0.2 - 1e-9
    grouped = replay(rows, NAMES, ema_rho=0.0, harmonize_every=10, reward_groups={"ab": ["a", "b"]})
    assert all(abs(a - b) < 1e-12 for a, b, _ in grouped.replayed)
    assert not np.allclose(grouped.replayed, no_ema.replayed, atol=1e-3)


def test_replay_page_takes_the_knobs_and_names_a_bad_one():
    from app.pages.replay import render

    fig, note = render(1, 0.7, 10, True, 0.0, "[1, 2]", "{}")
    assert "reward groups='[1, 2]': must be a JSON object" in note


def test_a_config_shown_in_the_form_builds_back_to_the_same_config():
    from app.forms import config_form_values

    cfg = preset("tiny-sequential").with_overrides({"balance.ema_rho": 0.3, "steps": 9,
                                                    "balance.reward_groups": {"g": ["colorfulness", "brightness"]},
                                                    "balance.alpha_floor": 0.1})
    fields = form_fields(cfg)
    *values, rewards, weights, stages, single, sources = config_form_values(cfg, fields)
    again = build_config("tiny", {f.path: v for f, v in zip(fields, values)}, rewards, weights, stages, single,
                         sources)
    assert again == cfg


def test_replay_page_says_what_to_do_and_refuses_a_blank_n():
    from app.pages.replay import EMPTY, render

    fig, note = render(None, 0.7, 10, True)
    assert EMPTY in fig.layout.annotations[0].text and note == ""
    for bad in (None, 2.5):  # an emptied or fractional N box: a message, not a traceback
        fig, note = render(1, 0.7, bad, True)
        assert f"N={bad}: write a whole number of steps" in note and "N=" in fig.layout.annotations[0].text


def test_replay_of_a_run_deleted_since_the_picker_was_filled_says_so(web_store):
    from app.pages.replay import render

    fig, note = render(42, 0.7, 10, True)
    assert "run 42 does not exist: press Reload runs." in fig.layout.annotations[0].text


def test_every_preset_note_names_its_model_and_the_studied_worlds_give_a_measured_duration():
    from app.pages.new_run import preset_note
    from core.config import available_presets

    for name in available_presets():
        note = preset_note(name)
        assert note.startswith(available_presets()[name]) and "**Model:**" in note and "**Expected duration:**" in note
        if name.startswith(("mini-", "object-", "object150-")):
            assert "mini-world" in note and "minutes on 2 CPU cores" in note and "measured" in note
    assert preset_note("no-such-preset") == "" and preset_note(None) == ""


def test_no_number_box_rounds_or_bounds_what_the_user_typed(web_store):
    """precision=0 made Gradio round 2.5 to 2 before any check saw it (steps=2.5 was queued as 2 steps), and its
    minimum/maximum answered 0 seeds with an unnamed toast; the handlers' own checks name the field and rule."""
    import gradio as gr

    from app.main import build_app
    from app.pages.new_run import start

    numbers = [b for b in build_app().blocks.values() if isinstance(b, gr.Number)]
    assert len(numbers) > 20
    assert [n.label for n in numbers if n.precision is not None or n.minimum is not None or n.maximum is not None] == []
    fields = form_fields(preset("tiny"))
    values = [2.5 if f.path == "steps" else f.default for f in fields]
    cfg = preset("tiny")
    error, status = start("tiny", "", cfg.reward_names, "", "", None, list(cfg.prompts.sources), fields, values)
    assert "steps=2.5: must be an integer" in error and status == "" and web_store.list_runs() == []


@pytest.mark.parametrize("n", [2.5, 0, -3, None])
def test_replay_refuses_a_solve_interval_that_is_not_a_whole_number_of_steps(web_store, n):
    from app.pages.replay import render

    run_id = web_store.create_run(preset("tiny").to_dict(), strategy="marble", total_steps=3)
    _, note = render(run_id, 0.7, n, True)
    assert note == f"`N={n}: write a whole number of steps ≥ 1`"


@pytest.mark.parametrize("name, rule", [
    ("x" * 201, "(201 characters): a run name is at most 200 characters"),
    ("<b>bold</b>\nsecond line", "a run name is one line of text; it contains '\\n'"),
    ("tab\there", "it contains '\\t'"),
    ("<b>bold</b>", "may not contain '<' or '>'"),
])
def test_a_run_name_is_one_line_of_plain_text(web_store, name, rule):
    """New-user pass: a name with a newline and HTML was queued, split the Dashboard title in two and rendered
    bold; the queue refuses it by name, for the form, the CLI and imports alike (core.limits.check_name)."""
    from app.pages.new_run import start
    from core.limits import check_name

    cfg = preset("tiny")
    fields = form_fields(cfg)
    error, status = start("tiny", name, cfg.reward_names, "", "", None, list(cfg.prompts.sources), fields,
                          [f.default for f in fields])
    assert error.startswith("**Not started.**") and rule in error and status == "" and web_store.list_runs() == []
    with pytest.raises(ValueError, match="--name="):
        check_name("--name", name)
    check_name("name", "marble · seed 3 (ρ=0.7, lr 3e-4) — ünïcode")  # plain text of any script passes


def test_run_pickers_name_runs_by_what_does_not_change_while_they_train(web_store):
    """New-user pass: the Dashboard picker read "queued 0/20" after the run had finished (pickers fill on Reload)."""
    from app.context import job_choices, run_choices
    from jobs import schema as sch

    named = web_store.create_run(preset("tiny").to_dict(), strategy="marble", total_steps=20, name="sweep a")
    plain = web_store.create_run(preset("tiny").to_dict(), strategy="equal", total_steps=20)
    web_store.claim(named)
    web_store.finish(named, sch.SUCCEEDED)
    assert run_choices() == [(f"#{plain} equal", plain), (f"#{named} sweep a (marble)", named)]
    assert job_choices() == run_choices()


def test_help_text_keeps_its_formula_symbols_when_rendered_as_markdown():
    """New-user pass: "ᾱ_t = ρ·ᾱ_{t-1}" lost its underscores to italics and "α* ... α*" italicised the text between
    (Gradio's info lines read * and _ pairs as emphasis and honour neither backslash escapes nor entities)."""
    import re

    from app.forms import md_literal

    assert md_literal("ᾱ_t = ρ·ᾱ_{t-1}; α* as is, α*.") == "`ᾱ_t` = `ρ·ᾱ_{t-1}`; `α*` as is, `α*`."
    assert md_literal("marble_full, weighted_sum and `a_b*c`") == "marble_full, weighted_sum and `a_b*c`"
    for f in form_fields(preset("tiny")):  # outside code spans nothing is left that could open emphasis
        plain = re.sub(r"`[^`]*`", "", f.help or "")
        assert "*" not in plain and not re.search(r"(?<![A-Za-z0-9])_|_(?![A-Za-z0-9])", plain), (f.path, f.help)


def test_the_new_run_form_says_what_every_reward_measures():
    """New-user pass: bare reward names and values with no meaning or units; Reward.description was never shown."""
    from app.pages.new_run import reward_glossary
    from core.rewards import available_rewards

    table = reward_glossary()
    for name, description in available_rewards().items():
        assert f"<td><code>{name}</code></td>" in table
    assert "minus the image&#x27;s JPEG size in kB" in table  # what jpeg_compressibility -4.24 means


def test_small_axis_values_are_written_as_powers_of_ten_not_si_prefixes():
    """New-user pass: the Conflicts panel's 'variance over rewards' axis read "20p ... 80p" (pico)."""
    k = len(NAMES)
    rows = [balance_row(step, np.eye(k).tolist(), [1.0] * k, [1 / k] * k, [1 / k] * k, [0.5 + 1e-11 * step] * k)
            for step in (1, 2)]
    fig = plots.conflict_panels(rows, NAMES)
    full = fig.layout.template.layout
    assert full.xaxis.exponentformat == "power" and full.yaxis.exponentformat == "power"


def test_the_run_header_says_when_a_run_is_starting_or_finishing(web_store):
    """New-user pass: "step 0/20 (0%)" with nothing else for 40 s at the start, "ETA 0m00s" for 30 s at the end."""
    from app.pages.dashboard import header
    from jobs.storage import Batch

    run_id = web_store.create_run(preset("tiny").to_dict(), strategy="marble", total_steps=2, name="h")
    web_store.claim(run_id)
    assert "starting: loading the model" in header(run_id)
    web_store.write_batch(run_id, Batch(run={"step": 1, "seconds_per_step": 4.0}))
    assert "ETA 0m04s" in header(run_id)  # one step left at 4 s a step
    web_store.write_batch(run_id, Batch(run={"step": 2, "seconds_per_step": 4.0}))
    text = header(run_id)
    assert "finishing: writing the last checkpoint" in text and "ETA" not in text


def test_a_short_run_is_ticked_at_whole_steps():
    """New-user pass: the α and conflict x-axes ticked 1.5, 2.5 early in a run."""
    import plotly.graph_objects as go

    from app.plots import _few_whole_xs, alpha_trajectories

    rows = [balance_row(step, np.eye(3).tolist(), [1.0] * 3, [1 / 3] * 3, [1 / 3] * 3, [0.5] * 3) for step in (1, 2, 3)]
    assert alpha_trajectories(rows, {}, NAMES).layout.xaxis.dtick == 1
    assert _few_whole_xs(go.Figure(go.Scatter(x=[1, 2, 3], y=[0, 1, 0])))
    assert not _few_whole_xs(go.Figure(go.Scatter(x=list(range(1, 200)), y=[0] * 199)))  # a long run: plotly's ticks
    assert not _few_whole_xs(go.Figure(go.Scatter(x=[0.1, 0.5], y=[0, 1])))  # a reward on x (Pareto): not steps
    assert not _few_whole_xs(go.Figure(go.Heatmap(z=[[1, 0], [0, 1]], x=["a", "b"], y=["a", "b"])))  # categories


def test_the_cosine_slider_is_locked_until_a_second_step_is_diagnosed():
    """New-user pass: with one diagnosed step the slider ran 1-2, offering a step that has no diagnosis."""
    from app.pages.dashboard import DashState, cos_slider

    state = DashState()
    state.balance = [balance_row(1, np.eye(3).tolist(), [1.0] * 3, [1 / 3] * 3, [1 / 3] * 3, [0.5] * 3)]
    one = cos_slider(state)
    assert one["interactive"] is False and one["value"] == 1
    state.balance.append(balance_row(3, np.eye(3).tolist(), [1.0] * 3, [1 / 3] * 3, [1 / 3] * 3, [0.5] * 3))
    two = cos_slider(state)
    assert two["interactive"] is True and (two["minimum"], two["maximum"], two["value"]) == (1, 3, 3)


def test_the_attribution_plot_names_its_one_prompt_source_in_a_legend():
    """New-user pass: the help says the bar colours are prompt sources, but a run with one source had no legend."""
    att = {"pair": ["a", "b"], "cosine": -0.5, "scope": "microbatch",
           "samples": [{"share": -0.4, "source": "world-general", "prompt": "a red circle", "seed": 0, "sigma": 0.5},
                       {"share": -0.1, "source": "world-general", "prompt": "a blue square", "seed": 1, "sigma": 0.5}]}
    fig = plots.conflict_attribution(att, 3)
    assert fig.layout.showlegend is True and [t.name for t in fig.data] == ["world-general"]
    assert fig.layout.legend.title.text == "prompt source"


def test_the_study_alpha_overlay_draws_a_run_with_a_single_solve():
    """Second pass: two 3-step runs with one harmonized step each gave a legend and an empty plot (lines of one
    point draw nothing)."""
    row = balance_row(1, np.eye(3).tolist(), [1.0] * 3, [1 / 3] * 3, [1 / 3] * 3, [0.5] * 3)
    fig = plots.alpha_overlay([{"label": "#1 a", "balance": [row]}, {"label": "#2 b", "balance": [row, {**row, "step": 3}]}],
                              NAMES)
    modes = {t.name: t.mode for t in fig.data}
    assert modes["#1 a · a"] == "lines+markers" and modes["#2 b · a"] == "lines"
