"""Evaluation: Table-1 arithmetic, the reward set, and the --run / --study commands end to end on tiny runs."""

import gzip
import json
import math
import shutil

import numpy as np
import pytest
from PIL import Image

from core.evaluate import (EvalSettings, compare, eval_reward_names, evaluate_run, main, mean_alpha, strategy_findings,
                           strategy_stats, strategy_summary, study,
                           study_figures, training_summary, write_figures)
from core.train import main as train_main
from tests.helpers import load_script, small_config

WORLD = ["world-general", "world-color", "world-count", "world-position"]


def test_composite_is_the_sum_of_improvements_in_base_std_units():
    base = {"a": [0.0, 1.0, 2.0, 3.0], "b": [1.0, 1.0, 3.0, 3.0], "c": [float("nan")] * 4}
    run = {"a": [1.0, 2.0, 3.0, 4.0], "b": [0.0, 0.0, 2.0, 2.0], "c": [float("nan")] * 4}
    out = compare(base, run, train_rewards=["a"])
    std_a = (sum((x - 1.5) ** 2 for x in base["a"]) / 3) ** 0.5
    std_b = (4 / 3) ** 0.5
    assert out["rewards"]["a"]["z"] == pytest.approx(1.0 / std_a)
    assert out["rewards"]["b"]["z"] == pytest.approx(-1.0 / std_b)
    assert out["rewards"]["c"]["n"] == 0 and math.isnan(out["rewards"]["c"]["z"])
    assert out["composite_train"] == pytest.approx(1.0 / std_a)
    assert out["composite_all"] == pytest.approx(1.0 / std_a - 1.0 / std_b)
    assert out["rewards"]["a"]["trained_on"] and not out["rewards"]["b"]["trained_on"]


def test_strategy_summary_spreads_each_strategy_over_its_seeds():
    def result(strategy, za, zb):
        return {"strategy": strategy, "train_rewards": ["a", "b"], "composite_train": za + zb,
                "rewards": {"a": {"z": za}, "b": {"z": zb}}}

    one_each = [result("marble", 1.0, 1.0), result("weighted_sum", 2.0, -1.0)]
    assert strategy_summary(one_each) == ""  # nothing to spread: the per-run table says it all
    lines = strategy_summary(one_each + [result("marble", 3.0, -0.5)]).splitlines()
    marble = next(line for line in lines if line.startswith("| marble |"))
    # a: 1 and 3 -> +2.00, standard error std/√2 = 1.00; b: 1 and -0.5 -> +0.25 ± 0.75; composite 2 and 2.5
    # (+2.25 ± 0.25); the worst reward is b; one run has both up
    assert marble == "| marble | 2 | +2.00 ± 1.00 | +0.25 ± 0.75 | +2.25 ± 0.25 | b +0.25 ± 0.75 | 1 of 2 |"
    assert "| weighted_sum | 1 | +2.00 | -1.00 | +1.00 | b -1.00 | 0 of 1 |" in lines


def test_strategy_findings_apply_the_one_standard_error_rule():
    def result(strategy, za, zb, alpha=None):
        return {"strategy": strategy, "train_rewards": ["a", "b"], "composite_train": za + zb,
                "rewards": {"a": {"z": za}, "b": {"z": zb}}, "mean_alpha": alpha or {}}

    # "bal": a = 2 ± 1 (up), b = 1 ± 0.1 (up; the worst); "sum": a = 3 ± 0.1 (up), b = -0.05 ± 0.45 (within 1 SE:
    # the worst); "lean": a = -2 ± 0.5 (down; the worst), b = 1 ± 0 (up)
    results = [result("bal", 1.0, 0.9, {"a": 0.7, "b": 0.3}), result("bal", 3.0, 1.1, {"a": 0.5, "b": 0.5}),
               result("sum", 2.9, 0.4), result("sum", 3.1, -0.5),
               result("lean", -1.5, 1.0), result("lean", -2.5, 1.0)]
    stats = strategy_stats(results)
    assert stats["bal"]["rewards"]["a"] == pytest.approx({"mean": 2.0, "se": 1.0, "n": 2})
    assert [stats[s]["worst"] for s in ("bal", "sum", "lean")] == ["b", "b", "a"]
    assert stats["bal"]["mean_alpha"]["a"] == pytest.approx({"mean": 0.6, "se": 0.1})
    assert stats["sum"]["mean_alpha"] == {}  # logs without α: no α row
    findings, alpha_table = strategy_findings(stats).split("Mean α over each run's steps")
    rows = {line.split(" | ")[0][2:]: line.split(" | ") for line in findings.splitlines()
            if line.startswith("| ") and not line.startswith("| strategy")}
    assert rows["bal"][1:4] == ["a, b", "—", "—"]
    assert rows["sum"][1:4] == ["a", "—", "b"] and rows["lean"][1:4] == ["b", "a", "—"]
    # bal's worst (1 ± 0.1) against sum's (-0.05 ± 0.45): +1.05 > √(0.1² + 0.45²) = 0.46; against lean's
    # (-2 ± 0.5) +3.00 ± 0.51; sum's worst beats lean's (+1.95 ± 0.67) but not bal's
    assert rows["bal"][5] == "sum (+1.05 ± 0.46), lean (+3.00 ± 0.51)" and rows["bal"][6] == "— |"
    assert rows["sum"][5] == "lean (+1.95 ± 0.67)" and rows["sum"][6].startswith("bal (-1.05 ± 0.46)")
    assert "| bal | 0.60 ± 0.10 | 0.40 ± 0.10 |" in alpha_table and "| sum |" not in alpha_table
    assert strategy_findings(strategy_stats(results[:1] + results[2:3])) == ""  # one run each: no spread, no finding


def test_mean_alpha_averages_the_applied_coefficients_over_steps():
    events = [{"event": "start"}, {"event": "step", "step": 1, "alpha": {"a": 0.2, "b": 0.8}},
              {"event": "balance", "step": 1, "alpha_raw": {"a": 1.0, "b": 0.0}},
              {"event": "step", "step": 2, "alpha": {"a": 0.4, "b": None}}]
    assert mean_alpha(events) == pytest.approx({"a": 0.3, "b": 0.8})
    assert mean_alpha([]) == {}


def test_evaluation_uses_training_rewards_first_then_offline_held_out_ones():
    names = eval_reward_names(["count_accuracy", "jpeg_compressibility"], ["three red circles"])
    assert names[:2] == ["count_accuracy", "jpeg_compressibility"]
    assert {"world_geneval", "spatial_relation", "contrast"} <= set(names)
    assert not {"pickscore", "geneval", "remote", "ocr"} & set(names)  # need weights / a server / quotes
    assert "ocr" in eval_reward_names(["count_accuracy"], ['a sign that says "hi"'])


def _tiny_world_run(tmp_path, name, strategy):
    cfg = small_config(strategy, steps=2, **{
        "prompts.sources": WORLD, "sampling.prompts_per_step": 4, "sampling.max_sequence_length": 4,
        "rewards": [{"name": "count_accuracy"}, {"name": "spatial_relation"}, {"name": "colorfulness"}],
        "balance.diagnose_every": 1, "optim.lr": 0.02})
    path = tmp_path / f"{name}.json"
    cfg.save(path)
    out = tmp_path / name
    assert train_main(["--config", str(path), "--out", str(out), "--quiet"]) == 0
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("evalruns")
    return [_tiny_world_run(tmp, "marble", "marble"), _tiny_world_run(tmp, "wsum", "weighted_sum")]


def test_run_evaluation_scores_base_and_checkpoint_on_held_out_prompts(runs, capsys):
    assert main(["--run", str(runs[0]), "--prompts-per-source", "2", "--seeds", "2"]) == 0
    printed = capsys.readouterr().out
    assert "| count_accuracy | ✓ |" in printed and "world_geneval" in printed
    result = json.loads((runs[0] / "eval_test.json").read_text())
    assert result["images"] == 4 * 2 * 2
    rows = result["rewards"]
    assert rows["count_accuracy"]["n"] == 4 and rows["spatial_relation"]["n"] == 4  # NaN off their sources
    assert rows["colorfulness"]["n"] == 16
    # the checkpoint's LoRA really is applied: the images (hence a continuous reward) moved
    assert rows["colorfulness"]["mean"] != rows["colorfulness"]["base_mean"]
    assert set(result["by_source"]["run"]) == set(WORLD)
    assert result["weights"] == "ema"  # the checkpoint's parameter EMA, by default
    assert main(["--run", str(runs[0]), "--prompts-per-source", "2", "--seeds", "2", "--weights", "raw"]) == 0
    raw = json.loads((runs[0] / "eval_test.json").read_text())
    assert raw["weights"] == "raw" and raw["rewards"]["colorfulness"]["mean"] != rows["colorfulness"]["mean"]


def test_study_writes_the_table_and_figures_from_the_runs_own_logs(runs, tmp_path, capsys):
    doc = study(runs, tmp_path / "study", EvalSettings("test", 2, 2))
    md = (tmp_path / "study" / "study.md").read_text()
    assert "| base model |" in md and "marble (marble)" in md and "wsum (weighted_sum)" in md
    assert "composite (train)" in md
    bases = {json.dumps(r["by_source"]["base"], sort_keys=True) for r in doc["runs"]}
    assert len(bases) == 1  # one shared base evaluation
    for name in ("alpha.png", "worst_cosine.png"):
        img = np.asarray(Image.open(tmp_path / "study" / name).convert("RGB"))
        assert img.shape[1] > 400 and len(np.unique(img.reshape(-1, 3), axis=0)) > 5  # not blank
    assert doc["runs"][0]["training"]["diagnosed_steps"] == 2
    assert "KL at end" in md and math.isfinite(doc["runs"][0]["training"]["kl_end"])


def test_only_independent_seeds_of_one_design_pool():
    from core.evaluate import unpoolable

    base = {"seed": 0, "steps": 20, "num_threads": 1, "model": {"name": "m", "device": "cpu"},
            "balance": {"strategy": "marble"}}

    def cfg(**over):
        out = json.loads(json.dumps(base))
        for k, v in over.items():
            if "." in k:
                section, field = k.split(".")
                out[section][field] = v
            else:
                out[k] = v
        return out

    seeds = [("a", "marble", cfg(seed=0)), ("b", "marble", cfg(seed=1, num_threads=2, **{"model.device": "cuda"}))]
    assert unpoolable(seeds) == {}  # the seed, threads and device may differ
    assert unpoolable([seeds[0]]) == {}  # one run: nothing to pool
    assert unpoolable(seeds + [("c", "marble", cfg(seed=0))]) == {"marble": "seed 0 is picked 2 times (a, c)"}
    other = [("d", "marble", cfg(seed=2, steps=10, **{"model.name": "n"}))]
    assert unpoolable(seeds + other) == {"marble": "its runs differ in more than the seed: steps, model.name"}
    # strategies are checked apart: two equal-α runs of one seed do not stop the MARBLE seeds from pooling
    assert unpoolable(seeds + [("e", "equal", cfg(seed=0)), ("f", "equal", cfg(seed=0))]) == {
        "equal": "seed 0 is picked 2 times (e, f)"}


def test_a_study_refuses_one_run_counted_twice(runs, capsys):
    assert main(["--study", str(runs[0]), str(runs[0]), str(runs[1]), "--out", "unused",
                 "--prompts-per-source", "2", "--seeds", "2"]) == 2
    assert f"marble: seed 0 is picked 2 times ({runs[0]}, {runs[0]})" in capsys.readouterr().out
    assert main(["--curve", str(runs[0]), str(runs[0]), "--out", "unused"]) == 2  # --curve pools the same way
    assert "a curve pools each strategy's runs as seeds of one design; marble: seed 0 is picked 2 times" in \
        capsys.readouterr().out


def test_training_summary_gives_the_drift_over_the_last_tenth_of_steps(tmp_path):
    """kl_end: the mean logged KL over the last 10% of steps, so a run that collapses late (KL jumping from 0.2 to
    2.6 in its last steps, as one object-study run did) stands out in the study table."""
    steps = [{"event": "step", "step": i, "kl": 0.2 if i <= 18 else 2.0 + i / 10, "seconds": 1.0} for i in range(1, 21)]
    steps[5]["kl"] = None  # a step logged without it is skipped
    (tmp_path / "events.jsonl").write_text("\n".join(json.dumps(e) for e in steps) + "\n")
    summary = training_summary(tmp_path)
    assert summary["kl_end"] == pytest.approx((3.9 + 4.0) / 2) and summary["steps"] == 20
    (tmp_path / "events.jsonl").write_text("")
    assert math.isnan(training_summary(tmp_path)["kl_end"])
    # a caller that has parsed the log already passes it, and the file is not read again
    assert training_summary(tmp_path, steps)["kl_end"] == pytest.approx((3.9 + 4.0) / 2)


def _archive(run, dest):
    """What a study commits of a run: its config, compressed training log and evaluation, not its checkpoints."""
    dest.mkdir()
    for name in ("config.json", "eval_test.json"):
        shutil.copy(run / name, dest / name)
    (dest / "events.jsonl.gz").write_bytes(gzip.compress((run / "events.jsonl").read_bytes()))
    return dest


def test_a_study_reuses_an_archived_runs_evaluation_only_when_it_is_comparable(runs, tmp_path, capsys):
    settings = EvalSettings("test", 2, 2)
    evaluate_run(runs[0], settings)
    archived = _archive(runs[0], tmp_path / "marble-archived")
    live = study(runs, tmp_path / "live", settings)
    doc = study([archived, runs[1]], tmp_path / "from-archive", settings)
    # the archived run's numbers are its stored ones, the same as evaluating its checkpoint now
    same = lambda a, b: json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)  # noqa: E731 (NaN == NaN)
    assert same(doc["runs"][0]["rewards"], live["runs"][0]["rewards"])
    assert doc["runs"][0]["training"] == live["runs"][0]["training"]
    assert (tmp_path / "from-archive" / "alpha.png").is_file()  # figures come from its events.jsonl
    assert doc["runs"][0]["mean_alpha"] == live["runs"][0]["mean_alpha"]  # α from the archived log too
    assert sum(doc["runs"][0]["mean_alpha"].values()) == pytest.approx(1.0)
    assert set(doc["strategies"]) == {"marble", "weighted_sum"}
    assert doc["strategies"]["weighted_sum"]["mean_alpha"]["colorfulness"]["mean"] == pytest.approx(1 / 3)

    # evaluated with other settings (3 seeds a prompt): refused by name, not mixed into the table
    evaluate_run(runs[0], EvalSettings("test", 2, 3))
    other = _archive(runs[0], tmp_path / "other-settings")
    with pytest.raises(ValueError, match="was evaluated with"):
        study([other, runs[1]], tmp_path / "refused", settings)
    # the raw LoRA scored where the study scores the EMA
    evaluate_run(runs[0], EvalSettings("test", 2, 2, weights="raw"))
    raw = _archive(runs[0], tmp_path / "raw-weights")
    with pytest.raises(ValueError, match="scored the 'raw' LoRA"):
        study([raw, runs[1]], tmp_path / "refused", settings)
    # a base model that scores differently now (another model, or a changed reward): not comparable
    stored = json.loads((archived / "eval_test.json").read_text())
    stored["rewards"]["colorfulness"]["base_mean"] += 0.01
    (archived / "eval_test.json").write_text(json.dumps(stored))
    with pytest.raises(ValueError, match="the base model scored colorfulness"):
        study([archived, runs[1]], tmp_path / "refused", settings)
    # no checkpoint and no evaluation: the command says what to do, with exit status 2
    (archived / "eval_test.json").unlink()
    assert main(["--study", str(archived), str(runs[1]), "--out", str(tmp_path / "x"),
                 "--prompts-per-source", "2", "--seeds", "2"]) == 2
    assert "has neither a checkpoint to evaluate nor an evaluation" in capsys.readouterr().out


def _panels(fig):
    return [ax for ax in fig.axes if ax.get_visible()]


def _dots(ax, name):
    """The y of the dots of category ``name`` in a strip-chart panel (core.figures gives them a gid)."""
    (dots,) = [a for a in ax.collections if a.get_gid() == f"dots:{name}"]
    return sorted(dots.get_offsets()[:, 1].tolist())


def test_a_seed_study_draws_one_panel_per_strategy_and_every_seed(runs, tmp_path):
    def result(strategy, z, composite):
        return {"strategy": strategy, "train_rewards": ["count_accuracy"], "composite_train": composite,
                "rewards": {"count_accuracy": {"z": z}}}

    marble, wsum = runs
    seeded = [result("marble", 0.5, 0.25), result("marble", -0.5, 0.75), result("weighted_sum", 1.0, 2.0)]
    figures = study_figures([marble, marble, wsum], seeded)
    assert list(figures) == ["alpha.png", "worst_cosine.png", "seeds.png"]
    # a strategy's runs are one α panel and one cosine line: their mean
    assert [ax.get_title() for ax in _panels(figures["alpha.png"])] == ["marble (mean of 2 runs)",
                                                                        "wsum (weighted_sum)"]
    (cos,) = _panels(figures["worst_cosine.png"])
    assert sorted(line.get_gid() for line in cos.lines if line.get_gid() != "hline") == [
        "line:marble (mean of 2)", "line:wsum"]
    # seeds.png: one panel per training reward plus the composite; one dot per run, one column per strategy
    reward, composite = _panels(figures["seeds.png"])
    assert reward.get_title() == "count_accuracy (trained on)"
    assert _dots(reward, "marble") == [-0.5, 0.5] and _dots(reward, "weighted_sum") == [1.0]
    assert _dots(composite, "marble") == [0.25, 0.75] and _dots(composite, "weighted_sum") == [2.0]
    (mean,) = next(a for a in composite.collections if a.get_gid() == "mean:marble").get_segments()
    assert mean[:, 1].tolist() == [0.5, 0.5]

    paths = write_figures([marble, marble, wsum], seeded, tmp_path)
    assert [p.name for p in paths] == ["alpha.png", "worst_cosine.png", "seeds.png"]
    single = write_figures([marble, marble, wsum], [result("marble", 0.5, 0.5), result("equal", -0.5, -0.5),
                                                    result("weighted_sum", 1.0, 1.0)], tmp_path / "single")
    assert [p.name for p in single] == ["alpha.png", "worst_cosine.png"]  # no seeds figure without seeds

    # logs the caller has parsed are drawn instead of reading the runs' events.jsonl again
    logs = [[{"event": "step", "step": 1, "alpha": {"count_accuracy": 0.9}}], []]
    alpha_panel = _panels(study_figures([marble, wsum], seeded[1:], logs)["alpha.png"])[0]
    (line,) = [ln for ln in alpha_panel.lines if ln.get_gid() == "line:count_accuracy"]
    assert line.get_ydata().tolist() == [0.9]
    # two strategies -> two α panels (one row), where three single runs take two rows
    with Image.open(paths[0]) as seeded_png, Image.open(single[0]) as single_png:
        assert seeded_png.size[1] < single_png.size[1]


def test_a_curve_evaluates_every_checkpoint_without_touching_the_runs(tmp_path, capsys):
    """--curve: held-out Δ/std at each checkpoint a run kept; the last point is the run's own evaluation (same
    seeds, same base), the strategy rows pool the runs, and the run folders are left as they were."""
    cfg = small_config("marble", steps=2, checkpoint_every=1, **{
        "prompts.sources": WORLD, "sampling.prompts_per_step": 4, "sampling.max_sequence_length": 4,
        "rewards": [{"name": "count_accuracy"}, {"name": "colorfulness"}], "optim.lr": 0.02})
    runs = []
    for seed in (0, 1):
        cfg.seed = seed
        cfg.save(tmp_path / f"s{seed}.json")
        runs.append(tmp_path / f"run-s{seed}")
        assert train_main(["--config", str(tmp_path / f"s{seed}.json"), "--out", str(runs[-1]), "--quiet"]) == 0
    settings = EvalSettings("test", 2, 2)
    final = evaluate_run(runs[0], settings)  # the run's own evaluation of its last checkpoint
    kept = (runs[0] / "eval_test.json").read_bytes()
    assert main(["--curve", *map(str, runs), "--out", str(tmp_path / "curve"), "--prompts-per-source", "2",
                 "--seeds", "2"]) == 0
    assert "| marble | 1 | 2 |" in capsys.readouterr().out
    doc = json.loads((tmp_path / "curve" / "curve.json").read_text())
    assert [(p["run"], p["step"]) for p in doc["points"]] == [("run-s0", 1), ("run-s0", 2), ("run-s1", 1),
                                                              ("run-s1", 2)]
    last = doc["points"][1]
    for name in ("count_accuracy", "colorfulness"):
        assert last["z"][name] == pytest.approx(final["rewards"][name]["z"])
        zs = [p["z"][name] for p in doc["points"] if p["step"] == 2]
        assert doc["strategies"]["marble"]["2"]["rewards"][name]["mean"] == pytest.approx(sum(zs) / 2)
    assert doc["points"][0]["z"] != last["z"]  # step 1 is its own checkpoint, not the last one again
    assert (runs[0] / "eval_test.json").read_bytes() == kept and not (runs[1] / "eval_test.json").exists()
    img = np.asarray(Image.open(tmp_path / "curve" / "curve.png").convert("RGB"))
    assert len(np.unique(img.reshape(-1, 3), axis=0)) > 5

    archived = _archive(runs[0], tmp_path / "archived")  # what a study keeps: no checkpoints
    assert main(["--curve", str(archived), "--out", str(tmp_path / "c2")]) == 2
    assert "a curve needs the run folders with their checkpoints/" in capsys.readouterr().out


def test_errors_name_the_problem(tmp_path, capsys):
    (tmp_path / "config.json").write_text(small_config().to_json())
    assert main(["--run", str(tmp_path)]) == 2
    assert "no checkpoint" in capsys.readouterr().out
    with pytest.raises(ValueError, match="valid choices: train, test"):
        EvalSettings("val").validate()


def test_ceiling_report_summarizes_an_evaluated_single_reward_run(tmp_path, capsys):
    cfg = small_config("single", steps=4, **{
        "prompts.sources": ["world-count"], "sampling.max_sequence_length": 4,
        "rewards": [{"name": "count_accuracy"}], "balance.single_reward": "count_accuracy", "optim.lr": 0.02})
    cfg.save(tmp_path / "count.json")
    run = tmp_path / "count-alone"
    assert train_main(["--config", str(tmp_path / "count.json"), "--out", str(run), "--quiet"]) == 0
    assert main(["--run", str(run), "--prompts-per-source", "2", "--seeds", "2"]) == 0
    report = load_script("ceiling_report")
    out = tmp_path / "ceiling" / "ceiling.md"
    report.main(["--out", str(out), "--window", "2", "--conclusion", "What it shows.", str(run)])
    page = out.read_text()

    z = json.loads((run / "eval_test.json").read_text())["rewards"]["count_accuracy"]["z"]
    steps = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
    values = [e["rewards"]["count_accuracy"] for e in steps if e["event"] == "step"]
    best = max((values[i] + values[i + 1]) / 2 for i in range(3))
    row = next(line for line in page.splitlines() if line.startswith("| `count-alone` |"))
    assert row == (f"| `count-alone` | count_accuracy | 0.02 | 8 × 4 | {z:+.2f} | "
                   f"{(values[0] + values[1]) / 2:.3f} → {(values[2] + values[3]) / 2:.3f} ({best:.3f}) |")
    assert "What it shows." in page and "## `count-alone`" in page and "| count_accuracy | ✓ |" in page

    # runs of two studies (here with one name) are told apart by their study's folder
    twin = tmp_path / "wide" / "count-alone"
    shutil.copytree(run, twin)
    report.main(["--out", str(out), "--window", "2", str(run), str(twin)])
    rows = [line.split(" | ")[0] for line in out.read_text().splitlines() if line.startswith("| `")]
    assert rows == [f"| `{tmp_path.name}/count-alone`", "| `wide/count-alone`"]

    # a folder that is not a run, a run of another strategy, or one not yet evaluated, is refused by name
    with pytest.raises(SystemExit, match="no config.json; not a run folder"):
        report.main(["--out", str(out), str(tmp_path)])
    with pytest.raises(SystemExit, match="not 'single'"):
        report.main(["--out", str(out), str(_tiny_world_run(tmp_path, "mixed", "equal"))])
    (run / "eval_test.json").unlink()
    with pytest.raises(SystemExit, match="core.evaluate --run"):
        report.main(["--out", str(out), str(run)])
