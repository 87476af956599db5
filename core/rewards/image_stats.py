"""Weight-free rewards: image statistics that need no model, work offline and are deterministic.

Each reward applies one numpy function to each image on its own (so scoring a batch equals scoring
every image alone) and takes well under 1 ms on a 64x64 image. They are cheap training rewards for
the CPU path (DDPO's JPEG compressibility) and cheap held-out / extra rewards (contrast, entropy).

Conventions shared by all of them:
- the image arrives as float RGB in [0, 1], shape [H, W, 3];
- "gray" is Rec. 601 luma, Y' = 0.299 R' + 0.587 G' + 0.114 B' on the gamma-encoded values (the
  weights PIL's ``convert("L")`` uses), so it stays in [0, 1];
- 8-bit values, where a statistic needs them (JPEG, histogram), are round(255 * x).
"""

from __future__ import annotations

import io
from functools import partial
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Callable

import numpy as np
from PIL import Image

from core.rewards.base import Reward, check_number_in_range, register_reward

if TYPE_CHECKING:  # pragma: no cover - for annotations only
    import torch

REC601_WEIGHTS = np.array([0.299, 0.587, 0.114])
"""Rec. 601 luma weights for R', G', B'."""

ImageStat = Callable[[np.ndarray], float]
"""One image [H, W, 3] float64 in [0, 1] -> one number."""


class ImageStatReward(Reward):
    """A reward computed by ``stat`` on every image independently; prompts and metadata are unused."""

    def __init__(self, stat: ImageStat, sign: float = 1.0):
        self.stat = stat
        self.sign = sign  # +1 or -1, so that higher is always better (JPEG compressibility: -1)

    def score(
        self,
        images: torch.Tensor,
        prompts: Sequence[str],
        metadata: Sequence[Mapping[str, Any]],
    ) -> torch.Tensor:
        import torch

        pixels = images.detach().to(device="cpu", dtype=torch.float64).permute(0, 2, 3, 1).numpy()
        values = [self.sign * self.stat(image) for image in pixels]  # pixels: [B, H, W, 3]
        return torch.tensor(values, dtype=torch.float32)


# ---- the statistics (pure numpy functions, tested directly) -----------------------------------


def to_uint8(image: np.ndarray) -> np.ndarray:
    """[..., 3] floats in [0, 1] -> uint8 0-255, round to nearest (as DDPO does before JPEG)."""
    return np.rint(image * 255.0).astype(np.uint8)


def luma(image: np.ndarray) -> np.ndarray:
    """Rec. 601 luma [H, W] in [0, 1] of an RGB image [H, W, 3] in [0, 1]."""
    return image @ REC601_WEIGHTS


def jpeg_kilobytes(image: np.ndarray, quality: int = 95) -> float:
    """Size in kB (bytes / 1000) of the image saved as JPEG by PIL at ``quality`` (PIL's defaults
    otherwise, as in DDPO)."""
    buffer = io.BytesIO()
    Image.fromarray(to_uint8(image)).save(buffer, format="JPEG", quality=quality)
    return buffer.getbuffer().nbytes / 1000.0


def mean_luma(image: np.ndarray) -> float:
    """Mean Rec. 601 luma, in [0, 1]: 0 for black, 1 for white."""
    return float(luma(image).mean())


def rms_contrast(image: np.ndarray) -> float:
    """RMS contrast: the (population) standard deviation of the luma, in [0, 0.5]."""
    return float(luma(image).std())


def hasler_susstrunk_colorfulness(image: np.ndarray) -> float:
    """Hasler & Süsstrunk (2003) colorfulness M on 0-255 RGB, divided by 100.

    With rg = R - G and yb = (R + G) / 2 - B per pixel (R, G, B in 0-255, not quantized), and
    population means μ and standard deviations σ over the pixels:
        M = sqrt(σ_rg² + σ_yb²) + 0.3 · sqrt(μ_rg² + μ_yb²)
    0 for any gray image; the paper calls M ≈ 59 "quite colorful" and M ≥ 109 "extremely colorful",
    i.e. 0.59 and 1.09 on the /100 scale returned here (which keeps it on the order of the other
    rewards for the weighted-sum baseline).
    """
    rgb = image * 255.0
    rg = rgb[..., 0] - rgb[..., 1]
    yb = 0.5 * (rgb[..., 0] + rgb[..., 1]) - rgb[..., 2]
    spread = np.hypot(rg.std(), yb.std())
    offset = np.hypot(rg.mean(), yb.mean())
    return float(spread + 0.3 * offset) / 100.0


def laplacian_variance(image: np.ndarray) -> float:
    """Variance of the 3x3 Laplacian of the luma (0-1 scale), borders mirrored.

    Kernel [[0, 1, 0], [1, -4, 1], [0, 1, 0]] with half-sample symmetric padding: the same as
    ``scipy.ndimage.laplace(gray)`` (mode "reflect"), computed in numpy to keep imports light.
    0 for a flat image; at most 16, since the Laplacian lies in [-4, 4] (a 1-pixel black/white
    checkerboard comes close).
    """
    gray = luma(image)
    padded = np.pad(gray, 1, mode="symmetric")
    laplacian = (padded[:-2, 1:-1] + padded[2:, 1:-1] + padded[1:-1, :-2] + padded[1:-1, 2:]
                 - 4.0 * gray)
    return float(laplacian.var())


def gray_histogram_entropy(image: np.ndarray) -> float:
    """Shannon entropy in bits of the 256-bin histogram of the 8-bit luma, in [0, 8].

    0 for a flat image; close to 8 when every gray level is equally frequent.
    """
    levels = np.rint(luma(image) * 255.0).astype(np.int64)
    counts = np.bincount(levels.ravel(), minlength=256)
    p = counts[counts > 0] / levels.size
    return float(-(p * np.log2(p)).sum()) + 0.0  # + 0.0 turns -0.0 into 0.0


# ---- registered rewards ---------------------------------------------------------------------


def _checked_jpeg_quality(reward: str, quality: Any) -> int:
    check_number_in_range(reward, "quality", quality, 1, 100, integer=True)
    return quality


@register_reward("jpeg_compressibility",
                 "DDPO: minus the image's JPEG size in kB (default quality 95); favours simple, smooth images")
def jpeg_compressibility(quality: int = 95) -> Reward:
    """-(JPEG bytes) / 1000 at PIL ``quality`` (an integer in [1, 100]; DDPO uses 95)."""
    quality = _checked_jpeg_quality("jpeg_compressibility", quality)
    return ImageStatReward(partial(jpeg_kilobytes, quality=quality), sign=-1.0)


@register_reward("jpeg_incompressibility",
                 "DDPO: the image's JPEG size in kB (default quality 95); favours detailed, busy images")
def jpeg_incompressibility(quality: int = 95) -> Reward:
    """+(JPEG bytes) / 1000 at PIL ``quality`` (an integer in [1, 100]; DDPO uses 95)."""
    quality = _checked_jpeg_quality("jpeg_incompressibility", quality)
    return ImageStatReward(partial(jpeg_kilobytes, quality=quality))


@register_reward("brightness", "Mean Rec. 601 luma in [0, 1] (0 black, 1 white)")
def brightness() -> Reward:
    """Mean Rec. 601 luma in [0, 1]."""
    return ImageStatReward(mean_luma)


@register_reward("colorfulness",
                 "Hasler–Süsstrunk colorfulness / 100 (0 for gray, above 1.09 is 'extremely colorful')")
def colorfulness() -> Reward:
    """Hasler–Süsstrunk colorfulness on 0-255 RGB, divided by 100."""
    return ImageStatReward(hasler_susstrunk_colorfulness)


@register_reward("sharpness", "Variance of the Laplacian of the gray image (0-1 scale; 0 when flat)")
def sharpness() -> Reward:
    """Variance of the 3x3 Laplacian of the Rec. 601 luma."""
    return ImageStatReward(laplacian_variance)


@register_reward("contrast", "RMS contrast: standard deviation of the luma, in [0, 0.5]")
def contrast() -> Reward:
    """Standard deviation of the Rec. 601 luma."""
    return ImageStatReward(rms_contrast)


@register_reward("gray_entropy", "Shannon entropy (bits) of the 256-bin gray histogram, in [0, 8]")
def gray_entropy() -> Reward:
    """Entropy in bits of the 8-bit Rec. 601 luma histogram."""
    return ImageStatReward(gray_histogram_entropy)
