"""The DiffusionNFT loss (MARBLE_SPEC §2) and the per-reward / combined objectives built on it (§4-§5).

Per sample the policy loss is ``a + r·b`` with a = (A_max/β)·L⁻ and b = (A_max/β)·(L⁺ − L⁻): affine in
the optimality weight r, and L± do not depend on the advantage. That structure is what lets K per-reward
objectives share one forward pass and lets a single backward give their α-weighted sum (§5).
"""

from __future__ import annotations

import torch

from core.config import AMORTIZED_COMBINATIONS


def advantage_to_r(advantages: torch.Tensor, adv_clip_max: float = 5.0) -> torch.Tensor:
    """Optimality weight r = clip(A, -A_max, A_max) / (2·A_max) + 1/2, in [0, 1]. NaN stays NaN."""
    return advantages.clamp(-adv_clip_max, adv_clip_max) / (2.0 * adv_clip_max) + 0.5


def _per_sample_mean(x: torch.Tensor) -> torch.Tensor:
    return x.flatten(1).mean(dim=1)


def nft_loss_terms(v_theta: torch.Tensor, v_old: torch.Tensor, x_t: torch.Tensor, x0: torch.Tensor,
                   t: torch.Tensor, nft_beta: float = 0.1) -> tuple[torch.Tensor, torch.Tensor]:
    """(L⁺, L⁻), each [B]: adaptive-weighted x0-space errors of the implicit positive/negative policies.

    v± = (1∓β)·v_old ± β·v_θ; x̂0± = x_t − t·v±; w± = max(mean|x̂0± − x0|, 1e-5) detached;
    L± = mean((x̂0± − x0)²) / w±. Shapes: v_*, x_t, x0 [B, C, h, w]; t [B] (σ in (0, 1]).
    """
    t = t.reshape(-1, *([1] * (x_t.dim() - 1)))
    v_pos = (1.0 - nft_beta) * v_old + nft_beta * v_theta
    v_neg = (1.0 + nft_beta) * v_old - nft_beta * v_theta
    terms = []
    for v in (v_pos, v_neg):
        err = (x_t - t * v) - x0  # x̂0 − x0
        w = _per_sample_mean(err.detach().abs()).clamp(min=1e-5)
        terms.append(_per_sample_mean(err ** 2) / w)
    return terms[0], terms[1]


def nft_policy_loss(l_pos: torch.Tensor, l_neg: torch.Tensor, r: torch.Tensor, nft_beta: float = 0.1,
                    adv_clip_max: float = 5.0) -> torch.Tensor:
    """ℓ = (A_max/β)·[r·L⁺ + (1 − r)·L⁻], per sample [B] (no KL)."""
    return (adv_clip_max / nft_beta) * (r * l_pos + (1.0 - r) * l_neg)


def nft_loss(v_theta: torch.Tensor, v_old: torch.Tensor, x_t: torch.Tensor, x0: torch.Tensor, t: torch.Tensor,
             r: torch.Tensor, nft_beta: float = 0.1, adv_clip_max: float = 5.0) -> torch.Tensor:
    """The per-sample DiffusionNFT policy loss [B] exactly as in spec §2 (x0-space, no KL)."""
    l_pos, l_neg = nft_loss_terms(v_theta, v_old, x_t, x0, t, nft_beta)
    return nft_policy_loss(l_pos, l_neg, r, nft_beta, adv_clip_max)


def kl_loss(v_theta: torch.Tensor, v_ref: torch.Tensor) -> torch.Tensor:
    """Per-sample mean((v_θ − v_ref)²) [B]; multiply by λ_KL (``kl_coef``)."""
    return _per_sample_mean((v_theta - v_ref) ** 2)


def per_reward_objectives(l_pos: torch.Tensor, l_neg: torch.Tensor, r: torch.Tensor, nft_beta: float,
                          adv_clip_max: float) -> torch.Tensor:
    """ℓ_k for each reward, [K]: the NFT loss with r_k, masked mean over the samples where reward k
    applies (r NaN = not applicable). A reward with no valid sample gives 0 (its gradient is zero, and
    the balancer excludes it). Shapes: l_pos, l_neg [B]; r [B, K]."""
    valid = torch.isfinite(r)
    r0 = torch.where(valid, r, torch.zeros_like(r))
    losses = nft_policy_loss(l_pos[:, None], l_neg[:, None], r0, nft_beta, adv_clip_max)  # [B, K]
    counts = valid.sum(dim=0)
    return (losses * valid).sum(dim=0) / counts.clamp(min=1)


def combine_r(r: torch.Tensor, alpha: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One (weight, r̃) per sample such that Σ_i w_i·ℓ(r̃_i) = Σ_k α_k·ℓ_k exactly (§5, amortized step).

    w_i = Σ_k α_k·m_ik/n_k and r̃_i = Σ_k α_k·m_ik·r_ik/(n_k·w_i), with m the validity mask and n_k the
    number of valid samples of reward k. Because ℓ is affine in r, one backward through this single
    objective is the α-weighted sum of the K masked per-reward gradients, with NaN rewards and clipped
    advantages. When every reward applies to every sample, w_i = 1/B and r̃_i = r(Σ_k α_k·A_ik) — the
    authors' combined advantage Ā (Proposition 1). Shapes: r [B, K]; alpha [K] -> ([B], [B]).
    """
    valid = torch.isfinite(r)
    counts = valid.sum(dim=0).clamp(min=1).to(r.dtype)
    coef = alpha.to(r.dtype)[None, :] * valid / counts[None, :]  # [B, K]
    weight = coef.sum(dim=1)
    r_sum = (coef * torch.where(valid, r, torch.zeros_like(r))).sum(dim=1)
    r_tilde = torch.where(weight > 0, r_sum / weight.clamp(min=1e-30), torch.full_like(weight, 0.5))
    return weight, r_tilde


def combined_objective(l_pos: torch.Tensor, l_neg: torch.Tensor, r: torch.Tensor, alpha: torch.Tensor,
                       nft_beta: float, adv_clip_max: float) -> torch.Tensor:
    """Scalar Σ_i w_i·ℓ(r̃_i) = Σ_k α_k·ℓ_k: the amortized step's objective, one backward."""
    weight, r_tilde = combine_r(r, alpha)
    return (weight * nft_policy_loss(l_pos, l_neg, r_tilde, nft_beta, adv_clip_max)).sum()


def authors_combined_r(advantages: torch.Tensor, alpha: torch.Tensor, adv_clip_max: float) -> torch.Tensor:
    """r(Ā) per sample [B] with Ā = Σ_k α_k·nan_to_num(A_k): the authors' amortized advantage (their train.py
    combines the NaN-zeroed per-reward advantages, then clips). Averaged over all B samples, reward k's
    part of the loss weighs n_k/B of what the masked form gives it. Shapes: advantages [B, K]; alpha [K]."""
    a_bar = (torch.nan_to_num(advantages, nan=0.0) * alpha.to(advantages.dtype)[None, :]).sum(dim=1)
    return advantage_to_r(a_bar, adv_clip_max)


def amortized_objective(l_pos: torch.Tensor, l_neg: torch.Tensor, advantages: torch.Tensor, alpha: torch.Tensor,
                        combination: str, nft_beta: float, adv_clip_max: float) -> torch.Tensor:
    """The scalar loss of an amortized unit, one backward (spec §5), in one of two combinations:

    - "masked": Σ_k α_k·ℓ_k, each ℓ_k the NFT loss with r_k averaged over the n_k samples where reward k
      applies (:func:`combined_objective`) — exactly the α-weighted sum of the per-reward objectives the
      QP balanced;
    - "authors": mean_i ℓ(r(Σ_k α_k·nan_to_num(A_ik))) over all B samples, as the release computes it.

    Both are equal when every reward applies to every sample and no combined advantage is clipped.
    Shapes: l_pos, l_neg [B]; advantages [B, K] (NaN = not applicable); alpha [K]."""
    if combination == "masked":
        return combined_objective(l_pos, l_neg, advantage_to_r(advantages, adv_clip_max), alpha, nft_beta,
                                  adv_clip_max)
    if combination == "authors":
        r_bar = authors_combined_r(advantages, alpha, adv_clip_max)
        return nft_policy_loss(l_pos, l_neg, r_bar, nft_beta, adv_clip_max).mean()
    raise ValueError(f"combination={combination!r}: valid choices: {', '.join(AMORTIZED_COMBINATIONS)}")
