"""The min-norm QP on the simplex (spec §4.3): α* = argmin_{α >= 0, Σα = 1} αᵀGα for a K×K Gram matrix G.

One documented helper, as torchjd keeps its QP apart from its weightings: Gram checks, an independent numpy
solver (FISTA + active-set polish: the fallback and the tests' oracle), and the production solve (cvxpy's
canonical form compiled once per K into a kept OSQP workspace). The balancers (core/balancing.py) compose
it; nothing here knows about rewards, schedules or configs.

cvxpy (≈2 s to import) is imported lazily on the first solve, so that listing balancers (config
validation in the web process) stays cheap.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

GRAD_NORM_MIN = 1e-12
"""A per-reward gradient with ‖g_k‖ <= this (or non-finite) is excluded from balancing (spec §4.2)."""
SYMMETRY_RTOL = 1e-4
"""Allowed max|G − Gᵀ| relative to max|G|. Loose on purpose: a Gram matrix of long float32 gradients is
not exactly symmetric, while a matrix that is not a Gram matrix at all is off by O(1)."""
PSD_RTOL = 1e-3
"""Allowed negative eigenvalue of G relative to its largest diagonal entry (rounding of near-duplicate
float32 gradients); :func:`_psd_part` clips such eigenvalues to 0 before the QP."""
RIDGE = 1e-12
"""Ridge added to the scaled Gram matrix (max diagonal = 1) so OSQP always sees a convex P."""


# ==== Gram matrix checks =============================================================================

def _as_square_matrix(gram: Any, name: str = "gram") -> np.ndarray:
    try:
        G = np.array(gram, dtype=np.float64)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{name} must be a K×K array of numbers; could not convert it ({e})") from None
    if G.ndim != 2 or G.shape[0] != G.shape[1] or G.shape[0] == 0:
        raise ValueError(f"{name} must be a square K×K matrix with K >= 1; got shape {G.shape}")
    return G


def validate_gram(gram: Any, name: str = "gram") -> np.ndarray:
    """A float64, exactly symmetrized copy of a Gram matrix, or ValueError saying which rule it breaks.

    Rules: square K×K (K >= 1); every entry finite; symmetric within SYMMETRY_RTOL·max|G|;
    positive semidefinite within PSD_RTOL·max diag (as every G = J Jᵀ is).
    """
    G = _as_square_matrix(gram, name)
    if not np.isfinite(G).all():
        bad = [tuple(int(i) for i in ij) for ij in np.argwhere(~np.isfinite(G))[:4]]
        raise ValueError(f"{name} must be finite; found NaN/inf at entries {bad}")
    scale = float(np.max(np.abs(G)))
    asym = float(np.max(np.abs(G - G.T)))
    if asym > SYMMETRY_RTOL * scale:
        raise ValueError(f"{name} must be symmetric: max|G − Gᵀ| = {asym:.3g} exceeds "
                         f"{SYMMETRY_RTOL:g}·max|G| = {SYMMETRY_RTOL * scale:.3g}")
    G = 0.5 * (G + G.T)
    diag_max = float(np.max(np.diag(G)))
    min_eig = float(np.linalg.eigvalsh(G)[0]) if G.shape[0] > 1 else float(G[0, 0])
    if min_eig < -PSD_RTOL * max(diag_max, 0.0) or diag_max < 0:
        raise ValueError(f"{name} must be positive semidefinite (a Gram matrix J Jᵀ is): smallest eigenvalue "
                         f"{min_eig:.3g} is below −{PSD_RTOL:g}·max diag = {-PSD_RTOL * max(diag_max, 0.0):.3g}")
    return G


def valid_gradients(gram: np.ndarray) -> np.ndarray:
    """[K] bool: g_k is finite and ‖g_k‖ = sqrt(G_kk) > GRAD_NORM_MIN (spec §4.2).

    A NaN gradient makes its whole row/column of G NaN; a reward is valid only if its diagonal entry
    passes and its row is finite against the other candidates.
    """
    diag = np.diag(gram)
    with np.errstate(invalid="ignore"):
        valid = np.isfinite(diag) & (diag > GRAD_NORM_MIN ** 2)
    for k in np.flatnonzero(valid):
        if not np.isfinite(gram[k, valid]).all():
            valid[k] = False
    return valid


# ==== independent numpy solver (fallback and test oracle) ============================================

def project_to_simplex(v: Any) -> np.ndarray:
    """Euclidean projection of v onto the probability simplex {α >= 0, Σα = 1} (sort-based, exact)."""
    v = np.asarray(v, dtype=np.float64).reshape(-1)
    if v.size == 0 or not np.isfinite(v).all():
        raise ValueError(f"project_to_simplex needs a non-empty finite vector; got {v.tolist()}")
    return _project_to_simplex(v)


def _project_to_simplex(v: np.ndarray) -> np.ndarray:
    u = np.sort(v)[::-1]
    css = np.cumsum(u) - 1.0
    ranks = np.arange(1, v.size + 1)
    rho = np.flatnonzero(u - css / ranks > 0)[-1]
    return np.maximum(v - css[rho] / (rho + 1), 0.0)


def frank_wolfe_gap(gram: np.ndarray, alpha: np.ndarray) -> float:
    """2·(αᵀGα − min_i (Gα)_i) >= f(α) − f*: a certificate of sub-optimality on the simplex."""
    Ga = gram @ alpha
    return float(2.0 * (alpha @ Ga - np.min(Ga)))


def _fista_simplex(G: np.ndarray, iters: int, tol: float) -> np.ndarray:
    """Accelerated projected gradient with function-value restart on min αᵀGα over the simplex,
    stopped when the Frank–Wolfe gap is <= tol."""
    K = G.shape[0]
    step = 1.0 / (2.0 * float(np.linalg.eigvalsh(G)[-1]))
    x = np.full(K, 1.0 / K)
    y, fx, t = x.copy(), float(x @ G @ x), 1.0
    for _ in range(iters):
        Gx = G @ x
        if 2.0 * (x @ Gx - Gx.min()) <= tol:
            break
        x_new = _project_to_simplex(y - step * 2.0 * (G @ y))
        f_new = float(x_new @ G @ x_new)
        if f_new > fx:              # momentum overshot: restart from the last iterate
            y, t = x.copy(), 1.0
            continue
        t_new = 0.5 * (1.0 + np.sqrt(1.0 + 4.0 * t * t))
        y = x_new + ((t - 1.0) / t_new) * (x_new - x)
        x, fx, t = x_new, f_new, t_new
    return x


def _kkt_on_support(G: np.ndarray, support: np.ndarray) -> np.ndarray:
    """α on ``support`` solving 2·G_SS α_S = λ·1, Σ α_S = 1 (least squares when G_SS is singular)."""
    n = support.size
    kkt = np.zeros((n + 1, n + 1))
    kkt[:n, :n] = 2.0 * G[np.ix_(support, support)]
    kkt[:n, n] = -1.0
    kkt[n, :n] = 1.0
    rhs = np.zeros(n + 1)
    rhs[n] = 1.0
    alpha = np.zeros(G.shape[0])
    alpha[support] = np.linalg.lstsq(kkt, rhs, rcond=None)[0][:n]
    return alpha


def _active_set_polish(G: np.ndarray, alpha: np.ndarray, rounds: int) -> np.ndarray:
    """Refine α to the exact optimum by a small primal active-set loop started from its support:
    solve the KKT system on the support, drop a coordinate that went negative, add the coordinate
    with the most negative reduced gradient, until the KKT conditions hold. Keeps the best α seen."""
    best, best_gap = alpha, frank_wolfe_gap(G, alpha)
    support = np.flatnonzero(alpha > 1e-9 * np.max(alpha))
    for _ in range(rounds):
        cand = _kkt_on_support(G, support)
        if not np.isfinite(cand).all():
            break
        if cand[support].min() < 0:                       # infeasible: drop the most negative
            support = support[support != support[np.argmin(cand[support])]]
            if support.size == 0:
                break
            continue
        gap = frank_wolfe_gap(G, cand)
        if gap < best_gap:
            best, best_gap = cand, gap
        reduced = G @ cand
        outside = np.setdiff1d(np.arange(G.shape[0]), support)
        if outside.size == 0 or reduced[outside].min() >= reduced[support].max() - 1e-15:
            break                                         # KKT holds: optimal
        support = np.union1d(support, outside[np.argmin(reduced[outside])])
    return best


def projected_gradient_min_norm(gram: Any, iters: int = 2000, tol: float = 1e-8) -> np.ndarray:
    """α* = argmin_{α >= 0, Σα = 1} αᵀGα with numpy only (the cvxpy fallback and the tests' oracle).

    Accelerated projected gradient (FISTA with restart) on G scaled to max diagonal 1, run until the
    Frank–Wolfe gap (an upper bound on f(α) − f*, in scaled units) is <= ``tol`` or ``iters`` steps,
    then an active-set polish (exact KKT solves from the found support) that is kept only where it
    lowers the gap; this reaches ~1e-15 on small K. A zero Gram matrix (every α optimal) returns the
    uniform α.
    """
    G = validate_gram(gram)
    K = G.shape[0]
    scale = float(np.max(np.diag(G)))
    if K == 1 or scale <= 0.0:
        return np.full(K, 1.0 / K)
    G = G / scale
    alpha = _fista_simplex(G, iters, tol)
    alpha = np.maximum(_active_set_polish(G, alpha, rounds=2 * K + 2), 0.0)
    return alpha / alpha.sum()


# ==== the cvxpy solve (DPP, compiled once per K) ====================================================

@dataclass
class MinNormSolution:
    """Result of :func:`solve_min_norm`."""

    alpha: np.ndarray
    """[K] float64 α* on the simplex."""
    status: str
    """How it was solved, e.g. "cvxpy:OSQP:optimal", "projected_gradient(cvxpy:OSQP:infeasible)", "trivial:K=1"."""
    seconds: float
    """Wall time of the solve, validation included."""


@dataclass
class _MinNormProblem:
    """min αᵀGα s.t. α >= 0, Σα = 1, compiled by cvxpy once per K into OSQP's standard form.

    cvxpy canonicalizes the problem (with a dense template Gram) to ``min ½xᵀPx s.t. l <= Ax <= u``;
    compilation checks that P = 2·G_template, so a later solve only writes 2·G into P's upper triangle
    of the kept OSQP workspace (``update(Px=...)``) and re-solves warm. This skips cvxpy's per-solve
    parameter re-stuffing (~2 ms on 2 CPU cores for K = 5), leaving the QP itself (~0.1 ms).
    """

    problem: Any        # cvxpy.Problem, the canonicalization source
    solver: Any         # osqp.OSQP workspace, set up once
    p_rows: np.ndarray  # CSC (row, col) of the upper triangle of P, in OSQP's data order
    p_cols: np.ndarray
    solves: int = 0


_PROBLEMS: dict[int, _MinNormProblem] = {}
"""Compiled min-norm problems keyed by K (cvxpy compiles once; later solves only update P)."""
_PROBLEMS_LOCK = threading.Lock()
_OSQP_OPTIONS = dict(eps_abs=1e-10, eps_rel=1e-10, polish=True, max_iter=50000, verbose=False)


def _csc32(m):
    """A CSC matrix with 32-bit indices, the integer width the OSQP extension is built with."""
    import scipy.sparse as sp

    m = sp.csc_matrix(m)
    m.indices, m.indptr = m.indices.astype(np.int32), m.indptr.astype(np.int32)
    return m


def _min_norm_problem(K: int) -> _MinNormProblem:
    """The cached compiled problem for K rewards (built on first use). Call with _PROBLEMS_LOCK held."""
    if K not in _PROBLEMS:
        import cvxpy as cp
        import osqp
        import scipy.sparse as sp

        rng = np.random.default_rng(0)
        M = rng.normal(size=(K, K))
        template = M @ M.T + K * np.eye(K)  # dense PD: every entry of P is in the sparsity pattern
        alpha = cp.Variable(K, name="alpha")
        problem = cp.Problem(cp.Minimize(cp.quad_form(alpha, template)), [alpha >= 0, cp.sum(alpha) == 1])
        data, _, _ = problem.get_problem_data(cp.OSQP)
        P = sp.csc_array(data["P"])
        if data["n_var"] != K or not np.allclose(P.toarray(), 2 * template) or np.any(data["q"]):
            raise RuntimeError("cvxpy's canonical form of the min-norm QP is not P = 2G over α alone")
        P_upper = _csc32(sp.triu(P, format="csc"))
        p_cols = np.repeat(np.arange(K), np.diff(P_upper.indptr))
        A = _csc32(sp.vstack([data["A"], data["F"]], format="csc"))
        lower = np.concatenate([data["b"], np.full(data["F"].shape[0], -np.inf)])
        upper = np.concatenate([data["b"], data["G"]])
        solver = osqp.OSQP()
        solver.setup(P_upper, data["q"], A, lower, upper, **_OSQP_OPTIONS)
        _PROBLEMS[K] = _MinNormProblem(problem, solver, P_upper.indices.copy(), p_cols)
    return _PROBLEMS[K]


_OSQP_STATUS = {"solved": "optimal", "solved inaccurate": "optimal_inaccurate",
                "maximum iterations reached": "user_limit"}
"""OSQP's status words mapped to cvxpy's names for them."""


def _psd_part(G: np.ndarray) -> np.ndarray:
    """G symmetrized, with rounding-level negative eigenvalues clipped to 0, plus RIDGE·I."""
    G = 0.5 * (G + G.T)
    w, V = np.linalg.eigh(G)
    if w.min() < 0:
        G = (V * np.maximum(w, 0.0)) @ V.T
    return G + RIDGE * np.eye(G.shape[0])


def _solve_cvxpy(G: np.ndarray) -> tuple[np.ndarray | None, str]:
    """(α, status) from the compiled OSQP workspace; α is None when the solve failed or is unusable."""
    with _PROBLEMS_LOCK:
        try:
            entry = _min_norm_problem(G.shape[0])
            entry.solver.update(Px=2.0 * _psd_part(G)[entry.p_rows, entry.p_cols])
            result = entry.solver.solve(raise_error=False)
        except Exception as e:  # solver errors are reported in the status, then the fallback solves
            return None, f"cvxpy:OSQP:error:{type(e).__name__}"
        entry.solves += 1
        outcome, value = _OSQP_STATUS.get(str(result.info.status), str(result.info.status)), result.x
    status = f"cvxpy:OSQP:{outcome.replace(' ', '_')}"
    if outcome != "optimal" or value is None or not np.isfinite(value).all():
        return None, status
    alpha = np.maximum(np.asarray(value, dtype=np.float64), 0.0)    # clip solver-tolerance negatives
    total = alpha.sum()
    if not total > 0:
        return None, f"{status}:zero-sum"
    return alpha / total, status


def solve_min_norm(gram: Any) -> MinNormSolution:
    """α* = argmin_{α >= 0, Σα = 1} αᵀGα (spec §4.3) with cvxpy/OSQP on a DPP problem cached per K.

    G is scaled to max diagonal 1 first (α* does not change). K = 1 returns [1] without solving; a zero
    G (every α optimal) returns the uniform α. When cvxpy fails or returns a non-finite/non-optimal
    answer, :func:`projected_gradient_min_norm` solves it and the status says
    "projected_gradient(<cvxpy status>)". Raises ValueError for a non-square, non-finite, asymmetric
    or indefinite G.
    """
    start = time.perf_counter()
    G = validate_gram(gram)
    K = G.shape[0]
    scale = float(np.max(np.diag(G)))
    if K == 1:
        return MinNormSolution(np.ones(1), "trivial:K=1", time.perf_counter() - start)
    if scale <= 0.0:
        return MinNormSolution(np.full(K, 1.0 / K), "trivial:zero-gram", time.perf_counter() - start)
    G = G / scale
    alpha, status = _solve_cvxpy(G)
    if alpha is None:
        alpha, status = projected_gradient_min_norm(G), f"projected_gradient({status})"
    return MinNormSolution(alpha, status, time.perf_counter() - start)


def min_norm_weights(gram: Any) -> np.ndarray:
    """α* of :func:`solve_min_norm`."""
    return solve_min_norm(gram).alpha
