"""Per-sample gradients (core/per_sample.py): every per-reward gradient from two backward passes equals
the K-backward path's, in float64 on the tiny SD3 transformer with its LoRA."""

import math

import numpy as np

import pytest
import torch

from core.config import ModelConfig
from core.loss import nft_loss_terms, per_reward_objectives
from core.models import Policy, build_tiny_pipeline
from core.per_sample import (PerSampleGradients, conflict_attribution, jacobian_bytes, per_reward_gradients,
                             reward_mixing)

BETA, A_MAX = 0.1, 5.0


def _r_matrix(b: int, k: int, seed: int) -> torch.Tensor:
    """Optimality weights [b, K] with the awkward cases: NaN-masked specialists (uneven validity), a
    reward valid on one sample only, values at the clip (r = 0 or 1) and one reward valid nowhere."""
    g = torch.Generator().manual_seed(seed)
    r = torch.rand(b, k, generator=g, dtype=torch.float64)
    r[0, 0], r[1, 0] = 1.0, 0.0  # clipped advantages
    for j in range(1, k):
        keep = torch.rand(b, generator=g) < (0.3 + 0.6 * j / k)
        r[~keep, j] = math.nan
    if k >= 3:
        r[:, 2] = math.nan
        r[b // 2, 2] = 0.8  # valid on one sample
    if k >= 8:
        r[:, 7] = math.nan  # valid nowhere: a zero gradient
    return r


@pytest.mark.parametrize("k", [1, 2, 4, 8])
def test_reward_mixing_reproduces_the_masked_per_reward_objectives(k):
    b = 6
    r = _r_matrix(b, k, seed=k)
    l_pos = torch.rand(b, dtype=torch.float64) + 0.1
    l_neg = torch.rand(b, dtype=torch.float64) + 0.1
    W = reward_mixing(r, BETA, A_MAX)
    assert W.shape == (k, 2 * b)
    direct = per_reward_objectives(l_pos, l_neg, r, BETA, A_MAX)
    torch.testing.assert_close(W @ torch.cat([l_pos, l_neg]), direct, rtol=1e-12, atol=1e-12)


@pytest.fixture(scope="module")
def tiny64():
    """The tiny SD3 transformer with the default LoRA, all in float64, θ moved off θ_old."""
    pipe = build_tiny_pipeline()
    policy = Policy(pipe, ModelConfig(name="tiny"), torch.device("cpu"), seed=0)
    policy.transformer.double()
    with torch.no_grad():
        for p in policy.parameters:
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(1), dtype=p.dtype))
    return policy


def _unit(policy, b: int, seed: int):
    """One unit's L⁺, L⁻ [b] through the real transformer, float64 (v_old from the frozen base)."""
    g = torch.Generator().manual_seed(seed)
    tr = policy.transformer
    x0 = torch.randn(b, 4, 16, 16, generator=g, dtype=torch.float64)
    noise = torch.randn(b, 4, 16, 16, generator=g, dtype=torch.float64)
    t = torch.rand(b, generator=g, dtype=torch.float64) * 0.8 + 0.1
    tb = t.view(-1, 1, 1, 1)
    x_t = (1 - tb) * x0 + tb * noise
    kwargs = dict(hidden_states=x_t, timestep=t * 1000.0,
                  encoder_hidden_states=torch.randn(b, 12, 64, generator=g, dtype=torch.float64),
                  pooled_projections=torch.randn(b, 64, generator=g, dtype=torch.float64), return_dict=False)
    with torch.no_grad():
        tr.disable_adapters()
        try:
            v_old = tr(**kwargs)[0]
        finally:
            tr.enable_adapters()
    v_theta = tr(**kwargs)[0]
    return nft_loss_terms(v_theta, v_old, x_t, x0, t, BETA)


def _flat_grad(policy, total) -> torch.Tensor:
    grads = torch.autograd.grad(total, policy.parameters, retain_graph=True, allow_unused=True)
    return torch.cat([torch.zeros(p.numel(), dtype=torch.float64) if g is None else g.reshape(-1)
                      for g, p in zip(grads, policy.parameters)])


def _k_backward(policy, l_pos, l_neg, r) -> torch.Tensor:
    per_reward = per_reward_objectives(l_pos, l_neg, r, BETA, A_MAX)
    rows = []
    for k in range(r.shape[1]):
        grads = torch.autograd.grad(per_reward[k], policy.parameters, retain_graph=True, allow_unused=True)
        rows.append(torch.cat([torch.zeros(p.numel(), dtype=torch.float64) if g is None else g.reshape(-1)
                               for g, p in zip(grads, policy.parameters)]))
    return torch.stack(rows)


@pytest.mark.parametrize("k", [1, 2, 4, 8])
def test_two_backward_passes_give_every_per_reward_gradient_gram_and_update(tiny64, k):
    b = 5
    r = _r_matrix(b, k, seed=10 + k)
    psg = PerSampleGradients(tiny64.transformer, tiny64.parameters)
    with psg.recording(batch=b, passes=2, dtype=torch.float64):
        l_pos, l_neg = _unit(tiny64, b, seed=k)
    psg.backward(l_pos.sum(), 0)
    psg.backward(l_neg.sum(), 1)
    sum_pos, sum_neg = _flat_grad(tiny64, l_pos.sum()), _flat_grad(tiny64, l_neg.sum())
    expected = _k_backward(tiny64, l_pos, l_neg, r)  # other backward passes leave J alone
    J = psg.jacobian
    assert J.shape == (2 * b, tiny64.num_trainable)
    # each block's rows sum to the ordinary gradient of its pass: the samples were split, not changed
    torch.testing.assert_close(J[:b].sum(0), sum_pos, rtol=1e-10, atol=1e-14)
    torch.testing.assert_close(J[b:].sum(0), sum_neg, rtol=1e-10, atol=1e-14)
    assert (J[:b].norm(dim=1) > 0).all() and not torch.allclose(J[0], J[1])  # per sample, not copies
    g, mixing = per_reward_gradients(J, r, BETA, A_MAX)
    # Float64 throughout except a few float32 nodes inside diffusers' SD3 (the sinusoidal timestep
    # embedding): a cotangent rounded there differs between the two orders of summation by ~1e-8 of the
    # gradient's scale; the rewards' gradients differ from each other by ~1e-1 of it.
    scale = float(expected.abs().max())
    tol = dict(rtol=1e-6, atol=1e-7 * scale)
    torch.testing.assert_close(g, expected, **tol)
    if k >= 2:
        assert float((expected[0] - expected[1]).abs().max()) > 1e-2 * scale
    # Gram matrix from the 2b x 2b per-sample products alone: G = W (J Jᵀ) Wᵀ
    W = reward_mixing(r, BETA, A_MAX)
    gram = W @ (J @ J.T) @ W.T
    torch.testing.assert_close(gram, expected @ expected.T, rtol=1e-6, atol=1e-7 * scale ** 2)
    torch.testing.assert_close(g.norm(dim=1), expected.norm(dim=1), **tol)
    # any combined direction Σ c_k g_k = (cᵀW) J
    c = torch.linspace(0.2, 1.0, k, dtype=torch.float64)
    torch.testing.assert_close((c @ W) @ J, c @ expected, **tol)
    if k >= 8:
        assert float(g[7].abs().max()) == 0.0  # valid nowhere
    # which samples drive the worst conflict: each sample's share, against its own autograd gradients
    att = conflict_attribution(J, mixing, g)
    if k == 1:
        assert att is None  # no pair
        return
    norms = expected.norm(dim=1)
    cos = (expected @ expected.T) / torch.outer(norms, norms)
    pairs = [(a, c_) for a in range(k) for c_ in range(a + 1, k) if norms[a] > 0 and norms[c_] > 0]
    worst = min(pairs, key=lambda kl: float(cos[kl]))
    assert (att.k, att.l) == worst and att.cosine == pytest.approx(float(cos[worst]), abs=1e-6)
    torch.testing.assert_close(att.shares.sum(), torch.tensor(att.cosine, dtype=torch.float64), rtol=0, atol=1e-9)
    counts = torch.isfinite(r).sum(dim=0)

    def own(reward: int, i: int) -> torch.Tensor:  # sample i's part of g_reward, by autograd on its term alone
        if not torch.isfinite(r[i, reward]):
            return torch.zeros(tiny64.num_trainable, dtype=torch.float64)
        only = torch.full_like(r, float("nan"))
        only[i] = r[i]
        term = per_reward_objectives(l_pos, l_neg, only, BETA, A_MAX)[reward] / counts[reward]
        return _flat_grad(tiny64, term)

    a, c_ = worst
    brute = torch.stack([0.5 * (own(a, i) @ expected[c_] + own(c_, i) @ expected[a]) / (norms[a] * norms[c_])
                         for i in range(b)])
    torch.testing.assert_close(att.shares, brute, rtol=1e-5, atol=1e-7)
    assert att.shares.abs().max() > 1e-3 and not torch.allclose(att.shares, att.shares.mean().expand(b))


def test_the_old_adapter_and_no_grad_forwards_are_not_recorded(tiny64):
    """v_old runs through the same LoRA layers (functional_call, no grad): it must not touch J."""
    b = 3
    psg = PerSampleGradients(tiny64.transformer, tiny64.parameters)
    with psg.recording(batch=b, passes=1, dtype=torch.float64):
        with torch.no_grad():
            _unit(tiny64, b, seed=3)
        l_pos, _ = _unit(tiny64, b, seed=3)
    psg.backward(l_pos.sum(), 0)
    torch.testing.assert_close(psg.jacobian.sum(0), _flat_grad(tiny64, l_pos.sum()), rtol=1e-10, atol=1e-14)


def test_under_gradient_checkpointing_the_rows_are_the_same(tiny64):
    """Checkpointing re-runs each block's forward inside the backward; J must not change."""
    b = 3
    psg = PerSampleGradients(tiny64.transformer, tiny64.parameters)
    with psg.recording(batch=b, passes=1, dtype=torch.float64):
        l_pos, _ = _unit(tiny64, b, seed=4)
    psg.backward(l_pos.sum(), 0, retain_graph=False)
    plain = psg.jacobian.clone()
    tiny64.transformer.enable_gradient_checkpointing()
    try:
        with psg.recording(batch=b, passes=1, dtype=torch.float64):
            l_pos, _ = _unit(tiny64, b, seed=4)
        psg.backward(l_pos.sum(), 0, retain_graph=False)
    finally:
        tiny64.transformer.disable_gradient_checkpointing()
    torch.testing.assert_close(psg.jacobian, plain, rtol=1e-10, atol=1e-16)


def test_a_forward_that_was_not_recorded_is_an_error_not_a_zero_jacobian(tiny64):
    psg = PerSampleGradients(tiny64.transformer, tiny64.parameters)
    psg.recording(batch=2, passes=1, dtype=torch.float64)  # armed, but the forward runs outside it
    l_pos, _ = _unit(tiny64, 2, seed=5)
    with pytest.raises(RuntimeError, match="no recorded forward of the trainable layers"):
        psg.backward(l_pos.sum(), 0, retain_graph=False)


def test_a_trainable_tensor_that_is_not_a_linear_weight_is_refused():
    lin = torch.nn.Linear(3, 2)
    with pytest.raises(ValueError, match="bias is not supported"):
        PerSampleGradients(lin, [lin.weight, lin.bias])
    stray = torch.nn.Parameter(torch.zeros(4))
    with pytest.raises(ValueError, match="not the weight of a linear layer"):
        PerSampleGradients(lin, [lin.weight, stray])


def test_jacobian_bytes_counts_two_rows_per_sample():
    assert jacobian_bytes(9, 19_000_000) == 2 * 9 * 19_000_000 * 4
    assert jacobian_bytes(2, 10, torch.float64) == 320


def _one_step(tmp_path, gradients: str, strategy: str, **sets):
    from core.trainer import Trainer
    from tests.helpers import small_config

    events = []
    cfg = small_config(strategy, steps=1, **{"balance.gradients": gradients, "balance.diagnose_every": 1, **sets})
    trainer = Trainer(cfg, tmp_path / gradients, events.append)
    trainer.before = {n: p.detach().clone() for n, p in trainer.policy.named_trainable.items()}
    trainer.train_step(0)
    (balance,) = [e for e in events if e.kind == "balance"]
    return trainer, balance


@pytest.mark.slow
@pytest.mark.parametrize("strategy,sets", [
    ("marble_full", {"balance.harmonize_scope": "step"}),  # every unit harmonized, one solve on their sum
    ("marble", {}),  # the first unit harmonized, the rest amortized with the fresh ᾱ
    ("weighted_sum", {}),  # a diagnostic unit: per-reward gradients measured against the strategy's update
])
def test_a_training_step_on_either_gradient_path_is_the_same_step(tmp_path, strategy, sets):
    """The trainer on the per-sample path takes the step the K-backward path takes: same Gram (cosines,
    norms), same α, same update, same LoRA after the optimizer step (float32: to rounding)."""
    a, ev_a = _one_step(tmp_path, "per_sample", strategy, **sets)
    b, ev_b = _one_step(tmp_path, "per_reward", strategy, **sets)
    assert (ev_a.gradients, ev_b.gradients) == ("per_sample", "per_reward")
    assert a.gradient_path == "per_sample"
    for name in a.reward_names:
        assert ev_a.grad_norms[name] == pytest.approx(ev_b.grad_norms[name], rel=1e-4)
        assert ev_a.grad_norms[name] > 0
        assert ev_a.cos_to_update[name] == pytest.approx(ev_b.cos_to_update[name], abs=1e-4)
        assert ev_a.alpha_raw[name] == pytest.approx(ev_b.alpha_raw[name], abs=1e-4)
    np.testing.assert_allclose(np.array(ev_a.cosine["matrix"]), np.array(ev_b.cosine["matrix"]), atol=1e-4)
    assert ev_a.update_norm == pytest.approx(ev_b.update_norm, rel=1e-4)
    moved = 0.0
    for name, p in a.policy.named_trainable.items():
        q = b.policy.named_trainable[name]
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-6)
        moved = max(moved, float((p.detach() - a.before[name]).abs().max()))
    assert moved > 0  # the step did change the adapter


def test_an_unknown_gradient_path_is_refused_naming_the_field():
    from core.config import ConfigError
    from tests.helpers import small_config

    with pytest.raises(ConfigError, match=r"balance\.gradients.*per_sample, per_reward"):
        small_config("marble", **{"balance.gradients": "jacobian"})
