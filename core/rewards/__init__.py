"""Rewards: one signature, registered by name (STYLE.md principle 6).

    images [B, 3, H, W] in [0, 1] + B prompts + B metadata dicts -> float32 [B] on the CPU, NaN = n/a

Importing this package registers the built-in rewards and stays light (no torch, no model
libraries): the web process imports it to list reward names. Rewards with heavy dependencies import
them inside their factory.
"""

from core.rewards.base import Reward, available_rewards, make_reward, register_reward
from core.rewards import image_stats  # noqa: F401,E402  (registers the weight-free rewards)
# model-based rewards (weights from a local path or the HF cache) and the HTTP reward
from core.rewards import clip_rewards, geneval, imagereward, remote  # noqa: F401,E402
# the built-in mini world's analytic rewards and the offline OCR reward (rapidocr, imported lazily)
from core.rewards import ocr, world, world_quality  # noqa: F401,E402

EXTERNAL_REWARDS = ("aesthetic", "clipscore", "geneval", "hpsv2", "imagereward", "pickscore", "remote")
"""Rewards that need model weights (local path / HF cache) or a server: they cannot be built offline from
their defaults alone (tests/test_reward_models.py and tests/test_remote_reward.py build them on tiny models)."""

__all__ = ["EXTERNAL_REWARDS", "Reward", "available_rewards", "make_reward", "register_reward"]
