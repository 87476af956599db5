"""Model-based rewards on tiny random-weight models of their real architectures, built from configs.

No weights are downloaded: each test saves a tiny model in the layout of the real repo / checkpoint and
loads it through the reward's own loading path (local folder, HF cache layout, or original checkpoint
format). Reference computations (open_clip's tower, timm's ViT, the documented pipelines) are written
out here independently of the code under test.
"""

import json
import math
from collections import OrderedDict

import numpy as np
import pytest
import torch
from PIL import Image
from torch import nn

from core.models import _byte_level_vocab
from core.rewards import make_reward
from core.rewards.geneval import (Detection, GenEvalReward, geneval_binary, geneval_partial, parse_requirements,
                                  relative_position, select_detections)
from core.rewards.hub import RewardWeightsNotFoundError
from core.rewards.imagereward import IMAGEREWARD_MEAN, IMAGEREWARD_STD
from core.rewards.preprocess import (clip_pixels, hps_pixels, resize_shortest_center_crop, tensor_resize_center_crop,
                                     to_pil_images)

# OpenAI CLIP's normalization, typed here independently of the code under test.
MEAN = np.array([0.48145466, 0.4578275, 0.40821073])
STD = np.array([0.26862954, 0.26130258, 0.27577711])
SIZE = 32  # the tiny vision towers' input size (224 in the real models)


@pytest.fixture(autouse=True)
def offline(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-hub-cache"))


def batch(n=3, h=40, w=40, seed=0):
    return torch.rand(n, 3, h, w, generator=torch.Generator().manual_seed(seed))


# ---- tiny models ---------------------------------------------------------------------------------------------

def clip_tokenizer():
    from transformers import CLIPTokenizer

    return CLIPTokenizer(vocab=_byte_level_vocab(), merges=[], model_max_length=77)


def tiny_clip_config(projection_dim=16):
    from transformers import CLIPConfig

    vocab = _byte_level_vocab()
    return CLIPConfig(
        text_config=dict(vocab_size=len(vocab), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, max_position_embeddings=77, hidden_act="gelu",
                         bos_token_id=vocab["<|startoftext|>"], eos_token_id=vocab["<|endoftext|>"],
                         pad_token_id=vocab["<|endoftext|>"]),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                           image_size=SIZE, patch_size=8, hidden_act="gelu"),
        projection_dim=projection_dim)


@pytest.fixture(scope="module")
def clip_dir(tmp_path_factory):
    """A CLIPModel repo folder: config.json, model.safetensors and the tokenizer files."""
    from transformers import CLIPModel

    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("tiny-clip")
    CLIPModel(tiny_clip_config()).save_pretrained(folder)
    clip_tokenizer().save_pretrained(folder)
    return folder


def clip_scores_by_hand(folder, images, prompts, pixels, divisor):
    """cos(image, text) · logit_scale.exp() / divisor, computed with CLIPModel's own forward."""
    from transformers import CLIPModel

    model = CLIPModel.from_pretrained(folder).eval()
    tok = clip_tokenizer()(prompts, padding="max_length", max_length=77, truncation=True, return_tensors="pt")
    with torch.no_grad():
        out = model(input_ids=tok["input_ids"], attention_mask=tok["attention_mask"], pixel_values=pixels)
    return out.logits_per_image.diagonal() / divisor  # logits_per_image = logit_scale.exp() · cos


# ---- preprocessing ---------------------------------------------------------------------------------------------

def test_clip_pipeline_matches_the_transformers_clip_processor_and_the_constants():
    from transformers.image_utils import PILImageResampling
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    x = batch(2, h=48, w=64)
    reference = CLIPImageProcessorPil(do_resize=True, size={"shortest_edge": SIZE}, resample=PILImageResampling.BICUBIC,
                                      do_center_crop=True, crop_size={"height": SIZE, "width": SIZE}, do_rescale=True,
                                      rescale_factor=1 / 255, do_normalize=True, image_mean=MEAN.tolist(),
                                      image_std=STD.tolist())
    expected = reference(images=to_pil_images(x), return_tensors="pt")["pixel_values"]
    got = clip_pixels(x, size=SIZE)
    assert got.shape == (2, 3, SIZE, SIZE) and got.dtype == torch.float32
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)

    flat = torch.zeros(1, 3, 50, 70)
    flat[:, 0], flat[:, 1], flat[:, 2] = 200 / 255, 100 / 255, 0.0
    want = (np.array([200, 100, 0]) / 255 - MEAN) / STD
    torch.testing.assert_close(clip_pixels(flat, size=SIZE)[0], torch.tensor(want, dtype=torch.float32)
                               .view(3, 1, 1).expand(3, SIZE, SIZE), rtol=0, atol=1e-6)


def test_center_crop_keeps_the_middle_of_the_long_side():
    img = Image.new("RGB", (90, 30), (0, 0, 0))  # resize 30 -> 10 keeps 30x10; the crop keeps columns 10..19
    for x in range(30, 60):
        for y in range(30):
            img.putpixel((x, y), (255, 255, 255))
    out = np.asarray(resize_shortest_center_crop(img, 10))
    assert out.shape == (10, 10, 3) and out.mean() > 250  # only the white middle third survives


def test_hps_pipeline_resizes_the_long_side_and_pads_with_black():
    x = torch.ones(1, 3, 20, 40)  # white, 2:1
    got = hps_pixels(x, size=SIZE)[0]  # 40 -> 32 wide, 20 -> 16 high, padded 8 rows above and below
    black = torch.tensor((0 - MEAN) / STD, dtype=torch.float32).view(3, 1)
    white = torch.tensor((1 - MEAN) / STD, dtype=torch.float32).view(3, 1)
    torch.testing.assert_close(got[:, :8].reshape(3, -1), black.expand(3, 8 * SIZE), rtol=0, atol=1e-6)
    torch.testing.assert_close(got[:, 24:].reshape(3, -1), black.expand(3, 8 * SIZE), rtol=0, atol=1e-6)
    torch.testing.assert_close(got[:, 9:23].reshape(3, -1), white.expand(3, 14 * SIZE), rtol=0, atol=2e-2)


def test_tensor_pipeline_resizes_crops_and_normalizes():
    x = torch.zeros(1, 3, 24, 48)
    x[..., 12:36] = 1.0  # a white middle half; the crop keeps exactly it
    got = tensor_resize_center_crop(x, size=12)
    assert got.shape == (1, 3, 12, 12)
    white = torch.tensor((1 - MEAN) / STD, dtype=torch.float32).view(1, 3, 1, 1)
    torch.testing.assert_close(got[..., 1:-1], white.expand(1, 3, 12, 10), rtol=0, atol=1e-5)


# ---- PickScore / CLIPScore / aesthetic ----------------------------------------------------------------------

def test_pickscore_is_logit_over_26_and_batches_consistently(clip_dir):
    reward = make_reward("pickscore", model=str(clip_dir), processor=str(clip_dir), device="cpu", batch_size=2)
    x, prompts = batch(3), ["a red cat", "two dogs", ""]
    scores = reward(x, prompts, [{}] * 3)
    assert scores.shape == (3,) and scores.dtype == torch.float32 and torch.isfinite(scores).all()
    expected = clip_scores_by_hand(clip_dir, x, prompts, clip_pixels(x, size=SIZE), 26.0)
    torch.testing.assert_close(scores, expected, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(reward(x[1:2], prompts[1:2], [{}]), scores[1:2], rtol=1e-4, atol=1e-6)


def test_clipscore_is_the_cosine_on_the_tensor_pipeline(clip_dir):
    reward = make_reward("clipscore", model=str(clip_dir), device="cpu")
    x, prompts = batch(2, h=48, w=40), ["a photo", "text"]
    scores = reward(x, prompts, [{}, {}])
    expected = clip_scores_by_hand(clip_dir, x, prompts, tensor_resize_center_crop(x, SIZE), 100.0)
    torch.testing.assert_close(scores, expected, rtol=1e-4, atol=1e-5)
    assert scores.abs().max() <= 1.0 + 1e-5  # logit_scale.exp() of a fresh CLIP is 1/0.07; still a scaled cosine


def test_aesthetic_applies_the_mlp_to_the_normalized_image_embedding(clip_dir, tmp_path):
    from transformers import CLIPModel

    from core.rewards.clip_rewards import aesthetic_head

    torch.manual_seed(1)
    head = aesthetic_head(16)
    assert [k for k in head.state_dict()][::2] == ["layers.0.weight", "layers.2.weight", "layers.4.weight",
                                                   "layers.6.weight", "layers.7.weight"]
    torch.save(head.state_dict(), tmp_path / "aesthetic-model.pth")
    reward = make_reward("aesthetic", head=str(tmp_path), clip=str(clip_dir), device="cpu")
    x = batch(2)
    scores = reward(x, ["", ""], [{}, {}])
    model = CLIPModel.from_pretrained(clip_dir).eval()
    with torch.no_grad():
        emb = model.visual_projection(model.vision_model(pixel_values=clip_pixels(x, SIZE)).pooler_output)
        expected = head.eval()(emb / emb.norm(dim=-1, keepdim=True)).squeeze(-1)
    torch.testing.assert_close(scores, expected, rtol=1e-4, atol=1e-5)
    assert reward(x, ["totally", "different"], [{}, {}]).tolist() == scores.tolist()  # prompt-independent


# ---- HPSv2.1: the open_clip checkpoint in a CLIPModel ---------------------------------------------------------

class OpenClipBlock(nn.Module):
    """open_clip's ResidualAttentionBlock (pre-LN, nn.MultiheadAttention, GELU MLP), its parameter names."""

    def __init__(self, width, heads):
        super().__init__()
        self.ln_1 = nn.LayerNorm(width)
        self.attn = nn.MultiheadAttention(width, heads, batch_first=True)
        self.ln_2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(OrderedDict(c_fc=nn.Linear(width, 2 * width), gelu=nn.GELU(),
                                             c_proj=nn.Linear(2 * width, width)))

    def forward(self, x, mask=None):
        h = self.ln_1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln_2(x))


class OpenClipTower(nn.Module):
    def __init__(self, width, heads, layers):
        super().__init__()
        self.resblocks = nn.ModuleList([OpenClipBlock(width, heads) for _ in range(layers)])

    def forward(self, x, mask=None):
        for block in self.resblocks:
            x = block(x, mask)
        return x


class OpenClipReference(nn.Module):
    """open_clip's CLIP with ViT towers (the ViT-H-14 layout at toy size), written from its architecture."""

    def __init__(self, vocab, context=77, width=32, heads=4, layers=2, patch=8, image=SIZE, embed=16):
        super().__init__()
        self.token_embedding = nn.Embedding(vocab, width)
        self.positional_embedding = nn.Parameter(torch.randn(context, width) * 0.02)
        self.transformer = OpenClipTower(width, heads, layers)
        self.ln_final = nn.LayerNorm(width)
        self.text_projection = nn.Parameter(torch.randn(width, embed) * width ** -0.5)
        self.logit_scale = nn.Parameter(torch.tensor(math.log(1 / 0.07)))
        self.register_buffer("attn_mask", torch.full((context, context), float("-inf")).triu(1), persistent=True)
        self.visual = nn.Module()
        self.visual.conv1 = nn.Conv2d(3, width, patch, patch, bias=False)
        self.visual.class_embedding = nn.Parameter(torch.randn(width) * 0.02)
        self.visual.positional_embedding = nn.Parameter(torch.randn((image // patch) ** 2 + 1, width) * 0.02)
        self.visual.ln_pre = nn.LayerNorm(width)
        self.visual.transformer = OpenClipTower(width, heads, layers)
        self.visual.ln_post = nn.LayerNorm(width)
        self.visual.proj = nn.Parameter(torch.randn(width, embed) * width ** -0.5)

    def encode_image(self, pixels):
        v = self.visual
        x = v.conv1(pixels).flatten(2).transpose(1, 2)  # [B, patches, width]
        x = torch.cat([v.class_embedding.expand(x.shape[0], 1, -1), x], dim=1) + v.positional_embedding
        x = v.transformer(v.ln_pre(x))
        x = v.ln_post(x[:, 0]) @ v.proj
        return x / x.norm(dim=-1, keepdim=True)

    def encode_text(self, tokens):
        x = self.token_embedding(tokens) + self.positional_embedding
        x = self.ln_final(self.transformer(x, self.attn_mask))
        x = x[torch.arange(x.shape[0]), tokens.argmax(dim=-1)] @ self.text_projection  # pooled at end-of-text
        return x / x.norm(dim=-1, keepdim=True)


@pytest.fixture(scope="module")
def hps_files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-hps")
    torch.manual_seed(2)
    reference = OpenClipReference(len(_byte_level_vocab())).eval()
    torch.save({"state_dict": {f"module.{k}": v for k, v in reference.state_dict().items()}},
               folder / "HPS_v2.1_compressed.pt")  # wrapped and prefixed like a DDP training checkpoint
    config_dir = folder / "vit-h-14"  # config + tokenizer only, like the laion repo's small files
    tiny_clip_config().save_pretrained(config_dir)
    clip_tokenizer().save_pretrained(config_dir)
    return folder, config_dir, reference


def test_hpsv2_converted_checkpoint_equals_the_open_clip_computation(hps_files):
    folder, config_dir, reference = hps_files
    reward = make_reward("hpsv2", checkpoint=str(folder / "HPS_v2.1_compressed.pt"), clip=str(config_dir),
                         device="cpu")
    x, prompts = batch(3, h=40, w=60), ["a cat", "a very long prompt " * 10, "x"]
    scores = reward(x, prompts, [{}] * 3)
    vocab = _byte_level_vocab()
    # open_clip's tokenizer pads with 0 after the end-of-text token
    ids = clip_tokenizer()(prompts, truncation=True, max_length=77)["input_ids"]
    tokens = torch.zeros(3, 77, dtype=torch.long)
    for i, row in enumerate(ids):
        tokens[i, :len(row)] = torch.tensor(row)
    assert int(tokens.max()) == vocab["<|endoftext|>"]
    with torch.no_grad():
        expected = (reference.encode_image(hps_pixels(x, SIZE)) * reference.encode_text(tokens)).sum(-1)
    torch.testing.assert_close(scores, expected, rtol=1e-4, atol=1e-5)


def test_hpsv2_rejects_a_checkpoint_of_another_architecture(hps_files, tmp_path):
    folder, config_dir, _ = hps_files
    torch.save({"state_dict": {"visual.trunk.weight": torch.zeros(2)}}, tmp_path / "other.pt")
    with pytest.raises(ValueError, match="unknown keys.*visual.trunk"):
        make_reward("hpsv2", checkpoint=str(tmp_path / "other.pt"), clip=str(config_dir), device="cpu")


# ---- ImageReward: the original checkpoint in transformers' BLIP classes ---------------------------------------

class TimmViTBlock(nn.Module):
    """BLIP's vit.py Block: x + attn(norm1(x)); x + mlp(norm2(x)); fused qkv; LayerNorm eps 1e-6."""

    def __init__(self, width, heads):
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(width, eps=1e-6)
        self.attn = nn.Module()
        self.attn.qkv = nn.Linear(width, 3 * width)
        self.attn.proj = nn.Linear(width, width)
        self.norm2 = nn.LayerNorm(width, eps=1e-6)
        self.mlp = nn.Module()
        self.mlp.fc1 = nn.Linear(width, 4 * width)
        self.mlp.fc2 = nn.Linear(4 * width, width)

    def forward(self, x):
        b, n, c = x.shape
        qkv = self.attn.qkv(self.norm1(x)).reshape(b, n, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]
        att = ((q @ k.transpose(-2, -1)) * (c // self.heads) ** -0.5).softmax(dim=-1)
        x = x + self.attn.proj((att @ v).transpose(1, 2).reshape(b, n, c))
        return x + self.mlp.fc2(nn.functional.gelu(self.mlp.fc1(self.norm2(x))))


class TimmViT(nn.Module):
    def __init__(self, width=64, heads=1, layers=2, patch=8, image=SIZE):
        super().__init__()
        self.patch_embed = nn.Module()
        self.patch_embed.proj = nn.Conv2d(3, width, patch, patch)
        self.cls_token = nn.Parameter(torch.randn(1, 1, width) * 0.02)
        self.pos_embed = nn.Parameter(torch.randn(1, (image // patch) ** 2 + 1, width) * 0.02)
        self.blocks = nn.ModuleList([TimmViTBlock(width, heads) for _ in range(layers)])
        self.norm = nn.LayerNorm(width, eps=1e-6)

    def forward(self, pixels):
        x = self.patch_embed.proj(pixels).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1) + self.pos_embed
        for block in self.blocks:
            x = block(x)
        return self.norm(x)


BERT_WORDS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "a", "photo", "of", "cat", "dog", "red", "##s"] + \
    list("bcdefghijklmnopqrstuvwxyz")


@pytest.fixture(scope="module")
def imagereward_files(tmp_path_factory):
    from transformers import BertTokenizer, BlipTextConfig, BlipTextModel

    folder = tmp_path_factory.mktemp("tiny-imagereward")
    (folder / "vocab.txt").write_text("\n".join(BERT_WORDS) + "\n")
    tok_dir = folder / "bert"
    BertTokenizer(vocab=str(folder / "vocab.txt")).save_pretrained(tok_dir)
    med = {"architectures": ["BertModel"], "attention_probs_dropout_prob": 0.1, "hidden_act": "gelu",
           "hidden_dropout_prob": 0.1, "hidden_size": 32, "initializer_range": 0.02, "intermediate_size": 64,
           "layer_norm_eps": 1e-12, "max_position_embeddings": 64, "model_type": "bert", "num_attention_heads": 4,
           "num_hidden_layers": 2, "pad_token_id": 0, "type_vocab_size": 2, "vocab_size": len(BERT_WORDS) + 2,
           "encoder_width": 64, "add_cross_attention": True}
    (folder / "med_config.json").write_text(json.dumps(med))
    torch.manual_seed(3)
    vit = TimmViT().eval()
    text = BlipTextModel(BlipTextConfig(vocab_size=med["vocab_size"], hidden_size=32, encoder_hidden_size=64,
                                        intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                        max_position_embeddings=64, is_decoder=True), add_pooling_layer=False)
    from core.rewards.clip_rewards import aesthetic_head

    mlp = aesthetic_head(32)
    state = {f"blip.visual_encoder.{k}": v for k, v in vit.state_dict().items()}
    state.update({f"blip.text_encoder.{k}": v for k, v in text.state_dict().items()})
    state["blip.text_encoder.embeddings.position_ids"] = torch.arange(64)[None]  # persistent in BLIP's med.py
    state.update({f"mlp.{k}": v for k, v in mlp.state_dict().items()})
    state.update({"blip.vision_proj.weight": torch.zeros(8, 64), "blip.text_proj.weight": torch.zeros(8, 32)})
    torch.save(state, folder / "ImageReward.pt")
    return folder, tok_dir, vit


def test_imagereward_vision_tower_equals_blips_vit_and_scores_are_standardized(imagereward_files):
    folder, tok_dir, vit = imagereward_files
    reward = make_reward("imagereward", checkpoint=str(folder), tokenizer=str(tok_dir), device="cpu")
    model = reward.model
    assert model.vision.config.hidden_size == 64 and model.vision.config.num_hidden_layers == 2
    assert model.vision.config.image_size == SIZE and len(reward.tokenizer) == len(BERT_WORDS) + 2
    x = batch(2, h=48, w=40)
    pixels = clip_pixels(x, SIZE)
    with torch.no_grad():
        torch.testing.assert_close(model.vision(pixel_values=pixels).last_hidden_state, vit(pixels),
                                   rtol=1e-4, atol=1e-5)
    scores = reward(x, ["a red cat", "a dog"], [{}, {}])
    assert scores.shape == (2,) and torch.isfinite(scores).all()
    tokens = reward.tokenizer(["a red cat", "a dog"], padding="max_length", max_length=35, truncation=True,
                              return_tensors="pt")
    assert tokens["input_ids"].shape == (2, 35)
    with torch.no_grad():
        raw = model(pixels, tokens["input_ids"], tokens["attention_mask"])
    torch.testing.assert_close(scores, (raw - 0.16717362830052426) / 1.0333394966054072, rtol=1e-5, atol=1e-6)
    # the head's last bias alone: every score is (b - mean) / std
    with torch.no_grad():
        for p in model.mlp.parameters():
            p.zero_()
        model.mlp.layers[7].bias.fill_(1.5)
    torch.testing.assert_close(reward(x, ["a", "b"], [{}, {}]),
                               torch.full((2,), (1.5 - IMAGEREWARD_MEAN) / IMAGEREWARD_STD), rtol=0, atol=1e-6)


# ---- GenEval rules -------------------------------------------------------------------------------------------

def det(x0, y0, x1, y1, score=0.9):
    return Detection((x0, y0, x1, y1), score)


def test_relative_position_follows_geneval():
    left, right = det(0, 40, 20, 60), det(60, 40, 80, 60)
    assert relative_position(left, right) == {"left of"}
    assert relative_position(right, left) == {"right of"}
    top, bottom = det(40, 0, 60, 20), det(40, 60, 60, 80)
    assert relative_position(top, bottom) == {"above"} and relative_position(bottom, top) == {"below"}
    assert relative_position(det(0, 0, 20, 20), det(60, 60, 80, 80)) == {"left of", "above"}
    # overlapping boxes whose centres differ by less than 0.1·(sum of sizes): no relation
    assert relative_position(det(0, 0, 100, 100), det(10, 0, 110, 100)) == set()


def test_select_detections_thresholds_sorts_suppresses_and_caps():
    dets = [det(0, 0, 10, 10, 0.5), det(1, 1, 11, 11, 0.8), det(50, 50, 60, 60, 0.05), det(30, 30, 40, 40, 0.3)]
    kept = select_detections(dets, threshold=0.1, nms_threshold=0.5, max_objects=16)
    assert [d.score for d in kept] == [0.8, 0.3]  # 0.5 overlaps 0.8 (IoU 0.68), 0.05 is under the threshold
    assert len(select_detections(dets, 0.1, 1.0, 16)) == 3  # NMS off
    assert len(select_detections(dets, 0.0, 1.0, 2)) == 2


def colors_from(mapping):
    return lambda cls, objs: [mapping[(cls, o.box)] for o in objs]


def test_geneval_scores_counts_colours_and_positions():
    meta = {"tag": "position", "include": [{"class": "dog", "count": 1},
                                           {"class": "cat", "count": "1", "position": ["left of", "0"]}]}
    includes, excludes = parse_requirements(meta)
    assert includes[1] == {"class": "cat", "count": 1, "position": ("left of", 0)}
    dog, cat = det(60, 40, 80, 60), det(0, 40, 20, 60)
    none = colors_from({})
    assert geneval_binary(includes, excludes, {"dog": [dog], "cat": [cat]}, none) == 1.0
    assert geneval_partial(includes, {"dog": [dog], "cat": [cat]}, none) == 1.0
    # cat on the wrong side: GenEval fails; partial = mean(1, 1, 0)
    swapped = {"dog": [cat], "cat": [dog]}
    assert geneval_binary(includes, excludes, swapped, none) == 0.0
    assert geneval_partial(includes, swapped, none) == pytest.approx(2 / 3)

    counting = parse_requirements({"tag": "counting", "include": [{"class": "bird", "count": 3}],
                                   "exclude": [{"class": "bird", "count": 4}]})
    birds = [det(10 * i, 0, 10 * i + 5, 5) for i in range(5)]
    assert geneval_binary(*counting, {"bird": birds[:3]}, none) == 1.0
    assert geneval_binary(*counting, {"bird": birds[:4]}, none) == 0.0  # the exclude: 4 or more
    assert geneval_partial(counting[0], {"bird": birds[:2]}, none) == pytest.approx(2 / 3)
    assert geneval_partial(counting[0], {"bird": birds[:5]}, none) == pytest.approx(1 / 3)

    colours = parse_requirements({"tag": "colors", "include": [{"class": "car", "count": 2, "color": "red"}]})
    cars = [det(0, 0, 5, 5), det(10, 10, 15, 15)]
    paint = colors_from({("car", cars[0].box): "red", ("car", cars[1].box): "blue"})
    assert geneval_binary(*colours, {"car": cars}, paint) == 0.0
    assert geneval_partial(colours[0], {"car": cars}, paint) == pytest.approx((1 + 0.5) / 2)
    assert geneval_partial(colours[0], {"car": cars[:1]}, paint) == pytest.approx((0.5 + 0) / 2)

    assert parse_requirements({"source": "general"}) is None
    with pytest.raises(ValueError, match="relation must be one of"):
        parse_requirements({"include": [{"class": "a"}, {"class": "b", "position": ["near", 0]}]})


# ---- GenEval end to end on a tiny OWLv2 ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def owl_dir(tmp_path_factory):
    from transformers import Owlv2Config, Owlv2ForObjectDetection, Owlv2ImageProcessor, Owlv2Processor

    vocab = _byte_level_vocab()
    folder = tmp_path_factory.mktemp("tiny-owlv2")
    torch.manual_seed(4)
    config = Owlv2Config(
        text_config=dict(vocab_size=len(vocab), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, max_position_embeddings=16, bos_token_id=vocab["<|startoftext|>"],
                         eos_token_id=vocab["<|endoftext|>"], pad_token_id=vocab["<|endoftext|>"]),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                           image_size=SIZE, patch_size=8),
        projection_dim=32)  # OWL's class head compares text embeddings with width-32 box embeddings
    Owlv2ForObjectDetection(config).save_pretrained(folder)
    tokenizer = clip_tokenizer()
    tokenizer.model_max_length = 16
    Owlv2Processor(image_processor=Owlv2ImageProcessor(size={"height": SIZE, "width": SIZE}),
                   tokenizer=tokenizer).save_pretrained(folder)
    return folder


def test_geneval_reward_on_tiny_owlv2_scores_geneval_prompts_and_nan_elsewhere(owl_dir, clip_dir):
    reward = make_reward("geneval", detector=str(owl_dir), clip=str(clip_dir), device="cpu", queries="prompt",
                         threshold=0.0, counting_threshold=0.0)
    meta = [{"source": "nft-geneval", "tag": "single_object", "include": [{"class": "cat", "count": 1}]},
            {"source": "nft-general"},
            {"tag": "color_attr", "include": [{"class": "car", "count": 1, "color": "red"},
                                              {"class": "dog", "count": 1, "color": "blue"}]}]
    scores = reward(batch(3), ["a cat", "a sunset", "a red car and a blue dog"], meta)
    assert scores.dtype == torch.float32 and scores.shape == (3,)
    assert math.isnan(scores[1]) and torch.isfinite(scores[[0, 2]]).all()
    assert ((scores[[0, 2]] >= -15) & (scores[[0, 2]] <= 1)).all()  # count terms can go below 0 (GenEval-partial)
    assert reward.processor.image_processor.image_mean == pytest.approx(MEAN.tolist())
    none = reward(batch(2), ["a", "b"], [{}, {"source": "x"}])
    assert torch.isnan(none).all()


class StubDetector(nn.Module):
    """Fixed OWL outputs: box k is (cx, cy, w, h) = BOXES[k] (fractions) with the given per-query logits."""

    def __init__(self, boxes, logits):
        super().__init__()
        self.dummy = nn.Parameter(torch.zeros(1))
        self.boxes, self.logits = torch.tensor(boxes), torch.tensor(logits)

    def forward(self, pixel_values, **kwargs):
        from types import SimpleNamespace

        b = pixel_values.shape[0]
        return SimpleNamespace(logits=self.logits.expand(b, -1, -1), pred_boxes=self.boxes.expand(b, -1, -1))


def test_geneval_detections_map_to_pixels_and_respect_the_counting_threshold(owl_dir, clip_dir):
    from transformers import Owlv2Processor

    real = make_reward("geneval", detector=str(owl_dir), clip=str(clip_dir), device="cpu", queries="prompt")
    big = 10.0  # sigmoid -> ~1; -big -> ~0
    boxes = [[0.2, 0.5, 0.2, 0.2], [0.8, 0.5, 0.2, 0.2], [0.5, 0.1, 0.1, 0.1]]
    logits = [[big, -big], [-big, big], [-big, 0.0]]  # queries: dog, cat ; box 2 is a 0.5-confidence cat
    stub = GenEvalReward(StubDetector(boxes, logits), Owlv2Processor.from_pretrained(owl_dir), real.clip,
                         real.clip_tokenizer, mode="binary", threshold=0.3, counting_threshold=0.9,
                         queries="prompt")
    found = stub.detect(to_pil_images(batch(1, h=40, w=40)), ["dog", "cat"])[0]
    assert [d.box for d in found["dog"]] == [pytest.approx((4.0, 16.0, 12.0, 24.0))]  # fractions x 40 px
    # classes are queried in order of first appearance in the batch's metadata: dog, cat (as the stub's logits)
    position = {"tag": "position", "include": [{"class": "dog", "count": 1},
                                               {"class": "cat", "count": 1, "position": ["right of", 0]}]}
    counting = {"tag": "counting", "include": [{"class": "cat", "count": 1}],
                "exclude": [{"class": "cat", "count": 2}]}
    two_cats = {"tag": "counting", "include": [{"class": "cat", "count": 2}]}
    scores = stub(batch(3), ["p", "c", "c2"], [position, counting, two_cats])
    # the confident cat is right of the dog; at 0.9 the 0.5-confidence cat is not counted: exactly one cat
    assert scores.tolist() == [1.0, 1.0, 0.0]


# ---- missing weights ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name, kwargs, repo", [
    ("pickscore", {}, "yuvalkirstain/PickScore_v1"),
    ("clipscore", {}, "openai/clip-vit-large-patch14"),
    ("hpsv2", {}, "xswu/HPSv2"),
    ("aesthetic", {"clip": "CLIP_DIR"}, "trl-lib/ddpo-aesthetic-predictor"),
    ("imagereward", {}, "THUDM/ImageReward"),
    ("geneval", {}, "google/owlv2-base-patch16-ensemble"),
])
def test_missing_weights_name_the_repo_the_cache_and_the_fix(name, kwargs, repo, clip_dir, tmp_path):
    kwargs = {k: (str(clip_dir) if v == "CLIP_DIR" else v) for k, v in kwargs.items()}
    with pytest.raises(RewardWeightsNotFoundError) as e:
        make_reward(name, device="cpu", **kwargs)
    message = str(e.value)
    assert f"reward {name!r}" in message and repo in message
    assert str(tmp_path / "empty-hub-cache") in message and "HF_HUB_OFFLINE" in message and "hf download" in message


def test_a_local_folder_without_weights_is_named(tmp_path):
    tiny_clip_config().save_pretrained(tmp_path)
    with pytest.raises(RewardWeightsNotFoundError, match="lacks model.safetensors or pytorch_model.bin"):
        make_reward("clipscore", model=str(tmp_path), device="cpu")


def test_weights_in_the_hf_cache_layout_are_found_offline(clip_dir, tmp_path, monkeypatch):
    import shutil

    cache = tmp_path / "hub"
    snapshot = cache / "models--someorg--tiny-pickscore" / "snapshots" / "0123456789abcdef"
    shutil.copytree(clip_dir, snapshot)
    (cache / "models--someorg--tiny-pickscore" / "refs").mkdir()
    (cache / "models--someorg--tiny-pickscore" / "refs" / "main").write_text("0123456789abcdef")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    reward = make_reward("pickscore", model="someorg/tiny-pickscore", processor="someorg/tiny-pickscore",
                         device="cpu")
    assert reward(batch(1), ["a cat"], [{}]).shape == (1,)


def test_model_rewards_are_registered_and_listed_as_external():
    from core.rewards import EXTERNAL_REWARDS, available_rewards

    registry = available_rewards()
    assert {"pickscore", "clipscore", "hpsv2", "aesthetic", "imagereward", "geneval", "remote"} == set(EXTERNAL_REWARDS)
    assert set(EXTERNAL_REWARDS) <= set(registry)
