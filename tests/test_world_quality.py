"""The mini world's general quality rewards (core/rewards/world_quality.py): the world's own renders score
near the top, and each reward falls for the defect it names and only loosely for the others."""

import numpy as np
import pytest
import torch
from scipy import ndimage

from core.rewards import available_rewards, make_reward
from core.rewards.world_quality import clean_background, crisp_edges, palette_purity
from core.world.scenes import all_specs, render

QUALITY = ("clean_background", "palette_purity", "crisp_edges")


def renders(n=24, seed=0):
    rng = np.random.default_rng(seed)
    specs = [s for task in ("single", "color", "count", "position") for s in all_specs(task)]
    picks = rng.choice(len(specs), size=n, replace=False)
    return [render(specs[i], int(i)) for i in picks]


def noisy(img, sigma, seed=0):
    noise = np.random.default_rng(seed).normal(0, sigma, img.shape)
    return np.clip(img.astype(float) + noise, 0, 255).round().astype(np.uint8)


def test_the_worlds_own_renders_score_near_the_top():
    imgs = renders()
    assert min(clean_background(i) for i in imgs) > 0.9
    assert min(palette_purity(i) for i in imgs) > 0.95
    assert np.mean([crisp_edges(i) for i in imgs]) > 0.7  # anti-aliased edges are the in-between pixels


def test_pixel_noise_lowers_every_quality_reward():
    for img in renders(6):
        for judge in (clean_background, palette_purity, crisp_edges):
            assert judge(noisy(img, 25)) < judge(img) - 0.05, judge.__name__


def test_blur_lowers_crisp_edges_far_more_than_the_background():
    for img in renders(6, seed=1):
        blurred = ndimage.uniform_filter(img.astype(float), size=(3, 3, 1)).round().astype(np.uint8)
        crisp_drop = crisp_edges(img) - crisp_edges(blurred)
        assert crisp_drop > 0.2 and crisp_drop > 2 * (clean_background(img) - clean_background(blurred))


def test_off_palette_objects_lower_palette_purity_and_nothing_drawn_is_not_clean():
    img = renders(1, seed=2)[0]
    border = np.concatenate([img[0], img[-1], img[:, 0], img[:, -1]])
    bg = np.median(border, 0)
    objects = np.sqrt(((img.astype(float) - bg) ** 2).sum(-1)) > 60
    washed = img.astype(float)
    washed[objects] = 0.55 * washed[objects] + 0.45 * 128  # greyed-out colours, same shapes
    washed = washed.round().astype(np.uint8)
    assert palette_purity(washed) < palette_purity(img) - 0.3
    blank = np.broadcast_to(bg.astype(np.uint8), img.shape).copy()
    assert clean_background(blank) == pytest.approx(1.0)
    assert palette_purity(blank) == 0.0 and crisp_edges(blank) == 0.0


@pytest.mark.parametrize("name", QUALITY)
def test_registered_valid_on_every_prompt_and_batch_equals_one_by_one(name):
    assert name in available_rewards()
    reward = make_reward(name)
    imgs = renders(5, seed=3) + [noisy(renders(1, seed=4)[0], 30)]
    batch = torch.tensor(np.stack(imgs), dtype=torch.float32).permute(0, 3, 1, 2) / 255.0
    prompts = ["a red circle", "anything", "", "three white squares", "x", "y"]
    metadata = [{}, {"task": "count"}, {"source": "other"}, {}, {}, {}]
    scores = reward(batch, prompts, metadata)
    assert scores.shape == (6,) and torch.isfinite(scores).all() and ((scores >= 0) & (scores <= 1)).all()
    one = [float(reward(batch[i:i + 1], prompts[i:i + 1], metadata[i:i + 1])) for i in range(6)]
    assert scores.tolist() == pytest.approx(one)
    assert scores[5] < scores[:5].min()  # the noisy image scores lowest
