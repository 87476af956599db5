"""Small event records that training emits; the job layer (or the CLI) subscribes and persists them.

Every event serializes to one JSON object with an ``"event"`` key (events.jsonl). NaN becomes null.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, ClassVar


def _json_safe(x: Any) -> Any:
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: _json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_json_safe(v) for v in x]
    return x


@dataclass
class Event:
    kind: ClassVar[str] = "event"

    def to_dict(self) -> dict:
        return {"event": self.kind, **_json_safe(dataclasses.asdict(self))}


@dataclass
class StartEvent(Event):
    kind: ClassVar[str] = "start"
    step: int  # steps already done (0, or the resumed checkpoint's step)
    total_steps: int
    reward_names: list[str]
    strategy: str
    trainable_parameters: int
    device: str  # rank 0's device under torchrun
    resumed_from: str | None = None
    world_size: int = 1  # processes training together (torchrun); 1 = a plain single-process run


@dataclass
class StepEvent(Event):
    """One optimizer step. ``step`` counts completed updates (1-based)."""

    kind: ClassVar[str] = "step"
    step: int
    rewards: dict[str, float]  # mean raw reward over the samples where it applies
    alpha: dict[str, float]  # coefficient applied on the (amortized part of the) step
    seconds: float
    loss: float
    kl: float
    grad_norm: float
    phase: str  # "harmonized", "diagnostic", or "amortized"
    valid_counts: dict[str, int] = field(default_factory=dict)
    reward_std: dict[str, float] = field(default_factory=dict)
    stage: int | None = None  # sequential strategy: the current stage


@dataclass
class BalanceEvent(Event):
    """Per-reward gradient diagnostics (every harmonized step, and every M-th step for any strategy)."""

    kind: ClassVar[str] = "balance"
    step: int
    alpha_raw: dict[str, float]
    alpha_ema: dict[str, float]
    cosine: dict[str, Any]  # {"names": [...], "matrix": [[...]]}; null where a gradient is invalid
    cos_to_update: dict[str, float]  # cos(g_k, the update this step applied)
    grad_norms: dict[str, float]
    valid: dict[str, bool]
    solver: str
    phase: str  # "harmonized" or "diagnostic"
    update_norm: float = float("nan")
    solve_seconds: float = 0.0
    dropped: list[str] = field(default_factory=list)  # rewards dropped on this unit (balance.reward_dropout)
    cos_to_mean: dict[str, float] = field(default_factory=dict)  # cos(g_k, (1/K)·Σ_j g_j), the paper's Fig. S2
    gradients: str = "per_reward"  # how the g_k were formed: "per_sample" (2 backward passes) or "per_reward" (K)
    # which samples drive the worst conflict (per-sample path only; empty otherwise): {pair: [k, l], cosine,
    # timestep_index, scope, samples: [{prompt, source, seed, sigma, share}]}, the shares summing to the cosine;
    # measured on the unit the diagnostics describe, or on the last unit of a step solved whole (scope "unit")
    # (core.per_sample.conflict_attribution)
    attribution: dict = field(default_factory=dict)


@dataclass
class SampleEvent(Event):
    kind: ClassVar[str] = "samples"
    step: int
    items: list[dict]  # {prompt, source, seed, path (relative to the run folder), rewards, advantages}


@dataclass
class PreviewEvent(Event):
    """The fixed preview prompts (TrainConfig.preview_prompts) rendered at a sample step: the same prompt and
    seed at every step, so a strip of them shows what training did to one image."""
    kind: ClassVar[str] = "previews"
    step: int
    items: list[dict]  # {prompt, source, seed, path (relative to the run folder), rewards}


@dataclass
class CheckpointEvent(Event):
    kind: ClassVar[str] = "checkpoint"
    step: int
    path: str


@dataclass
class NoticeEvent(Event):
    """Something the user should know that is not a failure, e.g. a damaged checkpoint skipped on resume."""
    kind: ClassVar[str] = "notice"
    step: int
    message: str


@dataclass
class EndEvent(Event):
    kind: ClassVar[str] = "end"
    step: int
    status: str  # "completed" or "stopped"
    seconds: float
