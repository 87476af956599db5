"""Hub-ready export (jobs.hub_export, `python -m jobs export RUN --format hub`): the folder loads with plain
``StableDiffusion3Pipeline.load_lora_weights``, raw and EMA, and its card parses back with ``ModelCard.load``.
One tiny run (2 steps, samples and a checkpoint) is trained once for the module."""

import json
import os
import shutil
import struct
from pathlib import Path

import pytest
import torch
from huggingface_hub import ModelCard
from PIL import Image
from safetensors import safe_open
from safetensors.torch import save_file

from core.checkpoint import write_manifest
from core.models import build_tiny_pipeline
from jobs.hub_export import ExportError, base_model_id, check_safetensors, export_hub
from jobs.runner import submit
from jobs.storage import Store
from tests.helpers import small_config
from tests.jobs_support import run_cli

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    home = tmp_path_factory.mktemp("hub") / "home"
    store = Store.open(home)
    run_id = submit(store, small_config("marble", steps=2, sample_every=1), preset="tiny", name="hub-run",
                    immediate=True)
    store.add_evaluation(run_id, "tiny/test", {"colorfulness": 0.25, "brightness": 0.5}, checkpoint_step=2)
    yield store, run_id
    store.close()


def _read(path):
    with safe_open(str(path), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, f.metadata()


def _loaded_lora(folder):
    """A fresh tiny pipeline with the folder's LoRA loaded the plain diffusers way; its LoRA tensors by key."""
    from peft.utils import get_peft_model_state_dict

    pipe = build_tiny_pipeline()
    pipe.load_lora_weights(str(folder))
    (adapter,) = pipe.transformer.peft_config  # the one adapter the folder held
    return pipe, get_peft_model_state_dict(pipe.transformer, adapter_name=adapter)


def _assert_same_lora(loaded: dict, saved: dict):
    saved = {k.removeprefix("transformer."): v for k, v in saved.items()}
    assert sorted(loaded) == sorted(saved) and saved
    for key, value in saved.items():
        torch.testing.assert_close(loaded[key], value)


def test_exported_folder_loads_with_plain_diffusers_and_the_card_parses_back(trained, tmp_path):
    store, run_id = trained
    ckpt = store.latest_checkpoint(run_id)
    # the LoRA's parameter EMA, as the EMA feature stores it: <checkpoint>/ema/pytorch_lora_weights.safetensors
    raw, meta = _read(f"{ckpt['path']}/pytorch_lora_weights.safetensors")
    ema_tensors = {k: v * 0.5 + 0.01 for k, v in raw.items()}
    ema_dir = f"{ckpt['path']}/ema"
    backup = tmp_path / "ema_backup"  # the run's own EMA (optim.ema_decay), restored for the other tests
    if os.path.isdir(ema_dir):
        shutil.copytree(ema_dir, backup)
    os.makedirs(ema_dir, exist_ok=True)
    save_file(ema_tensors, f"{ema_dir}/pytorch_lora_weights.safetensors", metadata=meta)
    write_manifest(ckpt["path"])  # planted on purpose: re-sealed, or the export refuses the changed file

    out = tmp_path / "export"
    code, stdout, err = run_cli(store.home, "export", str(run_id), "--format", "hub", "--out", str(out))
    assert code == 0, err
    assert "exported to" in stdout and "with its EMA" in stdout
    for name in ("pytorch_lora_weights.safetensors", "ema/pytorch_lora_weights.safetensors", "README.md",
                 "marble_config.json", "alpha_trajectory.png", "samples.png"):
        assert (out / name).is_file(), name

    pipe, loaded = _loaded_lora(out)
    _assert_same_lora(loaded, raw)
    cfg = json.loads((out / "marble_config.json").read_text())
    adapter = next(iter(pipe.transformer.peft_config.values()))
    assert (adapter.r, adapter.lora_alpha) == (cfg["model"]["lora_rank"], cfg["model"]["lora_alpha"])
    _, loaded_ema = _loaded_lora(out / "ema")
    _assert_same_lora(loaded_ema, ema_tensors)

    card = ModelCard.load(out / "README.md")
    data = card.data.to_dict()
    assert data["base_model"] == "tiny" and data["library_name"] == "diffusers"
    assert "license" not in data  # left for the user, and the card says so
    assert "license:** not set" in card.text
    assert {"marble", "lora", "strategy-marble"} <= set(data["tags"])
    assert data["marble"]["strategy"] == "marble" and data["marble"]["checkpoint_step"] == 2
    assert data["marble"]["rewards"] == ["jpeg_compressibility", "colorfulness", "brightness"]
    assert data["marble"]["ema_lora"] is True
    assert data["marble"]["run_status"] == "succeeded" and "unfinished run" not in card.text
    assert "| tiny/test | 2 | 0.5000 | 0.2500 |" in card.text  # the stored held-out evaluation
    assert "](alpha_trajectory.png)" in card.text and "](samples.png)" in card.text
    assert "| strategy | marble |" in card.text and str(store.home) not in card.text
    with Image.open(out / "samples.png") as grid:
        assert grid.size == (4 * 128, 2 * 128)  # the 8 samples of step 2

    # a picked checkpoint and a license; without the ema folder only the raw LoRA is exported
    shutil.rmtree(ema_dir)
    write_manifest(ckpt["path"])
    out2 = tmp_path / "export2"
    done = export_hub(store, run_id, out2, checkpoint_step=2, license_id="apache-2.0")
    assert not done.has_ema and not (out2 / "ema").exists()
    assert ModelCard.load(out2 / "README.md").data.license == "apache-2.0"
    if backup.is_dir():
        shutil.copytree(backup, ema_dir)
    write_manifest(ckpt["path"])

    # a checkpoint that does not match its manifest is never exported
    stray = Path(ckpt["path"]) / "stray.bin"
    stray.write_bytes(b"not part of the checkpoint")
    try:
        code, _, err = run_cli(store.home, "export", str(run_id), "--format", "hub", "--out", str(tmp_path / "x"))
    finally:
        stray.unlink()
    assert code == 2 and "Traceback" not in err and "stray.bin' is not listed in manifest.json" in err
    assert not (tmp_path / "x").exists()


def test_push_offline_or_without_token_is_one_sentence_and_exit_code_2(trained, tmp_path, monkeypatch):
    store, run_id = trained
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    code, stdout, err = run_cli(store.home, "export", str(run_id), "--format", "hub", "--out", str(tmp_path / "a"),
                                "--push", "me/my-lora")
    assert code == 2 and "Traceback" not in err
    assert err.strip().count("\n") == 0 and "not pushed to me/my-lora: HF_HUB_OFFLINE is set" in err
    assert (tmp_path / "a" / "pytorch_lora_weights.safetensors").is_file()  # the folder is still written

    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", False, raising=False)
    monkeypatch.setattr("huggingface_hub.get_token", lambda: None)
    code, _, err = run_cli(store.home, "export", str(run_id), "--format", "hub", "--out", str(tmp_path / "b"),
                           "--push", "me/my-lora")
    assert code == 2 and "no Hugging Face token is configured" in err and "Traceback" not in err


def test_push_with_a_token_uploads_the_exported_folder_and_a_refusal_is_one_sentence(trained, tmp_path, monkeypatch):
    """The push itself, with the Hub replaced by a recorder (no network here): a private repo is created and
    the exported folder uploaded as it is; a Hub error becomes one sentence, exit code 2."""
    import huggingface_hub

    store, run_id = trained
    calls = []

    class FakeApi:
        def __init__(self, token=None):
            calls.append(("token", token))

        def create_repo(self, repo_id, **kw):
            calls.append(("create", repo_id, kw.get("private"), kw.get("exist_ok")))

        def upload_folder(self, repo_id, folder_path, **kw):
            calls.append(("upload", repo_id, sorted(p.name for p in Path(folder_path).iterdir())))

    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", False, raising=False)
    monkeypatch.setattr(huggingface_hub, "is_offline_mode", lambda: False, raising=False)
    monkeypatch.setattr(huggingface_hub, "get_token", lambda: "hf_secret")
    monkeypatch.setattr(huggingface_hub, "HfApi", FakeApi)
    code, stdout, err = run_cli(store.home, "export", str(run_id), "--format", "hub", "--out", str(tmp_path / "c"),
                                "--push", "me/my-lora")
    assert code == 0, err
    assert calls[0] == ("token", "hf_secret") and calls[1] == ("create", "me/my-lora", True, True)
    assert calls[2][:2] == ("upload", "me/my-lora") and "pytorch_lora_weights.safetensors" in calls[2][2]
    assert "README.md" in calls[2][2] and "https://huggingface.co/me/my-lora" in stdout

    def refuse(self, repo_id, **kw):
        raise RuntimeError("403 Forbidden: you cannot write to me/my-lora\nmore detail")

    monkeypatch.setattr(FakeApi, "create_repo", refuse)
    code, _, err = run_cli(store.home, "export", str(run_id), "--format", "hub", "--out", str(tmp_path / "d"),
                           "--push", "me/my-lora")
    assert code == 2 and "Traceback" not in err and err.strip().count("\n") == 0
    assert "not pushed to me/my-lora: the Hub refused or could not be reached (403 Forbidden" in err


def test_bad_export_input_names_the_field(trained, tmp_path):
    store, run_id = trained
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    cases = [
        (["--out", str(tmp_path / "full")], "must be an empty or new folder"),
        (["--out", str(tmp_path / "c"), "--checkpoint", "7"], "checkpoint=7: run %d has checkpoints at steps 2" % run_id),
        (["--out", str(tmp_path / "d"), "--push", "not a repo"], "push='not a repo': must be a Hub repo id"),
        (["--out", str(tmp_path / "e"), "--license", "bogus license"], "license='bogus license': must be a Hub license id"),
        (["--out", str(tmp_path / "f"), "--license", "mit\nfoo: bar"], "license='mit\\nfoo: bar': must be a Hub"),
        ([], "--out: --format hub writes a folder"),
    ]
    for extra, message in cases:
        code, _, err = run_cli(store.home, "export", str(run_id), "--format", "hub", *extra)
        assert code == 2 and message in err, (extra, err)
    assert not (tmp_path / "e").exists() and not (tmp_path / "f").exists()  # refused before anything is written
    code, _, err = run_cli(store.home, "export", str(run_id), "--format", "csv", "--push", "me/x")
    assert code == 2 and "--push: only --format hub takes it" in err


def test_safetensors_header_check_and_base_model_names(tmp_path):
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\x80\x04pickle")  # never loaded, only refused
    with pytest.raises(ExportError, match="not a readable safetensors file"):
        check_safetensors(bad)
    header = json.dumps({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}).encode()
    good = tmp_path / "good.safetensors"
    good.write_bytes(struct.pack("<Q", len(header)) + header + b"\0\0\0\0")
    assert "a" in check_safetensors(good)
    assert base_model_id("stabilityai/stable-diffusion-3.5-medium") == "stabilityai/stable-diffusion-3.5-medium"
    assert base_model_id("/c/hub/models--stabilityai--stable-diffusion-3.5-medium/snapshots/abc") == \
        "stabilityai/stable-diffusion-3.5-medium"
    assert base_model_id("mini-world") == "mini-world" and base_model_id("/data/my-sd3") == "my-sd3"


def test_runs_page_export_button_writes_the_folder_and_says_why_it_did_not_push(trained, monkeypatch):
    from app import context
    from app.pages.runs import export_for_hub

    store, run_id = trained
    monkeypatch.setattr(context, "store", lambda: store)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert export_for_hub(None) == "Pick a run first."
    first = export_for_hub(run_id)
    second = export_for_hub(run_id, "me/my-lora")
    folder = store.run_dir(run_id) / "exports" / "hub-step_2"
    # the run's checkpoints hold the parameter EMA (optim.ema_decay), so the export carries it too
    assert f"checkpoint 2 exported with its EMA to `{folder}`" in first and "Pushed" not in first
    assert (folder / "ema" / "pytorch_lora_weights.safetensors").is_file()
    assert f"`{folder}-2`" in second and "Not pushed to me/my-lora: HF_HUB_OFFLINE is set" in second
    assert ModelCard.load(folder / "README.md").data.library_name == "diffusers"
    assert export_for_hub(run_id + 99).startswith(f"Run #{run_id + 99}: ")


def test_a_checkpoint_of_an_unfinished_run_says_so_on_its_card(trained, tmp_path, monkeypatch):
    """New-user pass: a run cancelled at 16 of 20 steps exported with a card that read "steps | 20" and nothing
    else; the card now says the run did not finish, and where it stopped."""
    import dataclasses

    store, run_id = trained
    real = store.get_run
    monkeypatch.setattr(store, "get_run", lambda rid: dataclasses.replace(real(rid), status="cancelled", step=2)
                        if rid == run_id else real(rid))
    done = export_hub(store, run_id, tmp_path / "unfinished", checkpoint_step=2)
    card = ModelCard.load(done.folder / "README.md")
    assert "**unfinished run:** it was cancelled at step 2 of 2" in card.text
    assert card.data.to_dict()["marble"]["run_status"] == "cancelled"
    assert "| steps (configured) | 2 |" in card.text
