"""Shared builders for the tests: small, fast configurations of the tiny model, and scripts/ as modules."""

import importlib.util
from pathlib import Path
from types import ModuleType

from core.config import TrainConfig, preset

REPO = Path(__file__).resolve().parents[1]


def small_config(strategy: str = "marble", steps: int = 3, **overrides) -> TrainConfig:
    """The tiny preset shrunk to seconds per step: 2 prompts x 4 images, 4 denoising steps."""
    sets = {
        "steps": steps,
        "sampling.num_steps": 4,
        "sampling.prompts_per_step": 2,
        "sampling.images_per_prompt": 4,
        "nft.micro_batch_size": 4,
        "checkpoint_every": 0,
        "sample_every": 0,
        "balance.strategy": strategy,
        "num_threads": 1,
    }
    if strategy == "single":
        sets["balance.single_reward"] = "colorfulness"
    if strategy == "sequential":
        sets["balance.stages"] = [{"rewards": ["colorfulness"], "steps": 1},
                                  {"rewards": ["jpeg_compressibility", "brightness"], "steps": 1}]
    sets.update(overrides)
    return preset("tiny").with_overrides(sets)


def load_script(name: str) -> ModuleType:
    """A file of scripts/ (not a package) imported as a module, e.g. ``load_script("gpu_check")``."""
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
