"""SD3-family pipelines, the trainable LoRA adapter, the "old" adapter and the KL reference.

Three velocity predictions per training sample (MARBLE_SPEC §2):
- ``policy``: the trainable LoRA adapter θ (with grad);
- ``old``: a soft copy θ_old of the adapter (no grad), also the rollout policy;
- ``ref``: the base model with adapters disabled (no grad), only for the KL term.

The old adapter is held as a dict of tensors and applied with ``torch.func.functional_call`` so the
trainable parameters are never swapped or re-flagged; its soft update is one ``lerp`` per tensor.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from core.cache import hf_cache_dir
from core.config import ModelConfig

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ModelNotFoundError(FileNotFoundError):
    """The model is neither a registered name, a local folder nor in the Hugging Face cache."""


# ---- registry of built-in models -------------------------------------------------------------------

_MODELS: dict[str, tuple[str, Callable[[], "object"]]] = {}


def register_model(name: str, description: str):
    def deco(builder):
        _MODELS[name] = (description, builder)
        return builder

    return deco


def available_models() -> dict[str, str]:
    """Built-in model name -> one-line description."""
    return {name: desc for name, (desc, _) in _MODELS.items()}


def _byte_level_vocab() -> dict[str, int]:
    """A CLIP BPE vocabulary with no merges: one token per byte (GPT-2's byte->unicode map)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
        range(ord("®"), ord("ÿ") + 1))
    chars, n = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + n)
            n += 1
    symbols = [chars[b] for b in range(256)]
    vocab = {s: i for i, s in enumerate(symbols)}
    vocab.update({s + "</w>": 256 + i for i, s in enumerate(symbols)})
    vocab["<|startoftext|>"] = len(vocab)
    vocab["<|endoftext|>"] = len(vocab)
    return vocab


@register_model("tiny", "Random-weight SD3 (0.6 M params, 64 px, byte-level CLIP text side, no T5). "
                        "Built in a second; for tests, benchmarks and smoke runs.")
def build_tiny_pipeline(seed: int = 0, text_max_length: int = 32):
    """A tiny ``StableDiffusion3Pipeline`` with random weights, identical for a given seed.

    Shapes follow ENV_NOTES' recipe: transformer width 64 (4 heads x 16), 2 layers, patch 2; VAE with
    three blocks (factor 4: 64 px -> 16x16x4 latents); two CLIP text encoders (hidden 32, projection 32),
    so pooled_projection_dim = 64; no T5 (``max_sequence_length`` pads zeros of joint_attention_dim).
    """
    from diffusers import (AutoencoderKL, FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel,
                           StableDiffusion3Pipeline)
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection, CLIPTokenizer

    vocab = _byte_level_vocab()
    tokenizer = CLIPTokenizer(vocab=vocab, merges=[], model_max_length=text_max_length)
    saved_rng = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        text_cfg = CLIPTextConfig(vocab_size=len(vocab), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                  num_attention_heads=4, max_position_embeddings=text_max_length,
                                  projection_dim=32, bos_token_id=vocab["<|startoftext|>"],
                                  eos_token_id=vocab["<|endoftext|>"], pad_token_id=vocab["<|endoftext|>"])
        text_encoder = CLIPTextModelWithProjection(text_cfg).eval()
        text_encoder_2 = CLIPTextModelWithProjection(text_cfg).eval()
        transformer = SD3Transformer2DModel(
            sample_size=16, patch_size=2, in_channels=4, out_channels=4, num_layers=2, attention_head_dim=16,
            num_attention_heads=4, joint_attention_dim=64, caption_projection_dim=64, pooled_projection_dim=64,
            pos_embed_max_size=16, qk_norm="rms_norm", dual_attention_layers=(0,))
        vae = AutoencoderKL(
            in_channels=3, out_channels=3, down_block_types=["DownEncoderBlock2D"] * 3,
            up_block_types=["UpDecoderBlock2D"] * 3, block_out_channels=[16, 32, 32], latent_channels=4,
            layers_per_block=1, norm_num_groups=8, use_quant_conv=False, use_post_quant_conv=False,
            mid_block_add_attention=False, scaling_factor=1.0, shift_factor=0.0)
    finally:
        torch.random.set_rng_state(saved_rng)
    pipe = StableDiffusion3Pipeline(
        transformer=transformer, scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0), vae=vae,
        text_encoder=text_encoder, tokenizer=tokenizer, text_encoder_2=text_encoder_2, tokenizer_2=tokenizer,
        text_encoder_3=None, tokenizer_3=None)
    return pipe


MINI_WORLD_DIR = Path(__file__).resolve().parent / "assets" / "mini-world"


@register_model("mini-world", "Pretrained mini SD3 (1.6 M params, 64 px) on the built-in shapes world; the "
                              "default. Follows colours well, counts and positions less: room for RL.")
def load_mini_world():
    """The shipped pipeline in core/assets/mini-world (see its MODEL_CARD.md); made by core.pretrain."""
    from diffusers import StableDiffusion3Pipeline

    if not (MINI_WORLD_DIR / "model_index.json").is_file():
        raise ModelNotFoundError(f"the mini-world model folder {str(MINI_WORLD_DIR)!r} is missing; restore it "
                                 f"from git or rebuild it with `python -m core.pretrain --out {MINI_WORLD_DIR}`")
    return StableDiffusion3Pipeline.from_pretrained(MINI_WORLD_DIR, local_files_only=True, text_encoder_3=None,
                                                    tokenizer_3=None, use_safetensors=True)


# ---- loading ---------------------------------------------------------------------------------------

_OPTIONAL_COMPONENTS = ("text_encoder_3", "tokenizer_3", "image_encoder", "feature_extractor")


def resolve_model_path(name: str) -> Path:
    """A local diffusers folder for ``name``: the folder itself, or the cached snapshot of a repo id.

    Nothing is downloaded. Raises :class:`ModelNotFoundError` saying what is missing and where to put it.
    """
    path = Path(name).expanduser()
    if path.exists():
        if not (path / "model_index.json").is_file():
            raise ModelNotFoundError(
                f"model folder {str(path)!r} has no model_index.json: point model.name at a diffusers "
                f"pipeline folder (the one written by save_pretrained or by `hf download`).")
        return path
    if name.count("/") == 1 and not name.startswith((".", "/", "~")):
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import LocalEntryNotFoundError

        cache = hf_cache_dir()
        try:
            return Path(snapshot_download(repo_id=name, local_files_only=True, cache_dir=cache))
        except (LocalEntryNotFoundError, FileNotFoundError, OSError) as e:
            raise ModelNotFoundError(
                f"model {name!r} is not in the local Hugging Face cache ({cache}) and nothing is downloaded at "
                f"run time. On a machine with network run `hf download {name}` and copy the cache here, or pass "
                f"the local folder of the pipeline as model.name. ({type(e).__name__})") from None
    raise ModelNotFoundError(
        f"model {name!r} is not a built-in model ({', '.join(available_models())}), not an existing folder, "
        f"and not a Hugging Face repo id of the form org/name.")


def load_pipeline(name: str, dtype: str = "float32", device: str = "cpu"):
    """Any ``StableDiffusion3Pipeline``: a built-in name, a local folder, or a cached Hugging Face repo id."""
    if name in _MODELS:
        pipe = _MODELS[name][1]()
    else:
        from diffusers import StableDiffusion3Pipeline

        path = resolve_model_path(name)
        index = json.loads((path / "model_index.json").read_text())
        missing = {c: None for c in _OPTIONAL_COMPONENTS if c not in index or index[c] in (None, [None, None])}
        # use_safetensors: a model folder is user-reachable; its pickled .bin weights are never loaded
        pipe = StableDiffusion3Pipeline.from_pretrained(path, local_files_only=True, torch_dtype=DTYPES[dtype],
                                                        use_safetensors=True, **missing)
    pipe.to(device)
    if dtype != "float32":
        pipe.to(DTYPES[dtype])
    pipe.set_progress_bar_config(disable=True)
    for module in (pipe.transformer, pipe.vae, pipe.text_encoder, pipe.text_encoder_2, pipe.text_encoder_3):
        if module is not None:
            module.requires_grad_(False)
            module.eval()
    return pipe


LORA_WEIGHTS = ("ema", "raw")


def load_lora(pipe, directory: str | Path, weights: str = "ema") -> str:
    """Load a checkpoint's LoRA (``save_diffusers_lora``'s format) into ``pipe``; returns which weights it
    loaded: "ema" (the parameter EMA in the checkpoint's ema/ folder, the default, as the release evaluates)
    or "raw" (the optimizer's weights; also what a checkpoint without an EMA gives).

    Our adapters are transformer-only, so they go straight into the transformer: ``load_lora_weights``
    would also try both text encoders and log a "No LoRA keys associated to ..." warning for each. A file
    that does carry text-encoder LoRA (someone else's) takes the full diffusers path.

    Only the safetensors file is read (never a pickled ``.bin``). A folder with a manifest (every checkpoint
    this program writes) is checked against it first: a damaged file raises CheckpointError naming it."""
    from core.checkpoint import EMA_FOLDER, LORA_FILE, MANIFEST_FILE, CheckpointError, verify

    if weights not in LORA_WEIGHTS:
        raise ValueError(f"weights={weights!r}: valid choices: {', '.join(LORA_WEIGHTS)}")
    directory = Path(directory)
    if (directory / MANIFEST_FILE).exists():
        verify(directory)  # the manifest covers ema/ too
    loaded = "raw"
    if weights == "ema" and (directory / EMA_FOLDER / LORA_FILE).is_file():
        directory, loaded = directory / EMA_FOLDER, "ema"
    if not (directory / LORA_FILE).is_file():
        raise CheckpointError(f"{str(directory)!r} holds no {LORA_FILE} (LoRA weights are read only from "
                              f"safetensors; pass a checkpoint folder such as RUN/checkpoints/step_000010)")
    state, metadata = pipe.lora_state_dict(str(directory), weight_name=LORA_FILE, use_safetensors=True,
                                           return_lora_metadata=True)
    if all(k.startswith(f"{pipe.transformer_name}.") for k in state):
        pipe.load_lora_into_transformer(state, transformer=pipe.transformer, metadata=metadata, _pipeline=pipe)
    else:
        pipe.load_lora_weights(str(directory), weight_name=LORA_FILE, use_safetensors=True)
    return loaded


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        from core.config import ConfigError  # a ValueError: the CLIs answer it with one line and exit 2

        raise ConfigError("model.device", device, "no CUDA device is available on this machine; use 'cpu' or 'auto'")
    if device.startswith("cuda:") and not (device[5:].isdigit() and int(device[5:]) < torch.cuda.device_count()):
        from core.config import ConfigError

        raise ConfigError("model.device", device, f"this machine has {torch.cuda.device_count()} CUDA device(s), "
                                                  f"numbered from 0")
    return torch.device(device)


# ---- the policy: LoRA + old adapter + reference ----------------------------------------------------

@dataclass
class VelocityInputs:
    """What the transformer needs for one prediction. Shapes: x [B, C, h, w]; sigma [B] in (0, 1];
    prompt_embeds [B, S, D]; pooled [B, P]."""

    x: torch.Tensor
    sigma: torch.Tensor
    prompt_embeds: torch.Tensor
    pooled: torch.Tensor


class Policy:
    """The SD3 transformer with a trainable LoRA adapter, a soft-copied old adapter and the base reference."""

    def __init__(self, pipe, config: ModelConfig, device: torch.device, seed: int = 0):
        from peft import LoraConfig

        self.pipe = pipe
        self.transformer = pipe.transformer
        self.device = device
        self.compute_dtype = DTYPES[config.dtype]
        self.lora_config = LoraConfig(r=config.lora_rank, lora_alpha=config.lora_alpha,
                                      init_lora_weights="gaussian", target_modules=list(config.lora_targets))
        with torch.random.fork_rng(devices=[]):  # LoRA A's random init depends on the run's seed only
            torch.manual_seed(seed)
            self.transformer.add_adapter(self.lora_config)
        self.named_trainable: dict[str, torch.nn.Parameter] = {}
        for name, p in self.transformer.named_parameters():
            if "lora_" in name:
                p.data = p.data.float()  # LoRA weights train in float32 whatever the base dtype
                p.requires_grad_(True)
                self.named_trainable[name] = p
        if not self.named_trainable:
            raise ValueError(f"model.lora_targets={list(config.lora_targets)!r} matched no module of the "
                             f"transformer; SD3 attention projections are e.g. {', '.join(LORA_HINT)}")
        if config.gradient_checkpointing:  # v_θ's backward recomputes each block's activations (no_grad calls
            self.transformer.enable_gradient_checkpointing()  # — v_old, v_ref, rollouts — are unaffected)
        # θ_old starts as θ; a plain tensor dict, applied with functional_call.
        self.old: dict[str, torch.Tensor] = {n: p.detach().clone() for n, p in self.named_trainable.items()}
        self.num_trainable = sum(p.numel() for p in self.named_trainable.values())
        # What v_θ runs through: the transformer, or its DistributedDataParallel wrapper under torchrun
        # (set by the trainer), so that DDP sees the graphs it reduces.
        self.train_module: torch.nn.Module = self.transformer

    # -- parameters --
    @property
    def parameters(self) -> list[torch.nn.Parameter]:
        return list(self.named_trainable.values())

    @torch.no_grad()
    def soft_update_old(self, eta: float) -> None:
        """θ_old ← η·θ_old + (1-η)·θ (spec §2)."""
        for name, p in self.named_trainable.items():
            self.old[name].lerp_(p.detach(), 1.0 - eta)

    # -- predictions --
    def _call(self, inp: VelocityInputs, params: dict[str, torch.Tensor] | None,
              module: torch.nn.Module | None = None) -> torch.Tensor:
        kwargs = dict(hidden_states=inp.x.to(self.compute_dtype), timestep=inp.sigma * 1000.0,
                      encoder_hidden_states=inp.prompt_embeds.to(self.compute_dtype),
                      pooled_projections=inp.pooled.to(self.compute_dtype), return_dict=False)
        autocast = self.compute_dtype != torch.float32
        with torch.autocast(self.device.type, dtype=self.compute_dtype, enabled=autocast):
            if params is None:
                out = (self.transformer if module is None else module)(**kwargs)[0]
            else:
                out = torch.func.functional_call(self.transformer, params, args=(), kwargs=kwargs, strict=False)[0]
        return out.float()

    def velocity(self, inp: VelocityInputs) -> torch.Tensor:
        """v_θ, differentiable in the LoRA parameters."""
        return self._call(inp, None, self.train_module)

    @torch.no_grad()
    def velocity_old(self, inp: VelocityInputs) -> torch.Tensor:
        """v_old, from the soft-copied adapter θ_old."""
        return self._call(inp, self.old)

    @torch.no_grad()
    def velocity_ref(self, inp: VelocityInputs) -> torch.Tensor:
        """v_ref, the base model with adapters disabled (the KL reference)."""
        self.transformer.disable_adapters()
        try:
            return self._call(inp, None)
        finally:
            self.transformer.enable_adapters()

    # -- state --
    def lora_state(self, which: str = "policy") -> dict[str, torch.Tensor]:
        src = self.named_trainable if which == "policy" else self.old
        return {n: t.detach().cpu().clone() for n, t in src.items()}

    @torch.no_grad()
    def load_lora_state(self, policy: dict[str, torch.Tensor], old: dict[str, torch.Tensor]) -> None:
        expected = set(self.named_trainable)
        for label, state in (("policy", policy), ("old", old)):
            if set(state) != expected:
                diff = sorted(set(state) ^ expected)[:3]
                raise ValueError(f"the checkpoint's {label} adapter does not match this model's LoRA layout "
                                 f"(first differing names: {diff}); was it saved with another model.lora_* config?")
        for n, p in self.named_trainable.items():
            p.copy_(policy[n].to(p.device))
            self.old[n].copy_(old[n].to(p.device))

    def save_diffusers_lora(self, directory: str | Path) -> None:
        """Write the policy adapter in the diffusers LoRA format, loadable with ``pipe.load_lora_weights``.

        The adapter metadata (rank, alpha, targets) is saved with it: without it lora_alpha is lost on reload.
        """
        from diffusers import StableDiffusion3Pipeline
        from peft.utils import get_peft_model_state_dict

        StableDiffusion3Pipeline.save_lora_weights(
            str(directory), transformer_lora_layers=get_peft_model_state_dict(self.transformer),
            transformer_lora_adapter_metadata=self.lora_config.to_dict())


LORA_HINT = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0")
