"""The shipped mini-world model: loads offline from the repository and follows colour prompts.

Loaded once per module; sampling uses the project's own sampler with the presets' settings
(8 steps, no guidance, max_sequence_length 4).
"""

import json
import os

import numpy as np
import pytest
import torch

from core.models import MINI_WORLD_DIR, available_models, load_pipeline
from core.sampling import generate_images
from core.world.checker import detect
from core.world.scenes import COLORS, SHAPES


@pytest.fixture(scope="module")
def pipe():
    assert os.environ.get("HF_HUB_OFFLINE") == "1"  # tests/conftest.py: nothing may be downloaded
    return load_pipeline("mini-world")


def _sample(pipe, prompts, seeds, steps=8):
    images = generate_images(pipe, prompts, seeds, num_steps=steps, guidance_scale=1.0, resolution=64,
                             max_sequence_length=4)
    return (images.permute(0, 2, 3, 1).numpy() * 255).round().astype(np.uint8)


def test_the_shipped_folder_is_a_small_sd3_pipeline_with_its_card(pipe):
    assert "mini-world" in available_models()
    assert type(pipe).__name__ == "StableDiffusion3Pipeline"
    assert pipe.text_encoder_3 is None and pipe.tokenizer_3 is None
    size = sum(p.stat().st_size for p in MINI_WORLD_DIR.rglob("*") if p.is_file())
    assert size <= 30e6
    card = (MINI_WORLD_DIR / "MODEL_CARD.md").read_text()
    assert "Parameters" in card and "Recipe" in card and "sample_grid.png" in card
    assert (MINI_WORLD_DIR / "sample_grid.png").stat().st_size > 10_000
    log = json.loads((MINI_WORLD_DIR / "pretrain_log.json").read_text())
    assert log["parameters"]["transformer"] == sum(p.numel() for p in pipe.transformer.parameters())
    # every caption word is one token of the shipped tokenizer
    assert len(pipe.tokenizer("a red circle left of a blue square").input_ids) == 10


def test_samples_are_deterministic_per_seed(pipe):
    a = _sample(pipe, ["a green square", "two red circles"], [5, 6])
    b = _sample(pipe, ["a green square", "two red circles"], [5, 6])
    assert np.array_equal(a, b)


def test_colour_prompts_carry_their_colour_far_more_than_chance(pipe):
    colours = ["red", "blue", "yellow", "green", "purple"]
    prompts = [f"a {c} {SHAPES[i % 3]}" for i, c in enumerate(colours) for _ in range(6)]
    images = _sample(pipe, prompts, list(range(len(prompts))))
    hits = []
    for prompt, img in zip(prompts, images):
        dets = detect(img)
        # the requested colour is the colour of the largest object found
        hits.append(bool(dets) and dets[0].color == prompt.split()[1])
    chance = 1 / len(COLORS)
    assert np.mean(hits) >= 0.6 > 4 * chance, f"colour right in {np.mean(hits):.0%} of images (chance {chance:.0%})"


def test_lora_training_path_works_on_the_shipped_model(pipe):
    """One policy forward/backward through the LoRA adapter on the real model (what every mini-* preset does)."""
    from core.config import ModelConfig
    from core.models import Policy, VelocityInputs

    fresh = load_pipeline("mini-world")
    policy = Policy(fresh, ModelConfig(name="mini-world", lora_rank=4, lora_alpha=8.0), torch.device("cpu"))
    emb = fresh.encode_prompt(["a red circle"] * 2, None, None, device=torch.device("cpu"),
                              do_classifier_free_guidance=False, max_sequence_length=4)
    inp = VelocityInputs(torch.randn(2, 4, 16, 16), torch.tensor([0.5, 0.8]), emb[0], emb[2])
    v = policy.velocity(inp)
    assert v.shape == (2, 4, 16, 16)
    v.pow(2).mean().backward()
    assert all(p.grad is not None for p in policy.parameters)
    assert torch.allclose(policy.velocity_ref(inp), policy.velocity_old(inp), atol=1e-5)  # LoRA B starts at 0


def test_card_measurement_judges_the_relation_only_on_position_prompts(pipe):
    from core.world.card import _table, measure
    from core.world.checker import relation_holds
    from core.world.prompts import world_source

    m = measure(pipe, 1.0, prompts_per_source=2, seeds_per_prompt=2)
    by = m["by_source"]
    assert all("pair_found" not in by[s] for s in ("world-general", "world-color", "world-count"))
    pos = by["world-position"]
    # recompute from the same images: the first 2 test prompts x 2 seeds, seeds 0..3
    items = world_source("world-position").test[:2]
    images = _sample(pipe, [it.text for it in items for _ in range(2)], [0, 1, 2, 3])
    judged = [relation_holds(it.metadata, detect(img)) for it, img in zip([i for i in items for _ in range(2)], images)]
    found = [j for j in judged if j is not None]
    assert pos["pair_found"] == len(found) / 4
    assert (np.isnan(pos["relation_right"]) if not found else pos["relation_right"] == np.mean(found))
    rows = _table(m).splitlines()
    assert rows[0].endswith("| both colours found | relation right |")
    assert next(r for r in rows if r.startswith("| world-count |")).endswith("| — | — |")
