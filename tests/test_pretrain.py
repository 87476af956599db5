"""core.pretrain end to end at a tiny scale (3 VAE, 3 diffusion and 2 decoder steps of batch 2), plus the
properties of its schedule and time box.

The tiny run still builds the real mini-world architecture; what costs time is fixed work per run (latent
calibration and the decoder's PSNR, 256 renders each), so the runs below skip what a test does not need:
--init-from skips the VAE stage and calibration, --decoder-steps 0 the decoder stage.
"""

import contextlib
import io
import json
import math

import numpy as np
import pytest
import torch

from core.pretrain import cosine_lr, main, run_stage, stage_progress

TINY = ["--vae-steps", "3", "--steps", "3", "--decoder-steps", "2", "--batch", "2", "--log-every", "1",
        "--no-card", "--vae-max-minutes", "60", "--max-minutes", "60", "--decoder-max-minutes", "60"]
TRANSFORMER = "transformer/diffusion_pytorch_model.safetensors"
VAE = "vae/diffusion_pytorch_model.safetensors"


def pretrain(out, *args: str) -> tuple[dict, str]:
    """Run ``python -m core.pretrain`` in-process; returns its pretrain_log.json and stdout."""
    threads = torch.get_num_threads()  # main sets it (default 1); leave the session as it was
    stdout = io.StringIO()
    try:
        with contextlib.redirect_stdout(stdout):
            assert main(["--out", str(out), *args]) == 0
    finally:
        torch.set_num_threads(threads)
    return json.loads((out / "pretrain_log.json").read_text()), stdout.getvalue()


@pytest.fixture(scope="module")
def seed0(tmp_path_factory):
    out = tmp_path_factory.mktemp("seed0")
    log, stdout = pretrain(out, *TINY, "--seed", "0")
    return out, log, stdout


@pytest.mark.slow
def test_the_folder_loads_offline_and_generates_images(seed0):
    from diffusers import StableDiffusion3Pipeline

    from core.sampling import generate_images

    out, _, _ = seed0
    pipe = StableDiffusion3Pipeline.from_pretrained(out, local_files_only=True, text_encoder_3=None, tokenizer_3=None)
    images = generate_images(pipe, ["a red circle", "two blue squares"], [0, 1], num_steps=2, resolution=64,
                             max_sequence_length=4)
    assert images.shape == (2, 3, 64, 64)
    assert torch.isfinite(images).all() and images.min() >= 0 and images.max() <= 1
    assert not torch.equal(images[0], images[1])


@pytest.mark.slow
def test_the_log_records_the_steps_run_and_the_stage_results(seed0):
    out, log, stdout = seed0
    assert (log["vae"]["steps"], log["diffusion"]["steps"], log["decoder"]["steps"]) == (3, 3, 2)
    assert log["recipe"]["seed"] == 0 and log["previous"] is None
    for stage, result in (("vae", "final_mse"), ("diffusion", "final_loss"), ("decoder", "psnr_db")):
        assert math.isfinite(log[stage][result]) and log[stage]["seconds"] > 0
    vae_config = json.loads((out / "vae" / "config.json").read_text())  # the calibration travels with the VAE
    assert vae_config["shift_factor"] == log["vae"]["shift_factor"] != 0.0
    assert vae_config["scaling_factor"] == log["vae"]["scaling_factor"] != 1.0
    for line in ("[vae] step 3 ", "[diffusion] step 3 ", "[decoder] step 2 ", "saved "):
        assert line in stdout
    assert "time box reached" not in stdout


@pytest.mark.slow
def test_a_seed_fixes_the_weights_and_another_seed_changes_them(seed0, tmp_path):
    out, _, _ = seed0
    pretrain(tmp_path / "again", *TINY, "--seed", "0")
    pretrain(tmp_path / "other", *TINY, "--seed", "1")
    assert (tmp_path / "again" / TRANSFORMER).read_bytes() == (out / TRANSFORMER).read_bytes()
    assert (tmp_path / "again" / VAE).read_bytes() == (out / VAE).read_bytes()
    assert (tmp_path / "other" / TRANSFORMER).read_bytes() != (out / TRANSFORMER).read_bytes()


@pytest.mark.slow
def test_init_from_keeps_the_vae_and_goes_on_training_the_transformer(seed0, tmp_path):
    first, first_log, _ = seed0
    out = tmp_path / "continued"
    log, stdout = pretrain(out, "--init-from", str(first), "--steps", "3", "--batch", "2", "--log-every", "1",
                           "--no-card", "--max-minutes", "60")
    assert (out / VAE).read_bytes() == (first / VAE).read_bytes()
    assert (out / TRANSFORMER).read_bytes() != (first / TRANSFORMER).read_bytes()
    assert log["vae"]["steps"] == 0 and log["vae"]["kept_from"] == str(first)
    assert log["vae"]["scaling_factor"] == first_log["vae"]["scaling_factor"]
    assert log["vae"]["psnr_db"] == first_log["decoder"]["psnr_db"]  # the kept VAE is the refined one
    assert log["diffusion"]["steps"] == 3 and log["previous"] == first_log
    assert "[vae] step" not in stdout and "[diffusion] step 3 " in stdout


@pytest.mark.slow
def test_a_continued_run_that_refines_the_decoder_repeats_for_its_seed(seed0, tmp_path):
    first, _, _ = seed0
    args = ["--init-from", str(first), "--steps", "0", "--decoder-steps", "2", "--batch", "2", "--log-every", "1",
            "--no-card", "--decoder-max-minutes", "60", "--seed", "3"]
    pretrain(tmp_path / "a", *args)
    pretrain(tmp_path / "b", *args)
    assert (tmp_path / "a" / VAE).read_bytes() == (tmp_path / "b" / VAE).read_bytes() != (first / VAE).read_bytes()


@pytest.mark.slow
def test_the_time_box_stops_a_stage_early_and_the_log_says_so(seed0, tmp_path):
    first, _, _ = seed0
    # a box of 6 µs has closed before the second step starts; the step during which it closed still runs
    log, stdout = pretrain(tmp_path / "boxed", "--init-from", str(first), "--steps", "50", "--batch", "2",
                           "--log-every", "1", "--no-card", "--max-minutes", "1e-7")
    steps = log["diffusion"]["steps"]
    assert 1 <= steps <= 2
    assert f"[diffusion] time box reached after {steps} steps" in stdout


def test_the_schedule_warms_up_then_decays_to_the_floor():
    base, warmup, floor = 1e-3, 100, 0.05
    warm = [cosine_lr(0.0, s, base, warmup, floor) for s in range(warmup)]
    assert warm == sorted(warm) and warm[-1] == pytest.approx(base)
    decay = [cosine_lr(p, warmup, base, warmup, floor) for p in np.linspace(0, 1, 101)]
    assert decay[0] == pytest.approx(base) and decay[-1] == pytest.approx(floor * base)
    assert all(a >= b for a, b in zip(decay, decay[1:]))
    assert cosine_lr(1.7, 10_000, base, warmup, floor) == pytest.approx(floor * base)  # clamped past the end


def test_stage_progress_is_the_step_budget_or_the_time_box_whichever_binds_first():
    import time

    now = time.perf_counter()
    assert stage_progress(5, 10, now, max_seconds=3600) == pytest.approx(0.5, abs=1e-3)
    assert stage_progress(10, 10, now, max_seconds=3600) >= 1.0
    assert stage_progress(1, 10, now - 60, max_seconds=30) >= 2.0


def test_when_the_time_box_binds_the_stage_stops_early_at_the_lr_floor(capsys):
    """The promise of stage_progress: on a slow machine the learning rate still decays fully."""
    base = 1e-3
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=base)
    lrs = []

    def step_fn(step: int) -> float:  # a step that only records its learning rate
        lrs.append(opt.param_groups[0]["lr"])
        return float(step)

    steps = 10**8
    done, seconds, recent = run_stage("test", opt, base, steps, 0.3, 10**9, 5, step_fn, lambda m: {"m": m})
    assert done > 100, f"only {done} steps ran in the 0.3 s box; the warm-up alone is 100 steps"
    assert done < steps and len(lrs) == done and seconds >= 0.3
    assert lrs[-1] == pytest.approx(0.05 * base)
    assert all(a >= b for a, b in zip(lrs[100:], lrs[101:]))  # after warm-up the rate only goes down
    assert recent == np.mean(range(done - 4, done + 1))  # the mean over the last `window` (5) losses
    assert f"[test] time box reached after {done} steps" in capsys.readouterr().out


def test_task_mix_chooses_which_captions_the_diffusion_stage_sees(capsys):
    from core.pretrain import parse_task_mix, world_batch
    from core.world.scenes import TASK_MIX

    assert parse_task_mix("position=3, count=1") == {"single": 0.0, "color": 0.0, "count": 1.0, "position": 3.0}
    _, captions = world_batch(np.random.default_rng(0), 24, parse_task_mix("position=1"))
    assert all(any(r in c for r in (" left of ", " right of ", " above ", " below ")) for c in captions)
    # no mix = the default one, drawn exactly as before the option existed
    default = world_batch(np.random.default_rng(1), 8)[1]
    assert default == world_batch(np.random.default_rng(1), 8, dict(TASK_MIX))[1]
    for bad, message in (("postion=1", "TASK one of single, color, count, position"),
                         ("position=lots", "must be a number"), ("position=-1", ">= 0"),
                         ("position=0", "at least one weight")):
        with pytest.raises(ValueError, match=message):
            parse_task_mix(bad)
    with pytest.raises(SystemExit):
        main(["--out", "unused", "--task-mix", "postion=1"])
    assert "--task-mix entry 'postion=1'" in capsys.readouterr().err


@pytest.mark.slow
def test_a_continued_run_records_its_task_mix_and_the_card_command_repeats_it(seed0, tmp_path):
    first, _, _ = seed0
    out = tmp_path / "positions"
    log, _ = pretrain(out, "--init-from", str(first), "--steps", "2", "--batch", "2", "--log-every", "1",
                      "--no-card", "--max-minutes", "60", "--task-mix", "position=0.6,single=0.4")
    assert log["recipe"]["task_mix"] == {"single": 0.4, "color": 0.0, "count": 0.0, "position": 0.6}
    assert log["previous"]["recipe"]["task_mix"]["position"] == 0.25  # the fresh run: the default mix
    from core.world.card import stage_command

    assert stage_command(log, 2).endswith("--init-from <stage 1> --task-mix single=0.4,color=0,count=0,position=0.6`")
    assert "--task-mix" not in stage_command(log["previous"], 1)  # the default mix is not spelled out
