"""Upper bounds on what a run may ask for, and an estimate of its memory, checked before anything is allocated.

Two layers:

- **Static bounds** (the ``MAX_*`` constants): checked by ``TrainConfig.validate()`` on every config, on
  any machine. They are generous — the paper's recipe (48 prompts x 24 images, 512 px, LoRA r=32) sits far
  inside them — and exist so that a typo such as ``prompts_per_step=100000`` or ``resolution=1048576`` is
  refused by name instead of growing the process until the machine swaps.
- **Memory estimate** (:func:`estimate_memory`, :func:`check_fits`): what one process of the run holds at its
  peak, compared with the memory of the device it will run on (the host's RAM for CPU runs, the GPU's memory
  for CUDA runs). It depends on the machine, so it is not part of ``validate()`` (a stored config must stay
  loadable on any machine); ``jobs.runner.submit`` (CLI and web form), ``core.train`` and the trainer call
  :func:`check_fits` before loading the model.

Torch-free (the web process imports this module).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any

MAX_PROMPTS_PER_STEP = 4096
MAX_IMAGES_PER_PROMPT = 256
MAX_BATCH = 16384
"""prompts_per_step x images_per_prompt per step (the paper: 48 x 24 = 1152 over 16 GPUs)."""
MAX_RESOLUTION = 2048
MAX_LORA_RANK = 1024
"""Above the width of every SD3 transformer (SD3.5 Large: 2432), a rank buys nothing."""
MAX_MICRO_BATCH = 4096
MAX_STEPS = 10_000_000
MAX_SEED = 2**63 - 1
"""torch.manual_seed and numpy take seeds up to 64 bits; 2**70 used to end in an OverflowError."""
MAX_THREADS = 1024
MAX_PREVIEW_PROMPTS = 64
"""Preview images rendered at each sample step: a strip needs a handful; each is a full sampling trajectory."""
MAX_REWARDS = 32
MAX_SOURCES = 64
MAX_LORA_TARGETS = 256
MAX_PROMPT_CHARS = 4096
"""One prompt's length. T5 reads at most 512 tokens (~2,000 characters); a longer prompt is cut by the
tokenizer anyway, and every sample row repeats its prompt (a megabyte prompt made 16 MB of events in 2 steps)."""
MAX_PROMPT_FILE_BYTES = 64 * 1024 * 1024
"""A prompt file is read whole; DiffusionNFT's largest prompt set is ~3 MB."""
MAX_RUN_NAME_CHARS = 200
"""The runs table's name column (jobs/schema.py: String(200))."""


def check_name(field: str, name: str, what: str = "a run name") -> None:
    """A name the pages and ``jobs list`` show: at most MAX_RUN_NAME_CHARS characters on one line, without the
    characters a page would read as markup. Raises ValueError naming the field, the value and the rule."""
    import unicodedata

    if len(name) > MAX_RUN_NAME_CHARS:
        raise ValueError(f"{field}={name[:40]!r}... ({len(name)} characters): {what} is at most "
                         f"{MAX_RUN_NAME_CHARS} characters")
    control = next((ch for ch in name if unicodedata.category(ch) in ("Cc", "Zl", "Zp")), None)
    if control is not None:
        raise ValueError(f"{field}={name[:60]!r}: {what} is one line of text; it contains {control!r} (no newlines, "
                         f"tabs or other control characters)")
    if "<" in name or ">" in name:
        raise ValueError(f"{field}={name[:60]!r}: {what} may not contain '<' or '>' (pages show names as text, "
                         f"and these would be read as HTML)")

GiB = 1024**3


@dataclass(frozen=True)
class ModelProfile:
    """What the estimate needs to know about a model without loading it."""

    params: float  # parameters of the whole pipeline (transformer, VAE, text encoders)
    latent_channels: int
    vae_factor: int  # pixels per latent cell
    patch: int  # transformer patch size (latent cells per token side)
    width: int  # transformer hidden size
    layers: int  # transformer blocks
    text_dim: int  # joint_attention_dim: width of the prompt embeddings
    vae_width: int  # channels of the VAE decoder at full resolution
    clip_tokens: int = 77


# Built-in models from their configs (core/models.py, core/assets/mini-world); any other name is taken to be
# SD3.5 Medium (the largest model a preset names): 2.5 B transformer + 4.7 B T5-XXL + 0.8 B CLIP + 84 M VAE.
PROFILES = {
    "tiny": ModelProfile(0.6e6, 4, 4, 2, 64, 2, 64, 32, 32),
    "mini-world": ModelProfile(1.6e6, 4, 4, 2, 96, 4, 64, 8, 32),
}
SD35_MEDIUM = ModelProfile(8.1e9, 16, 8, 2, 1536, 24, 4096, 128)
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def profile(model_name: str) -> ModelProfile:
    return PROFILES.get(model_name, SD35_MEDIUM)


def estimate_memory(config: Any, world_size: int = 1) -> dict[str, int]:
    """Peak bytes one process of the run holds, by part (a ``TrainConfig``; duck-typed to stay torch-free).

    B_p = ceil(B / world_size) samples per process, R the resolution, L the T5 budget, d the dtype's bytes:

    - ``weights``: the pipeline in its dtype, plus the LoRA (policy, old copy, grad, AdamW m and v in
      float32: 5 x 4 bytes x r x (in + out) on 8 projections per block).
    - ``rollout``: what a step keeps for all its B_p samples until the update: clean latents x0 (float32),
      decoded images (float32, 3 x R^2) and the prompt embeddings ((77 + L) x text_dim, dtype d).
    - ``sampling``: transient per sampler call of rollout_batch_size images (0 = all B_p): the VAE decoder's
      full-resolution activations (~3 live maps of vae_width x R^2) — the largest buffer of a rollout.
    - ``training``: one micro-batch's activations kept for backward: per block ~20 tensors of
      tokens x width (gradient checkpointing keeps ~2), tokens = image tokens + text tokens.

    A deliberately rough, conservative figure (an order of magnitude is what it must get right): it is
    compared with the device's total memory to refuse runs that cannot fit, not to pack runs tightly.
    """
    s, m, nft = config.sampling, config.model, config.nft
    p = profile(m.name)
    d = DTYPE_BYTES.get(m.dtype, 4)
    per_process = math.ceil(s.prompts_per_step * s.images_per_prompt / max(1, world_size))
    latent_side = s.resolution // p.vae_factor
    text_tokens = p.clip_tokens + s.max_sequence_length
    image_tokens = (latent_side // p.patch) ** 2
    lora = 8 * p.layers * m.lora_rank * 2 * p.width
    weights = int(_weights_bytes(m.name, p, d) + 5 * 4 * lora)
    per_sample = (p.latent_channels * latent_side**2 * 4 + 3 * s.resolution**2 * 4 + text_tokens * p.text_dim * d)
    chunk = min(s.rollout_batch_size or per_process, per_process)
    sampling = chunk * 3 * p.vae_width * s.resolution**2 * d
    kept_per_block = 2 if m.gradient_checkpointing else 20
    micro = min(nft.micro_batch_size, per_process)
    training = micro * p.layers * kept_per_block * (image_tokens + text_tokens) * p.width * d
    return {"weights": weights, "rollout": per_process * per_sample, "sampling": int(sampling),
            "training": int(training)}


def _weights_bytes(name: str, p: ModelProfile, d: int) -> float:
    """A built-in model: its parameter count. A local folder or cached repo: its safetensors files' size,
    taken as 16-bit on disk (x2 in float32). A repo id not cached here: SD3.5 Medium's count (the preset's
    model, downloaded later). Anything else names no model: 0 here, and the loader says what is missing."""
    from pathlib import Path

    from core.cache import hf_cache_dir

    if name in PROFILES:
        return p.params * d
    folder = Path(name).expanduser()
    if not folder.is_dir():
        folder = Path(hf_cache_dir()) / ("models--" + name.replace("/", "--")) / "snapshots"
    if folder.is_dir():
        size = sum(f.stat().st_size for f in folder.rglob("*.safetensors") if f.is_file())
        if size:
            return size * d / 2
    return p.params * d if name.count("/") == 1 and not name.startswith((".", "/", "~")) else 0.0


# The field to lower when a part is too big, and what to say about it.
_CULPRIT = {
    "weights": ("model.name", "the model's weights"),
    "rollout": ("sampling.prompts_per_step", "the rollout kept for the update (prompts_per_step x "
                                             "images_per_prompt samples of latents, images and embeddings)"),
    "sampling": ("sampling.rollout_batch_size", "one sampler call's VAE decode (rollout_batch_size images; "
                                                "0 = the whole batch)"),
    "training": ("nft.micro_batch_size", "one micro-batch's activations for backward"),
}


def check_fits(config: Any, available_bytes: int, where: str, world_size: int = 1) -> None:
    """Raise ``ConfigError`` naming the field to lower when the estimate exceeds ``available_bytes``."""
    from core.config import ConfigError

    parts = estimate_memory(config, world_size)
    total = sum(parts.values())
    if total <= available_bytes:
        return
    part = max(parts, key=parts.get)
    field, what = _CULPRIT[part]
    node: Any = config
    for attr in field.split("."):
        node = getattr(node, attr)
    breakdown = ", ".join(f"{k} {v / GiB:.1f}" for k, v in parts.items())
    per = f" per process ({world_size} processes)" if world_size > 1 else ""
    raise ConfigError(field, node, f"the run would need ~{total / GiB:.1f} GiB{per}, more than the "
                                   f"{available_bytes / GiB:.1f} GiB of {where} (GiB: {breakdown}); the "
                                   f"largest part is {what}: lower it (or resolution, or the batch)")


def host_memory_bytes() -> int:
    """Total physical RAM of this machine (not the free amount, which moves: the figure must be stable)."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):  # not POSIX: do not guess
        return 1 << 62


def gpu_likely_present() -> bool:
    """Torch-free guess whether device "auto" will pick CUDA here (an NVIDIA device node is visible)."""
    if os.environ.get("CUDA_VISIBLE_DEVICES", None) in ("", "-1"):
        return False
    return os.path.exists("/dev/nvidia0") or os.path.exists("/proc/driver/nvidia/version")


def check_fits_host(config: Any, world_size: int = 1) -> None:
    """The check the queue can do without torch: CPU runs (device cpu, or auto on a host without a GPU)
    against this host's RAM. CUDA runs are checked by the trainer against the GPU before loading."""
    device = config.model.device
    if device == "cpu" or (device == "auto" and not gpu_likely_present()):
        check_fits(config, host_memory_bytes(), "this machine's RAM", world_size)


def check_prompt(text: str, where: str) -> None:
    """Refuse an over-long prompt, naming where it came from."""
    if len(text) > MAX_PROMPT_CHARS:
        raise ValueError(f"{where}: a prompt of {len(text)} characters is longer than the limit of "
                         f"{MAX_PROMPT_CHARS} (T5 reads ~2,000 characters; every sample row repeats its prompt)")
