"""CLIP-family rewards: PickScore, CLIPScore, HPSv2.1 and the LAION aesthetic predictor.

Each one is the real model class of ``transformers`` (``CLIPModel``) with its weights from a local path or
the Hugging Face cache (core/rewards/hub.py), the reference scorer's preprocessing (core/rewards/preprocess.py)
and the scaling DiffusionNFT / Flow-GRPO / MARBLE train with:

=========  ===========================================================  ===================  =======================
reward     weights (default)                                            preprocessing        score
=========  ===========================================================  ===================  =======================
pickscore  yuvalkirstain/PickScore_v1; tokenizer of                     CLIP (bicubic,       logit_scale.exp()·cos/26
           laion/CLIP-ViT-H-14-laion2B-s32B-b79K                        short side, crop)    (≈ 0.8–0.9)
clipscore  openai/clip-vit-large-patch14                                tensor bilinear-aa,  logit_scale.exp()·cos/100
                                                                        short side, crop     = cos (≈ 0.2–0.4)
hpsv2      xswu/HPSv2 HPS_v2.1_compressed.pt (open_clip ViT-H-14,       HPSv2 (bicubic long  cos (≈ 0.25–0.35)
           converted to CLIPModel); config + tokenizer of the laion     side, black pad)
           ViT-H-14 repo
aesthetic  trl-lib/ddpo-aesthetic-predictor aesthetic-model.pth         CLIP                 raw MLP output (≈ 1–10)
           (= LAION sac+logos+ava1-l14-linearMSE.pth) on the
           normalized image embedding of openai/clip-vit-large-patch14
=========  ===========================================================  ===================  =======================

"cos" is the cosine between the L2-normalized projected image and text embeddings. Text is tokenized to
at most 77 tokens, truncated. Nothing here imports torch or transformers at module level (the registry
must stay light); the factories do.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any

from core.rewards.base import Reward, check_number_in_range, register_reward
from core.rewards.hub import (RewardWeightsNotFoundError, resolve_device, resolve_dtype, resolve_file,
                              resolve_folder)

if TYPE_CHECKING:  # pragma: no cover
    import torch

PICKSCORE_DIVISOR = 26.0
"""PickScore's logit (≈ 100·cos) divided by 26 to land near 1, as in Flow-GRPO / DiffusionNFT."""
CLIPSCORE_DIVISOR = 100.0
"""CLIPScore's logit 100·cos divided by 100, i.e. the plain cosine (DiffusionNFT / Flow-GRPO)."""
CLIP_MAX_TOKENS = 77

WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin", "model.safetensors.index.json",
                "pytorch_model.bin.index.json")
TOKENIZER_FILES = ("tokenizer.json", "vocab.json", "vocab.txt", "tokenizer.model", "spiece.model")
MODEL_PATTERNS = ("*.json", "*.txt", "*.safetensors")
TOKENIZER_PATTERNS = ("*.json", "*.txt", "*.model")


# ---- shared loading helpers -------------------------------------------------------------------------

def load_clip_model(reward: str, source: str, what: str, device, dtype):
    """A ``CLIPModel`` from a folder / cached repo, in eval mode on ``device`` in ``dtype``."""
    from transformers import CLIPModel

    folder = resolve_folder(source, reward=reward, what=what, required=("config.json",),
                            required_any=WEIGHT_FILES, allow_patterns=MODEL_PATTERNS)
    model = CLIPModel.from_pretrained(folder, local_files_only=True, dtype=dtype)
    return model.eval().requires_grad_(False).to(device)


def load_tokenizer(reward: str, source: str, what: str):
    """The tokenizer saved in a folder / cached repo (``AutoTokenizer``)."""
    from transformers import AutoTokenizer

    folder = resolve_folder(source, reward=reward, what=what, required=(), required_any=TOKENIZER_FILES,
                            allow_patterns=TOKENIZER_PATTERNS)
    return AutoTokenizer.from_pretrained(folder, local_files_only=True)


def clip_image_embeds(model, pixel_values: torch.Tensor) -> torch.Tensor:
    """L2-normalized projected image embeddings [B, D] of a ``CLIPModel``."""
    pooled = model.vision_model(pixel_values=pixel_values).pooler_output
    emb = model.visual_projection(pooled)
    return emb / emb.norm(dim=-1, keepdim=True)


def clip_text_embeds(model, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """L2-normalized projected text embeddings [B, D] of a ``CLIPModel`` (pooled at the EOS token)."""
    pooled = model.text_model(input_ids=input_ids, attention_mask=attention_mask).pooler_output
    emb = model.text_projection(pooled)
    return emb / emb.norm(dim=-1, keepdim=True)


def text_budget(model) -> int:
    """77 tokens, or fewer when the model's position table is shorter (tiny test models)."""
    return min(CLIP_MAX_TOKENS, model.config.text_config.max_position_embeddings)


def image_size(model) -> int:
    """The square input size of a CLIP-like vision tower (224 for every model used here)."""
    return int(model.config.vision_config.image_size)


def check_batch_size(reward: str, batch_size: Any) -> None:
    check_number_in_range(reward, "batch_size", batch_size, 1, 4096, integer=True)


# ---- rewards ----------------------------------------------------------------------------------------

class ClipSimilarityReward(Reward):
    """``multiplier · cos(image, prompt)`` of a CLIPModel; prompts matter, metadata does not."""

    def __init__(self, model, tokenizer, pixels: Callable[[torch.Tensor], torch.Tensor], multiplier: float,
                 batch_size: int = 32):
        self.model = model
        self.tokenizer = tokenizer
        self.pixels = pixels  # [b, 3, H, W] in [0, 1] -> normalized [b, 3, S, S]
        self.multiplier = float(multiplier)
        self.batch_size = batch_size
        self.max_length = text_budget(model)

    def score(self, images: torch.Tensor, prompts: Sequence[str],
              metadata: Sequence[Mapping[str, Any]]) -> torch.Tensor:
        import torch

        device, dtype = self.model.device, self.model.dtype
        out = []
        for start in range(0, len(prompts), self.batch_size):
            stop = start + self.batch_size
            pixel_values = self.pixels(images[start:stop]).to(device=device, dtype=dtype)
            tokens = self.tokenizer(list(prompts[start:stop]), padding="max_length", truncation=True,
                                    max_length=self.max_length, return_tensors="pt").to(device)
            img = clip_image_embeds(self.model, pixel_values)
            txt = clip_text_embeds(self.model, tokens["input_ids"], tokens["attention_mask"])
            out.append((img * txt).sum(dim=-1).float() * self.multiplier)  # [b]
        return torch.cat(out)


class AestheticReward(Reward):
    """LAION aesthetic predictor v2: an MLP on the normalized CLIP ViT-L/14 image embedding."""

    def __init__(self, clip_model, head, batch_size: int = 32):
        self.model = clip_model
        self.head = head
        self.batch_size = batch_size

    def score(self, images: torch.Tensor, prompts: Sequence[str],
              metadata: Sequence[Mapping[str, Any]]) -> torch.Tensor:
        import torch

        from core.rewards.preprocess import clip_pixels

        device, dtype = self.model.device, self.model.dtype
        out = []
        for start in range(0, images.shape[0], self.batch_size):
            pixel_values = clip_pixels(images[start:start + self.batch_size], size=image_size(self.model))
            pixel_values = pixel_values.to(device=device, dtype=dtype)
            emb = clip_image_embeds(self.model, pixel_values)  # [b, 768]
            out.append(self.head(emb.to(next(self.head.parameters()).dtype)).squeeze(-1).float())
        return torch.cat(out)


def aesthetic_head(in_features: int = 768):
    """The improved-aesthetic-predictor MLP; parameter names ``layers.{0,2,4,6,7}`` match its checkpoint.

    Linear(in, 1024) → Dropout(0.2) → Linear(1024, 128) → Dropout(0.2) → Linear(128, 64) → Dropout(0.1)
    → Linear(64, 16) → Linear(16, 1); no activations (as trained).
    """
    from torch import nn

    class AestheticMLP(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.Sequential(nn.Linear(in_features, 1024), nn.Dropout(0.2), nn.Linear(1024, 128),
                                        nn.Dropout(0.2), nn.Linear(128, 64), nn.Dropout(0.1), nn.Linear(64, 16),
                                        nn.Linear(16, 1))

        def forward(self, x):  # [B, in_features] -> [B, 1]
            return self.layers(x)

    return AestheticMLP()


def load_torch_state_dict(reward: str, path, what: str) -> dict:
    """A checkpoint's tensors (``torch.load(weights_only=True)``); a top-level "state_dict" is unwrapped."""
    import torch

    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - a corrupt / non-tensor pickle
        raise ValueError(f"reward {reward!r}: {what} {str(path)!r} could not be read as a tensor checkpoint "
                         f"({type(e).__name__}: {e})") from None
    if isinstance(state, dict) and isinstance(state.get("state_dict"), dict):
        state = state["state_dict"]
    if not isinstance(state, dict) or not state:
        raise ValueError(f"reward {reward!r}: {what} {str(path)!r} holds no state dict of tensors")
    return {k.removeprefix("module."): v for k, v in state.items()}


def load_exactly(reward: str, module, state: Mapping[str, Any], what: str) -> None:
    """``load_state_dict`` that fails on any missing or unexpected parameter, naming a few of each."""
    result = module.load_state_dict(dict(state), strict=False)
    missing = [k for k in result.missing_keys if not k.endswith("position_ids")]
    if missing or result.unexpected_keys:
        raise ValueError(f"reward {reward!r}: {what} does not match the model: missing {missing[:5]} "
                         f"({len(missing)}), unexpected {list(result.unexpected_keys)[:5]} "
                         f"({len(result.unexpected_keys)})")


# ---- HPSv2.1: open_clip ViT-H-14 weights in a transformers CLIPModel --------------------------------

def open_clip_to_clip_state_dict(state: Mapping[str, Any]) -> dict:
    """Rename an open_clip CLIP state dict (ViT towers, e.g. ViT-H-14) into ``CLIPModel``'s layout.

    open_clip fuses q/k/v into ``attn.in_proj_weight`` [3d, d] (nn.MultiheadAttention) and stores the
    projections as matrices applied on the right (``x @ proj``); transformers keeps separate q/k/v Linear
    layers and Linear projections (``weight = proj.T``). The text tower pools at the end-of-text token
    (open_clip: argmax of the token ids; CLIPModel: first EOS id, the same position). ``attn_mask`` (the
    causal mask buffer) is dropped. Unknown keys raise ValueError.
    """
    out: dict = {}
    towers = (("visual.transformer.resblocks.", "vision_model.encoder.layers."),
              ("transformer.resblocks.", "text_model.encoder.layers."))
    block_names = {"ln_1": "layer_norm1", "ln_2": "layer_norm2", "mlp.c_fc": "mlp.fc1", "mlp.c_proj": "mlp.fc2",
                   "attn.out_proj": "self_attn.out_proj"}
    plain = {
        "token_embedding.weight": "text_model.embeddings.token_embedding.weight",
        "positional_embedding": "text_model.embeddings.position_embedding.weight",
        "ln_final.weight": "text_model.final_layer_norm.weight",
        "ln_final.bias": "text_model.final_layer_norm.bias",
        "logit_scale": "logit_scale",
        "visual.class_embedding": "vision_model.embeddings.class_embedding",
        "visual.positional_embedding": "vision_model.embeddings.position_embedding.weight",
        "visual.conv1.weight": "vision_model.embeddings.patch_embedding.weight",
        "visual.ln_pre.weight": "vision_model.pre_layrnorm.weight",
        "visual.ln_pre.bias": "vision_model.pre_layrnorm.bias",
        "visual.ln_post.weight": "vision_model.post_layernorm.weight",
        "visual.ln_post.bias": "vision_model.post_layernorm.bias",
    }
    unknown = []
    for key, value in state.items():
        if key in plain:
            out[plain[key]] = value
        elif key == "text_projection":
            out["text_projection.weight"] = value.T.contiguous()
        elif key == "visual.proj":
            out["visual_projection.weight"] = value.T.contiguous()
        elif key.endswith("attn_mask"):
            continue
        else:
            for src, dst in towers:
                if key.startswith(src):
                    index, rest = key[len(src):].split(".", 1)
                    prefix = f"{dst}{index}."
                    if rest.startswith("attn.in_proj_"):
                        kind = rest.rsplit("_", 1)[-1]  # weight or bias
                        for name, part in zip(("q_proj", "k_proj", "v_proj"), value.chunk(3, dim=0)):
                            out[f"{prefix}self_attn.{name}.{kind}"] = part.contiguous()
                    else:
                        module, kind = rest.rsplit(".", 1)
                        if module not in block_names:
                            unknown.append(key)
                            break
                        out[f"{prefix}{block_names[module]}.{kind}"] = value
                    break
            else:
                unknown.append(key)
    if unknown:
        raise ValueError(f"not an open_clip ViT CLIP state dict: unknown keys {unknown[:5]} ({len(unknown)})")
    return out


# ---- factories ----------------------------------------------------------------------------------------

@register_reward("pickscore", "PickScore_v1 (CLIP ViT-H/14 preference model): logit_scale·cos / 26")
def pickscore(model: str = "yuvalkirstain/PickScore_v1",
              processor: str = "laion/CLIP-ViT-H-14-laion2B-s32B-b79K",
              device: str = "auto", dtype: str = "float32", batch_size: int = 32) -> Reward:
    """PickScore: ``model`` (a CLIPModel folder or repo id) with the tokenizer of ``processor``."""
    from core.rewards.preprocess import clip_pixels

    check_batch_size("pickscore", batch_size)
    clip = load_clip_model("pickscore", model, "the PickScore model", resolve_device(device),
                           resolve_dtype("pickscore", dtype))
    tokenizer = load_tokenizer("pickscore", processor, "the PickScore processor (CLIP ViT-H-14 tokenizer)")
    multiplier = float(clip.logit_scale.float().exp()) / PICKSCORE_DIVISOR
    return ClipSimilarityReward(clip, tokenizer, partial(clip_pixels, size=image_size(clip)), multiplier, batch_size)


@register_reward("clipscore", "CLIPScore with CLIP ViT-L/14: 100·cos / 100 (the cosine)")
def clipscore(model: str = "openai/clip-vit-large-patch14", device: str = "auto", dtype: str = "float32",
              batch_size: int = 32) -> Reward:
    """CLIPScore: the logit of ``model`` divided by 100, on the tensor pipeline of DiffusionNFT's scorer."""
    from core.rewards.preprocess import tensor_resize_center_crop

    check_batch_size("clipscore", batch_size)
    clip = load_clip_model("clipscore", model, "the CLIP model", resolve_device(device),
                           resolve_dtype("clipscore", dtype))
    tokenizer = load_tokenizer("clipscore", model, "the CLIP tokenizer")
    multiplier = float(clip.logit_scale.float().exp()) / CLIPSCORE_DIVISOR
    return ClipSimilarityReward(clip, tokenizer, partial(tensor_resize_center_crop, size=image_size(clip)),
                                multiplier, batch_size)


@register_reward("hpsv2", "HPSv2.1 (open_clip ViT-H/14 fine-tuned on human preferences): cos")
def hpsv2(checkpoint: str = "xswu/HPSv2", filename: str = "HPS_v2.1_compressed.pt",
          clip: str = "laion/CLIP-ViT-H-14-laion2B-s32B-b79K", device: str = "auto", dtype: str = "float32",
          batch_size: int = 32) -> Reward:
    """HPSv2.1: the open_clip checkpoint ``filename`` of ``checkpoint`` (or a file path), converted into the
    ``CLIPModel`` described by ``clip``'s config.json, with ``clip``'s tokenizer. The score is the raw cosine
    ``image_features @ text_features`` that HPSv2 reports (no logit scale)."""
    from transformers import CLIPConfig, CLIPModel

    from core.rewards.preprocess import hps_pixels

    check_batch_size("hpsv2", batch_size)
    ckpt_path = resolve_file(checkpoint, filename, reward="hpsv2", what="the HPSv2.1 checkpoint")
    clip_dir = resolve_folder(clip, reward="hpsv2", what="the ViT-H-14 config and tokenizer",
                              required=("config.json",), required_any=TOKENIZER_FILES,
                              allow_patterns=TOKENIZER_PATTERNS)
    state = open_clip_to_clip_state_dict(load_torch_state_dict("hpsv2", ckpt_path, "the HPSv2.1 checkpoint"))
    model = CLIPModel(CLIPConfig.from_pretrained(clip_dir, local_files_only=True))
    load_exactly("hpsv2", model, state, f"the checkpoint {str(ckpt_path)!r}")
    model = model.eval().requires_grad_(False).to(device=resolve_device(device), dtype=resolve_dtype("hpsv2", dtype))
    tokenizer = load_tokenizer("hpsv2", str(clip_dir), "the ViT-H-14 tokenizer")
    return ClipSimilarityReward(model, tokenizer, partial(hps_pixels, size=image_size(model)), 1.0, batch_size)


@register_reward("aesthetic", "LAION aesthetic predictor v2: MLP on CLIP ViT-L/14 image embeddings (≈1-10)")
def aesthetic(head: str = "trl-lib/ddpo-aesthetic-predictor", filename: str = "aesthetic-model.pth",
              clip: str = "openai/clip-vit-large-patch14", device: str = "auto", dtype: str = "float32",
              batch_size: int = 32) -> Reward:
    """The aesthetic score: the MLP in ``filename`` of ``head`` (or a path to sac+logos+ava1-l14-linearMSE.pth)
    on the normalized image embedding of ``clip``. Raw output, no rescaling (as DDPO reports it)."""
    check_batch_size("aesthetic", batch_size)
    dev = resolve_device(device)
    clip_model = load_clip_model("aesthetic", clip, "the CLIP ViT-L/14 model", dev, resolve_dtype("aesthetic", dtype))
    head_path = resolve_file(head, filename, reward="aesthetic", what="the aesthetic MLP")
    mlp = aesthetic_head(clip_model.config.projection_dim)
    load_exactly("aesthetic", mlp, load_torch_state_dict("aesthetic", head_path, "the aesthetic MLP"),
                 f"the aesthetic MLP {str(head_path)!r}")
    mlp = mlp.eval().requires_grad_(False).to(device=dev, dtype=clip_model.dtype)
    return AestheticReward(clip_model, mlp, batch_size)


__all__ = ["ClipSimilarityReward", "AestheticReward", "RewardWeightsNotFoundError", "aesthetic_head",
           "open_clip_to_clip_state_dict", "pickscore", "clipscore", "hpsv2", "aesthetic"]
