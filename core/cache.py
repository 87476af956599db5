"""Where local model weights live (torch-free: the web process uses it to list available models)."""

from __future__ import annotations

import os
from pathlib import Path


def hf_cache_dir() -> str:
    """The Hugging Face hub cache, read from the environment at call time (HF_HUB_CACHE, HF_HOME)."""
    if os.environ.get("HF_HUB_CACHE"):
        return os.environ["HF_HUB_CACHE"]
    home = os.environ.get("HF_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "huggingface")
    return os.path.join(home, "hub")


BUILT_IN_MODELS = ("tiny", "mini-world")
"""The models core.models builds or ships (its ``register_model`` names; a test keeps the two equal), named here so
torch-free callers (the web form's preflight) can tell them from paths and repo ids."""


def model_available(name: str) -> bool:
    """True when ``name`` is a local folder or a repo id with a snapshot in the local HF cache."""
    if Path(name).expanduser().exists():
        return True
    folder = Path(hf_cache_dir()) / ("models--" + name.replace("/", "--")) / "snapshots"
    return folder.is_dir() and any(folder.iterdir())


def cached_repos() -> list[str]:
    """Repo ids ("org/name") with a snapshot in the local Hugging Face cache, sorted."""
    root = Path(hf_cache_dir())
    if not root.is_dir():
        return []
    out = []
    for d in root.glob("models--*--*"):
        snaps = d / "snapshots"
        if snaps.is_dir() and any(snaps.iterdir()):
            out.append(d.name[len("models--"):].replace("--", "/", 1))
    return sorted(out)
