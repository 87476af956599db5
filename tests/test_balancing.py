"""Min-norm QP (spec §4.3) and the balancers (spec §4-§7): properties first, then golden numbers."""

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from core import balancing
from core.balancing import (
    Balancer,
    BalanceDecision,
    available_balancers,
    frank_wolfe_gap,
    make_balancer,
    min_norm_weights,
    project_to_simplex,
    projected_gradient_min_norm,
    register_balancer,
    solve_min_norm,
)
from core.config import BalanceConfig, StageConfig

NAMES3 = ["a", "b", "c"]


# ---- helpers --------------------------------------------------------------------------------------

def gram(J: np.ndarray) -> np.ndarray:
    """G = J Jᵀ for per-reward gradients stacked as rows of J [K, n]."""
    return J @ J.T


def unit(angle: float) -> np.ndarray:
    return np.array([np.cos(angle), np.sin(angle)])


def assert_on_simplex(alpha: np.ndarray) -> None:
    assert alpha.ndim == 1 and np.all(alpha >= 0) and alpha.sum() == pytest.approx(1.0, abs=1e-12)


def assert_matches_oracle(G: np.ndarray, unique: bool, statuses=("cvxpy:OSQP:optimal",)) -> np.ndarray:
    """cvxpy's α vs the numpy oracle: objective within 1e-7 (relative to max G_kk), α within 1e-4."""
    sol = solve_min_norm(G)
    oracle = projected_gradient_min_norm(G)
    assert sol.status in statuses
    assert_on_simplex(sol.alpha)
    assert_on_simplex(oracle)
    scale = np.max(np.diag(G))
    assert abs(sol.alpha @ G @ sol.alpha - oracle @ G @ oracle) <= 1e-7 * scale
    if unique:
        np.testing.assert_allclose(sol.alpha, oracle, atol=1e-4)
    return sol.alpha


def assert_no_conflict(G: np.ndarray, alpha: np.ndarray) -> None:
    """MGDA property: every g_k·d >= ‖d‖² >= 0 for d = Σ α_k g_k (up to solver tolerance)."""
    scale = np.max(np.diag(G))
    Ga = G @ alpha
    assert np.all(Ga >= alpha @ Ga - 1e-8 * scale)
    assert np.all(Ga >= -1e-8 * scale)


def random_jacobian(rng, K, n, log_scale=0.0):
    return rng.normal(size=(K, n)) * np.exp(rng.uniform(-log_scale, log_scale, size=(K, 1)))


def marble(names=NAMES3, **cfg) -> balancing.MarbleBalancer:
    return make_balancer(cfg.pop("strategy", "marble"), names, BalanceConfig(**cfg), [1.0] * len(names))


# ---- the simplex projection and the oracle ---------------------------------------------------------

def test_project_to_simplex_golden_and_optimality():
    np.testing.assert_allclose(project_to_simplex([2.0, 0.0]), [1.0, 0.0])
    np.testing.assert_allclose(project_to_simplex([1.0, 1.0, 1.0]), [1 / 3] * 3)
    np.testing.assert_allclose(project_to_simplex([0.5, 0.3, -0.1]), [0.6, 0.4, 0.0])
    rng = np.random.default_rng(0)
    for _ in range(20):
        v = rng.normal(size=5) * 3
        p = project_to_simplex(v)
        assert_on_simplex(p)
        # variational inequality of a projection: <v − p, q − p> <= 0 for every vertex q
        assert np.all((np.eye(5) - p) @ (v - p) <= 1e-12)
        np.testing.assert_allclose(project_to_simplex(p), p, atol=1e-15)


def test_oracle_reaches_its_certificate():
    rng = np.random.default_rng(1)
    for _ in range(10):
        G = gram(random_jacobian(rng, 6, 3, log_scale=2.0))
        alpha = projected_gradient_min_norm(G)
        assert frank_wolfe_gap(G / np.max(np.diag(G)), alpha) < 1e-9


# ---- min_norm_weights vs the oracle -------------------------------------------------------------

def test_aligned_gradients_pick_the_smallest():
    u = np.array([0.6, 0.8, 0.0])
    G = gram(np.array([3.0, 1.0, 2.0])[:, None] * u)           # same direction, norms 3, 1, 2
    alpha = assert_matches_oracle(G, unique=True)
    np.testing.assert_allclose(alpha, [0.0, 1.0, 0.0], atol=1e-6)


def test_two_opposite_gradients_cancel():
    G = gram(np.array([unit(0.3), -unit(0.3)]))
    alpha = assert_matches_oracle(G, unique=True)
    np.testing.assert_allclose(alpha, [0.5, 0.5], atol=1e-6)
    assert alpha @ G @ alpha < 1e-10


def test_three_gradients_at_120_degrees():
    G = gram(np.array([unit(0.0), unit(2 * np.pi / 3), unit(4 * np.pi / 3)]))
    alpha = assert_matches_oracle(G, unique=True)
    np.testing.assert_allclose(alpha, [1 / 3] * 3, atol=1e-5)


def test_orthogonal_gradients_golden():
    # α ∝ 1/‖g_k‖²: norms 1 and 2 → (4/5, 1/5)
    G = np.diag([1.0, 4.0])
    alpha = assert_matches_oracle(G, unique=True)
    np.testing.assert_allclose(alpha, [0.8, 0.2], atol=1e-7)


def test_degenerate_rank_deficient_and_duplicated():
    rng = np.random.default_rng(2)
    J = random_jacobian(rng, 5, 2)                              # K = 5 gradients in a plane
    assert_no_conflict(gram(J), assert_matches_oracle(gram(J), unique=False))
    J_dup = np.vstack([J[:3], J[:1]])                          # g_3 duplicates g_0
    alpha = assert_matches_oracle(gram(J_dup), unique=False)
    assert_no_conflict(gram(J_dup), alpha)
    # duplicated gradients: their combined weight is what matters, and it equals the 3-reward answer
    alpha3 = min_norm_weights(gram(J[:3]))
    d, d3 = (alpha @ J_dup), (alpha3 @ J[:3])
    np.testing.assert_allclose(d, d3, atol=1e-5)


def test_singular_gram_that_breaks_cholesky_uses_eigen_factor():
    G = gram(np.array([[1.0, 2.0], [2.0, 4.0], [1.0, 2.0]]))   # rank 1, duplicated rows
    G[0, 0] -= 1e-13                                           # tiny rounding: indefinite by 1e-13
    alpha = assert_matches_oracle(G, unique=False)
    assert alpha @ G @ alpha == pytest.approx(5.0, rel=1e-7)


@pytest.mark.parametrize("seed", range(3))
def test_badly_scaled_norms(seed):
    rng = np.random.default_rng(seed)
    J = rng.normal(size=(5, 8)) * np.logspace(-4, 4, 5)[:, None]   # norms 1e-4 .. 1e4
    G = gram(J)
    # f* ~ 1e-8 against max G_kk = 1e8: at double precision α is not determined (the oracle puts ~0.99
    # on g_0, OSQP may split g_0/g_1), so compare objectives relative to max G_kk. OSQP may also give up
    # at this conditioning; then the numpy solver answers and the status says so. MARBLE normalizes first.
    statuses = ("cvxpy:OSQP:optimal", "projected_gradient(cvxpy:OSQP:user_limit)",
                "projected_gradient(cvxpy:OSQP:optimal_inaccurate)")
    alpha = assert_matches_oracle(G, unique=False, statuses=statuses)
    assert_no_conflict(G, alpha)


def test_random_grams_agree_and_never_conflict():
    rng = np.random.default_rng(3)
    for _ in range(30):
        K = int(rng.integers(2, 7))
        n = int(rng.integers(K, 12))                           # full rank → unique optimum
        G = gram(random_jacobian(rng, K, n, log_scale=1.0))
        assert_no_conflict(G, assert_matches_oracle(G, unique=True))


def test_permutation_equivariance():
    rng = np.random.default_rng(4)
    for _ in range(10):
        G = gram(random_jacobian(rng, 5, 7))
        perm = rng.permutation(5)
        np.testing.assert_allclose(min_norm_weights(G[np.ix_(perm, perm)]), min_norm_weights(G)[perm], atol=1e-6)


def test_k1_and_zero_gram():
    sol = solve_min_norm([[4.0]])
    assert sol.alpha.tolist() == [1.0] and sol.status == "trivial:K=1" and sol.seconds >= 0
    sol = solve_min_norm(np.zeros((3, 3)))
    assert sol.status == "trivial:zero-gram"
    np.testing.assert_allclose(sol.alpha, [1 / 3] * 3)


def test_solution_is_scale_invariant():
    G = gram(np.random.default_rng(5).normal(size=(4, 6)))
    np.testing.assert_allclose(min_norm_weights(G * 1e-9), min_norm_weights(G), atol=1e-6)
    np.testing.assert_allclose(min_norm_weights(G * 1e9), min_norm_weights(G), atol=1e-6)


def test_compiled_problem_is_cached_once_per_k():
    rng = np.random.default_rng(6)
    min_norm_weights(gram(rng.normal(size=(5, 5))))
    entry = balancing._PROBLEMS[5]
    workspace, before = entry.solver, entry.solves
    for _ in range(5):
        G = gram(rng.normal(size=(5, 5)))
        sol = solve_min_norm(G)
        assert sol.status == "cvxpy:OSQP:optimal"
        oracle = projected_gradient_min_norm(G)
        assert sol.alpha @ G @ sol.alpha <= oracle @ G @ oracle + 1e-9 * np.max(np.diag(G))
    assert balancing._PROBLEMS[5] is entry and entry.solver is workspace  # no recompilation
    assert entry.solves == before + 5
    assert list(balancing._PROBLEMS).count(5) == 1


def test_solver_failure_falls_back_to_the_oracle(monkeypatch):
    G = gram(np.random.default_rng(7).normal(size=(3, 4)))
    min_norm_weights(G)  # compile K = 3
    entry = balancing._PROBLEMS[3]

    class BrokenWorkspace:
        def update(self, **kwargs):
            raise ValueError("simulated")

    monkeypatch.setattr(entry, "solver", BrokenWorkspace())
    sol = solve_min_norm(G)
    assert sol.status == "projected_gradient(cvxpy:OSQP:error:ValueError)"
    np.testing.assert_allclose(sol.alpha, projected_gradient_min_norm(G), atol=1e-12)


@pytest.mark.parametrize("bad, message", [
    (np.ones((2, 3)), "square K×K"),
    (np.array([[1.0, np.nan], [np.nan, 1.0]]), "must be finite"),
    (np.array([[1.0, 0.5], [0.2, 1.0]]), "must be symmetric"),
    (np.array([[1.0, 2.0], [2.0, 1.0]]), "positive semidefinite"),
    ("not a matrix", "K×K array of numbers"),
])
def test_invalid_gram_is_rejected_with_the_reason(bad, message):
    with pytest.raises(ValueError, match=message):
        solve_min_norm(bad)


# ---- MARBLE: harmonization (spec §4) -----------------------------------------------------------

def test_marble_k1_update_is_the_raw_gradient():
    b = marble(names=["only"])
    g = np.array([[3.0, -4.0]])
    decision = b.balance(gram(g), step=0)
    assert isinstance(decision, BalanceDecision)
    assert decision.solver == "single-valid"
    np.testing.assert_array_equal(decision.alpha_raw, [1.0])
    np.testing.assert_allclose(decision.grad_weights @ g, g[0])


def test_marble_direction_is_dstar_rescaled_by_mean_norm():
    rng = np.random.default_rng(8)
    J = random_jacobian(rng, 3, 6, log_scale=2.0)
    decision = marble().balance(gram(J), step=0)
    norms = np.linalg.norm(J, axis=1)
    d_star = decision.alpha_raw @ (J / norms[:, None])          # Σ α*_k ĝ_k
    d = decision.grad_weights @ J                               # Σ c_k g_k
    np.testing.assert_allclose(d, d_star * norms.mean(), rtol=1e-10)
    assert np.linalg.norm(d) == pytest.approx(norms.mean() * np.linalg.norm(d_star), rel=1e-10)
    assert np.all(J @ d >= -1e-8 * norms.max() ** 2)            # no reward is harmed


def test_marble_normalization_makes_alpha_scale_invariant():
    rng = np.random.default_rng(9)
    J = random_jacobian(rng, 3, 5)
    J_big = J.copy()
    J_big[0] *= 1000.0
    alpha = marble().balance(gram(J), 0).alpha_raw
    np.testing.assert_allclose(marble().balance(gram(J_big), 0).alpha_raw, alpha, atol=1e-6)
    J_spread = J * np.array([1e-4, 1.0, 1e4])[:, None]       # norms spread over 8 decades
    np.testing.assert_allclose(marble().balance(gram(J_spread), 0).alpha_raw, alpha, atol=1e-6)


def test_marble_without_normalization_is_dominated_by_scale():
    J = np.array([[1000.0, 0.0], [0.0, 1.0]])                  # orthogonal, norms 1000 and 1
    normalized = marble(names=["a", "b"]).balance(gram(J), 0)
    raw = marble(names=["a", "b"], normalize=False).balance(gram(J), 0)
    np.testing.assert_allclose(normalized.alpha_raw, [0.5, 0.5], atol=1e-6)
    assert raw.alpha_raw[0] < 1e-5 and raw.alpha_raw[1] > 0.99     # α ∝ 1/‖g‖²: the small one wins
    np.testing.assert_array_equal(raw.grad_weights, raw.alpha_raw)  # no rescaling in the ablation


@pytest.mark.parametrize("bad_row", [np.full(4, np.nan), np.zeros(4), np.array([np.inf, 0, 0, 0])])
def test_invalid_gradient_is_excluded(bad_row):
    rng = np.random.default_rng(10)
    J = rng.normal(size=(3, 4))
    J_bad = J.copy()
    J_bad[1] = bad_row
    with np.errstate(invalid="ignore"):
        G = gram(J_bad)
    decision = marble().balance(G, 0)
    np.testing.assert_array_equal(decision.valid, [True, False, True])
    assert decision.alpha_raw[1] == 0.0 and decision.grad_weights[1] == 0.0
    two = marble(names=["a", "c"]).balance(gram(J[[0, 2]]), 0)
    np.testing.assert_allclose(decision.alpha_raw[[0, 2]], two.alpha_raw, atol=1e-9)
    np.testing.assert_allclose(decision.grad_weights[[0, 2]], two.grad_weights, atol=1e-9)


def test_single_valid_gradient_is_used_raw():
    J = np.array([[0.0, 0.0], [2.0, 1.0], [np.nan, 1.0]])
    with np.errstate(invalid="ignore"):
        decision = marble().balance(gram(J), 0)
    assert decision.solver == "single-valid"
    np.testing.assert_array_equal(decision.alpha_raw, [0.0, 1.0, 0.0])
    np.testing.assert_array_equal(decision.grad_weights, [0.0, 1.0, 0.0])


def test_no_valid_gradient_gives_zero_update_and_keeps_the_ema():
    b = marble()
    none = np.full((3, 3), np.nan)
    first = b.balance(none, 0)
    assert first.solver == "no-valid" and not first.valid.any()
    np.testing.assert_array_equal(first.grad_weights, np.zeros(3))
    np.testing.assert_allclose(first.alpha_ema, [1 / 3] * 3)          # still the uniform start
    assert b.alpha_ema is None
    ok = b.balance(np.diag([1.0, 4.0, 4.0]), 10)
    again = b.balance(np.zeros((3, 3)), 20)
    assert again.solver == "no-valid"
    np.testing.assert_array_equal(again.alpha_ema, ok.alpha_ema)


# ---- MARBLE: EMA (spec §6) and schedule (spec §5) ------------------------------------------------

def test_ema_first_solve_initializes_then_blends():
    G1 = gram(np.array([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 1.0]]))
    G2 = gram(np.array([[1.0, 0.0], [-1.0, 0.0], [0.0, 1.0]]))      # a and b cancel: α* = (.5, .5, 0)
    b = marble(ema_rho=0.7)
    d1 = b.balance(G1, 0)
    np.testing.assert_array_equal(d1.alpha_ema, d1.alpha_raw)
    np.testing.assert_allclose(d1.alpha_raw, [1 / 3] * 3, atol=1e-6)
    d2 = b.balance(G2, 10)
    np.testing.assert_allclose(d2.alpha_raw, [0.5, 0.5, 0.0], atol=1e-6)
    np.testing.assert_allclose(d2.alpha_ema, 0.7 * d1.alpha_raw + 0.3 * d2.alpha_raw, atol=1e-12)
    np.testing.assert_allclose(b.advantage_weights(11), d2.alpha_ema)
    assert d2.alpha_ema.sum() == pytest.approx(1.0)
    b0 = marble(ema_rho=0.0)
    b0.balance(G1, 0)
    d = b0.balance(G2, 10)
    np.testing.assert_array_equal(d.alpha_ema, d.alpha_raw)          # ρ = 0: no EMA


def run_schedule(b: Balancer, steps: int, G: np.ndarray) -> list[int]:
    """Steps at which the balancer asked for the K gradients (and got a balance() call)."""
    full = []
    for s in range(steps):
        if b.harmonizes(s):
            b.balance(G, s)
            full.append(s)
    return full


def test_schedule_warmup_1_refresh_10():
    b = marble(warmup_steps=1, harmonize_every=10)
    np.testing.assert_allclose(b.advantage_weights(0), [1 / 3] * 3)   # uniform before any solve
    assert run_schedule(b, 25, np.eye(3)) == [0, 10, 20]
    b = marble(warmup_steps=1, harmonize_every=10)
    assert b.harmonizes(0)
    b.balance(np.eye(3), 0)
    assert not any(b.harmonizes(s) for s in range(1, 10))
    assert b.harmonizes(10)


def test_schedule_longer_warmup_and_marble_full():
    assert run_schedule(marble(warmup_steps=3, harmonize_every=5), 14, np.eye(3)) == [0, 1, 2, 7, 12]
    assert run_schedule(marble(strategy="marble_full"), 5, np.eye(3)) == [0, 1, 2, 3, 4]


def test_state_dict_round_trips_through_json():
    rng = np.random.default_rng(11)
    b = marble(warmup_steps=1, harmonize_every=10, ema_rho=0.5)
    for s in (0, 10):
        b.balance(gram(rng.normal(size=(3, 4))), s)
    state = json.loads(json.dumps(b.state_dict()))
    assert state["last_harmonized_step"] == 10 and state["num_solves"] == 2
    resumed = marble(warmup_steps=1, harmonize_every=10, ema_rho=0.5)
    resumed.load_state_dict(state)
    np.testing.assert_array_equal(resumed.advantage_weights(11), b.advantage_weights(11))
    assert [resumed.harmonizes(s) for s in range(11, 31)] == [b.harmonizes(s) for s in range(11, 31)]
    assert resumed.harmonizes(20) and not resumed.harmonizes(19)
    fresh = marble()
    fresh.load_state_dict(json.loads(json.dumps(fresh.state_dict())))
    assert fresh.alpha_ema is None and fresh.harmonizes(5)


def test_state_saved_before_the_rename_resumes_on_the_same_schedule():
    b = marble(warmup_steps=1, harmonize_every=10)
    b.balance(np.eye(3), 0)
    state = json.loads(json.dumps(b.state_dict()))
    state["last_full_step"] = state.pop("last_harmonized_step")  # a checkpoint written before 2026-12
    resumed = marble(warmup_steps=1, harmonize_every=10)
    resumed.load_state_dict(state)
    assert resumed.last_harmonized_step == 0
    assert [resumed.harmonizes(s) for s in range(1, 21)] == [b.harmonizes(s) for s in range(1, 21)]


@pytest.mark.parametrize("change, message", [
    ({"balancer": "equal"}, "saved by 'equal'"),
    ({"reward_names": ["a", "b"]}, "is for rewards"),
    ({"alpha_ema": [0.5, 0.6, 0.0]}, "summing to 1"),
    ({"alpha_ema": [1.0, 0.0]}, "3 numbers"),
    ({"last_harmonized_step": -1}, "last_harmonized_step"),
])
def test_load_state_dict_rejects_mismatches(change, message):
    state = marble().state_dict()
    state.update(change)
    with pytest.raises(ValueError, match=message):
        marble().load_state_dict(state)


# ---- fixed-α baselines (spec §7) -------------------------------------------------------------------

def test_equal_balancer():
    b = make_balancer("equal", NAMES3, BalanceConfig(strategy="equal"), [1.0, 1.0, 1.0])
    assert not b.harmonizes(0) and not b.scalarize
    np.testing.assert_allclose(b.advantage_weights(7), [1 / 3] * 3)
    decision = b.balance(np.diag([1.0, 0.0, 2.0]), 7)
    assert decision.solver == "fixed"
    np.testing.assert_array_equal(decision.valid, [True, False, True])
    for arr in (decision.alpha_raw, decision.alpha_ema, decision.grad_weights):
        np.testing.assert_allclose(arr, [1 / 3] * 3)
    assert b.state_dict() == {"balancer": "equal", "reward_names": NAMES3}


def test_weighted_sum_balancer():
    b = make_balancer("weighted_sum", NAMES3, BalanceConfig(strategy="weighted_sum"), [1.0, 3.0, 0.0])
    assert b.scalarize and not b.harmonizes(0)
    np.testing.assert_allclose(b.advantage_weights(0), [0.25, 0.75, 0.0])
    assert b.balance(np.eye(3), 0).solver == "fixed"
    with pytest.raises(ValueError, match="at least one reward weight > 0"):
        make_balancer("weighted_sum", NAMES3, BalanceConfig(), [0.0, 0.0, 0.0])


def test_single_balancer():
    b = make_balancer("single", NAMES3, BalanceConfig(strategy="single", single_reward="b"), None)
    np.testing.assert_array_equal(b.advantage_weights(3), [0.0, 1.0, 0.0])
    with pytest.raises(ValueError, match="valid choices|needs one of the run's rewards: a, b, c"):
        make_balancer("single", NAMES3, BalanceConfig(strategy="single", single_reward="zzz"), None)


def test_sequential_stage_boundaries():
    stages = [StageConfig(["a"], 3), StageConfig(["b"], 2), StageConfig(["a", "c"], 1)]
    b = make_balancer("sequential", NAMES3, BalanceConfig(strategy="sequential", stages=stages), None)
    assert [b.current_stage(s) for s in range(8)] == [0, 0, 0, 1, 1, 2, 2, 2]
    assert b.current_stage(10_000) == 2
    np.testing.assert_array_equal(b.advantage_weights(2), [1.0, 0.0, 0.0])
    np.testing.assert_array_equal(b.advantage_weights(3), [0.0, 1.0, 0.0])
    np.testing.assert_array_equal(b.advantage_weights(99), [0.5, 0.0, 0.5])
    assert not b.harmonizes(0)
    with pytest.raises(ValueError, match="at least one stage"):
        make_balancer("sequential", NAMES3, BalanceConfig(strategy="sequential", stages=[]), None)


# ---- registry and inputs ----------------------------------------------------------------------------

def test_registry_lists_the_strategies():
    names = available_balancers()
    for expected in ("marble", "marble_full", "weighted_sum", "equal", "single", "sequential"):
        assert expected in names and names[expected]
    for name in names:
        cfg = BalanceConfig(strategy=name, single_reward="a", stages=[StageConfig(["a"], 1)])
        assert make_balancer(name, NAMES3, cfg, [1.0, 1.0, 1.0]).name == name


def test_listing_balancers_imports_neither_torch_nor_cvxpy():
    # config validation in the web process calls available_balancers(): it must stay light
    code = ("import sys, core.balancing as b; b.available_balancers(); "
            "print('torch' in sys.modules, 'cvxpy' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parents[1])
    assert out.stdout.split() == ["False", "False"]


def test_unknown_balancer_lists_valid_choices():
    with pytest.raises(ValueError, match=re.escape("valid choices: ") + ".*marble.*sequential"):
        make_balancer("nope", NAMES3, BalanceConfig(), None)


def test_register_rejects_duplicate_names():
    class Clash(balancing.EqualBalancer):
        name = "marble"

    with pytest.raises(ValueError, match="already registered"):
        register_balancer(Clash)


def test_balancer_input_errors():
    b = marble()
    with pytest.raises(ValueError, match="K = 3 rewards"):
        b.balance(np.eye(2), 0)
    with pytest.raises(ValueError, match="step=-1"):
        b.harmonizes(-1)
    with pytest.raises(ValueError, match="distinct"):
        marble(names=["a", "a"])
    with pytest.raises(ValueError, match="reward_weights"):
        make_balancer("equal", NAMES3, BalanceConfig(), [1.0])
    with pytest.raises(ValueError, match="ema_rho"):
        marble(ema_rho=1.5)


# ---- optional torchjd weightings ------------------------------------------------------------------

needs_torchjd = pytest.mark.skipif(not balancing._torchjd_available(),
                                   reason='needs torchjd[quadprog-projector]==0.18.0')


@needs_torchjd
def test_upgrad_golden_weights_from_torchjd_docs():
    J = np.array([[-4.0, 1.0, 1.0], [6.0, 1.0, 1.0]])        # torchjd's documented example
    decision = marble(names=["a", "b"], strategy="upgrad", normalize=False).balance(gram(J), 0)
    assert decision.solver == "torchjd:UPGradWeighting"
    np.testing.assert_allclose(decision.grad_weights, [1.1109, 0.7894], atol=1e-4)
    np.testing.assert_allclose(decision.alpha_raw, decision.grad_weights / decision.grad_weights.sum())


@needs_torchjd
@pytest.mark.parametrize("name", ["upgrad", "dualproj"])
def test_torchjd_balancers_do_not_conflict_and_follow_marble_schedule(name):
    rng = np.random.default_rng(12)
    for _ in range(5):
        J = random_jacobian(rng, 4, 6, log_scale=2.0)
        decision = marble(names=list("abcd"), strategy=name).balance(gram(J), 0)
        assert_on_simplex(decision.alpha_raw)
        d = decision.grad_weights @ J
        cosines = (J @ d) / np.linalg.norm(J, axis=1) / np.linalg.norm(d)
        assert cosines.min() > -1e-2                            # torchjd regularizes its projection by 1e-4
    b = marble(strategy=name, warmup_steps=1, harmonize_every=10)
    assert run_schedule(b, 25, np.eye(3)) == [0, 10, 20]
    resumed = marble(strategy=name)
    resumed.load_state_dict(json.loads(json.dumps(b.state_dict())))
    np.testing.assert_array_equal(resumed.advantage_weights(21), b.advantage_weights(21))


@needs_torchjd
def test_torchjd_failure_falls_back_to_min_norm(monkeypatch):
    from torchjd import aggregation

    def broken(self, gramian):
        raise ValueError("Failed to solve the quadratic programming problem.")

    monkeypatch.setattr(aggregation.UPGradWeighting, "forward", broken)
    G = gram(np.random.default_rng(13).normal(size=(3, 4)))
    decision = marble(strategy="upgrad").balance(G, 0)
    assert decision.solver == "min-norm(torchjd:UPGradWeighting:error:ValueError)"
    np.testing.assert_allclose(decision.alpha_raw, marble().balance(G, 0).alpha_raw, atol=1e-6)


def test_a_marble_decision_records_its_real_solve_time():
    G = gram(np.array([[1.0, 0.0], [-0.5, 1.0], [0.2, -1.0]]))
    d = marble().balance(G, 0)
    assert d.seconds > 0 and d.solver.startswith("cvxpy")


# ---- the release's optional knobs: groups, weights, α floor (config/base.py pareto.*) ----------------

def _scipy_floor_solve(G, floor):
    """An independent oracle: SLSQP on min αᵀGα, α >= floor, Σα = 1 (as the release's mgda_solve)."""
    from scipy.optimize import minimize

    K = G.shape[0]
    res = minimize(lambda a: a @ G @ a, np.full(K, 1 / K), jac=lambda a: 2 * G @ a, bounds=[(floor, None)] * K,
                   constraints=[{"type": "eq", "fun": lambda a: a.sum() - 1}], method="SLSQP",
                   options={"ftol": 1e-14, "maxiter": 1000})
    return res.x


def test_alpha_floor_keeps_every_alpha_above_it_at_the_constrained_optimum():
    rng = np.random.default_rng(4)
    J = random_jacobian(rng, 4, 6, log_scale=1.0)
    J[1] = J[0] * 1.01 + 0.01 * rng.normal(size=6)  # near-duplicate: the plain solve puts ~0 on one of them
    G = gram(J)
    for floor in (0.05, 0.2):
        d = marble(names=list("abcd"), alpha_floor=floor).balance(G, 0)
        norms = np.sqrt(np.diag(G))
        Ghat = G / np.outer(norms, norms)
        oracle = _scipy_floor_solve(Ghat, floor)
        assert d.alpha_raw.min() >= floor - 1e-9 and d.alpha_raw.sum() == pytest.approx(1.0)
        assert d.alpha_raw @ Ghat @ d.alpha_raw <= oracle @ Ghat @ oracle + 1e-9
        np.testing.assert_allclose(d.alpha_raw, oracle, atol=1e-4)
    plain = marble(names=list("abcd")).balance(G, 0)
    assert plain.alpha_raw.min() < 0.05  # the floor binds in this case
    assert marble(names=list("abcd"), alpha_floor=0.5).balance(G, 0).alpha_raw == pytest.approx([0.25] * 4)


def test_group_weights_scale_the_normalized_gradients_before_the_qp():
    J = np.array([[1.0, 0.0], [0.0, 1.0], [-0.6, -0.8]])
    G = gram(J)
    d = marble(group_weights={"c": 3.0}).balance(G, 0)
    U = J * np.array([[1.0], [1.0], [3.0]])  # unit gradients (norm 1 here) times their weights
    oracle = projected_gradient_min_norm(gram(U))
    np.testing.assert_allclose(d.alpha_raw, oracle, atol=1e-6)
    # the update is Σ α_k u_k ĝ_k · mean‖g‖ on the raw gradients
    np.testing.assert_allclose(d.grad_weights @ J, oracle @ U * 1.0, atol=1e-6)
    assert not np.allclose(d.alpha_raw, marble().balance(G, 0).alpha_raw, atol=1e-3)


def test_reward_groups_balance_the_mean_gradient_of_each_group_and_split_its_alpha():
    rng = np.random.default_rng(9)
    J = random_jacobian(rng, 3, 5, log_scale=0.5)
    G = gram(J)
    d = marble(reward_groups={"ab": ["a", "b"]}).balance(G, 0)
    J_M = np.stack([J[:2].mean(axis=0), J[2]])  # the group's gradient is its members' mean
    norms = np.linalg.norm(J_M, axis=1)
    oracle = projected_gradient_min_norm(gram(J_M / norms[:, None]))
    np.testing.assert_allclose(d.alpha_raw, [oracle[0] / 2, oracle[0] / 2, oracle[1]], atol=1e-6)
    expected_update = (oracle[:, None] * J_M / norms[:, None]).sum(axis=0) * norms.mean()
    np.testing.assert_allclose(d.grad_weights @ J, expected_update, atol=1e-6)
    assert d.alpha_raw.sum() == pytest.approx(1.0)


def test_the_knobs_are_validated_by_name():
    from core.config import ConfigError, preset

    tiny = preset("tiny")
    cases = [({"balance.reward_groups": {"g": ["nope"]}}, r"balance.reward_groups.g=\['nope'\]: must list the run's"),
             ({"balance.reward_groups": {"g": ["colorfulness"], "h": ["colorfulness"]}}, "one group, once"),
             ({"balance.group_weights": {"zzz": 2}}, r"balance.group_weights=\{'zzz': 2\}: must map groups or lone"),
             ({"balance.alpha_floor": 2}, r"balance.alpha_floor=2.0: must be a number in \[0, 1\]"),
             ({"balance.reward_dropout": {"colorfulness": 1.5}}, "must map rewards .* to probabilities in")]
    for overrides, message in cases:
        with pytest.raises(ConfigError, match=message):
            tiny.with_overrides(overrides)
