"""ImageReward v1.0 (Xu et al. 2023) on the BLIP classes of ``transformers``.

ImageReward is BLIP (a ViT image encoder and a BERT text encoder with cross-attention to the image
tokens) plus an MLP on the text encoder's [CLS] output. The ``image-reward`` package needs timm 0.6,
fairscale and torchvision, none of which fit beside this project's torch; but its network is exactly
``BlipVisionModel`` + ``BlipTextModel`` (the BLIP port in transformers follows the same med.py), so the
original checkpoint (THUDM/ImageReward, ImageReward.pt) is renamed into those classes on load:

    blip.visual_encoder.{cls_token, pos_embed, patch_embed.proj}  -> vision.embeddings.{class_embedding,
                                                                      position_embedding, patch_embedding}
    blip.visual_encoder.blocks.i.{norm1, attn.qkv, attn.proj, norm2, mlp.fc1, mlp.fc2}
                                                                   -> vision.encoder.layers.i.{layer_norm1,
                                                                      self_attn.qkv, self_attn.projection,
                                                                      layer_norm2, mlp.fc1, mlp.fc2}
    blip.visual_encoder.norm                                       -> vision.post_layernorm
    blip.text_encoder.*                                            -> text.* (same names)
    mlp.layers.*                                                   -> mlp.layers.*

The vision tower's size is read from the checkpoint's tensor shapes (ViT-L/16 at 224 px for v1.0; heads
of 64 channels, LayerNorm eps 1e-6, as BLIP builds it); the text tower's from ``med_config.json``.

Scoring follows ``ImageReward.score``: BLIP's transform (bicubic short side -> 224, centre crop, OpenAI CLIP
mean/std), the prompt tokenized with BERT's uncased tokenizer to exactly 35 tokens (padded, truncated),
image tokens as cross-attention memory, MLP on [CLS], then ``(r - 0.16717) / 1.03334`` — the
standardization the package applies, so scores are roughly zero-mean, unit-variance over its data.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from core.rewards.base import Reward, register_reward
from core.rewards.hub import resolve_device, resolve_dtype, resolve_file, resolve_folder

if TYPE_CHECKING:  # pragma: no cover
    import torch

IMAGEREWARD_MEAN = 0.16717362830052426
"""Mean of the raw MLP output that ImageReward subtracts."""
IMAGEREWARD_STD = 1.0333394966054072
"""Standard deviation of the raw MLP output that ImageReward divides by."""
IMAGEREWARD_MAX_TOKENS = 35
"""ImageReward tokenizes every prompt to exactly 35 BERT tokens."""
VIT_HEAD_DIM = 64
"""BLIP's ViT-B/16 and ViT-L/16 both use 64-channel attention heads (12×64, 16×64)."""
BLIP_EXTRA_TOKENS = {"bos_token": "[DEC]", "additional_special_tokens": ["[ENC]"]}
"""BLIP's tokenizer adds [DEC] and [ENC] to bert-base-uncased (vocabulary 30522 -> 30524)."""

_VISION_RENAMES = {"norm1": "layer_norm1", "norm2": "layer_norm2", "attn.qkv": "self_attn.qkv",
                   "attn.proj": "self_attn.projection", "mlp.fc1": "mlp.fc1", "mlp.fc2": "mlp.fc2"}
_IGNORED_PREFIXES = ("blip.vision_proj.", "blip.text_proj.")


def convert_imagereward_state_dict(state: Mapping[str, Any]) -> dict:
    """Rename an ImageReward.pt state dict to :class:`ImageRewardModel`'s names (see the module docstring)."""
    out: dict = {}
    unknown = []
    vis = "blip.visual_encoder."
    for key, value in state.items():
        if key.startswith(_IGNORED_PREFIXES) or key.endswith("embeddings.position_ids"):
            continue
        if key.startswith("blip.text_encoder."):
            out["text." + key[len("blip.text_encoder."):]] = value
        elif key.startswith("mlp."):
            out[key] = value
        elif key == vis + "cls_token":
            out["vision.embeddings.class_embedding"] = value
        elif key == vis + "pos_embed":
            out["vision.embeddings.position_embedding"] = value
        elif key.startswith(vis + "patch_embed.proj."):
            out["vision.embeddings.patch_embedding." + key.rsplit(".", 1)[1]] = value
        elif key.startswith(vis + "norm."):
            out["vision.post_layernorm." + key.rsplit(".", 1)[1]] = value
        elif key.startswith(vis + "blocks."):
            index, rest = key[len(vis + "blocks."):].split(".", 1)
            module, kind = rest.rsplit(".", 1)
            if module not in _VISION_RENAMES:
                unknown.append(key)
                continue
            out[f"vision.encoder.layers.{index}.{_VISION_RENAMES[module]}.{kind}"] = value
        else:
            unknown.append(key)
    if unknown:
        raise ValueError(f"not an ImageReward checkpoint: unknown keys {unknown[:5]} ({len(unknown)})")
    return out


def vision_config_from_state(state: Mapping[str, Any]):
    """``BlipVisionConfig`` of the ViT in a converted state dict, read from tensor shapes."""
    from transformers import BlipVisionConfig

    hidden = state["vision.embeddings.class_embedding"].shape[-1]
    patch = state["vision.embeddings.patch_embedding.weight"].shape[-1]
    positions = state["vision.embeddings.position_embedding"].shape[1]
    grid = round((positions - 1) ** 0.5)
    layers = 1 + max(int(k.split(".")[3]) for k in state if k.startswith("vision.encoder.layers."))
    intermediate = state["vision.encoder.layers.0.mlp.fc1.weight"].shape[0]
    if grid * grid != positions - 1 or hidden % VIT_HEAD_DIM:
        raise ValueError(f"unexpected ViT shapes in the checkpoint: {positions} positions, width {hidden}")
    return BlipVisionConfig(hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                            num_attention_heads=hidden // VIT_HEAD_DIM, image_size=grid * patch, patch_size=patch,
                            hidden_act="gelu", layer_norm_eps=1e-6)


def text_config_from_med(med: Mapping[str, Any], encoder_width: int):
    """``BlipTextConfig`` from BLIP's med_config.json (a BERT config), cross-attending to ``encoder_width``."""
    from transformers import BlipTextConfig

    keys = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
            "max_position_embeddings", "hidden_act", "layer_norm_eps", "hidden_dropout_prob",
            "attention_probs_dropout_prob", "pad_token_id")
    missing = [k for k in keys if k not in med]
    if missing:
        raise ValueError(f"med_config.json lacks {', '.join(missing)}")
    # is_decoder=True only makes transformers build the cross-attention layers; scoring runs the encoder
    # bidirectionally (is_decoder=False in forward), BLIP's "multimodal" mode.
    return BlipTextConfig(**{k: med[k] for k in keys}, encoder_hidden_size=encoder_width, is_decoder=True)


def build_imagereward_model(vision_config, text_config):
    """The ImageReward network: BLIP vision tower, BLIP text tower with cross-attention, MLP head."""
    from torch import nn
    from transformers import BlipTextModel, BlipVisionModel

    from core.rewards.clip_rewards import aesthetic_head

    class ImageRewardModel(nn.Module):
        def __init__(self):
            super().__init__()
            self.vision = BlipVisionModel(vision_config)
            self.text = BlipTextModel(text_config, add_pooling_layer=False)
            self.mlp = aesthetic_head(text_config.hidden_size)  # the same MLP layout as the aesthetic predictor

        def forward(self, pixel_values, input_ids, attention_mask):
            """Raw (unstandardized) reward [B]."""
            image_embeds = self.vision(pixel_values=pixel_values).last_hidden_state  # [B, 1 + patches, Dv]
            image_mask = image_embeds.new_ones(image_embeds.shape[:-1], dtype=attention_mask.dtype)
            text = self.text(input_ids=input_ids, attention_mask=attention_mask, encoder_hidden_states=image_embeds,
                             encoder_attention_mask=image_mask, is_decoder=False)
            return self.mlp(text.last_hidden_state[:, 0, :]).squeeze(-1)

    return ImageRewardModel()


class ImageRewardReward(Reward):
    def __init__(self, model, tokenizer, batch_size: int = 32):
        self.model = model
        self.tokenizer = tokenizer
        self.batch_size = batch_size

    def score(self, images: torch.Tensor, prompts: Sequence[str],
              metadata: Sequence[Mapping[str, Any]]) -> torch.Tensor:
        import torch

        from core.rewards.preprocess import clip_pixels

        param = next(self.model.parameters())
        size = self.model.vision.config.image_size
        out = []
        for start in range(0, len(prompts), self.batch_size):
            stop = start + self.batch_size
            pixel_values = clip_pixels(images[start:stop], size=size).to(device=param.device, dtype=param.dtype)
            tokens = self.tokenizer(list(prompts[start:stop]), padding="max_length", truncation=True,
                                    max_length=IMAGEREWARD_MAX_TOKENS, return_tensors="pt").to(param.device)
            raw = self.model(pixel_values, tokens["input_ids"], tokens["attention_mask"]).float()
            out.append((raw - IMAGEREWARD_MEAN) / IMAGEREWARD_STD)
        return torch.cat(out)


def load_blip_tokenizer(reward: str, source: str):
    """bert-base-uncased's tokenizer with BLIP's two extra special tokens."""
    from transformers import AutoTokenizer

    folder = resolve_folder(source, reward=reward, what="the BERT tokenizer (bert-base-uncased)", required=(),
                            required_any=("tokenizer.json", "vocab.txt"), allow_patterns=("*.json", "*.txt"))
    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    tokenizer.add_special_tokens(dict(BLIP_EXTRA_TOKENS))
    return tokenizer


@register_reward("imagereward", "ImageReward v1.0 (BLIP + MLP, human preference), standardized (≈ -2..2)")
def imagereward(checkpoint: str = "THUDM/ImageReward", filename: str = "ImageReward.pt",
                med_config: str = "med_config.json", tokenizer: str = "google-bert/bert-base-uncased",
                device: str = "auto", dtype: str = "float32", batch_size: int = 32) -> Reward:
    """ImageReward from ``filename`` of ``checkpoint`` (repo id, folder or the .pt path) and its
    ``med_config`` (a path, or a file name next to the checkpoint / in the repo)."""
    from core.rewards.clip_rewards import check_batch_size, load_exactly, load_torch_state_dict

    check_batch_size("imagereward", batch_size)
    ckpt = resolve_file(checkpoint, filename, reward="imagereward", what="the ImageReward checkpoint")
    if Path(med_config).expanduser().is_file():
        med_path = Path(med_config).expanduser()
    else:
        med_source = str(ckpt.parent) if Path(checkpoint).expanduser().is_file() else checkpoint
        med_path = resolve_file(med_source, med_config, reward="imagereward", what="ImageReward's med_config.json")
    state = convert_imagereward_state_dict(load_torch_state_dict("imagereward", ckpt, "the ImageReward checkpoint"))
    vision_config = vision_config_from_state(state)
    text_config = text_config_from_med(json.loads(med_path.read_text()), vision_config.hidden_size)
    model = build_imagereward_model(vision_config, text_config)
    load_exactly("imagereward", model, state, f"the checkpoint {str(ckpt)!r}")
    model = model.eval().requires_grad_(False).to(device=resolve_device(device),
                                                   dtype=resolve_dtype("imagereward", dtype))
    return ImageRewardReward(model, load_blip_tokenizer("imagereward", tokenizer), batch_size)
