"""One validated training configuration that travels form -> stored JSON -> worker -> core.

Every field is documented where it is declared. ``TrainConfig.validate()`` (run by ``__post_init__``)
checks each rule and raises :class:`ConfigError` naming the field, the bad value and the valid choices.
Symbols in comments refer to ../shared/MARBLE_SPEC.md.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from core import limits

SAMPLER_SIGMAS = ("scheduler",)
SAMPLERS = ("euler", "dpm2")  # core.sampling.SAMPLERS
STD_MODES = ("global", "group")
HARMONIZE_SCOPES = ("first_microbatch", "step")
AMORTIZED_COMBINATIONS = ("masked", "authors")
GRADIENT_PATHS = ("per_sample", "per_reward")
DTYPES = ("float32", "bfloat16", "float16")
TRACKERS = ("wandb", "tensorboard", "trackio", "mlflow")  # report_to: mirrored by jobs/trackers.py
LORA_TARGETS_SD3 = (
    "attn.to_q",
    "attn.to_k",
    "attn.to_v",
    "attn.to_out.0",
    "attn.add_q_proj",
    "attn.add_k_proj",
    "attn.add_v_proj",
    "attn.to_add_out",
)


MAX_LR = 1.0
"""The largest learning rate a config accepts: far above any LoRA recipe (1e-4 to 1e-3), below what diverges on
the first step (lr 1e9 turned the weights to NaN, which surfaced only as a reward's 'images contain NaN')."""


class ConfigError(ValueError):
    """A configuration value breaks a rule. The message names field, value and valid choices."""

    def __init__(self, field_name: str, value: Any, rule: str):
        self.field = field_name
        self.value = value
        self.rule = rule
        shown = repr(value)
        if len(shown) > 120:  # a megabyte value must not become a megabyte message
            shown = f"{shown[:100]}... ({len(shown)} characters)"
        super().__init__(f"{field_name}={shown}: {rule}")


def _require(ok: bool, field_name: str, value: Any, rule: str) -> None:
    if not ok:
        raise ConfigError(field_name, value, rule)


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(float(x))


@dataclass
class ModelConfig:
    """Which SD3-family pipeline to train and how its LoRA adapter is shaped."""

    name: str = "tiny"
    """A registered model name (``core.models.available_models()``), a local diffusers folder,
    or a Hugging Face repo id that is already in the local cache (nothing is downloaded)."""
    lora_rank: int = 4
    """LoRA rank r (the paper: 32)."""
    lora_alpha: float = 8.0
    """LoRA alpha (the paper: 64); the adapter's scale is alpha / rank."""
    lora_targets: list[str] = field(default_factory=lambda: list(LORA_TARGETS_SD3))
    """Transformer sub-modules that get a LoRA adapter (the paper: the attention projections)."""
    dtype: str = "float32"
    """Weights' dtype for the frozen base model. The LoRA parameters always train in float32."""
    device: str = "auto"
    """"auto" (CUDA when available, else CPU), "cpu", "cuda" or "cuda:N"."""
    gradient_checkpointing: bool = False
    """Recompute the transformer blocks' activations in the backward pass of v_θ: less memory, ~30% more
    compute. The gradients are the same (tests/test_sd35_path.py)."""

    def validate(self, prefix: str = "model") -> None:
        _require(isinstance(self.name, str) and self.name.strip() != "", f"{prefix}.name", self.name,
                 "must be a model name, a local folder or a cached Hugging Face repo id")
        _require(_is_int(self.lora_rank) and 1 <= self.lora_rank <= limits.MAX_LORA_RANK, f"{prefix}.lora_rank",
                 self.lora_rank, f"must be an integer in [1, {limits.MAX_LORA_RANK}]")
        _require(_is_number(self.lora_alpha) and self.lora_alpha > 0, f"{prefix}.lora_alpha",
                 self.lora_alpha, "must be a number > 0")
        _require(isinstance(self.lora_targets, list) and 0 < len(self.lora_targets) <= limits.MAX_LORA_TARGETS
                 and all(isinstance(t, str) and t for t in self.lora_targets),
                 f"{prefix}.lora_targets", self.lora_targets, "must be a non-empty list of module names")
        _require(self.dtype in DTYPES, f"{prefix}.dtype", self.dtype, f"valid choices: {', '.join(DTYPES)}")
        _require(isinstance(self.device, str) and (self.device in ("auto", "cpu", "cuda")
                                                   or self.device.startswith("cuda:")),
                 f"{prefix}.device", self.device, "valid choices: auto, cpu, cuda, cuda:N")
        _require(isinstance(self.gradient_checkpointing, bool), f"{prefix}.gradient_checkpointing",
                 self.gradient_checkpointing, "must be true or false")


@dataclass
class PromptConfig:
    """Where prompts come from. Each step draws ``prompts_per_step`` prompts, stratified across sources."""

    sources: list[str] = field(default_factory=lambda: ["tiny"])
    """Registered prompt sources (``core.prompts.available_sources()``) or ``file:PATH`` (.txt, one prompt
    a line, or .jsonl with a "prompt" key and metadata, or a DiffusionNFT-style folder with train/test files).
    Several sources are sampled in equal shares."""
    split: str = "train"
    """Which split of each source to draw from: "train" or "test"."""

    def validate(self, prefix: str = "prompts") -> None:
        _require(isinstance(self.sources, list) and 0 < len(self.sources) <= limits.MAX_SOURCES
                 and all(isinstance(s, str) and s for s in self.sources),
                 f"{prefix}.sources", self.sources, "must be a non-empty list of prompt source names")
        _require(len(set(self.sources)) == len(self.sources), f"{prefix}.sources", self.sources,
                 "must not name a source twice")
        from core.prompts import validate_source_name

        for s in self.sources:
            err = validate_source_name(s)
            _require(err is None, f"{prefix}.sources", s, err or "")
        _require(self.split in ("train", "test"), f"{prefix}.split", self.split, "valid choices: train, test")


@dataclass
class SamplingConfig:
    """Rollouts: deterministic flow-matching sampling with the pipeline's scheduler."""

    num_steps: int = 10
    """Denoising steps per rollout (the paper: 25). Also the grid of training timesteps (spec §2)."""
    sampler: str = "euler"
    """Rollout ODE solver: "euler" (the pipeline's flow-matching scheduler) or "dpm2" (deterministic second-order
    DPM-Solver++ on flow sigmas, the authors' rollouts; its σ grid is also the training timesteps)."""
    guidance_scale: float = 1.0
    """Classifier-free guidance. The authors' rollouts are CFG-free (1.0)."""
    resolution: int = 64
    """Image height and width in pixels; must be a multiple of the VAE factor times the patch size."""
    prompts_per_step: int = 4
    """Distinct prompts per training step (the paper: 48)."""
    images_per_prompt: int = 4
    """Group size: images per prompt, the group for the per-prompt mean (the paper: 24)."""
    max_sequence_length: int = 8
    """T5 token budget (DiffusionNFT: 128). A pipeline without T5 pads this many zero tokens: keep it
    small there (each one costs attention time and carries nothing)."""
    rollout_batch_size: int = 0
    """Images generated per sampler call (0 = the whole batch at once). Bounds rollout memory on large
    models; each image depends only on its own seed either way."""

    @property
    def batch_size(self) -> int:
        return self.prompts_per_step * self.images_per_prompt

    def validate(self, prefix: str = "sampling") -> None:
        _require(_is_int(self.num_steps) and 2 <= self.num_steps <= 1000, f"{prefix}.num_steps",
                 self.num_steps, "must be an integer in [2, 1000]")
        _require(self.sampler in SAMPLERS, f"{prefix}.sampler", self.sampler, f"valid choices: {', '.join(SAMPLERS)}")
        _require(_is_number(self.guidance_scale) and self.guidance_scale >= 1.0, f"{prefix}.guidance_scale",
                 self.guidance_scale, "must be a number >= 1.0 (1.0 = no guidance)")
        _require(_is_int(self.resolution) and 16 <= self.resolution <= limits.MAX_RESOLUTION
                 and self.resolution % 16 == 0, f"{prefix}.resolution", self.resolution,
                 f"must be a multiple of 16 in [16, {limits.MAX_RESOLUTION}]")
        _require(_is_int(self.prompts_per_step) and 1 <= self.prompts_per_step <= limits.MAX_PROMPTS_PER_STEP,
                 f"{prefix}.prompts_per_step", self.prompts_per_step,
                 f"must be an integer in [1, {limits.MAX_PROMPTS_PER_STEP}]")
        _require(_is_int(self.images_per_prompt) and 2 <= self.images_per_prompt <= limits.MAX_IMAGES_PER_PROMPT,
                 f"{prefix}.images_per_prompt", self.images_per_prompt,
                 f"must be an integer in [2, {limits.MAX_IMAGES_PER_PROMPT}] (a group of one has no advantage)")
        _require(self.batch_size <= limits.MAX_BATCH, f"{prefix}.prompts_per_step", self.prompts_per_step,
                 f"prompts_per_step x images_per_prompt = {self.batch_size} images a step; the limit is "
                 f"{limits.MAX_BATCH}")
        _require(_is_int(self.max_sequence_length) and 1 <= self.max_sequence_length <= 512,
                 f"{prefix}.max_sequence_length", self.max_sequence_length, "must be an integer in [1, 512]")
        _require(_is_int(self.rollout_batch_size) and 0 <= self.rollout_batch_size <= limits.MAX_BATCH,
                 f"{prefix}.rollout_batch_size", self.rollout_batch_size,
                 f"must be an integer in [0, {limits.MAX_BATCH}] (0 = the whole batch at once)")


@dataclass
class NFTConfig:
    """The DiffusionNFT loss (spec §2). Two different "betas": ``nft_beta`` and ``kl_coef``."""

    nft_beta: float = 0.1
    """β, the NFT strength in v± = (1∓β)·v_old ± β·v_θ."""
    adv_clip_max: float = 5.0
    """A_max: advantages are clipped to [-A_max, A_max]; the loss is scaled by A_max/β."""
    kl_coef: float = 1e-4
    """λ_KL on mean((v_θ - v_ref)²), v_ref from the base model with adapters disabled. 0 disables it."""
    timestep_fraction: float = 0.99
    """Share of the sampler's timestep grid each sample trains on (a random permutation per sample)."""
    micro_batch_size: int = 16
    """Samples per forward/backward pass; a step accumulates over micro-batches and timesteps."""
    old_decay_rate: float = 0.001
    """Old adapter soft update θ_old ← η·θ_old + (1-η)·θ with η = min(old_decay_rate·step, old_decay_max)."""
    old_decay_max: float = 0.95

    def validate(self, prefix: str = "nft") -> None:
        _require(_is_number(self.nft_beta) and 0 < self.nft_beta <= 1, f"{prefix}.nft_beta", self.nft_beta,
                 "must be a number in (0, 1]")
        _require(_is_number(self.adv_clip_max) and self.adv_clip_max > 0, f"{prefix}.adv_clip_max",
                 self.adv_clip_max, "must be a number > 0")
        _require(_is_number(self.kl_coef) and self.kl_coef >= 0, f"{prefix}.kl_coef", self.kl_coef,
                 "must be a number >= 0")
        _require(_is_number(self.timestep_fraction) and 0 < self.timestep_fraction <= 1,
                 f"{prefix}.timestep_fraction", self.timestep_fraction, "must be a number in (0, 1]")
        _require(_is_int(self.micro_batch_size) and 1 <= self.micro_batch_size <= limits.MAX_MICRO_BATCH,
                 f"{prefix}.micro_batch_size", self.micro_batch_size,
                 f"must be an integer in [1, {limits.MAX_MICRO_BATCH}]")
        _require(_is_number(self.old_decay_rate) and self.old_decay_rate >= 0, f"{prefix}.old_decay_rate",
                 self.old_decay_rate, "must be a number >= 0")
        _require(_is_number(self.old_decay_max) and 0 <= self.old_decay_max < 1, f"{prefix}.old_decay_max",
                 self.old_decay_max, "must be a number in [0, 1)")


@dataclass
class RewardConfig:
    """One reward model. ``weight`` only matters for the weighted-sum strategy."""

    name: str
    """A registered reward (``core.rewards.available_rewards()``)."""
    weight: float = 1.0
    """w_k in the weighted-sum baseline's scalar reward Σ w_k R_k."""
    kwargs: dict = field(default_factory=dict)
    """Extra arguments for the reward's factory (e.g. a local model path)."""

    def validate(self, prefix: str) -> None:
        from core.rewards import available_rewards

        names = sorted(available_rewards())
        _require(self.name in names, f"{prefix}.name", self.name, f"valid choices: {', '.join(names)}")
        _require(_is_number(self.weight) and self.weight >= 0, f"{prefix}.weight", self.weight,
                 "must be a number >= 0")
        _require(isinstance(self.kwargs, dict), f"{prefix}.kwargs", self.kwargs, "must be a JSON object")


@dataclass
class StageConfig:
    """One stage of the sequential baseline: train on ``rewards`` for ``steps`` steps."""

    rewards: list[str]
    steps: int
    sources: list[str] = field(default_factory=list)
    """The prompt sources this stage draws from (a subset of prompts.sources; empty = every source of the run).
    DiffusionNFT's staged training draws each stage's prompts from its rewards' own data: a specialist's stage
    on prompts it applies to, not ¾ of images that carry no signal for it."""


@dataclass
class BalanceConfig:
    """How the K per-reward signals become one update (spec §4-§7)."""

    strategy: str = "marble"
    """A registered balancer (``core.balancing.available_balancers()``): marble, marble_full, weighted_sum,
    equal, single, sequential, and extras."""
    harmonize_every: int = 10
    """N: a harmonized step (per-reward gradients and the min-norm QP) every N steps, amortized steps in
    between."""  # the spec's "full step"; ``refresh_every`` before 2026-12 (RENAMED: old configs still load)
    warmup_steps: int = 1
    """The first steps, each a harmonized step that harmonizes every unit (as the authors' code does)."""
    ema_rho: float = 0.7
    """ρ in ᾱ(t) = ρ·ᾱ(t−1) + (1−ρ)·α∗(t); 0 disables the EMA."""
    normalize: bool = True
    """Normalize the per-reward gradients before the QP (the method fails without it; kept for ablation)."""
    harmonize_scope: str = "first_microbatch"  # ``refresh_scope`` before 2026-12
    """Which part of a harmonized step is harmonized: "first_microbatch" (the authors' code: the rest of the
    step is amortized with the fresh ᾱ) or "step" (every micro-batch of the step)."""
    diagnose_every: int = 10
    """M: per-reward gradient diagnostics every M steps for any strategy (0 = only on harmonized steps)."""
    amortized_combination: str = "masked"
    """How an amortized unit combines the K rewards into one loss (docs/faithfulness.md). "masked": Σ_k ᾱ_k·ℓ_k
    with each ℓ_k the masked mean over the samples reward k applies to — the α the QP chose, applied as it
    chose it. "authors": the release's one NFT loss on Ā = Σ_k ᾱ_k·nan_to_num(A_k), averaged over every
    sample, which scales each specialist by its share n_k/B of the batch."""
    gradients: str = "per_sample"
    """How a harmonized or diagnostic unit gets its K per-reward gradients (core/per_sample.py).
    "per_sample": two backward passes give every sample's LoRA gradient for L⁺ and L⁻, and each g_k is their
    masked, r-weighted mean — the same gradients for any K at the cost of ~2 backward passes; falls back to
    "per_reward" (and says so) when a unit's per-sample gradients would not fit in memory. "per_reward": one
    backward pass per reward (K)."""
    reward_groups: dict[str, list[str]] = field(default_factory=dict)
    """The release's pareto.reward_groups (off by default): the QP balances groups, each group's gradient the
    mean of its members' (e.g. {"general": ["pickscore", "hpsv2", "clipscore"]}); a member's α is its group's
    α divided by the group's size. Rewards in no group stand alone."""
    group_weights: dict[str, float] = field(default_factory=dict)
    """The release's pareto.reward_weights (off by default): a weight per group or lone reward (default 1)
    multiplying its normalized gradient before the QP, which changes the hull the min-norm point is taken on."""
    alpha_floor: float = 0.0
    """The release's pareto.alpha_floor (off by default): the QP's lower bound on each α (capped at 1/M for M
    groups and lone rewards)."""
    reward_dropout: dict[str, float] = field(default_factory=dict)
    """The release's pareto.reward_dropout_targets/prob (off by default): reward → probability that, on a unit,
    the reward is dropped from the samples where a reward outside this table applies (its signal kept only on
    the samples no non-target reward covers). Drawn per (seed, step, timestep) and recorded in the events."""
    reward_dropout_warmup_steps: int = 0
    """Linear ramp of the dropout probabilities from 0 over this many steps (0 = constant)."""
    single_reward: str | None = None
    """For strategy "single": the one reward that trains."""
    stages: list[StageConfig] = field(default_factory=list)
    """For strategy "sequential": the schedule of stages; the last stage continues after its steps."""

    def validate(self, reward_names: list[str], prefix: str = "balance") -> None:
        from core.balancing import available_balancers

        names = sorted(available_balancers())
        _require(self.strategy in names, f"{prefix}.strategy", self.strategy, f"valid choices: {', '.join(names)}")
        _require(_is_int(self.harmonize_every) and self.harmonize_every >= 1, f"{prefix}.harmonize_every",
                 self.harmonize_every, "must be an integer >= 1")
        _require(_is_int(self.warmup_steps) and self.warmup_steps >= 0, f"{prefix}.warmup_steps",
                 self.warmup_steps, "must be an integer >= 0")
        _require(_is_number(self.ema_rho) and 0 <= self.ema_rho < 1, f"{prefix}.ema_rho", self.ema_rho,
                 "must be a number in [0, 1)")
        _require(isinstance(self.normalize, bool), f"{prefix}.normalize", self.normalize, "must be true or false")
        _require(self.harmonize_scope in HARMONIZE_SCOPES, f"{prefix}.harmonize_scope", self.harmonize_scope,
                 f"valid choices: {', '.join(HARMONIZE_SCOPES)}")
        _require(_is_int(self.diagnose_every) and self.diagnose_every >= 0, f"{prefix}.diagnose_every",
                 self.diagnose_every, "must be an integer >= 0")
        _require(self.amortized_combination in AMORTIZED_COMBINATIONS, f"{prefix}.amortized_combination",
                 self.amortized_combination, f"valid choices: {', '.join(AMORTIZED_COMBINATIONS)}")
        _require(self.gradients in GRADIENT_PATHS, f"{prefix}.gradients", self.gradients,
                 f"valid choices: {', '.join(GRADIENT_PATHS)}")
        _validate_balance_knobs(self, reward_names, prefix)
        if self.strategy == "single":
            _require(self.single_reward in reward_names, f"{prefix}.single_reward", self.single_reward,
                     f"strategy 'single' needs one of the run's rewards: {', '.join(reward_names)}")
        if self.strategy == "sequential":
            _require(len(self.stages) > 0, f"{prefix}.stages", self.stages,
                     "strategy 'sequential' needs at least one stage")
        for i, st in enumerate(self.stages):
            _require(isinstance(st.rewards, list) and len(st.rewards) > 0
                     and all(r in reward_names for r in st.rewards),
                     f"{prefix}.stages[{i}].rewards", st.rewards,
                     f"must be a non-empty subset of the run's rewards: {', '.join(reward_names)}")
            _require(_is_int(st.steps) and st.steps >= 1, f"{prefix}.stages[{i}].steps", st.steps,
                     "must be an integer >= 1")


def _validate_balance_knobs(self: "BalanceConfig", reward_names: list[str], prefix: str) -> None:
    """The release's optional knobs: groups, group weights, α floor, reward dropout."""
    groups = self.reward_groups
    _require(isinstance(groups, dict) and all(isinstance(g, str) and g and isinstance(m, list) and len(m) >= 1
                                              for g, m in groups.items()),
             f"{prefix}.reward_groups", groups, "must map group names to non-empty lists of reward names")
    seen: list[str] = []
    for g, members in groups.items():
        _require(all(r in reward_names for r in members), f"{prefix}.reward_groups.{g}", members,
                 f"must list the run's rewards: {', '.join(reward_names)}")
        _require(not set(members) & set(seen) and len(set(members)) == len(members), f"{prefix}.reward_groups.{g}",
                 members, "a reward may belong to one group, once")
        _require(g not in reward_names, f"{prefix}.reward_groups", g, "a group may not be named like a reward")
        seen += members
    units = list(groups) + [r for r in reward_names if r not in seen]
    w = self.group_weights
    _require(isinstance(w, dict) and all(k in units and _is_number(v) and v > 0 for k, v in w.items()),
             f"{prefix}.group_weights", w, f"must map groups or lone rewards ({', '.join(units)}) to numbers > 0")
    _require(_is_number(self.alpha_floor) and 0 <= self.alpha_floor <= 1, f"{prefix}.alpha_floor", self.alpha_floor,
             "must be a number in [0, 1] (it is capped at 1/M for M groups and lone rewards)")
    d = self.reward_dropout
    _require(isinstance(d, dict) and all(k in reward_names and _is_number(v) and 0 <= v <= 1 for k, v in d.items()),
             f"{prefix}.reward_dropout", d, f"must map rewards ({', '.join(reward_names)}) to probabilities in [0, 1]")
    _require(_is_int(self.reward_dropout_warmup_steps) and self.reward_dropout_warmup_steps >= 0,
             f"{prefix}.reward_dropout_warmup_steps", self.reward_dropout_warmup_steps, "must be an integer >= 0")


@dataclass
class AdvantageConfig:
    """Per-reward advantages A_k = (R_k - μ_k(prompt)) / (σ_k + eps) (spec §3)."""

    std_mode: str = "global"
    """"global": σ over all valid images of the batch (the authors' code); "group": σ per prompt group."""
    eps: float = 1e-4

    def validate(self, prefix: str = "advantage") -> None:
        _require(self.std_mode in STD_MODES, f"{prefix}.std_mode", self.std_mode,
                 f"valid choices: {', '.join(STD_MODES)}")
        _require(_is_number(self.eps) and self.eps > 0, f"{prefix}.eps", self.eps, "must be a number > 0")


@dataclass
class OptimConfig:
    """AdamW on the LoRA parameters (spec §8)."""

    lr: float = 3e-4
    beta1: float = 0.9
    beta2: float = 0.999
    weight_decay: float = 1e-4
    eps: float = 1e-8
    grad_clip: float = 1.0
    """Max global gradient norm; 0 disables clipping."""
    ema_decay: float = 0.9
    """Decay of the LoRA parameter EMA (the release: train.ema with ema_decay 0.9); its weights are saved in each
    checkpoint's ema/ folder and are what evaluation, Compare and core.sample load by default. The decay
    warms up as min((1 + k)/(10 + k), ema_decay) at optimizer step k, as the release's EMAModuleWrapper does.
    0 disables the EMA."""

    def validate(self, prefix: str = "optim") -> None:
        _require(_is_number(self.lr) and 0 < self.lr <= MAX_LR, f"{prefix}.lr", self.lr,
                 f"must be a number in (0, {MAX_LR:g}] (LoRA fine-tuning uses about 1e-4 to 1e-3; the paper 3e-4)")
        for name in ("beta1", "beta2"):
            v = getattr(self, name)
            _require(_is_number(v) and 0 <= v < 1, f"{prefix}.{name}", v, "must be a number in [0, 1)")
        _require(_is_number(self.weight_decay) and self.weight_decay >= 0, f"{prefix}.weight_decay",
                 self.weight_decay, "must be a number >= 0")
        _require(_is_number(self.eps) and self.eps > 0, f"{prefix}.eps", self.eps, "must be a number > 0")
        _require(_is_number(self.ema_decay) and 0 <= self.ema_decay < 1, f"{prefix}.ema_decay", self.ema_decay,
                 "must be a number in [0, 1) (0 = no parameter EMA)")
        _require(_is_number(self.grad_clip) and self.grad_clip >= 0, f"{prefix}.grad_clip", self.grad_clip,
                 "must be a number >= 0 (0 = no clipping)")


def _default_rewards() -> list[RewardConfig]:
    return [RewardConfig("jpeg_compressibility"), RewardConfig("colorfulness"), RewardConfig("brightness")]


@dataclass
class TrainConfig:
    """A whole training run. JSON round-trip with :meth:`to_json` / :meth:`from_json`."""

    model: ModelConfig = field(default_factory=ModelConfig)
    prompts: PromptConfig = field(default_factory=PromptConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    nft: NFTConfig = field(default_factory=NFTConfig)
    rewards: list[RewardConfig] = field(default_factory=_default_rewards)
    balance: BalanceConfig = field(default_factory=BalanceConfig)
    advantage: AdvantageConfig = field(default_factory=AdvantageConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    steps: int = 20
    """Training steps; one step = one rollout batch and one optimizer update."""
    seed: int = 0
    """Every random draw of step s derives from (seed, s), so a resumed run repeats an uninterrupted one."""
    checkpoint_every: int = 10
    """Save a checkpoint every this many steps (and always at the end); 0 = only at the end."""
    sample_every: int = 10
    """Record the rollout images of every this many steps as sample events (0 = never)."""
    preview_prompts: int = 4
    """At every sample step, also render this many fixed preview prompts (held-out prompts of the run's sources
    in turn, seeds 0, 1, ...: the same in every run) with the rollout policy, so the Dashboard's progression
    strip shows one prompt and one noise across training (0 = none)."""
    num_threads: int = 0
    """torch CPU threads (0 = torch's default)."""
    report_to: list[str] = field(default_factory=list)
    """Experiment trackers that mirror the run's scalars and samples, any of wandb, tensorboard, trackio, mlflow
    (none by default; each needs its package: pip install -r requirements-trackers.txt). A tracker that fails
    is logged once and never stops training."""

    def __post_init__(self) -> None:
        self.validate()

    @property
    def reward_names(self) -> list[str]:
        return [r.name for r in self.rewards]

    def validate(self) -> None:
        self.model.validate()
        self.prompts.validate()
        self.sampling.validate()
        self.nft.validate()
        B, m = self.sampling.batch_size, self.nft.micro_batch_size
        _require(B % m == 0, "nft.micro_batch_size", m,
                 f"micro-batches must be of equal size (a smaller last one would weigh its samples more): the "
                 f"batch of {B} samples ({self.sampling.prompts_per_step} prompts × {self.sampling.images_per_prompt} "
                 f"images) splits evenly into micro-batches of {', '.join(map(str, _divisors(B)))}")
        _require(isinstance(self.rewards, list) and 1 <= len(self.rewards) <= limits.MAX_REWARDS, "rewards",
                 self.rewards, f"needs between 1 and {limits.MAX_REWARDS} rewards")
        for i, r in enumerate(self.rewards):
            r.validate(f"rewards[{i}]")
        names = self.reward_names
        dupes = sorted({n for n in names if names.count(n) > 1})
        _require(not dupes, "rewards", names, f"each reward may appear once; repeated: {', '.join(dupes)}")
        if self.balance.strategy == "weighted_sum":
            _require(sum(r.weight for r in self.rewards) > 0, "rewards[*].weight",
                     [r.weight for r in self.rewards], "weighted_sum needs at least one weight > 0")
        self.balance.validate(names)
        for i, st in enumerate(self.balance.stages):
            _require(isinstance(st.sources, list) and len(set(st.sources)) == len(st.sources)
                     and all(src in self.prompts.sources for src in st.sources),
                     f"balance.stages[{i}].sources", st.sources,
                     f"must be distinct sources of the run (prompts.sources: {', '.join(self.prompts.sources)}); "
                     f"empty = all of them")
        self.advantage.validate()
        self.optim.validate()
        _require(_is_int(self.steps) and 1 <= self.steps <= limits.MAX_STEPS, "steps", self.steps,
                 f"must be an integer in [1, {limits.MAX_STEPS}]")
        _require(_is_int(self.seed) and 0 <= self.seed <= limits.MAX_SEED, "seed", self.seed,
                 "must be an integer in [0, 2**63 - 1]")
        _require(_is_int(self.checkpoint_every) and self.checkpoint_every >= 0, "checkpoint_every",
                 self.checkpoint_every, "must be an integer >= 0")
        _require(_is_int(self.sample_every) and self.sample_every >= 0, "sample_every", self.sample_every,
                 "must be an integer >= 0")
        _require(_is_int(self.preview_prompts) and 0 <= self.preview_prompts <= limits.MAX_PREVIEW_PROMPTS,
                 "preview_prompts", self.preview_prompts,
                 f"must be an integer in [0, {limits.MAX_PREVIEW_PROMPTS}] (0 = no preview images)")
        _require(_is_int(self.num_threads) and 0 <= self.num_threads <= limits.MAX_THREADS, "num_threads",
                 self.num_threads, f"must be an integer in [0, {limits.MAX_THREADS}] (0 = torch's default)")
        _require(isinstance(self.report_to, list) and all(t in TRACKERS for t in self.report_to)
                 and len(set(self.report_to)) == len(self.report_to), "report_to", self.report_to,
                 f"must be a list of distinct trackers; valid choices: {', '.join(TRACKERS)}")

    # ---- serialization -------------------------------------------------------------------------
    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent, sort_keys=False)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "TrainConfig":
        return _build(cls, data, "")

    @classmethod
    def from_json(cls, text: str) -> "TrainConfig":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError("<json>", text[:60], f"is not valid JSON ({e})") from None
        return cls.from_dict(data)

    @classmethod
    def load(cls, path: str | Path) -> "TrainConfig":
        """The config in a JSON file; a path that is no readable file is a ValueError naming it (not an OSError
        traceback)."""
        p = Path(path)
        if p.is_dir():
            raise ConfigError("--config", str(path), "is a folder; give a TrainConfig JSON file (a run folder's "
                                                     "config.json)")
        try:
            text = p.read_text()
        except FileNotFoundError:
            raise ConfigError("--config", str(path), "no such file") from None
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError("--config", str(path), f"cannot be read ({type(e).__name__})") from None
        try:
            return cls.from_json(text)
        except ConfigError as e:
            if e.field == "<json>":
                raise ConfigError("--config", str(path), "is not valid JSON") from None
            raise

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json() + "\n")

    def with_overrides(self, overrides: Mapping[str, Any] | list[str]) -> "TrainConfig":
        """A copy with dotted-key overrides: ``{"balance.ema_rho": 0.5}`` or ``["balance.ema_rho=0.5"]``.

        String values are parsed as JSON when they are valid JSON (numbers, true/false, lists), else kept
        as strings.
        """
        if isinstance(overrides, list):
            parsed = {}
            for item in overrides:
                if "=" not in item:
                    raise ConfigError("--set", item, "must look like key=value, e.g. balance.ema_rho=0.5")
                k, v = item.split("=", 1)
                parsed[k.strip()] = _parse_value(v)
            overrides = parsed
        data = self.to_dict()
        for key, value in overrides.items():
            _set_dotted(data, key, value)
        return TrainConfig.from_dict(data)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _parse_value(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def _set_dotted(data: dict, key: str, value: Any) -> None:
    parts = key.split(".")
    node: Any = data
    for i, part in enumerate(parts):
        last = i == len(parts) - 1
        if isinstance(node, list):
            if not part.isdigit() or int(part) >= len(node):
                raise ConfigError(key, value, f"'{part}' is not an index of a list of {len(node)}")
            part_key: Any = int(part)
        else:
            if not isinstance(node, dict):  # balance.ema_rho.x: a number has no fields
                raise ConfigError(key, value, f"'{'.'.join(parts[:i])}' is a value, not a section: it has no "
                                              f"field '{part}'")
            if part not in node and part in _OLD_NAMES and isinstance(node, dict) and _OLD_NAMES[part] in node:
                part = _OLD_NAMES[part]  # an old field name (e.g. balance.refresh_every) sets the renamed field
            if part not in node:
                valid = ", ".join(sorted(node)) if isinstance(node, dict) else "none"
                raise ConfigError(key, value, f"unknown key '{part}'; valid keys here: {valid}")
            part_key = part
        if last:
            node[part_key] = value
        else:
            node = node[part_key]


# Fields renamed since runs were first stored: {dataclass: {old name: new name}}. Stored configs (the database,
# run folders, config files) keep loading; a config naming both the old and the new field is refused.
RENAMED = {"BalanceConfig": {"refresh_every": "harmonize_every", "refresh_scope": "harmonize_scope"}}
_OLD_NAMES = {old: new for names in RENAMED.values() for old, new in names.items()}


def _renamed(cls: type, data: Mapping[str, Any], prefix: str) -> dict[str, Any]:
    out = dict(data)
    for old, new in RENAMED.get(cls.__name__, {}).items():
        if old in out:
            if new in out:
                raise ConfigError(f"{prefix + '.' if prefix else ''}{old}", out[old],
                                  f"is the old name of {new}, which is also given; keep only {new}")
            out[new] = out.pop(old)
    return out


def _build(cls: type, data: Any, prefix: str) -> Any:
    """Build a (nested) dataclass from plain JSON data, rejecting unknown keys by name."""
    name = prefix or "config"
    if not isinstance(data, Mapping):
        raise ConfigError(name, data, "must be a JSON object")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields) - set(RENAMED.get(cls.__name__, {})))
    if unknown:
        raise ConfigError(f"{prefix + '.' if prefix else ''}{unknown[0]}", data[unknown[0]],
                          f"unknown key; valid keys: {', '.join(fields)}")
    kwargs = {}
    for key, value in _renamed(cls, data, prefix).items():
        f = fields[key]
        sub = f"{prefix}.{key}" if prefix else key
        kwargs[key] = _convert(f.type, value, sub)
    if cls is TrainConfig:
        return cls(**kwargs)
    try:
        return cls(**kwargs)
    except TypeError as e:  # a required field is missing
        raise ConfigError(name, dict(data), f"incomplete: {e}") from None


_NESTED = {
    "ModelConfig": ModelConfig,
    "PromptConfig": PromptConfig,
    "SamplingConfig": SamplingConfig,
    "NFTConfig": NFTConfig,
    "BalanceConfig": BalanceConfig,
    "AdvantageConfig": AdvantageConfig,
    "OptimConfig": OptimConfig,
}


def _convert(type_str: Any, value: Any, prefix: str) -> Any:
    t = str(type_str)
    if t in _NESTED:
        return _build(_NESTED[t], value, prefix)
    if t == "list[RewardConfig]":
        if not isinstance(value, list):
            raise ConfigError(prefix, value, "must be a list of {name, weight, kwargs} objects")
        return [_build(RewardConfig, v if not isinstance(v, str) else {"name": v}, f"{prefix}[{i}]")
                for i, v in enumerate(value)]
    if t == "list[StageConfig]":
        if not isinstance(value, list):
            raise ConfigError(prefix, value, "must be a list of {rewards, steps} objects")
        return [_build(StageConfig, v, f"{prefix}[{i}]") for i, v in enumerate(value)]
    if t == "float" and _is_int(value):
        return float(value)
    return copy.deepcopy(value)


# ---- presets live in core/presets.py; their names stay importable from here -------------------------

_PRESET_NAMES = ("PAPER_GPUS", "PAPER_TRAINING_REWARDS", "sd35m_paper", "MINI_WORLD_SOURCES", "MINI_WORLD_REWARDS",
                 "MINI_WORLD_STEPS", "mini_world", "PRESETS", "available_presets", "preset")


def __getattr__(name: str) -> Any:
    """``from core.config import preset`` (and the other preset names) keeps working: they are loaded from
    core.presets on first use, which imports this module, so the import is lazy."""
    if name in _PRESET_NAMES:
        from core import presets

        return getattr(presets, name)
    raise AttributeError(f"module 'core.config' has no attribute {name!r}")
