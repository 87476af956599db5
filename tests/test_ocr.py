"""The OCR reward: quoted-text targets, Flow-GRPO's normalized edit distance, and a real offline read."""

import math

import numpy as np
import pytest
import torch
from PIL import Image, ImageDraw, ImageFont

from core.rewards import make_reward
from core.rewards.ocr import edit_distance, quoted_text, text_similarity


def test_target_is_the_text_inside_double_quotes():
    assert quoted_text('a sign that says "Hello World"') == "Hello World"
    assert quoted_text('“OPEN” and "now"') == "OPEN now"
    assert quoted_text("a red circle") is None
    assert quoted_text('empty quotes "  " only') is None


def test_similarity_is_one_minus_normalized_edit_distance():
    assert edit_distance("kitten", "sitting") == 3
    assert edit_distance("", "abc") == 3
    assert text_similarity("MARBLE", "marble") == 1.0  # case and spaces ignored
    assert text_similarity("the word marble here", "marble") == 1.0  # containment scores 1
    assert text_similarity("marbel", "marble") == pytest.approx(1 - 2 / 6)
    assert text_similarity("", "marble") == 0.0
    assert text_similarity("completely different text", "cat") == 0.0  # capped at the target's length
    with pytest.raises(ValueError, match="empty"):
        text_similarity("x", "   ")


def _word_image(word: str, size: int = 128) -> torch.Tensor:
    img = Image.new("RGB", (size, size), (255, 255, 255))
    font = ImageFont.load_default(size=size // 4)
    ImageDraw.Draw(img).text((size // 10, size // 3), word, fill=(0, 0, 0), font=font)
    return torch.from_numpy(np.array(img)).permute(2, 0, 1)[None].float() / 255.0


def test_ocr_reads_a_rendered_quoted_word_and_is_nan_without_quotes():
    reward = make_reward("ocr")
    image = _word_image("MARBLE")
    blank = torch.ones(1, 3, 128, 128)
    scores = reward(torch.cat([image, image, blank, image]),
                    ['a sign that says "MARBLE"', 'a sign that says "PEBBLE"', 'a sign that says "MARBLE"',
                     "a sign without quotes"], [{}, {}, {}, {}])
    assert scores[0] == 1.0
    assert 0.0 < scores[1] < 0.7  # shares "BLE" with the target
    assert scores[2] == 0.0  # nothing to read
    assert math.isnan(float(scores[3]))
