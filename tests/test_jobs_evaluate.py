"""``python -m jobs evaluate RUN``: core.evaluate on a run the queue trained, recorded in the store's evaluations
table (which the Study reads), on a real tiny run; bad flags are one error line."""

from jobs.cli import main
from jobs.evaluations import latest
from jobs.runner import submit
from jobs.storage import Store
from tests.helpers import small_config

WORLD = ["world-general", "world-color", "world-count"]


def test_evaluate_records_the_checkpoints_held_out_scores(tmp_path, capsys):
    cfg = small_config("marble", steps=2, **{"prompts.sources": WORLD, "sampling.max_sequence_length": 4,
                                             "rewards": [{"name": "count_accuracy"}, {"name": "colorfulness"}],
                                             "checkpoint_every": 1})
    with Store.open(tmp_path) as store:
        run_id = submit(store, cfg, name="to evaluate", immediate=True)
        assert store.status(run_id) == "succeeded"
    home = ["--home", str(tmp_path)]
    assert main([*home, "evaluate", str(run_id), "--checkpoint", "7"]) == 2
    assert f"--checkpoint=7: run {run_id} has no checkpoint at that step (its checkpoints: 1, 2)" in \
        capsys.readouterr().err
    assert main([*home, "evaluate", str(run_id), "--checkpoint", "1", "--prompts-per-source", "2",
                 "--seeds", "2"]) == 0
    out = capsys.readouterr().out
    assert "| count_accuracy | ✓ |" in out and "recorded as evaluation" in out
    with Store.open(tmp_path) as store:
        ev = latest(store, run_id)
        assert ev["checkpoint_step"] == 1 and ev["details"]["weights"] == "ema" and ev["details"]["images"] == 12
        rewards = ev["details"]["rewards"]
        assert rewards["count_accuracy"]["n"] == 4 and rewards["colorfulness"]["n"] == 12  # NaN off its source
        assert rewards["colorfulness"]["z"] is not None and rewards["colorfulness"]["z_se"] > 0
        assert ev["details"]["checkpoint"].endswith("step_000001")
