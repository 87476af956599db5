"""Reward interface, registry and the weight-free rewards: properties first, then golden values."""

from __future__ import annotations

import io
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import scipy.ndimage
import torch
import torch.nn.functional as F
from PIL import Image

from core.rewards import EXTERNAL_REWARDS, Reward, available_rewards, make_reward, register_reward
from core.rewards import base as reward_base
from core.rewards.image_stats import laplacian_variance

BUILTIN = ("jpeg_compressibility", "jpeg_incompressibility", "brightness", "colorfulness",
           "sharpness", "contrast", "gray_entropy")
REPO_ROOT = Path(__file__).resolve().parents[1]


def score(name: str, images: torch.Tensor, **kwargs) -> torch.Tensor:
    """Score ``images`` [B, 3, H, W] with reward ``name`` and empty prompts/metadata."""
    batch = images.shape[0]
    return make_reward(name, **kwargs)(images, [""] * batch, [{}] * batch)


def random_images(batch: int = 4, size: int = 32, seed: int = 0) -> torch.Tensor:
    return torch.rand(batch, 3, size, size, generator=torch.Generator().manual_seed(seed))


def flat(level: float, size: int = 32) -> torch.Tensor:
    return torch.full((1, 3, size, size), level)


def solid(rgb: tuple[float, float, float], size: int = 8) -> torch.Tensor:
    return torch.tensor(rgb, dtype=torch.float32).view(1, 3, 1, 1).expand(1, 3, size, size).contiguous()


def checkerboard(size: int = 32, low: float = 0.0, high: float = 1.0) -> torch.Tensor:
    """1-pixel gray checkerboard [1, 3, size, size]."""
    ij = torch.arange(size)
    mask = ((ij[:, None] + ij[None, :]) % 2).float()
    return (low + (high - low) * mask).expand(1, 3, size, size).contiguous()


# ---- registry --------------------------------------------------------------------------------


def test_builtin_rewards_are_registered_with_one_line_descriptions():
    registry = available_rewards()
    assert set(BUILTIN) <= set(registry)
    assert list(registry) == sorted(registry)
    for name in BUILTIN:
        assert registry[name].strip() and "\n" not in registry[name]


@pytest.mark.parametrize("name", sorted(set(available_rewards()) - set(EXTERNAL_REWARDS)))
def test_every_registered_reward_builds_and_scores_random_images(name):
    reward = make_reward(name)
    assert isinstance(reward, Reward)
    assert reward.name == name and reward.description == available_rewards()[name]
    assert isinstance(reward.higher_is_better, bool)
    values = reward(random_images(batch=5), ["a red circle"] * 5, [{"source": "color"}] * 5)
    assert values.shape == (5,) and values.dtype == torch.float32 and values.device.type == "cpu"
    # a specialist may not apply to this prompt (NaN); nothing may be infinite, and an applicable score is
    # the same for the same image (rewards are deterministic)
    assert not torch.isinf(values).any()
    if name in BUILTIN:  # the weight-free image statistics apply to every image
        assert torch.isfinite(values).all()
    again = reward(random_images(batch=5), ["a red circle"] * 5, [{"source": "color"}] * 5)
    assert torch.equal(torch.isnan(values), torch.isnan(again))
    assert torch.equal(values[~torch.isnan(values)], again[~torch.isnan(again)])


def test_unknown_reward_name_lists_the_valid_choices():
    with pytest.raises(ValueError, match="not_a_reward") as info:
        make_reward("not_a_reward")
    for name in BUILTIN:
        assert name in str(info.value)


def test_unknown_argument_is_named_with_the_accepted_ones():
    with pytest.raises(ValueError, match=r"qualty.*accepted arguments: quality"):
        make_reward("jpeg_compressibility", qualty=90)
    with pytest.raises(ValueError, match=r"'brightness'.*gain.*accepted arguments: none"):
        make_reward("brightness", gain=2.0)


@pytest.mark.parametrize("quality", [0, 101, 90.5, True, "95", None])
def test_jpeg_quality_out_of_range_is_rejected_with_the_rule(quality):
    with pytest.raises(ValueError, match=r"quality=.*integer in \[1, 100\]"):
        make_reward("jpeg_incompressibility", quality=quality)


def test_jpeg_quality_argument_changes_the_size():
    noise = random_images(batch=2)
    assert (score("jpeg_incompressibility", noise, quality=10)
            < score("jpeg_incompressibility", noise, quality=95) - 1.0).all()


@pytest.fixture
def scratch_registry(monkeypatch):
    """A copy of the registry that the test may extend; the real one is restored afterwards."""
    monkeypatch.setattr(reward_base, "_REGISTRY", dict(reward_base._REGISTRY))


def test_register_reward_decorator_feeds_make_reward(scratch_registry):
    @register_reward("scratch_mean", "Mean pixel value")
    def scratch_mean(scale: float, offset: float = 0.0) -> Reward:
        return MeanReward(scale, offset)

    assert available_rewards()["scratch_mean"] == "Mean pixel value"
    reward = make_reward("scratch_mean", scale=2.0)
    assert reward.name == "scratch_mean" and reward.description == "Mean pixel value"
    assert torch.allclose(reward(flat(0.25), [""], [{}]), torch.tensor([0.5]))
    with pytest.raises(ValueError, match=r"missing required argument\(s\) scale"):
        make_reward("scratch_mean", offset=1.0)


def test_register_reward_rejects_duplicates_bad_names_and_bad_descriptions(scratch_registry):
    with pytest.raises(ValueError, match="'brightness' is already registered"):
        register_reward("brightness", "again")(lambda: MeanReward())
    with pytest.raises(ValueError, match="'Bad Name'.*lowercase letters"):
        register_reward("Bad Name", "x")
    with pytest.raises(ValueError, match="description=.*one non-empty line"):
        register_reward("two_lines", "first\nsecond")


def test_factory_that_does_not_return_a_reward_is_reported(scratch_registry):
    register_reward("not_a_reward_factory", "returns a number")(lambda: 3.0)
    with pytest.raises(TypeError, match="'not_a_reward_factory'.*returned float, not a Reward"):
        make_reward("not_a_reward_factory")


def test_importing_rewards_keeps_torch_out_of_the_web_process():
    code = ("import sys, core.rewards as r; assert len(r.available_rewards()) >= 7; "
            "print(sorted(m for m in ('torch', 'scipy', 'diffusers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True,
                         text=True, check=True).stdout
    assert out.strip() == "[]"


# ---- input and output validation -----------------------------------------------------------


class MeanReward(Reward):
    """Test reward: scale * mean pixel value + offset."""

    def __init__(self, scale: float = 1.0, offset: float = 0.0):
        self.scale, self.offset = scale, offset

    def score(self, images, prompts, metadata):
        return self.scale * images.mean(dim=(1, 2, 3)) + self.offset


class NeedsTargetReward(Reward):
    """Test reward that applies only to samples whose metadata has a "target": NaN elsewhere."""

    def score(self, images, prompts, metadata):
        values = images.mean(dim=(1, 2, 3)).double()  # float64 on purpose: the base converts
        applies = torch.tensor(["target" in m for m in metadata])
        return torch.where(applies, values, torch.full_like(values, math.nan))


class FixedOutputReward(Reward):
    """Test reward returning whatever it was given, to exercise the output checks."""

    def __init__(self, output):
        self.output = output

    def score(self, images, prompts, metadata):
        return self.output


def test_nan_marks_not_applicable_and_passes_through_unchanged():
    images = torch.stack([torch.full((3, 4, 4), v) for v in (0.1, 0.2, 0.3, 0.4)])
    metadata = [{"target": 1}, {}, {"source": "ocr"}, {"target": 2}]
    values = NeedsTargetReward()(images, ["p"] * 4, metadata)
    assert values.dtype == torch.float32 and values.shape == (4,)
    assert torch.isnan(values).tolist() == [False, True, True, False]
    assert torch.allclose(values[[0, 3]], torch.tensor([0.1, 0.4]))


@pytest.mark.parametrize("output, match", [
    (torch.zeros(3), r"shape \(3,\): must be \(2,\)"),
    (torch.zeros(2, 1), r"shape \(2, 1\): must be \(2,\)"),
    (torch.tensor(0.5), r"shape \(\): must be \(2,\)"),
    (torch.tensor([0.0, math.inf]), "must be finite, or NaN"),
    (torch.zeros(2, dtype=torch.complex64), "must be real"),
])
def test_wrong_output_of_score_is_a_clear_error(output, match):
    with pytest.raises(ValueError, match=match):
        FixedOutputReward(output)(random_images(batch=2), ["a", "b"], [{}, {}])


def test_score_must_return_a_tensor():
    with pytest.raises(TypeError, match="must return a torch.Tensor of shape \\[2\\], got list"):
        FixedOutputReward([0.0, 1.0])(random_images(batch=2), ["a", "b"], [{}, {}])


def test_reward_without_score_cannot_be_built():
    with pytest.raises(TypeError):
        Reward()


@pytest.mark.parametrize("images, match", [
    (torch.rand(3, 8, 8), r"images.shape=\(3, 8, 8\): must be \[B, 3, H, W\]"),
    (torch.rand(2, 1, 8, 8), r"images.shape=\(2, 1, 8, 8\): must be \[B, 3, H, W\]"),
    (torch.rand(2, 3, 0, 8), r"B, H and W must all be >= 1"),
    (torch.zeros(2, 3, 8, 8, dtype=torch.uint8), r"images.dtype=torch.uint8: must be floating"),
    (torch.full((2, 3, 8, 8), 1.5), r"span \[1.5, 1.5\]: every value must be in \[0, 1\]"),
    (torch.full((2, 3, 8, 8), -1.0), r"span \[-1, -1\]: every value must be in \[0, 1\]"),
    (torch.full((2, 3, 8, 8), math.nan), r"contain NaN values.*\[0, 1\]"),
    (random_images(batch=2, size=8).index_put_((torch.tensor(1), torch.tensor(2)), torch.tensor(math.nan)),
     r"contain NaN values"),
    (torch.full((2, 3, 8, 8), math.inf), r"span \[inf, inf\]: every value must be in \[0, 1\]"),
])
def test_bad_images_are_rejected_by_name(images, match):
    batch = images.shape[0] if images.ndim == 4 else 3
    with pytest.raises(ValueError, match=match):
        make_reward("brightness")(images, [""] * batch, [{}] * batch)


def test_images_must_be_a_tensor():
    with pytest.raises(TypeError, match="images must be a torch.Tensor.*got ndarray"):
        make_reward("brightness")(np.zeros((1, 3, 8, 8)), [""], [{}])


@pytest.mark.parametrize("prompts, metadata, match", [
    (["a"], [{}, {}], r"len\(prompts\)=1 does not match the batch size images.shape\[0\]=2"),
    (["a", "b"], [{}], r"len\(metadata\)=1 does not match the batch size images.shape\[0\]=2"),
    ("ab", [{}, {}], "prompts must be a sequence of 2 strings"),
    (["a", 3], [{}, {}], r"prompts\[1\]=3: every prompt must be a str"),
    (["a", "b"], {"source": "x"}, "metadata must be a sequence of 2 mappings"),
    (["a", "b"], [{}, "x"], r"metadata\[1\]='x': every metadata item must be a mapping"),
])
def test_prompts_and_metadata_must_match_the_batch(prompts, metadata, match):
    with pytest.raises(ValueError, match=match):
        make_reward("contrast")(random_images(batch=2), prompts, metadata)


def test_other_float_dtypes_are_scored_like_float32():
    images = random_images(batch=3)
    expected = score("colorfulness", images)
    assert torch.allclose(score("colorfulness", images.double()), expected)
    assert torch.allclose(score("colorfulness", images.bfloat16()), expected, atol=0.02)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_images_give_the_cpu_result_on_the_cpu():
    images = random_images(batch=3)
    for name in BUILTIN:
        values = score(name, images.cuda())
        assert values.device.type == "cpu"
        assert torch.allclose(values, score(name, images))


# ---- properties of the weight-free rewards ---------------------------------------------------


@pytest.mark.parametrize("name", BUILTIN)
def test_rewards_are_deterministic_and_per_sample(name):
    images = torch.cat([random_images(batch=3, size=24), flat(0.3, 24), checkerboard(24)])
    batch = score(name, images)
    assert torch.equal(batch, score(name, images))
    alone = torch.cat([score(name, images[i:i + 1]) for i in range(len(images))])
    assert torch.equal(batch, alone)


def test_values_stay_in_their_documented_ranges():
    images = torch.cat([random_images(batch=6), flat(0.0), flat(1.0), checkerboard()])
    ranges = {"brightness": (0, 1), "contrast": (0, 0.5), "gray_entropy": (0, 8),
              "sharpness": (0, 16), "colorfulness": (0, math.inf),
              "jpeg_incompressibility": (0, math.inf), "jpeg_compressibility": (-math.inf, 0)}
    for name, (low, high) in ranges.items():
        values = score(name, images)
        assert ((values >= low) & (values <= high)).all(), (name, values)


def test_flat_image_compresses_much_better_than_noise():
    images = torch.cat([flat(0.5, 64), random_images(batch=1, size=64)])
    compressibility = score("jpeg_compressibility", images)
    incompressibility = score("jpeg_incompressibility", images)
    assert compressibility[0] > compressibility[1] + 2.0  # kB
    assert incompressibility[0] < incompressibility[1] - 2.0
    assert torch.equal(compressibility, -incompressibility)


def test_jpeg_size_is_pil_bytes_over_1000_at_quality_95():
    images = random_images(batch=2, size=16)
    pixels = (images * 255).round().to(torch.uint8).permute(0, 2, 3, 1).numpy()
    sizes = []
    for image in pixels:
        buffer = io.BytesIO()
        Image.fromarray(image).save(buffer, format="JPEG", quality=95)
        sizes.append(len(buffer.getvalue()) / 1000)
    assert torch.equal(score("jpeg_incompressibility", images), torch.tensor(sizes))


def test_brightness_is_rec601_luma_and_monotone_in_gray_level():
    assert score("brightness", flat(1.0)).item() == pytest.approx(1.0, abs=1e-6)
    assert score("brightness", flat(0.0)).item() == 0.0
    levels = torch.linspace(0, 1, 11)
    values = score("brightness", torch.cat([flat(v.item(), 8) for v in levels]))
    assert (values.diff() > 0).all()
    assert torch.allclose(values, levels, atol=1e-6)
    pure = torch.cat([solid((1, 0, 0)), solid((0, 1, 0)), solid((0, 0, 1))])
    assert torch.allclose(score("brightness", pure), torch.tensor([0.299, 0.587, 0.114]))


def test_gray_images_have_no_colorfulness_and_red_green_has_a_lot():
    gray = torch.cat([flat(0.0), flat(0.4), flat(1.0), checkerboard(),
                      random_images(batch=1)[:, :1].expand(1, 3, 32, 32)])
    assert torch.allclose(score("colorfulness", gray), torch.zeros(5), atol=1e-6)
    mask = checkerboard(8)[:, :1]
    red_green = torch.cat([mask, 1 - mask, torch.zeros_like(mask)], dim=1)
    assert score("colorfulness", red_green).item() > 1.09  # "extremely colorful" (M >= 109)


def test_colorfulness_golden_values():
    # One red and one green pixel, 0-255: rg = (255, -255) -> μ 0, σ 255; yb = (127.5, 127.5)
    # -> μ 127.5, σ 0. M = sqrt(255² + 0²) + 0.3·sqrt(0² + 127.5²) = 255 + 38.25 = 293.25.
    red_green = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.0, 0.0]]).view(1, 3, 1, 2)
    assert score("colorfulness", red_green).item() == pytest.approx(2.9325, abs=1e-5)
    # A pure red image: σ = 0; μ_rg = 255, μ_yb = 127.5 -> M = 0.3·sqrt(255² + 127.5²) = 85.5296.
    assert score("colorfulness", solid((1, 0, 0))).item() == pytest.approx(0.855296, abs=1e-5)


def test_blur_lowers_sharpness_and_checkerboard_beats_flat():
    noise = random_images(batch=3)
    blurred = F.avg_pool2d(noise, 3, stride=1, padding=1, count_include_pad=False)
    assert (score("sharpness", blurred) < 0.5 * score("sharpness", noise)).all()
    values = score("sharpness", torch.cat([flat(0.7), checkerboard()]))
    assert values[0].item() == 0.0 and values[1].item() > 10.0


def test_sharpness_matches_scipy_laplace():
    image = random_images(batch=1, size=20, seed=3)[0].permute(1, 2, 0).double().numpy()
    gray = image @ np.array([0.299, 0.587, 0.114])
    assert laplacian_variance(image) == pytest.approx(scipy.ndimage.laplace(gray).var(), rel=1e-12)


def test_contrast_is_zero_when_flat_and_half_for_black_and_white():
    values = score("contrast", torch.cat([flat(0.0), flat(0.6), checkerboard()]))
    assert values.tolist() == pytest.approx([0.0, 0.0, 0.5], abs=1e-6)


def test_gray_entropy_of_flat_two_level_and_uniform_images():
    values = score("gray_entropy", torch.cat([flat(0.2), flat(1.0), checkerboard()]))
    assert values.tolist() == pytest.approx([0.0, 0.0, 1.0], abs=1e-6)
    # Every 8-bit level exactly 64 times: a perfectly uniform histogram, exactly 8 bits.
    exact = (torch.arange(128 * 128) % 256).float().div(255).view(1, 1, 128, 128).expand(1, 3, -1, -1)
    assert score("gray_entropy", exact.contiguous()).item() == pytest.approx(8.0, abs=1e-6)
    uniform = torch.rand(1, 1, 128, 128, generator=torch.Generator().manual_seed(1)).expand(1, 3, -1, -1)
    assert 7.95 < score("gray_entropy", uniform.contiguous()).item() <= 8.0
