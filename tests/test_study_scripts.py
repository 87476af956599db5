"""The study scripts refuse a bad setting by name before they start (or write) anything, and the world study keeps
what outlives a session."""

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def run_script(name: str, *args: str, timeout: int = 60, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(ROOT / "scripts" / name), *args], capture_output=True, text=True,
                          env={**os.environ, **env}, timeout=timeout)


@pytest.mark.parametrize("args, env, message", [
    ((), {}, "usage: scripts/ceiling_at_share.sh SEED REWARD..."),
    (("0",), {}, "usage: scripts/ceiling_at_share.sh SEED REWARD..."),
    (("zero", "single_object"), {}, "SEED=zero: must be a whole number >= 0"),
    (("0", "single_object"), {"STEPS": "abc"}, "STEPS=abc: must be a whole number >= 1"),
    (("0", "single_object"), {"STEPS": "0"}, "STEPS=0: must be a whole number >= 1"),
    (("0", "single_object"), {"SHARE_PROMPTS": "-4"}, "SHARE_PROMPTS=-4: must be a whole number >= 1"),
])
def test_ceiling_at_share_refuses_a_bad_setting_by_name(args, env, message):
    tag = "-test-refused"
    done = run_script("ceiling_at_share.sh", *args, TAG=tag, **env)
    assert done.returncode == 2 and message in done.stderr
    assert not list((ROOT / "runs").glob(f"ceiling-share*{tag}"))


def test_the_exact_study_refuses_a_bad_seed_by_name_before_training_any():
    done = run_script("exact_study.sh", SEEDS="0 x")   # seed 0 is fine, but nothing starts while x is wrong
    assert done.returncode == 2 and done.stderr.strip() == "SEEDS=x: must be a whole number >= 0"


@pytest.mark.parametrize("args, message", [
    (("docs/x", "0"), "usage: scripts/world_study.sh ARCHIVE"),
    (("{tmp}/a", "0 x", "tiny"), "SEED=x: must be a whole number >= 0"),
    (("{tmp}/a", " ", "tiny"), "SEEDS=' ': name at least one seed"),
    (("{tmp}/a", "0", "tiny", "tiny-huge"), "PRESET=tiny-huge: unknown; valid choices: mini-marble"),
])
def test_the_world_study_refuses_a_bad_setting_by_name_before_training_any(tmp_path, args, message):
    done = run_script("world_study.sh", *(a.format(tmp=tmp_path) for a in args), RUNS=str(tmp_path / "runs"))
    assert done.returncode == 2 and message in done.stderr
    assert not (tmp_path / "runs").exists() and not (tmp_path / "a").exists()


def test_the_world_study_archives_each_evaluated_run_and_skips_it_in_a_later_session(tmp_path):
    archive, runs = tmp_path / "archive", tmp_path / "runs"
    env = {"RUNS": str(runs), "STEPS": "2", "EVAL_ARGS": "--prompts-per-source 1 --seeds 1"}
    done = run_script("world_study.sh", str(archive), "0", "tiny", timeout=600, **env)
    assert done.returncode == 0, done.stderr
    kept = archive / "tiny-s0"
    assert sorted(p.name for p in kept.iterdir()) == ["config.json", "eval_test.json", "eval_test.md",
                                                      "events.jsonl.gz"]
    assert (runs / "tiny-s0" / "checkpoints" / "step_000002").is_dir()
    # the next session: the run folder is gone, the archive was committed; nothing is trained again
    shutil.rmtree(runs)
    again = run_script("world_study.sh", str(archive), "0", "tiny", timeout=600, **env)
    assert again.returncode == 0 and not (runs / "tiny-s0").exists()
    # a run that fails says which and why, and the study exits non-zero
    failed = run_script("world_study.sh", str(archive), "1", "tiny", timeout=600,
                        **dict(env, EVAL_ARGS="--prompts-per-source 0"))
    assert failed.returncode == 1 and "tiny-s1: evaluation failed" in failed.stderr
    assert not (archive / "tiny-s1").exists()


def test_the_family_study_names_its_families_and_passes_a_bad_seed_to_the_world_studys_check():
    done = run_script("family_study.sh", "colour")
    assert done.returncode == 2 and "FAMILY: object, object150 or quality (got 'colour')" in done.stderr
    done = run_script("family_study.sh", "object", "0 z")
    assert done.returncode == 2 and done.stderr.strip() == "SEED=z: must be a whole number >= 0"
