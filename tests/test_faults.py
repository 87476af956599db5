"""Faults end in a clear state (issue 17, docs/reliability.md): no file a run or model folder holds is
unpickled; a kill -9 during a checkpoint write, a damaged latest checkpoint and a full disk each leave a
run that resumes from its last good checkpoint or a failed run that says why."""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from core import checkpoint as ckpt_io
from core.config import TrainConfig
from core.trainer import Trainer, train
from jobs import schema as s
from jobs.runner import resume, submit
from jobs.storage import Store
from tests.helpers import small_config
from tests.jobs_support import REPO, subprocess_env, wait_for


# ---- a planted pickle never runs ------------------------------------------------------------------

class Planted:
    """Unpickling this calls open(marker, "w"): the marker file appearing means planted code ran."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def plant(path: Path, marker: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"step": 1, "policy": Planted(marker)}, path)
    return path


def test_the_planted_pickle_is_live(tmp_path):
    """The control: the same file DOES run its code when unpickled, so the tests below prove something."""
    marker = tmp_path / "ran"
    torch.load(plant(tmp_path / "evil.pt", marker), weights_only=False)
    assert marker.exists()


def _tiny_checkpoint(tmp_path: Path, steps: int = 1, **overrides) -> tuple[TrainConfig, Path]:
    cfg = small_config("marble", steps=steps, checkpoint_every=1, **overrides)
    train(cfg, tmp_path / "run")
    return cfg, tmp_path / "run"


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """One 2-step tiny run with a checkpoint per step (copied by each test that damages it)."""
    root = tmp_path_factory.mktemp("trained")
    cfg, run = _tiny_checkpoint(root, steps=2)
    return cfg, run


def _copy_run(trained, dest: Path) -> Path:
    shutil.copytree(trained[1], dest)
    return dest


def test_a_pickled_training_state_is_refused_by_name_and_never_loaded(tmp_path, trained, capsys):
    from core.train import main

    cfg, _ = trained
    run = _copy_run(trained, tmp_path / "run")
    marker = tmp_path / "ran"
    ckpt = run / "checkpoints" / "step_000002"
    shutil.rmtree(ckpt)  # an old-format (or attacker's) checkpoint: training_state.pt only
    plant(ckpt / ckpt_io.LEGACY_STATE_FILE, marker)
    (run / "checkpoints" / "step_000001" / ckpt_io.MANIFEST_FILE).unlink()  # no good one to fall back to

    assert main(["--config", str(run / "config.json"), "--out", str(run), "--resume", str(ckpt), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "training_state.pt" in err and str(ckpt) in err and "unpickling" in err and "Traceback" not in err
    assert main(["--out", str(run), "--resume", "--quiet"]) == 2  # the run folder: no checkpoint is good
    err = capsys.readouterr().err
    assert "no usable checkpoint" in err and "training_state.pt" in err and "manifest.json" in err
    assert not marker.exists()


def test_pickle_bytes_behind_a_rewritten_manifest_are_still_not_unpickled(tmp_path, trained):
    """The manifest is not a signature: whoever can write the folder can rewrite it. The state file is then
    read as safetensors, which has no code path, so the planted bytes are refused as unreadable."""
    cfg, _ = trained
    run = _copy_run(trained, tmp_path / "run")
    marker = tmp_path / "ran"
    ckpt = run / "checkpoints" / "step_000001"
    plant(ckpt / ckpt_io.STATE_TENSORS_FILE, marker)
    (ckpt / ckpt_io.MANIFEST_FILE).unlink()
    ckpt_io.write_manifest(ckpt)
    trainer = Trainer(cfg, tmp_path / "other")
    with pytest.raises(ckpt_io.CheckpointError, match="training_state.safetensors.*could not be read"):
        trainer.load_checkpoint(ckpt)
    assert not marker.exists()


def test_lora_and_model_folders_load_only_safetensors(tmp_path, trained):
    from core.models import ModelNotFoundError, build_tiny_pipeline, load_lora, load_pipeline

    marker = tmp_path / "ran"
    lora = tmp_path / "lora"
    plant(lora / "pytorch_lora_weights.bin", marker)  # a pickled LoRA where diffusers would look next
    pipe = build_tiny_pipeline()
    with pytest.raises(ckpt_io.CheckpointError, match=r"holds no pytorch_lora_weights\.safetensors"):
        load_lora(pipe, lora)

    model = tmp_path / "model"
    pipe.save_pretrained(model)
    weights = model / "transformer" / "diffusion_pytorch_model.safetensors"
    weights.unlink()
    plant(weights.with_suffix(".bin"), marker)
    with pytest.raises((OSError, EnvironmentError, ValueError, ModelNotFoundError)) as info:
        load_pipeline(str(model))
    assert "transformer" in str(info.value) or "safetensors" in str(info.value)
    assert not marker.exists()


def test_a_damaged_lora_checkpoint_is_refused_by_core_sample(tmp_path, trained, capsys):
    from core.sample import main

    run = _copy_run(trained, tmp_path / "run")
    lora = run / "checkpoints" / "step_000002" / ckpt_io.LORA_FILE
    data = bytearray(lora.read_bytes())
    data[-1] ^= 0xFF
    lora.write_bytes(bytes(data))
    code = main(["--prompt", "a red circle", "--lora", str(lora.parent), "--out", str(tmp_path / "x.png"),
                 "--steps", "2"])
    err = capsys.readouterr().err
    assert code == 2 and str(lora) in err and "sha256" in err and not (tmp_path / "x.png").exists()


def test_reward_weight_files_load_with_the_allow_list_only(tmp_path):
    from core.rewards.clip_rewards import load_torch_state_dict

    marker = tmp_path / "ran"
    evil = plant(tmp_path / "HPS_v2.1_compressed.pt", marker)
    with pytest.raises(ValueError, match=r"reward 'hpsv2': the HPSv2.1 checkpoint .*HPS_v2.1_compressed.pt"):
        load_torch_state_dict("hpsv2", evil, "the HPSv2.1 checkpoint")
    assert not marker.exists()


# ---- a damaged or partial latest checkpoint -------------------------------------------------------

def _flip_byte(path: Path, at: int = -100) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0x01
    path.write_bytes(bytes(data))


def test_manifest_names_the_damaged_missing_or_unexpected_file(tmp_path, trained):
    run = _copy_run(trained, tmp_path / "run")
    ckpt = run / "checkpoints" / "step_000001"
    assert ckpt_io.verify(ckpt)["files"].keys() >= {ckpt_io.LORA_FILE, ckpt_io.STATE_TENSORS_FILE,
                                                    ckpt_io.STATE_JSON_FILE, "config.json"}
    state = ckpt / ckpt_io.STATE_TENSORS_FILE
    _flip_byte(state)
    with pytest.raises(ckpt_io.CheckpointError, match=f"{state}.*sha256"):
        ckpt_io.verify(ckpt)
    state.write_bytes(state.read_bytes()[:-10])
    with pytest.raises(ckpt_io.CheckpointError, match=f"{state}.*truncated"):
        ckpt_io.verify(ckpt)
    state.unlink()
    with pytest.raises(ckpt_io.CheckpointError, match=f"{state}.*missing"):
        ckpt_io.verify(ckpt)
    extra = run / "checkpoints" / "step_000002" / "extra.bin"
    extra.write_bytes(b"x")
    with pytest.raises(ckpt_io.CheckpointError, match=f"{extra}.*not listed"):
        ckpt_io.verify(extra.parent)


def test_resume_of_a_run_folder_falls_back_past_a_damaged_latest_checkpoint_and_says_so(tmp_path, trained):
    cfg, _ = trained
    run = _copy_run(trained, tmp_path / "run")
    _flip_byte(run / "checkpoints" / "step_000002" / ckpt_io.STATE_TENSORS_FILE)
    events = []
    result = train(cfg.with_overrides({"steps": 3}), run, on_event=events.append, resume_from=run)
    notices = [e.message for e in events if e.kind == "notice"]
    start = next(e for e in events if e.kind == "start")
    assert start.step == 1 and start.resumed_from.endswith("step_000001")
    assert len(notices) == 1 and "skipped checkpoint step_000002" in notices[0] and "sha256" in notices[0]
    assert result.step == 3 and ckpt_io.verify(run / "checkpoints" / "step_000002")  # rewritten, good again


def test_a_damaged_checkpoint_given_explicitly_is_an_error_naming_the_file(tmp_path, trained, capsys):
    from core.train import main

    run = _copy_run(trained, tmp_path / "run")
    state = run / "checkpoints" / "step_000002" / ckpt_io.STATE_JSON_FILE
    state.write_text(state.read_text()[:20])
    assert main(["--out", str(run), "--resume", str(state.parent), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert str(state) in err and "Traceback" not in err


def _cli_config(tmp_path: Path, cfg: TrainConfig) -> Path:
    path = tmp_path / "config.json"
    cfg.save(path)
    return path


@pytest.mark.slow
def test_kill_9_during_a_checkpoint_write_resumes_from_the_last_good_one(tmp_path):
    """The job is SIGKILLed while step 2's checkpoint is half written (its manifest not yet in place);
    resume removes the orphan temp folder, continues from step 1 and ends where an unkilled run ends."""
    cfg = small_config("marble", steps=3, checkpoint_every=1)
    config = _cli_config(tmp_path, cfg)
    run, flag = tmp_path / "run", tmp_path / "writing"
    driver = (
        "import pathlib, sys, time\n"
        "import core.checkpoint as c\n"
        "real = c.write_manifest\n"
        "def slow(folder):\n"
        "    if 'step_000002' in str(folder):\n"
        f"        pathlib.Path({str(flag)!r}).write_text(str(folder)); time.sleep(600)\n"
        "    return real(folder)\n"
        "c.write_manifest = slow\n"
        "from core.train import main\n"
        f"sys.exit(main(['--config', {str(config)!r}, '--out', {str(run)!r}, '--quiet']))\n")
    proc = subprocess.Popen([sys.executable, "-c", driver], cwd=REPO, env=subprocess_env(tmp_path),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_for(lambda: flag.exists() or proc.poll() is not None, 300, "the checkpoint write of step 2")
        assert flag.exists(), proc.stdout.read().decode()
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    orphan = Path(flag.read_text())
    assert orphan.is_dir() and orphan.name.startswith(".tmp_step_000002_")
    assert [p.name for p in ckpt_io.checkpoints_in(run)] == ["step_000001"]

    from core.train import main

    assert main(["--out", str(run), "--resume", "--quiet"]) == 0  # the run folder's newest good checkpoint
    assert not orphan.exists() and not list((run / "checkpoints").glob(".tmp*"))
    events = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
    assert any(e["event"] == "notice" and str(orphan) in e["message"] for e in events)
    assert [e["step"] for e in events if e["event"] == "step"] == [1, 2, 3]  # step 2 once, from the resume

    straight = tmp_path / "straight"
    train(cfg, straight)
    done, ref = (ckpt_io.load_state(r / "checkpoints" / "step_000003")[0] for r in (run, straight))
    assert done.keys() == ref.keys() and all(torch.equal(done[k], ref[k]) for k in ref)


# ---- jobs: fallback, --from-step, errors naming the file -----------------------------------------

@pytest.fixture
def store(tmp_path):
    st = Store.open(tmp_path / "home")
    yield st
    st.close()


@pytest.mark.slow
def test_a_job_resume_skips_a_damaged_checkpoint_and_from_step_picks_one(store):
    cfg = small_config("marble", steps=3, checkpoint_every=1)
    run_id = submit(store, cfg, preset="tiny", immediate=True)
    ckpts = {c["step"]: Path(c["path"]) for c in store.checkpoints(run_id)}
    assert sorted(ckpts) == [1, 2, 3]
    _flip_byte(ckpts[3] / ckpt_io.LORA_FILE)

    resume(store, run_id, steps=4, immediate=True)
    run = store.get_run(run_id)
    log = store.log_tail(run_id, 400)
    assert (run.status, run.step) == (s.SUCCEEDED, 4), run.error
    assert "skipped checkpoint step_000003" in log and f"resuming from {ckpts[2]}" in log
    assert [r["step"] for r in store.steps(run_id)] == [1, 2, 3, 4]

    with pytest.raises(ValueError, match=r"from_step=7: run \d+ has no checkpoint at step 7 \(its checkpoints: "
                                         r"1, 2, 3, 4\)"):
        resume(store, run_id, steps=6, from_step=7)
    _flip_byte(ckpts[1] / ckpt_io.STATE_JSON_FILE, at=5)
    with pytest.raises(ckpt_io.CheckpointError, match=f"{ckpts[1] / ckpt_io.STATE_JSON_FILE}"):
        resume(store, run_id, steps=6, from_step=1)
    assert store.get_run(run_id).status == s.SUCCEEDED  # a refused resume changes nothing

    resume(store, run_id, steps=5, from_step=2, immediate=True)
    run = store.get_run(run_id)
    assert (run.status, run.step, run.attempt) == (s.SUCCEEDED, 5, 3), run.error
    assert f"resuming from {ckpts[2]} (dropped" in store.log_tail(run_id, 60)

    for c in store.checkpoints(run_id):  # no good checkpoint left: the job fails naming the files
        _flip_byte(Path(c["path"]) / ckpt_io.STATE_TENSORS_FILE)
    resume(store, run_id, steps=6, immediate=True)
    run = store.get_run(run_id)
    assert run.status == s.FAILED and "no usable checkpoint" in run.error
    assert str(ckpts[3] / ckpt_io.STATE_TENSORS_FILE) in run.error and "sha256" in run.error
    assert str(ckpts[1] / ckpt_io.STATE_JSON_FILE) in run.error and "Traceback" not in run.error


# ---- a full disk ----------------------------------------------------------------------------------

def _mount_tmpfs(path: Path, size: str) -> bool:
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        return False
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True)
    return done.returncode == 0


def test_a_full_disk_fails_the_job_with_no_space_left_on_device(tmp_path, monkeypatch, capsys):
    """Simulated: the checkpoint's safetensors write raises ENOSPC as the OS would."""
    store = Store(f"sqlite:///{tmp_path / 'marble.db'}", tmp_path / "home")
    real = ckpt_io.write_bytes

    def full(path, data):
        if path.name == ckpt_io.STATE_TENSORS_FILE:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        return real(path, data)

    monkeypatch.setattr(ckpt_io, "write_bytes", full)
    run_id = submit(store, small_config("marble", steps=1, checkpoint_every=1), immediate=True)
    run = store.get_run(run_id)
    assert run.status == s.FAILED and run.error.startswith("no space left on device"), run.error
    assert ".tmp_step_000001" in run.error and not list((run.run_dir / "checkpoints").iterdir())  # space given back
    store.close()

    from core.train import main

    config = _cli_config(tmp_path, small_config("marble", steps=1, checkpoint_every=1))
    assert main(["--config", str(config), "--out", str(tmp_path / "cli"), "--quiet"]) == 1
    err = capsys.readouterr().err
    assert "error: [Errno 28] no space left on device while writing" in err and "Traceback" not in err


@pytest.mark.slow
def test_a_really_full_tmpfs_fails_the_job_promptly_with_no_space_left_on_device(tmp_path):
    """A small tmpfs holds the run folders (the database stays on the normal disk): a checkpoint no
    longer fits. The job ends failed with the words the user needs, in seconds, not as 'running'."""
    home = tmp_path / "home"
    if not _mount_tmpfs(home, "1500k"):
        pytest.skip("mounting a tmpfs is not permitted here (needs root); the simulated ENOSPC test covers it")
    try:
        store = Store(f"sqlite:///{tmp_path / 'marble.db'}", home)
        ballast = home / "ballast"
        cfg = small_config("marble", steps=1, checkpoint_every=1)
        run_id = submit(store, cfg)
        run_dir = store.run_dir(run_id)
        run_dir.mkdir(parents=True, exist_ok=True)
        free = os.statvfs(home).f_bavail * os.statvfs(home).f_frsize
        ballast.write_bytes(b"\0" * max(0, free - 200_000))  # ~200 KB left: less than one checkpoint
        started = time.monotonic()
        proc = subprocess.run([sys.executable, "-m", "jobs", "worker", "--once", "--poll", "0.2"], cwd=REPO,
                              env=subprocess_env(home, f"sqlite:///{tmp_path / 'marble.db'}"),
                              capture_output=True, text=True, timeout=300)
        seconds = time.monotonic() - started
        run = store.get_run(run_id)
        assert run.status == s.FAILED, (run.status, run.error, proc.stderr[-2000:])
        assert run.error.lower().startswith("no space left on device"), run.error
        assert "iostream" not in run.error and seconds < 120
        assert proc.stderr.count("Traceback") <= 1
        store.close()
    finally:
        subprocess.run(["umount", "-l", str(home)], capture_output=True)
