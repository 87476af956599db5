"""OCR reward: does the image show the text the prompt quotes? (the paper's OCR reward, spec §8)

Target = the text inside double quotes in the prompt ("..." or “...”; several quoted parts are
joined with a space). Reward = 1 - normalized edit distance between what OCR reads and the target,
following Flow-GRPO's OCR reward (flow_grpo/ocr.py): spaces removed and lower-cased on both sides; a
recognized text that contains the target scores 1; otherwise the Levenshtein distance, capped at the
target's length, divided by it. NaN for prompts without quoted text (spec §3).

OCR is real and offline: ``rapidocr-onnxruntime`` ships the PP-OCRv4 detection and recognition ONNX
models inside its wheel. It is imported lazily, inside the factory (the registry stays light).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from core.rewards.base import Reward, check_number_in_range, register_reward

_QUOTED = re.compile(r'"([^"]+)"|“([^”]+)”')


def quoted_text(prompt: str) -> str | None:
    """The text a prompt asks to render: its double-quoted parts joined by spaces, or None."""
    parts = [a or b for a, b in _QUOTED.findall(prompt)]
    parts = [p.strip() for p in parts if p.strip()]
    return " ".join(parts) if parts else None


def edit_distance(a: str, b: str) -> int:
    """Levenshtein distance (insertions, deletions, substitutions all cost 1)."""
    if len(a) < len(b):
        a, b = b, a
    previous = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        current = [i]
        for j, cb in enumerate(b, 1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (ca != cb)))
        previous = current
    return previous[-1]


def text_similarity(recognized: str, target: str) -> float:
    """1 - min(1, d / len(target)) on space-free lower-case strings; 1 when the target is contained."""
    rec = recognized.replace(" ", "").lower()
    tgt = target.replace(" ", "").lower()
    if not tgt:
        raise ValueError("the OCR target is empty: a prompt's quoted text must contain a non-space character")
    if tgt in rec:
        return 1.0
    return 1.0 - min(len(tgt), edit_distance(rec, tgt)) / len(tgt)


class OcrReward(Reward):
    """Reads each image with RapidOCR and compares the text with the prompt's quoted target."""

    def __init__(self, engine, min_confidence: float, upscale_to: int):
        self.engine = engine
        self.min_confidence = min_confidence
        self.upscale_to = upscale_to

    def read(self, image) -> str:
        """The text OCR finds in one uint8 [H, W, 3] RGB image, boxes in reading order, joined by spaces."""
        import numpy as np
        from PIL import Image

        h, w = image.shape[:2]
        if max(h, w) < self.upscale_to:  # the detector is tuned for document-sized text
            f = self.upscale_to / max(h, w)
            image = np.asarray(Image.fromarray(image).resize((round(w * f), round(h * f)),
                                                              Image.Resampling.BICUBIC))
        result, _ = self.engine(image[:, :, ::-1].copy())  # RapidOCR expects OpenCV's BGR order
        if not result:
            return ""
        boxes = sorted(result, key=lambda r: (min(p[1] for p in r[0]), min(p[0] for p in r[0])))
        return " ".join(str(r[1]) for r in boxes if float(r[2]) >= self.min_confidence)

    def score(self, images, prompts: Sequence[str], metadata: Sequence[Mapping[str, Any]]):
        import numpy as np
        import torch

        out = torch.full((len(prompts),), float("nan"))
        targets = [quoted_text(p) for p in prompts]
        todo = [i for i, t in enumerate(targets) if t is not None]
        if not todo:
            return out
        arr = (images[todo].permute(0, 2, 3, 1).cpu().numpy() * 255.0).round().astype(np.uint8)
        for row, i in enumerate(todo):
            out[i] = text_similarity(self.read(arr[row]), targets[i])
        return out


@register_reward("ocr", "OCR accuracy (RapidOCR, offline): 1 - normalized edit distance to the prompt's "
                        "\"quoted\" text; NaN without quotes")
def ocr(min_confidence: float = 0.0, upscale_to: int = 256) -> Reward:
    check_number_in_range("ocr", "min_confidence", min_confidence, 0.0, 1.0)
    check_number_in_range("ocr", "upscale_to", upscale_to, 0, 4096, integer=True)
    try:
        from rapidocr_onnxruntime import RapidOCR
    except ImportError as e:
        raise ImportError("reward 'ocr' needs rapidocr-onnxruntime (pinned in requirements.txt: "
                          "pip install rapidocr-onnxruntime==1.4.4); it ships its ONNX models") from e
    return OcrReward(RapidOCR(), float(min_confidence), int(upscale_to))
