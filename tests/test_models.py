"""Loading SD3 pipelines (built-in, local folder, Hugging Face cache) and the LoRA / old / ref policy."""

import json
import logging
import shutil

import pytest
import torch

from core.config import ModelConfig
from core.models import (ModelNotFoundError, Policy, VelocityInputs, build_tiny_pipeline, load_lora, load_pipeline,
                         resolve_model_path)


def _inputs(pipe, b=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, 4, 16, 16, generator=g)
    emb, _, pooled, _ = pipe.encode_prompt(["a red circle"] * b, None, None, do_classifier_free_guidance=False,
                                           max_sequence_length=4)
    return VelocityInputs(x, torch.full((b,), 0.6), emb, pooled)


@pytest.fixture(scope="module")
def saved_tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_pipe")
    build_tiny_pipeline(seed=0).save_pretrained(path)
    return path


def test_tiny_pipeline_is_deterministic_per_seed():
    a, b, c = build_tiny_pipeline(0), build_tiny_pipeline(0), build_tiny_pipeline(1)
    wa = dict(a.transformer.named_parameters())
    assert all(torch.equal(p, wa[n]) for n, p in b.transformer.named_parameters())
    assert any(not torch.equal(p, wa[n]) for n, p in c.transformer.named_parameters())


def test_load_from_local_folder_matches_the_built_model(saved_tiny):
    built = load_pipeline("tiny")
    loaded = load_pipeline(str(saved_tiny))
    assert loaded.text_encoder_3 is None
    inp = _inputs(built)
    with torch.no_grad():
        a = built.transformer(hidden_states=inp.x, timestep=inp.sigma * 1000, encoder_hidden_states=inp.prompt_embeds,
                              pooled_projections=inp.pooled).sample
        b = loaded.transformer(hidden_states=inp.x, timestep=inp.sigma * 1000,
                               encoder_hidden_states=inp.prompt_embeds, pooled_projections=inp.pooled).sample
    assert torch.equal(a, b)
    assert not any(p.requires_grad for p in loaded.transformer.parameters())


def test_load_from_the_hugging_face_cache_layout(saved_tiny, tmp_path, monkeypatch):
    # The hub cache layout: models--org--name/{refs/main, snapshots/<commit>/...}.
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--someorg--tiny-sd3"
    shutil.copytree(saved_tiny, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    assert resolve_model_path("someorg/tiny-sd3") == repo / "snapshots" / commit
    pipe = load_pipeline("someorg/tiny-sd3")
    assert pipe.transformer.config.num_layers == 2


def test_missing_models_give_one_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    with pytest.raises(ModelNotFoundError, match=r"'stabilityai/stable-diffusion-3.5-medium' is not in the local "
                                                 r"Hugging Face cache .*hf download"):
        load_pipeline("stabilityai/stable-diffusion-3.5-medium")
    with pytest.raises(ModelNotFoundError, match="not a built-in model .*tiny"):
        load_pipeline("no_such_model")
    (tmp_path / "folder").mkdir()
    with pytest.raises(ModelNotFoundError, match="has no model_index.json"):
        load_pipeline(str(tmp_path / "folder"))


def test_policy_trains_only_lora_and_starts_at_the_reference():
    pipe = load_pipeline("tiny")
    policy = Policy(pipe, ModelConfig(lora_rank=2, lora_alpha=4.0), torch.device("cpu"))
    trainable = [n for n, p in pipe.transformer.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    assert policy.num_trainable == sum(p.numel() for p in policy.parameters)
    inp = _inputs(pipe)
    v, v_old, v_ref = policy.velocity(inp), policy.velocity_old(inp), policy.velocity_ref(inp)
    assert torch.allclose(v, v_ref) and torch.allclose(v_old, v_ref)  # LoRA B starts at zero
    assert v.requires_grad and not v_ref.requires_grad


def test_old_adapter_is_separate_and_soft_updates():
    pipe = load_pipeline("tiny")
    policy = Policy(pipe, ModelConfig(lora_rank=2, lora_alpha=4.0), torch.device("cpu"))
    inp = _inputs(pipe)
    with torch.no_grad():
        for p in policy.parameters:
            p.add_(0.05 * torch.randn_like(p))
    v_ref, v_old, v = policy.velocity_ref(inp), policy.velocity_old(inp), policy.velocity(inp)
    assert torch.allclose(v_old, v_ref)  # θ_old untouched by the change of θ
    assert not torch.allclose(v, v_ref, atol=1e-5)
    assert all(p.requires_grad for p in policy.parameters)  # the reference call re-enabled the adapter
    name, p = next(iter(policy.named_trainable.items()))
    before = policy.old[name].clone()
    policy.soft_update_old(0.75)  # θ_old ← 0.75·θ_old + 0.25·θ
    assert torch.allclose(policy.old[name], 0.75 * before + 0.25 * p.detach())
    policy.soft_update_old(0.0)
    assert torch.allclose(policy.velocity_old(inp), policy.velocity(inp).detach())


def test_saved_lora_reloads_through_diffusers_with_its_alpha(tmp_path):
    pipe = load_pipeline("tiny")
    policy = Policy(pipe, ModelConfig(lora_rank=2, lora_alpha=7.0), torch.device("cpu"))
    with torch.no_grad():
        for p in policy.parameters:
            p.add_(0.05 * torch.randn_like(p))
    inp = _inputs(pipe)
    want = policy.velocity(inp).detach()
    policy.save_diffusers_lora(tmp_path)
    assert (tmp_path / "pytorch_lora_weights.safetensors").is_file()
    outputs = {}
    for how in ("diffusers", "ours"):  # any diffusers user's path, and ours (transformer only, no warnings)
        fresh = load_pipeline("tiny")
        fresh.load_lora_weights(str(tmp_path)) if how == "diffusers" else load_lora(fresh, tmp_path)
        with torch.no_grad():
            outputs[how] = fresh.transformer(hidden_states=inp.x, timestep=inp.sigma * 1000,
                                             encoder_hidden_states=inp.prompt_embeds,
                                             pooled_projections=inp.pooled).sample
    for got in outputs.values():
        assert torch.allclose(got, want, atol=1e-5)
        # The scale alpha/r = 3.5 matters: the same weights at another alpha give another output.
        assert not torch.allclose(got, policy.velocity_ref(inp), atol=1e-4)


def test_our_lora_loader_does_not_warn_about_text_encoders(tmp_path, caplog):
    pipe = load_pipeline("tiny")
    Policy(pipe, ModelConfig(lora_rank=2), torch.device("cpu")).save_diffusers_lora(tmp_path)
    with caplog.at_level(logging.WARNING):
        load_lora(load_pipeline("tiny"), tmp_path)
    assert not [r for r in caplog.records if "No LoRA keys" in r.getMessage()]
    with caplog.at_level(logging.WARNING):  # the check can fail: diffusers' own path does warn
        load_pipeline("tiny").load_lora_weights(str(tmp_path))
    assert [r for r in caplog.records if "No LoRA keys" in r.getMessage()]


def test_bad_lora_targets_are_named():
    with pytest.raises(ValueError, match=r"matched no module|Target modules"):
        Policy(load_pipeline("tiny"), ModelConfig(lora_targets=["attn.nothing_here"]), torch.device("cpu"))
