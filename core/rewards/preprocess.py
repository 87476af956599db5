"""Image preprocessing shared by the model-based rewards, restating each reward's documented pipeline.

The reference scorers of this literature receive PIL images (8-bit) and run torchvision / transformers
transforms on them; to give the same numbers, the rollout tensor is first turned into 8-bit images
exactly as they do (round(255·x)), then resized with PIL:

- ``resize_shortest_center_crop`` — torchvision ``Resize(size, BICUBIC)`` + ``CenterCrop(size)``: the CLIP
  pipeline of OpenAI CLIP, of the CLIPProcessor used by PickScore and the aesthetic predictor, and of
  ImageReward's BLIP transform. Short side -> ``size``, long side -> int(size·long/short), centre crop.
- ``resize_longest_pad`` — open_clip's ``ResizeMaxSize`` used by HPSv2 (``light_augmentation=True``): long
  side -> ``size`` (BICUBIC), pad to a square with ``fill``, centred.
- ``tensor_resize_center_crop`` — torchvision's tensor ``Resize(size)`` (bilinear, antialiased) +
  ``CenterCrop``, applied by the CLIPScore reward of DiffusionNFT / Flow-GRPO straight to float images.

then ``to_pixel_values`` scales to [0, 1] and normalizes with the model's mean / std (OpenAI CLIP's
constants for every model here).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # pragma: no cover
    import torch
    from PIL import Image

OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
"""Per-channel RGB mean of OpenAI CLIP's training images; also used by open_clip ViT-H-14 and BLIP."""
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
"""Per-channel RGB standard deviation paired with :data:`OPENAI_CLIP_MEAN`."""


def to_pil_images(images: torch.Tensor) -> list[Image.Image]:
    """[B, 3, H, W] floats in [0, 1] -> B RGB 8-bit PIL images, round(255·x) as the reference scorers do."""
    import torch
    from PIL import Image

    arr = (images.detach().float().clamp(0, 1) * 255).round().to(torch.uint8)
    arr = arr.permute(0, 2, 3, 1).cpu().numpy()  # [B, H, W, 3]
    return [Image.fromarray(a) for a in arr]


def _center_box(width: int, height: int, size: int) -> tuple[int, int, int, int]:
    """torchvision CenterCrop's box: top = int(round((H - size) / 2)), left likewise."""
    top = int(round((height - size) / 2.0))
    left = int(round((width - size) / 2.0))
    return left, top, left + size, top + size


def resize_shortest_center_crop(image: Image.Image, size: int) -> Image.Image:
    """Short side -> ``size`` with PIL BICUBIC (long side int(size·long/short)), then centre-crop size×size."""
    from PIL import Image

    w, h = image.size
    if w <= h:
        new_w, new_h = size, int(size * h / w)
    else:
        new_w, new_h = int(size * w / h), size
    if (new_w, new_h) != (w, h):
        image = image.resize((new_w, new_h), Image.Resampling.BICUBIC)
    return image.crop(_center_box(new_w, new_h, size))


def resize_longest_pad(image: Image.Image, size: int, fill: int = 0) -> Image.Image:
    """Long side -> ``size`` with PIL BICUBIC (short side rounded), then pad to size×size with ``fill``,
    the padding split as (pad // 2) before and the rest after (open_clip's ResizeMaxSize)."""
    from PIL import Image

    w, h = image.size
    scale = size / float(max(w, h))
    if scale == 1.0:
        return image
    new_w, new_h = round(w * scale), round(h * scale)
    image = image.resize((new_w, new_h), Image.Resampling.BICUBIC)
    canvas = Image.new("RGB", (size, size), (fill, fill, fill))
    canvas.paste(image, ((size - new_w) // 2, (size - new_h) // 2))
    return canvas


def to_pixel_values(images: Sequence[Image.Image], mean: Sequence[float] = OPENAI_CLIP_MEAN,
                    std: Sequence[float] = OPENAI_CLIP_STD) -> torch.Tensor:
    """Equal-size PIL images -> float32 [B, 3, S, S]: x/255, then (x - mean) / std per channel."""
    import torch

    arr = np.stack([np.asarray(im.convert("RGB"), dtype=np.float32) / 255.0 for im in images])  # [B, S, S, 3]
    arr = (arr - np.asarray(mean, dtype=np.float32)) / np.asarray(std, dtype=np.float32)
    return torch.from_numpy(arr).permute(0, 3, 1, 2).contiguous()


def clip_pixels(images: torch.Tensor, size: int = 224) -> torch.Tensor:
    """The CLIP / BLIP pipeline on a rollout batch: 8-bit, BICUBIC short side -> size, centre crop, normalize."""
    return to_pixel_values([resize_shortest_center_crop(im, size) for im in to_pil_images(images)])


def hps_pixels(images: torch.Tensor, size: int = 224) -> torch.Tensor:
    """HPSv2's pipeline: 8-bit, BICUBIC long side -> size, pad with black to a square, normalize."""
    return to_pixel_values([resize_longest_pad(im, size, fill=0) for im in to_pil_images(images)])


def tensor_resize_center_crop(images: torch.Tensor, size: int = 224) -> torch.Tensor:
    """torchvision tensor ``Resize(size)`` (bilinear, antialias) + ``CenterCrop(size)`` + CLIP normalization,
    on float images in [0, 1] of any device; returns float32 [B, 3, size, size] on the same device."""
    import torch
    import torch.nn.functional as F

    x = images.float()
    h, w = x.shape[-2:]
    if h <= w:
        new_h, new_w = size, int(size * w / h)
    else:
        new_h, new_w = int(size * h / w), size
    if (new_h, new_w) != (h, w):
        x = F.interpolate(x, size=(new_h, new_w), mode="bilinear", align_corners=False, antialias=True)
    left, top, right, bottom = _center_box(new_w, new_h, size)
    x = x[..., top:bottom, left:right]
    mean = torch.tensor(OPENAI_CLIP_MEAN, device=x.device).view(1, 3, 1, 1)
    std = torch.tensor(OPENAI_CLIP_STD, device=x.device).view(1, 3, 1, 1)
    return (x - mean) / std
