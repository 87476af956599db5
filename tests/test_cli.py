"""The headless CLIs as a user runs them: python -m core.train / core.sample in real subprocesses."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["--set", "sampling.num_steps=4", "--set", "sampling.prompts_per_step=2", "--set",
         "sampling.images_per_prompt=4", "--set", "nft.micro_batch_size=8", "--set", "num_threads=1",
         "--set", "balance.harmonize_every=2"]


def run(*args, check=True):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    if check and proc.returncode != 0:
        raise AssertionError(proc.stderr[-3000:])
    return proc


def events(path):
    return [json.loads(line) for line in (path / "events.jsonl").read_text().splitlines()]


def test_train_writes_config_events_and_checkpoints_then_resumes_and_samples(tmp_path):
    out = tmp_path / "run"
    proc = run("core.train", "--preset", "tiny", "--out", str(out), "--steps", "2", "--quiet",
               "--set", "checkpoint_every=1", "--set", "sample_every=2", *SMALL)
    assert "completed: 2 steps" in proc.stdout
    assert json.loads((out / "config.json").read_text())["steps"] == 2
    evs = events(out)
    kinds = [e["event"] for e in evs]
    assert kinds[0] == "start" and kinds[-1] == "end"
    step = next(e for e in evs if e["event"] == "step")
    assert {"step", "rewards", "alpha", "seconds"} <= set(step)
    assert set(step["rewards"]) == {"jpeg_compressibility", "colorfulness", "brightness"}
    bal = next(e for e in evs if e["event"] == "balance")
    assert {"alpha_raw", "alpha_ema", "cosine", "cos_to_update", "grad_norms", "valid", "solver"} <= set(bal)
    assert len(bal["cosine"]["matrix"]) == 3 and bal["cosine"]["names"] == list(step["rewards"])
    assert (out / "checkpoints" / "step_000002" / "pytorch_lora_weights.safetensors").is_file()
    assert any(e["event"] == "samples" for e in evs)

    # Resume the same run to 3 steps: the events of steps 1-2 are kept once, step 3 appended.
    run("core.train", "--out", str(out), "--resume", "--steps", "3", "--quiet")
    steps = [e["step"] for e in events(out) if e["event"] == "step"]
    assert steps == [1, 2, 3]

    png = tmp_path / "a.png"
    proc = run("core.sample", "--model", "tiny", "--lora", str(out / "checkpoints" / "step_000003"),
               "--prompt", "a red circle", "--seed", "3", "--out", str(png), "--steps", "4")
    assert png.is_file() and png.stat().st_size > 100


def test_bad_input_gives_a_clear_error_and_exit_code_2(tmp_path):
    proc = run("core.train", "--preset", "tiny", "--out", str(tmp_path / "x"), "--set", "balance.ema_rho=2",
               check=False)
    assert proc.returncode == 2
    assert "balance.ema_rho=2.0: must be a number in [0, 1)" in proc.stderr
    assert not (tmp_path / "x").exists()  # nothing was started
    proc = run("core.sample", "--model", "nowhere/none", "--prompt", "x", "--out", str(tmp_path / "y.png"),
               check=False)
    assert proc.returncode == 2 and "not in the local Hugging Face cache" in proc.stderr
