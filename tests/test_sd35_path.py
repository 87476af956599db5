"""The SD3.5 Medium path: its transformer config, a tiny pipeline with SD3.5's component classes and layout
loaded through the real from_pretrained path (local folder and HF cache under the preset's repo id),
gradient checkpointing, the paper preset, DiffusionNFT's prompt folders and the GPU check's CPU mode."""

import json
import math
import statistics
import shutil
from pathlib import Path

import pytest
import torch

from core.config import LORA_TARGETS_SD3, ModelConfig, preset, sd35m_paper
from core.models import load_pipeline
from core.prompts import available_sources, load_source, validate_source_name
from core.sampling import encode_prompts, generate_images
from tests.helpers import load_script, small_config

REPO = Path(__file__).resolve().parents[1]
SD35M_REPO_ID = "stabilityai/stable-diffusion-3.5-medium"
T5_PIECES = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -2.0)] + \
    [(c, -3.0) for c in "abcdefghijklmnopqrstuvwxyz0123456789.,'\"!?-"] + \
    [("▁" + w, -1.0) for w in ("a", "the", "of", "photo", "red", "blue", "cat", "dog", "sign", "says")]


# ---- SD3.5 Medium's transformer config ---------------------------------------------------------------------

def test_the_shipped_transformer_config_is_sd35_medium():
    from diffusers import SD3Transformer2DModel
    from peft import LoraConfig

    cfg = json.loads((REPO / "configs" / "sd35m" / "transformer_config.json").read_text())
    expected = dict(sample_size=128, patch_size=2, in_channels=16, out_channels=16, num_layers=24,
                    attention_head_dim=64, num_attention_heads=24, joint_attention_dim=4096,
                    caption_projection_dim=1536, pooled_projection_dim=2048, pos_embed_max_size=384,
                    dual_attention_layers=list(range(13)), qk_norm="rms_norm")
    assert {k: cfg[k] for k in expected} == expected
    with torch.device("meta"):  # the architecture without allocating 2.2 B parameters
        model = SD3Transformer2DModel.from_config(cfg)
        model.add_adapter(LoraConfig(r=32, lora_alpha=64, init_lora_weights="gaussian",
                                     target_modules=list(LORA_TARGETS_SD3)))
    base = sum(p.numel() for n, p in model.named_parameters() if "lora_" not in n)
    lora = sum(p.numel() for n, p in model.named_parameters() if "lora_" in n)
    assert 2.2e9 < base < 2.3e9  # 2,243,171,520
    assert 18e6 < lora < 19e6  # r=32 on the joint attention's 8 projections of 24 blocks
    assert model.transformer_blocks[12].attn2 is not None and model.transformer_blocks[13].attn2 is None


# ---- a tiny SD3.5-layout pipeline on disk --------------------------------------------------------------------

def build_tiny_sd35():
    """SD3.5's component classes at toy size: MMDiT with a dual-attention block and RMS qk-norm, a 16-channel
    VAE with SD3.5's scaling/shift, CLIP-L/CLIP-G stand-ins with projections, a T5 encoder, their tokenizers."""
    from diffusers import (AutoencoderKL, FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel,
                           StableDiffusion3Pipeline)
    from transformers import (CLIPTextConfig, CLIPTextModelWithProjection, CLIPTokenizer, T5Config, T5EncoderModel,
                              T5TokenizerFast)

    from core.models import _byte_level_vocab

    torch.manual_seed(0)
    vocab = _byte_level_vocab()
    clip_cfg = dict(vocab_size=len(vocab), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                    num_attention_heads=4, max_position_embeddings=77, projection_dim=32,
                    bos_token_id=vocab["<|startoftext|>"], eos_token_id=vocab["<|endoftext|>"],
                    pad_token_id=vocab["<|endoftext|>"])
    t5_tokenizer = T5TokenizerFast(vocab=T5_PIECES, extra_ids=0)
    t5 = T5EncoderModel(T5Config(vocab_size=len(t5_tokenizer), d_model=64, d_kv=16, d_ff=128, num_layers=1,
                                 num_heads=4, feed_forward_proj="gated-gelu", decoder_start_token_id=0))
    transformer = SD3Transformer2DModel(
        sample_size=8, patch_size=2, in_channels=16, out_channels=16, num_layers=2, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=64, caption_projection_dim=32, pooled_projection_dim=64,
        pos_embed_max_size=16, qk_norm="rms_norm", dual_attention_layers=(0,))
    vae = AutoencoderKL(in_channels=3, out_channels=3, down_block_types=["DownEncoderBlock2D"] * 4,
                        up_block_types=["UpDecoderBlock2D"] * 4, block_out_channels=[8, 8, 16, 16], latent_channels=16,
                        layers_per_block=1, norm_num_groups=8, use_quant_conv=False, use_post_quant_conv=False,
                        scaling_factor=1.5305, shift_factor=0.0609)
    return StableDiffusion3Pipeline(
        transformer=transformer, scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0), vae=vae,
        text_encoder=CLIPTextModelWithProjection(CLIPTextConfig(**clip_cfg)).eval(),
        text_encoder_2=CLIPTextModelWithProjection(CLIPTextConfig(**clip_cfg)).eval(),
        text_encoder_3=t5.eval(), tokenizer=CLIPTokenizer(vocab=vocab, merges=[], model_max_length=77),
        tokenizer_2=CLIPTokenizer(vocab=vocab, merges=[], model_max_length=77), tokenizer_3=t5_tokenizer)


@pytest.fixture(scope="module")
def tiny_sd35_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-sd35m")
    build_tiny_sd35().save_pretrained(folder)
    return folder


def test_the_saved_layout_is_sd35s(tiny_sd35_dir):
    index = json.loads((tiny_sd35_dir / "model_index.json").read_text())
    assert index["_class_name"] == "StableDiffusion3Pipeline"
    classes = {k: v[1] for k, v in index.items() if isinstance(v, list)}
    assert classes["transformer"] == "SD3Transformer2DModel" and classes["vae"] == "AutoencoderKL"
    assert classes["text_encoder"] == classes["text_encoder_2"] == "CLIPTextModelWithProjection"
    assert classes["text_encoder_3"] == "T5EncoderModel" and classes["scheduler"] == "FlowMatchEulerDiscreteScheduler"
    assert classes["tokenizer_3"].startswith("T5Tokenizer") and classes["tokenizer"] == "CLIPTokenizer"
    for sub in ("tokenizer", "tokenizer_2", "tokenizer_3", "text_encoder_3", "transformer", "vae"):
        assert (tiny_sd35_dir / sub).is_dir()


def test_the_preset_repo_id_loads_from_the_hf_cache_and_generates(tiny_sd35_dir, tmp_path, monkeypatch):
    from transformers import T5EncoderModel

    commit = "5ab1e0b5ee5ab1e0b5ee5ab1e0b5ee5ab1e0b5ee"
    repo = tmp_path / "hub" / ("models--" + SD35M_REPO_ID.replace("/", "--"))
    shutil.copytree(tiny_sd35_dir, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert preset("sd35m-paper").model.name == SD35M_REPO_ID

    pipe = load_pipeline(SD35M_REPO_ID)  # the preset's model.name, through StableDiffusion3Pipeline.from_pretrained
    assert isinstance(pipe.text_encoder_3, T5EncoderModel) and not pipe.text_encoder_3.training
    assert pipe.vae.config.latent_channels == 16 and pipe.vae.config.scaling_factor == pytest.approx(1.5305)
    assert pipe.transformer.transformer_blocks[0].attn2 is not None  # SD3.5's dual attention
    assert not any(p.requires_grad for p in pipe.text_encoder_3.parameters())
    emb = encode_prompts(pipe, ['a red sign that says "open"', "a cat"], 8, 1.0, torch.device("cpu"))
    assert emb.prompt_embeds.shape == (2, 77 + 8, 64) and emb.pooled.shape == (2, 64)
    # T5 tokens sit after the 77 CLIP ones: a different prompt changes them
    assert not torch.allclose(emb.prompt_embeds[0, 77:], emb.prompt_embeds[1, 77:])
    images = generate_images(pipe, ["a cat", "a dog"], seeds=[0, 1], num_steps=2, resolution=64,
                             max_sequence_length=8)
    assert images.shape == (2, 3, 64, 64) and images.min() >= 0 and images.max() <= 1


def test_a_training_step_on_the_sd35_layout_with_nft_prompt_folders(tiny_sd35_dir, tmp_path):
    from core.trainer import Trainer

    general, geneval = tmp_path / "pickscore", tmp_path / "geneval"
    general.mkdir()
    geneval.mkdir()
    (general / "train.txt").write_text("a cat on a sofa\na dog in the snow\n")
    (general / "test.txt").write_text("a red car\n")
    row = {"tag": "single_object", "include": [{"class": "cat", "count": 1}], "prompt": "a photo of a cat"}
    for split in ("train", "test"):
        (geneval / f"{split}_metadata.jsonl").write_text(json.dumps(row) + "\n")
    config = small_config("marble", steps=1, **{"model.name": str(tiny_sd35_dir), "model.gradient_checkpointing": True,
                                                "sampling.max_sequence_length": 8,
                                                "prompts.sources": [f"file:{general}", f"file:{geneval}"]})
    events = []
    trainer = Trainer(config, tmp_path / "run", on_event=events.append)
    assert trainer.policy.transformer.gradient_checkpointing  # the flag reaches the transformer
    trainer.train_step(0)
    step = [e for e in events if e.kind == "step"][0]
    assert math.isfinite(step.loss) and step.grad_norm > 0 and step.phase == "harmonized"


# ---- gradient checkpointing changes memory, not gradients -------------------------------------------------------

def test_gradient_checkpointing_gives_the_same_update(tmp_path):
    from core.trainer import Trainer

    params = []
    for checkpointing in (False, True):
        config = small_config("marble_full", steps=1, **{"model.gradient_checkpointing": checkpointing})
        trainer = Trainer(config, tmp_path / str(checkpointing))
        trainer.train_step(0)  # K per-reward backward passes with a retained graph, then the KL one
        params.append({n: p.detach().clone() for n, p in trainer.policy.named_trainable.items()})
    assert params[0].keys() == params[1].keys()
    for name in params[0]:
        torch.testing.assert_close(params[1][name], params[0][name], rtol=1e-5, atol=1e-7)


def test_model_config_checks_the_flag():
    from core.config import ConfigError

    with pytest.raises(ConfigError, match="gradient_checkpointing.*true or false"):
        ModelConfig(gradient_checkpointing="yes").validate()


# ---- the paper preset ------------------------------------------------------------------------------------------

def test_sd35m_paper_preset_has_the_papers_recipe_scaled_to_the_gpus():
    cfg = preset("sd35m-paper")
    assert (cfg.model.name, cfg.model.lora_rank, cfg.model.lora_alpha, cfg.model.dtype) == \
        (SD35M_REPO_ID, 32, 64.0, "bfloat16")
    assert cfg.model.lora_targets == list(LORA_TARGETS_SD3)
    s = cfg.sampling
    assert (s.num_steps, s.guidance_scale, s.resolution, s.max_sequence_length) == (25, 1.0, 512, 128)
    assert (s.prompts_per_step, s.images_per_prompt) == (48, 24)  # 16 GPUs
    assert cfg.prompts.sources == ["nft-general", "nft-ocr", "nft-geneval"]
    assert cfg.reward_names == ["pickscore", "hpsv2", "clipscore", "ocr", "geneval"]
    o = cfg.optim
    assert (o.lr, o.beta1, o.beta2, o.weight_decay, o.grad_clip) == (3e-4, 0.9, 0.999, 1e-4, 1.0)
    b = cfg.balance
    assert (b.strategy, b.harmonize_every, b.ema_rho) == ("marble", 10, 0.7)
    one = preset("sd35m-paper-1gpu")
    assert (one.sampling.prompts_per_step, one.sampling.images_per_prompt) == (3, 24)
    assert sd35m_paper(8).sampling.prompts_per_step == 24
    assert one.to_dict() | {"sampling": None} == cfg.to_dict() | {"sampling": None}


# ---- DiffusionNFT's prompt folders ---------------------------------------------------------------------------------

def test_nft_prompt_folders_keep_their_splits_and_geneval_metadata(tmp_path):
    (tmp_path / "ocr").mkdir()
    (tmp_path / "ocr" / "train.txt").write_text('a sign that says "OPEN"\na mug with "hello"\n')
    (tmp_path / "ocr" / "test.txt").write_text('a poster that says "STOP"\n')
    ocr = load_source(f"file:{tmp_path / 'ocr'}")
    assert [p.text for p in ocr.train] == ['a sign that says "OPEN"', 'a mug with "hello"']
    assert [p.text for p in ocr.test] == ['a poster that says "STOP"']
    (tmp_path / "geneval").mkdir()
    row = {"tag": "counting", "include": [{"class": "bird", "count": 3}], "exclude": [{"class": "bird", "count": 4}],
           "prompt": "a photo of three birds"}
    (tmp_path / "geneval" / "train_metadata.jsonl").write_text(json.dumps(row) + "\n")
    (tmp_path / "geneval" / "test_metadata.jsonl").write_text(json.dumps(row) + "\n")
    geneval = load_source(f"file:{tmp_path / 'geneval'}")
    item = geneval.train[0]
    assert item.text == "a photo of three birds"
    assert item.metadata == {"source": f"file:{tmp_path / 'geneval'}", "tag": "counting",
                             "include": row["include"], "exclude": row["exclude"]}
    (tmp_path / "empty").mkdir()
    assert "train.txt + test.txt" in validate_source_name(f"file:{tmp_path / 'empty'}")


def test_nft_sources_are_registered_and_say_where_the_files_go():
    assert {"nft-general", "nft-ocr", "nft-geneval"} <= set(available_sources())
    assert validate_source_name("nft-ocr") is None  # a config may name it before the files are there
    if not (REPO / "data" / "prompts" / "ocr").is_dir():
        with pytest.raises(ValueError, match=r"data/prompts/ocr.*DiffusionNFT"):
            load_source("nft-ocr")


# ---- the GPU check's CPU mode ----------------------------------------------------------------------------------------

def test_gpu_check_runs_the_trainer_on_cpu_with_tiny(tmp_path):
    gpu_check = load_script("gpu_check")
    report = gpu_check.main(["--tiny", "--steps", "2", "--out", str(tmp_path / "gpu.json")])
    assert json.loads((tmp_path / "gpu.json").read_text())["paper"] == {"marble_speed": 0.97, "marble_memory": 1.14,
                                                                       "marble_full_speed": 0.56}
    strategies = report["strategies"]
    assert set(strategies) == {"weighted_sum", "marble", "marble_full", "marble_full_step_scope",
                               "marble_full_step_scope_per_reward"}
    assert strategies["marble_full_step_scope"]["gradients"] == "per_sample"
    assert strategies["marble_full_step_scope_per_reward"]["gradients"] == "per_reward"
    assert report["projected_to_paper_step"]["marble_full_step_scope_per_reward_speed"] > 0
    # MARBLE's timed window is two refresh periods: 9 amortized steps and the full step at N = 10, twice
    assert strategies["marble"]["full_steps"] == ([False] * 9 + [True]) * 2
    for result in strategies.values():  # a mean over the timed steps, with its standard error
        times = result["step_seconds"]
        assert result["seconds_per_step"] == pytest.approx(sum(times) / len(times))
        assert result["seconds_per_step_se"] == pytest.approx(statistics.stdev(times) / math.sqrt(len(times)))
    assert all(strategies["marble_full"]["full_steps"]) and not any(strategies["weighted_sum"]["full_steps"])
    assert report["setup"]["K"] == 5 and report["setup"]["lora"] == {"rank": 32, "alpha": 64}
    for value in list(report["ratios_vs_weighted_sum"].values()) + [report["projected_to_paper_step"]["marble_speed"]]:
        assert math.isfinite(value) and value > 0


def test_gpu_check_ratio_standard_error_is_the_delta_method():
    gpu_check = load_script("gpu_check")
    slow = {"seconds_per_step": 4.0, "seconds_per_step_se": 0.4}
    fast = {"seconds_per_step": 2.0, "seconds_per_step_se": 0.0}
    assert gpu_check.ratio(slow, fast) == pytest.approx((0.5, 0.05))  # relative errors add in quadrature
    assert gpu_check.ratio(slow, dict(slow))[1] == pytest.approx(math.sqrt(2) * 0.1)
    assert gpu_check.ratio({"seconds_per_step": 1.0, "seconds_per_step_se": None}, fast) == (2.0, None)
