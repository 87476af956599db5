"""General *quality* rewards of the built-in mini world: what a user would call a clean render, judged on
every image whatever it was asked to show, and fully attainable by an image that follows its prompt (the
world's own renders score 0.97-1.0 on the first two and ~0.8 on the third; the pretrained model's samples
0.26-0.47, measured on held-out prompts).

They play the part PickScore, HPSv2.1 and CLIPScore play for SD3.5 in the paper: three general rewards that
agree with each other (on the base model's samples, palette purity and crisp edges correlate at r ≈ 0.87,
clean background with each at r ≈ 0.05-0.36) and that a model can raise without following its prompts. The
image statistics (colorfulness, contrast, gray entropy) could not serve: they pay for clutter and noise,
which no prompt-following image keeps (docs/mini-world.md).

    clean_background   exp(-mean RGB distance of the background pixels to the background colour / 8)
    palette_purity     exp(-mean RGB distance of the objects' inner pixels to the nearest palette colour / 30)
    crisp_edges        pure object pixels / (pure object pixels + in-between pixels)

Pixels are judged with the checker's background estimate (median of the border) and palette; an image with
no object scores 0 on the last two (a blank image is not a clean render of anything).
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from core.rewards.base import Reward, register_reward

BACKGROUND_SCALE = 8.0  # RGB units: a background whose pixels stray 8 from its colour on average scores e^-1
PURITY_SCALE = 30.0  # RGB units: object pixels 30 from the nearest palette colour on average score e^-1
PURE = 40.0  # an object pixel within this RGB distance of a palette colour is "pure"
IN_BETWEEN = 20.0  # a pixel farther than this from the background and not pure is "in between"


def clean_background(image: np.ndarray) -> float:
    from core.world.checker import FG_THRESHOLD, background_distance

    _, _, dist = background_distance(image)
    back = dist <= FG_THRESHOLD
    return float(np.exp(-dist[back].mean() / BACKGROUND_SCALE)) if back.any() else 0.0


def palette_purity(image: np.ndarray) -> float:
    from scipy import ndimage

    from core.world.checker import FG_THRESHOLD, background_distance, palette_distance

    img, _, dist = background_distance(image)
    inner = ndimage.binary_erosion(dist > FG_THRESHOLD)  # edges blend with the background by design
    if inner.sum() < 3:
        return 0.0
    return float(np.exp(-palette_distance(img)[inner].mean() / PURITY_SCALE))


def crisp_edges(image: np.ndarray) -> float:
    from core.world.checker import FG_THRESHOLD, background_distance, palette_distance

    img, _, dist = background_distance(image)
    near_palette = palette_distance(img) < PURE
    pure = int(((dist > FG_THRESHOLD) & near_palette).sum())
    in_between = int(((dist > IN_BETWEEN) & ~near_palette).sum())
    return pure / (pure + in_between) if pure else 0.0


def _on_8bit(judge: Callable[[np.ndarray], float]) -> Reward:
    """``judge`` on every image (prompts and metadata unused, valid everywhere), given as 8-bit RGB as the
    checker reads images."""
    from core.rewards.image_stats import ImageStatReward, to_uint8

    return ImageStatReward(lambda image: judge(to_uint8(image)))


@register_reward("clean_background", "Mini world, every image: a flat background, free of noise and smudges "
                                     "(exp(-mean deviation of background pixels / 8 RGB), 0-1)")
def _clean_background() -> Reward:
    return _on_8bit(clean_background)


@register_reward("palette_purity", "Mini world, every image: objects drawn in clean palette colours "
                                   "(exp(-mean distance of inner object pixels to the palette / 30 RGB), 0-1; 0 if none)")
def _palette_purity() -> Reward:
    return _on_8bit(palette_purity)


@register_reward("crisp_edges", "Mini world, every image: objects with crisp edges, few in-between pixels "
                                "(pure object pixels / (pure + in-between), 0-1; 0 if no object)")
def _crisp_edges() -> Reward:
    return _on_8bit(crisp_edges)
