"""Replay: re-solve the balancing coefficients offline from a run's stored Gram matrices.

Every full or diagnostic step stores the cosine matrix and the gradient norms of the K per-reward
gradients, i.e. the Gram matrix G_ij = cos_ij·‖g_i‖·‖g_j‖. Feeding those to the real MARBLE balancer
with another ρ, N or normalization shows what ᾱ would have been — no model needed. (The gradients
themselves would have changed with other coefficients; replay answers "what would the balancer have
decided on these gradients", which is what an ablation of ρ/N/normalization is about.)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from core.balancing import make_balancer
from core.config import BalanceConfig


@dataclass
class ReplayResult:
    steps: list[int]
    recorded: list[list[float]]  # [T][K] the run's stored ᾱ at each stored step
    replayed: list[list[float]]  # [T][K] ᾱ under the replay settings
    solves: list[int]  # steps at which the replay solved the QP


def gram_from_row(row: dict, reward_names: Sequence[str]) -> np.ndarray:
    """G_ij = cos_ij·n_i·n_j; an invalid gradient (no cosine or norm) becomes a zero row and column."""
    names = row["cosine"]["names"]
    index = [names.index(n) for n in reward_names]
    norms = np.array([_num((row.get("grad_norms") or {}).get(n)) for n in reward_names])
    cos = np.array([[_num(row["cosine"]["matrix"][i][j]) for j in index] for i in index])
    valid = np.isfinite(norms) & np.isfinite(np.diag(cos)) & (norms > 0)
    norms = np.where(valid, norms, 0.0)
    cos = np.where(np.outer(valid, valid), np.nan_to_num(cos), 0.0)
    return cos * np.outer(norms, norms)


def replay(rows: Sequence[dict], reward_names: Sequence[str], ema_rho: float, harmonize_every: int,
           normalize: bool = True, alpha_floor: float = 0.0, reward_groups: dict | None = None,
           group_weights: dict | None = None) -> ReplayResult:
    """Run the MARBLE balancer over the stored rows (steps are the runs' 1-based steps), optionally with the
    release's knobs: an α floor, reward groups and per-group weights (BalanceConfig documents each)."""
    config = BalanceConfig(strategy="marble", ema_rho=ema_rho, harmonize_every=harmonize_every, warmup_steps=1,
                           normalize=normalize, alpha_floor=alpha_floor, reward_groups=dict(reward_groups or {}),
                           group_weights=dict(group_weights or {}))
    config.validate(list(reward_names))
    balancer = make_balancer("marble", list(reward_names), config, None)
    steps, recorded, replayed, solves = [], [], [], []
    for row in sorted((r for r in rows if r.get("cosine")), key=lambda r: r["step"]):
        step = int(row["step"])
        if balancer.harmonizes(step - 1):
            balancer.balance(gram_from_row(row, reward_names), step - 1)
            solves.append(step)
        steps.append(step)
        recorded.append([_num((row.get("alpha_ema") or {}).get(n)) for n in reward_names])
        replayed.append([float(a) for a in balancer.advantage_weights(step - 1)])
    return ReplayResult(steps, recorded, replayed, solves)


def _num(x) -> float:
    return float(x) if isinstance(x, (int, float)) and math.isfinite(x) else float("nan")
