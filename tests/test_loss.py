"""The DiffusionNFT loss (spec §2) and the per-reward / combined objectives (§4-§5)."""

import math

import pytest
import torch

from core.loss import (advantage_to_r, amortized_objective, combine_r, combined_objective, kl_loss, nft_loss,
                       nft_loss_terms, nft_policy_loss, per_reward_objectives)


def _tensors(seed=0, b=3):
    g = torch.Generator().manual_seed(seed)
    shape = (b, 4, 2, 2)
    x0, eps, v_old = (torch.randn(shape, generator=g) for _ in range(3))
    t = torch.rand(b, generator=g) * 0.9 + 0.05
    x_t = (1 - t.view(-1, 1, 1, 1)) * x0 + t.view(-1, 1, 1, 1) * eps
    v_theta = (v_old + 0.3 * torch.randn(shape, generator=g)).requires_grad_(True)
    return v_theta, v_old, x_t, x0, t


def test_advantage_to_r_clips_maps_and_keeps_nan():
    a = torch.tensor([-10.0, -5.0, 0.0, 2.5, 5.0, 10.0, math.nan])
    r = advantage_to_r(a, adv_clip_max=5.0)
    assert r[:6].tolist() == pytest.approx([0.0, 0.0, 0.5, 0.75, 1.0, 1.0])
    assert math.isnan(r[6])


def test_nft_loss_matches_the_formula_written_out_per_sample():
    v_theta, v_old, x_t, x0, t = _tensors()
    r = torch.tensor([0.9, 0.5, 0.1])
    beta, amax = 0.1, 5.0
    got = nft_loss(v_theta, v_old, x_t, x0, t, r, nft_beta=beta, adv_clip_max=amax)
    for i in range(3):
        vp = (1 - beta) * v_old[i] + beta * v_theta[i]
        vn = (1 + beta) * v_old[i] - beta * v_theta[i]
        ep = x_t[i] - t[i] * vp - x0[i]
        en = x_t[i] - t[i] * vn - x0[i]
        lp = (ep ** 2).mean() / max(ep.abs().mean().item(), 1e-5)
        ln = (en ** 2).mean() / max(en.abs().mean().item(), 1e-5)
        want = amax / beta * (r[i] * lp + (1 - r[i]) * ln)
        assert got[i].item() == pytest.approx(want.item(), rel=1e-5)


def test_adaptive_weights_are_detached():
    v_theta, v_old, x_t, x0, t = _tensors(b=1)
    l_pos, _ = nft_loss_terms(v_theta, v_old, x_t, x0, t, nft_beta=0.1)
    (grad,) = torch.autograd.grad(l_pos.sum(), v_theta)
    err = (x_t - t.view(-1, 1, 1, 1) * ((1 - 0.1) * v_old + 0.1 * v_theta) - x0).detach()
    w = err.abs().mean()
    expected = 2 * err * (-t.view(-1, 1, 1, 1) * 0.1) / (w * err.numel())
    assert torch.allclose(grad, expected, atol=1e-6)


def test_zero_advantage_gives_zero_gradient_when_policy_equals_old():
    # At v_θ = v_old, L⁺ and L⁻ move in opposite directions: r = 1/2 (A = 0) must not push.
    _, v_old, x_t, x0, t = _tensors()
    v_theta = v_old.clone().requires_grad_(True)
    loss = nft_loss(v_theta, v_old, x_t, x0, t, torch.full((3,), 0.5)).sum()
    (grad,) = torch.autograd.grad(loss, v_theta)
    assert grad.abs().max().item() < 1e-6
    # ...while a positive advantage pulls x̂0 = x_t − t·v_θ toward x0 (first-order decrease of its error).
    loss_pos = nft_loss(v_theta, v_old, x_t, x0, t, torch.ones(3)).sum()
    (g_pos,) = torch.autograd.grad(loss_pos, v_theta)
    step = v_theta.detach() - 1e-3 * g_pos
    err = lambda v: ((x_t - t.view(-1, 1, 1, 1) * v - x0) ** 2).sum()
    assert err(step) < err(v_theta.detach())


def test_kl_loss_is_per_sample_mean_square():
    a, b = torch.ones(2, 3, 2, 2), torch.zeros(2, 3, 2, 2)
    b[1] = 3.0
    assert kl_loss(a, b).tolist() == pytest.approx([1.0, 4.0])


def test_per_reward_objectives_are_masked_means():
    l_pos, l_neg = torch.tensor([1.0, 2.0, 3.0, 4.0]), torch.tensor([4.0, 3.0, 2.0, 1.0])
    r = torch.tensor([[1.0, 0.0], [0.0, math.nan], [0.5, math.nan], [0.25, 1.0]])
    got = per_reward_objectives(l_pos, l_neg, r, nft_beta=0.5, adv_clip_max=1.0)
    per_sample = lambda k: nft_policy_loss(l_pos, l_neg, torch.nan_to_num(r[:, k]), 0.5, 1.0)
    mask1 = torch.tensor([True, False, False, True])
    assert got[0].item() == pytest.approx(per_sample(0).mean().item())
    assert got[1].item() == pytest.approx(per_sample(1)[mask1].mean().item())


def test_combined_objective_is_the_alpha_weighted_sum_of_masked_losses_with_nan_and_clipping():
    g = torch.Generator().manual_seed(3)
    l_pos = torch.rand(6, generator=g).requires_grad_(True)
    l_neg = torch.rand(6, generator=g).requires_grad_(True)
    A = torch.randn(6, 3, generator=g) * 4  # some beyond the clip at 5
    A[0, 1] = A[3, 2] = A[4, 2] = math.nan
    r = advantage_to_r(A, 5.0)
    alpha = torch.tensor([0.2, 0.5, 0.3])
    combined = combined_objective(l_pos, l_neg, r, alpha, 0.1, 5.0)
    separate = (alpha * per_reward_objectives(l_pos, l_neg, r, 0.1, 5.0)).sum()
    assert combined.item() == pytest.approx(separate.item(), rel=1e-6)
    g1 = torch.autograd.grad(combined, (l_pos, l_neg), retain_graph=True)
    g2 = torch.autograd.grad(separate, (l_pos, l_neg))
    for a, b in zip(g1, g2):
        assert torch.allclose(a, b, atol=1e-6)


def test_combine_r_reduces_to_the_authors_combined_advantage_when_all_rewards_apply():
    # Proposition 1's form: r̃ = r(Σ_k α_k A_k) and uniform sample weights 1/B (no NaN, no clipping).
    g = torch.Generator().manual_seed(5)
    A = torch.randn(8, 4, generator=g)  # |A| < 5: nothing clipped
    alpha = torch.softmax(torch.randn(4, generator=g), 0)
    weight, r_tilde = combine_r(advantage_to_r(A, 5.0), alpha)
    assert torch.allclose(weight, torch.full((8,), 1 / 8))
    assert torch.allclose(r_tilde, advantage_to_r(A @ alpha, 5.0), atol=1e-6)


def test_a_sample_no_reward_applies_to_gets_zero_weight():
    r = torch.tensor([[0.7, math.nan], [math.nan, math.nan]])
    weight, r_tilde = combine_r(r, torch.tensor([0.5, 0.5]))
    assert weight[1].item() == 0.0 and r_tilde[1].item() == 0.5
    assert weight[0].item() == pytest.approx(0.5)


def _specialist_batch(seed=11):
    """8 samples, K = 3: a general reward (every sample) and two specialists valid on disjoint quarters / halves,
    with advantages large enough that some are clipped."""
    g = torch.Generator().manual_seed(seed)
    l_pos = torch.rand(8, generator=g).requires_grad_(True)
    l_neg = torch.rand(8, generator=g).requires_grad_(True)
    A = torch.randn(8, 3, generator=g) * 3
    A[:6, 1] = math.nan   # specialist 1 applies to 2 of 8 samples
    A[4:, 2] = math.nan   # specialist 2 applies to 4 of 8
    alpha = torch.tensor([0.2, 0.5, 0.3])
    return l_pos, l_neg, A, alpha


def test_masked_amortized_loss_is_the_alpha_weighted_sum_of_each_rewards_mean_over_its_own_samples():
    l_pos, l_neg, A, alpha = _specialist_batch()
    got = amortized_objective(l_pos, l_neg, A, alpha, "masked", 0.1, 5.0)
    direct = 0.0
    for k in range(3):  # written out: Σ_k α_k · mean over {i : A_ik valid} of ℓ(r(A_ik))
        rows = [i for i in range(8) if not math.isnan(A[i, k])]
        per = [nft_policy_loss(l_pos[i], l_neg[i], advantage_to_r(A[i, k], 5.0), 0.1, 5.0) for i in rows]
        direct = direct + alpha[k] * sum(per) / len(rows)
    assert got.item() == pytest.approx(direct.item(), rel=1e-6)
    g1 = torch.autograd.grad(got, (l_pos, l_neg))
    g2 = torch.autograd.grad(direct, (l_pos, l_neg))
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(g1, g2))


def test_authors_amortized_loss_is_one_nft_loss_on_the_nan_zeroed_combined_advantage_over_every_sample():
    l_pos, l_neg, A, alpha = _specialist_batch()
    got = amortized_objective(l_pos, l_neg, A, alpha, "authors", 0.1, 5.0)
    direct = 0.0
    for i in range(8):  # written out: mean_i ℓ(r(clip(Σ_k α_k · (A_ik or 0))))
        a_bar = sum(float(alpha[k]) * (0.0 if math.isnan(A[i, k]) else float(A[i, k])) for k in range(3))
        r = min(max(a_bar, -5.0), 5.0) / 10.0 + 0.5
        direct = direct + (5.0 / 0.1) * (r * l_pos[i] + (1 - r) * l_neg[i]) / 8
    assert got.item() == pytest.approx(direct.item(), rel=1e-6)
    # the two forms differ on specialists (each scaled by n_k/B in the authors' form) ...
    masked = amortized_objective(l_pos, l_neg, A, alpha, "masked", 0.1, 5.0)
    assert abs(masked.item() - got.item()) > 1e-3
    # ... and agree when every reward applies to every sample and nothing is clipped
    A_full = torch.randn(8, 3, generator=torch.Generator().manual_seed(2)).clamp(-1.5, 1.5)
    both = [amortized_objective(l_pos, l_neg, A_full, alpha, c, 0.1, 5.0).item() for c in ("masked", "authors")]
    assert both[0] == pytest.approx(both[1], rel=1e-6)


def test_an_unknown_combination_is_refused_by_name():
    l_pos, l_neg, A, alpha = _specialist_batch()
    with pytest.raises(ValueError, match="combination='mean': valid choices: masked, authors"):
        amortized_objective(l_pos, l_neg, A, alpha, "mean", 0.1, 5.0)
