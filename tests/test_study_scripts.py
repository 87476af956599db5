"""The study scripts refuse a bad setting by name before they start (or write) anything."""

import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def run_script(name: str, *args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(ROOT / "scripts" / name), *args], capture_output=True, text=True,
                          env={**os.environ, **env}, timeout=60)


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
