"""Per-reward advantages (spec §3) and the weighted-sum baseline's scalar reward (spec §7).

One pure function maps a rollout batch's rewards to advantages, one column per reward:

    A_k = (R_k − μ_k(group)) / (σ_k + eps)

* μ_k(group): mean of R_k over the valid images of the same prompt group in this batch;
* σ_k: population std (ddof = 0) of R_k over all valid images of the batch ("global", the authors'
  code) or over the valid images of the same group ("group", the paper's wording);
* NaN means "this reward does not apply to this sample": NaN in → NaN out, and NaN never enters μ or σ.

Everything is vectorized over the batch with ``index_add_`` (no Python loop over samples or rewards).
Statistics are computed in float64 and the result is cast back to the rewards' dtype.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

STD_MODES = ("global", "group")


# ---- validation ---------------------------------------------------------------------------------

def _check_rewards(rewards: Tensor) -> None:
    if not isinstance(rewards, Tensor):
        raise ValueError(f"rewards must be a torch.Tensor of shape [B] or [B, K]; got {type(rewards).__name__}")
    if rewards.ndim not in (1, 2):
        raise ValueError(f"rewards must have shape [B] or [B, K]; got shape {tuple(rewards.shape)}")
    if not rewards.is_floating_point():
        raise ValueError(f"rewards must be a floating-point tensor (NaN = not applicable); got {rewards.dtype}")
    if torch.isinf(rewards).any():
        bad = sorted({int(k) for k in torch.nonzero(torch.isinf(rewards.reshape(rewards.shape[0], -1)))[:, 1]})
        raise ValueError(f"rewards must be finite or NaN (not applicable); found ±inf in column(s) {bad}")


def _check_groups(groups: Tensor, batch_size: int) -> None:
    if not isinstance(groups, Tensor):
        raise ValueError(f"groups must be a torch.Tensor of shape [B]; got {type(groups).__name__}")
    if groups.dtype.is_floating_point or groups.dtype.is_complex or groups.dtype == torch.bool:
        raise ValueError(f"groups must be an integer tensor of prompt-group ids; got {groups.dtype}")
    if tuple(groups.shape) != (batch_size,):
        raise ValueError(f"groups must have shape [B] = ({batch_size},) to match rewards; "
                         f"got shape {tuple(groups.shape)}")


# ---- per-reward advantages ------------------------------------------------------------------------

def _group_sums(values: Tensor, group_index: Tensor, num_groups: int) -> Tensor:
    """Σ over each group of ``values`` [B, K] → [G, K]."""
    out = torch.zeros(num_groups, values.shape[1], dtype=values.dtype, device=values.device)
    return out.index_add_(0, group_index, values)


def _global_std(x: Tensor, valid: Tensor) -> Tensor:
    """σ_k over all valid entries of the batch, ddof = 0 → [1, K] (NaN for a column with no valid entry)."""
    count = valid.sum(0, keepdim=True).to(x.dtype)
    mean = x.sum(0, keepdim=True) / count
    sq = torch.where(valid, (x - mean) ** 2, torch.zeros_like(x))
    return torch.sqrt(sq.sum(0, keepdim=True) / count)


def _group_std(x: Tensor, valid: Tensor, mu: Tensor, group_index: Tensor, count: Tensor) -> Tensor:
    """σ_k(group) over the valid entries of each sample's group, ddof = 0 → [B, K]."""
    sq = torch.where(valid, (x - mu) ** 2, torch.zeros_like(x))
    var = _group_sums(sq, group_index, count.shape[0]) / count
    return torch.sqrt(var)[group_index]


def per_reward_advantages(rewards: Tensor, groups: Tensor, std_mode: str = "global",
                          eps: float = 1e-4) -> Tensor:
    """A_k = (R_k − μ_k(group)) / (σ_k + eps) for each reward column k separately (spec §3).

    Args:
        rewards: [B, K] (or [B], treated as K = 1 and returned as [B]) float; NaN = not applicable.
        groups: [B] integer prompt-group ids (any values; images of one prompt share an id).
        std_mode: "global" (σ_k over all valid images of the batch, the authors' code) or
            "group" (σ_k over the valid images of the sample's group).
        eps: added to σ_k (spec: 1e-4).

    Returns:
        Advantages with the shape and dtype of ``rewards``; NaN exactly where ``rewards`` is NaN.
        A column with no valid value is all NaN. A group with a single valid image gets A = 0 there.
    """
    if std_mode not in STD_MODES:
        raise ValueError(f"std_mode={std_mode!r}: valid choices: {', '.join(STD_MODES)}")
    if not (isinstance(eps, (int, float)) and eps > 0):
        raise ValueError(f"eps={eps!r}: must be a number > 0")
    _check_rewards(rewards)
    _check_groups(groups, rewards.shape[0])

    squeeze = rewards.ndim == 1
    r = rewards.unsqueeze(1) if squeeze else rewards
    x64 = r.to(torch.float64)
    valid = ~torch.isnan(x64)                                    # [B, K]
    x = torch.where(valid, x64, torch.zeros_like(x64))           # NaN → 0, kept out by `valid`
    _, group_index = torch.unique(groups, return_inverse=True)   # ids → 0..G-1
    num_groups = int(group_index.max()) + 1 if group_index.numel() else 0

    count = _group_sums(valid.to(x.dtype), group_index, num_groups)     # [G, K] valid images per group
    mu = (_group_sums(x, group_index, num_groups) / count)[group_index]  # [B, K] μ_k(group)
    if std_mode == "global":
        sigma = _global_std(x, valid)
    else:
        sigma = _group_std(x, valid, mu, group_index, count)
    adv = (x64 - mu) / (sigma + eps)                             # NaN rewards stay NaN
    adv = adv.to(rewards.dtype)
    return adv.squeeze(1) if squeeze else adv


# ---- baselines and combination ------------------------------------------------------------------

def _weights_tensor(weights: Sequence[float] | Tensor, num_rewards: int, like: Tensor, name: str) -> Tensor:
    w = torch.as_tensor(weights, dtype=torch.float64, device=like.device).reshape(-1)
    if w.numel() != num_rewards:
        raise ValueError(f"{name} must have one entry per reward (K = {num_rewards}); got {w.numel()}")
    if not torch.isfinite(w).all() or (w < 0).any():
        raise ValueError(f"{name} must be finite and >= 0; got {w.tolist()}")
    return w


def weighted_sum_rewards(rewards: Tensor, weights: Sequence[float] | Tensor) -> Tensor:
    """The weighted-sum baseline's scalar reward (spec §7), a NaN-aware weighted mean per sample:

        R_i = Σ_k w_k R_ik / Σ_k w_k   over the rewards k valid (non-NaN) for sample i.

    Args:
        rewards: [B, K] float, NaN = not applicable.
        weights: [K] w_k >= 0.

    Returns:
        [B] in the rewards' dtype; NaN where no reward applies or the applicable weights sum to 0.
    """
    _check_rewards(rewards)
    if rewards.ndim != 2:
        raise ValueError(f"rewards must have shape [B, K]; got shape {tuple(rewards.shape)}")
    w = _weights_tensor(weights, rewards.shape[1], rewards, "weights")
    x = rewards.to(torch.float64)
    valid = ~torch.isnan(x)
    w_valid = torch.where(valid, w.expand_as(x), torch.zeros_like(x))    # [B, K]
    num = (w_valid * torch.where(valid, x, torch.zeros_like(x))).sum(1)
    den = w_valid.sum(1)
    out = torch.where(den > 0, num / den.clamp_min(torch.finfo(torch.float64).tiny),
                      torch.full_like(num, float("nan")))
    return out.to(rewards.dtype)


def combine_advantages(advantages: Tensor, alpha: Sequence[float] | Tensor) -> Tensor:
    """Ā = Σ_k ᾱ_k · A_k with NaN → 0 (spec §5, the amortized step's single advantage).

    Args:
        advantages: [B, K] per-reward advantages (NaN = not applicable).
        alpha: [K] coefficients ᾱ (on the simplex for the scalarization equivalence to hold).

    Returns:
        [B] in the advantages' dtype. A sample for which no reward applies gets 0; the caller decides
        whether to mask it out of the loss (``torch.isnan(advantages).all(1)``).
    """
    _check_rewards(advantages)
    if advantages.ndim != 2:
        raise ValueError(f"advantages must have shape [B, K]; got shape {tuple(advantages.shape)}")
    a = _weights_tensor(alpha, advantages.shape[1], advantages, "alpha")
    x = torch.nan_to_num(advantages.to(torch.float64), nan=0.0)
    return (x @ a).to(advantages.dtype)
