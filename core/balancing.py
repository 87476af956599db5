"""Gradient balancing: the min-norm QP (spec §4) and the balancers a run picks by name (spec §4-§7).

A balancer maps the K×K Gram matrix G_ij = g_i·g_j of the RAW per-reward gradients (plus its own
explicit state, e.g. the EMA ᾱ) to K weights. It never calls backward: the trainer computes the
gradients, asks :meth:`Balancer.harmonizes`, and applies what :meth:`Balancer.balance` or
:meth:`Balancer.advantage_weights` return.

Symbols (spec): g_k per-reward gradient, ĝ_k = g_k/‖g_k‖, Ĝ the Gram matrix of the ĝ_k,
α* = argmin_{α ∈ simplex} αᵀĜα, d* = Σ α*_k ĝ_k, d = d*·mean_k‖g_k‖, ᾱ the EMA of α* with factor ρ.

The min-norm QP itself lives in core/min_norm.py (its public names are re-exported here). A MARBLE-family
balancer composes a weighting — Gram in, weights out (:func:`min_norm_weighting`, :class:`TorchJDWeighting`)
— with its schedule, normalization and EMA.
"""

from __future__ import annotations

import abc
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Sequence

import numpy as np

from core.min_norm import (  # noqa: F401  (re-exported: the solver's public names, and its cache for tests)
    _PROBLEMS, GRAD_NORM_MIN, PSD_RTOL, RIDGE, SYMMETRY_RTOL, MinNormSolution, _as_square_matrix,
    frank_wolfe_gap, min_norm_weights, project_to_simplex, projected_gradient_min_norm, solve_min_norm,
    valid_gradients, validate_gram)

if TYPE_CHECKING:  # only for annotations: core.config imports this module (lazily), never the reverse
    from core.config import BalanceConfig

# ==== balancers ====================================================================================

@dataclass
class BalanceDecision:
    """What one harmonized step decided (spec §4); all arrays are [K] float64 (``valid`` bool)."""

    alpha_raw: np.ndarray
    """α* of this solve, on the simplex over the valid rewards, 0 for excluded ones."""
    alpha_ema: np.ndarray
    """ᾱ after this update: what the amortized steps use next."""
    grad_weights: np.ndarray
    """c_k such that the update direction is d = Σ_k c_k g_k on the RAW gradients."""
    valid: np.ndarray
    """Finite gradient with ‖g_k‖ > GRAD_NORM_MIN."""
    solver: str
    """e.g. "cvxpy:OSQP:optimal", "single-valid", "no-valid", "fixed"."""
    seconds: float = 0.0
    """Wall time of the decision (checks, normalization and the QP solve)."""


def _check_reward_names(reward_names: Sequence[str]) -> list[str]:
    names = list(reward_names) if not isinstance(reward_names, str) else [reward_names]
    if not names or not all(isinstance(n, str) and n for n in names):
        raise ValueError(f"reward_names must be a non-empty list of names; got {reward_names!r}")
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ValueError(f"reward_names must be distinct; repeated: {', '.join(dupes)}")
    return names


def _check_reward_weights(reward_weights: Sequence[float] | None, K: int) -> np.ndarray:
    if reward_weights is None:
        return np.ones(K)
    w = np.asarray(reward_weights, dtype=np.float64).reshape(-1)
    if w.size != K or not np.isfinite(w).all() or (w < 0).any():
        raise ValueError(f"reward_weights must be {K} finite numbers >= 0 (one per reward); "
                         f"got {list(reward_weights)}")
    return w


def _check_step(step: int) -> int:
    if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0:
        raise ValueError(f"step={step!r}: must be an integer >= 0")
    return int(step)


def _uniform(K: int) -> np.ndarray:
    return np.full(K, 1.0 / K)


class Balancer(abc.ABC):
    """Base class: Gram matrix of raw per-reward gradients (+ explicit state) → K weights.

    Subclasses set ``name`` and ``description`` and implement :meth:`advantage_weights`. The default
    :meth:`balance` is the fixed-α one (diagnostics only: alpha_raw = alpha_ema = grad_weights = α,
    solver "fixed"); stateful balancers extend :meth:`state_dict` / :meth:`load_state_dict`.
    """

    name: ClassVar[str] = ""
    description: ClassVar[str] = ""
    scalarize: ClassVar[bool] = False
    """True only for weighted_sum: the rewards are combined into one scalar BEFORE the advantage."""

    def __init__(self, reward_names: list[str], config: BalanceConfig,
                 reward_weights: list[float] | None = None):
        self.reward_names = _check_reward_names(reward_names)
        config.validate(self.reward_names)
        self.config = config
        self.reward_weights = _check_reward_weights(reward_weights, self.num_rewards)

    @property
    def num_rewards(self) -> int:
        """K."""
        return len(self.reward_names)

    def harmonizes(self, step: int) -> bool:
        """Must this step compute the K per-reward gradients to decide its update? (MARBLE harmonized steps.)"""
        _check_step(step)
        return False

    @abc.abstractmethod
    def advantage_weights(self, step: int) -> np.ndarray:
        """[K] coefficients on the simplex combining the per-reward advantages in one backward (spec §5)."""

    def balance(self, gram: np.ndarray, step: int) -> BalanceDecision:
        """Fixed-α decision for diagnostics: alpha_raw = alpha_ema = grad_weights = α, solver "fixed"."""
        G = self._check_gram(gram)
        alpha = self.advantage_weights(step)
        return BalanceDecision(alpha.copy(), alpha.copy(), alpha.copy(), valid_gradients(G), "fixed")

    def state_dict(self) -> dict:
        """JSON-serializable state (identity only for stateless balancers)."""
        return {"balancer": self.name, "reward_names": list(self.reward_names)}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`; ValueError if it was saved by another balancer or reward set."""
        if not isinstance(state, dict):
            raise ValueError(f"balancer state must be a dict from state_dict(); got {type(state).__name__}")
        if state.get("balancer") != self.name:
            raise ValueError(f"balancer state was saved by {state.get('balancer')!r}, "
                             f"cannot load it into {self.name!r}")
        if list(state.get("reward_names", [])) != self.reward_names:
            raise ValueError(f"balancer state is for rewards {state.get('reward_names')!r}; "
                             f"this run has {self.reward_names!r}")

    def _check_gram(self, gram: Any) -> np.ndarray:
        G = _as_square_matrix(gram)
        if G.shape[0] != self.num_rewards:
            raise ValueError(f"gram must be K×K with K = {self.num_rewards} rewards "
                             f"({', '.join(self.reward_names)}); got shape {G.shape}")
        return G

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, rewards={self.reward_names!r})"


_BALANCERS: dict[str, type[Balancer]] = {}


def register_balancer(cls: type[Balancer]) -> type[Balancer]:
    """Class decorator: make ``cls`` available by ``cls.name`` (which must be new and non-empty)."""
    if not cls.name or not cls.description:
        raise ValueError(f"{cls.__name__} needs a non-empty class attribute `name` and `description`")
    if cls.name in _BALANCERS and _BALANCERS[cls.name] is not cls:
        raise ValueError(f"balancer name {cls.name!r} is already registered by {_BALANCERS[cls.name].__name__}")
    _BALANCERS[cls.name] = cls
    return cls


def available_balancers() -> dict[str, str]:
    """Registered balancer name → one-line description."""
    return {name: cls.description for name, cls in _BALANCERS.items()}


def make_balancer(name: str, reward_names: list[str], config: BalanceConfig,
                  reward_weights: list[float] | None = None) -> Balancer:
    """Build the balancer registered as ``name``; ValueError listing the valid choices otherwise."""
    if name not in _BALANCERS:
        raise ValueError(f"balancer {name!r} is unknown; valid choices: {', '.join(sorted(_BALANCERS))}")
    return _BALANCERS[name](reward_names, config, reward_weights)


# ---- weightings: Gram in, weights out ---------------------------------------------------------------

Weighting = Callable[[np.ndarray], "tuple[np.ndarray, str]"]
"""A Gram matrix of the (normalized) valid gradients -> (weights >= 0 with a positive sum, solver status)."""


def min_norm_weighting(gram: np.ndarray) -> tuple[np.ndarray, str]:
    """The min-norm α* (spec §4.3), summing to 1."""
    sol = solve_min_norm(gram)
    return sol.alpha, sol.status


class TorchJDWeighting:
    """A Gramian weighting of ``torchjd.aggregation`` by class name. If torchjd fails on a Gram matrix, the
    min-norm α* is used and the status says "min-norm(torchjd:<Weighting>:error:<Exception>)"."""

    def __init__(self, name: str):
        self.name = name

    def __call__(self, gram: np.ndarray) -> tuple[np.ndarray, str]:
        import torch
        from torchjd import aggregation

        status = f"torchjd:{self.name}"
        try:
            w = getattr(aggregation, self.name)()(torch.as_tensor(gram, dtype=torch.float64))
            w = w.detach().cpu().numpy().astype(np.float64)
            if not (np.isfinite(w).all() and (w >= 0).all() and w.sum() > 0):
                raise ValueError(f"weights {w.tolist()} are not finite, >= 0 with a positive sum")
        except Exception as e:  # quadprog failures and friends: reported in the status, then min-norm
            sol = solve_min_norm(gram)
            return sol.alpha, f"min-norm({status}:error:{type(e).__name__})"
        return w, status


# ---- MARBLE ---------------------------------------------------------------------------------------

@register_balancer
class MarbleBalancer(Balancer):
    """MARBLE (spec §4-§6): min-norm α* on the normalized Gram every N steps, EMA ᾱ in between.

    State: ᾱ (``alpha_ema``, None before the first solve), ``last_harmonized_step``, ``num_solves``.
    ``weighting`` (Gram in, weights and a status out) is the part other balancers swap.
    """

    weighting: ClassVar[Weighting] = staticmethod(min_norm_weighting)

    name = "marble"
    description = "MARBLE: min-norm QP on normalized per-reward gradients every N steps, EMA ᾱ in between"

    def __init__(self, reward_names: list[str], config: BalanceConfig,
                 reward_weights: list[float] | None = None):
        super().__init__(reward_names, config, reward_weights)
        self.alpha_ema: np.ndarray | None = None
        self.last_harmonized_step: int | None = None
        self.num_solves = 0

    # -- schedule (spec §5) --
    def harmonizes(self, step: int) -> bool:
        """Harmonized step when step < warmup_steps, before the first solve, or N = harmonize_every steps after
        the last harmonized step."""
        step = _check_step(step)
        return (step < self.config.warmup_steps or self.last_harmonized_step is None
                or step - self.last_harmonized_step >= self.config.harmonize_every)

    def advantage_weights(self, step: int) -> np.ndarray:
        """ᾱ (uniform 1/K before the first solve)."""
        _check_step(step)
        return _uniform(self.num_rewards) if self.alpha_ema is None else self.alpha_ema.copy()

    # -- one harmonized step (spec §4) --
    def balance(self, gram: np.ndarray, step: int) -> BalanceDecision:
        start = time.perf_counter()
        step = _check_step(step)
        G = self._check_gram(gram)
        valid = valid_gradients(G)
        alpha_raw, grad_weights, solver = self._harmonize(G, valid)
        self._update_ema(alpha_raw, solver)
        self.last_harmonized_step = step
        self.num_solves += 1
        return BalanceDecision(alpha_raw, self.advantage_weights(step), grad_weights, valid, solver,
                               time.perf_counter() - start)

    def _harmonize(self, G: np.ndarray, valid: np.ndarray) -> tuple[np.ndarray, np.ndarray, str]:
        """(α*, c, solver) with d = Σ c_k g_k; invalid rewards get α*_k = c_k = 0.

        With ``reward_groups`` (the release's pareto.reward_groups) the QP runs on the M groups and lone rewards,
        a group's gradient being the mean of its members' (G_M = P G Pᵀ, P [M, K] the averaging matrix, invalid
        gradients counted as zero as the release's sanitized vectors are); each member gets α_group/|group| and
        c_group/|group|."""
        P = self._grouping()
        if P is None:
            return self._harmonize_units(G, valid)
        G0 = np.where(np.outer(valid, valid), np.nan_to_num(G), 0.0)
        G_M = P @ G0 @ P.T
        alpha_M, c_M, solver = self._harmonize_units(G_M, valid_gradients(G_M))
        return P.T @ alpha_M, P.T @ c_M, solver  # P's rows are 1/|group| on the members

    def _grouping(self) -> np.ndarray | None:
        """[M, K] averaging matrix of the groups then the lone rewards (None without reward_groups)."""
        groups = self.config.reward_groups
        if not groups:
            return None
        grouped = {r for members in groups.values() for r in members}
        rows = [list(members) for members in groups.values()] + [[r] for r in self.reward_names if r not in grouped]
        P = np.zeros((len(rows), self.num_rewards))
        for i, members in enumerate(rows):
            for r in members:
                P[i, self.reward_names.index(r)] = 1.0 / len(members)
        return P

    def unit_names(self) -> list[str]:
        """The names the QP balances: the groups, then the rewards in no group (the rewards without groups)."""
        groups = self.config.reward_groups
        grouped = {r for members in groups.values() for r in members}
        return list(groups) + [r for r in self.reward_names if r not in grouped]

    def _harmonize_units(self, G: np.ndarray, valid: np.ndarray) -> tuple[np.ndarray, np.ndarray, str]:
        """The min-norm step on M units (rewards or groups), with the release's per-unit weights and α floor."""
        K = G.shape[0]
        alpha, weights = np.zeros(K), np.zeros(K)
        idx = np.flatnonzero(valid)
        if idx.size == 0:
            return alpha, weights, "no-valid"
        if idx.size == 1:                              # one valid gradient: used raw
            alpha[idx], weights[idx] = 1.0, 1.0
            return alpha, weights, "single-valid"
        G_valid = G[np.ix_(idx, idx)]
        norms = np.sqrt(np.diag(G_valid))              # ‖g_k‖
        names = self.unit_names()
        u = np.array([float(self.config.group_weights.get(names[i], 1.0)) for i in idx])  # release: weights
        scale = norms if self.config.normalize else np.ones_like(norms)
        G_solve = G_valid / np.outer(scale, scale) * np.outer(u, u)   # Gram of u_k·ĝ_k (or u_k·g_k)
        w, solver = self._solve_floored(G_solve)
        if self.config.normalize:
            weights[idx] = w * u * norms.mean() / norms  # d = Σ w_k u_k ĝ_k · mean‖g‖
        else:                                          # ablation: raw scale decides α
            weights[idx] = w * u
        alpha[idx] = w / w.sum()
        return alpha, weights, solver

    def _solve_floored(self, G: np.ndarray) -> tuple[np.ndarray, str]:
        """min αᵀGα on the simplex with α_k >= f (alpha_floor, capped at 1/M). With α = f·1 + s·β
        (s = 1 − M·f) and β on the simplex, αᵀGα = ‖Σ_k β_k h_k‖² for h_k = s·g_k + f·Σ_j g_j: the plain
        min-norm problem on the Gram H of the h_k, solved by the same QP."""
        M = G.shape[0]
        f = min(float(self.config.alpha_floor), 1.0 / M)
        if f <= 0:
            return self._solve_weights(G)
        s = 1.0 - M * f
        if s <= 1e-12:
            return np.full(M, 1.0 / M), "floor:uniform"
        G1 = G.sum(axis=1)
        H = s * s * G + s * f * (G1[:, None] + G1[None, :]) + f * f * G.sum()
        beta, solver = self._solve_weights(H)
        return f + s * beta / beta.sum(), f"{solver}:floor={f:g}"

    def _solve_weights(self, gram: np.ndarray) -> tuple[np.ndarray, str]:
        """Weights w on the (normalized) valid gradients, from the balancer's weighting."""
        return self.weighting(gram)

    def _update_ema(self, alpha_raw: np.ndarray, solver: str) -> None:
        """ᾱ ← ρ·ᾱ + (1 − ρ)·α* (spec §6); the first solve sets ᾱ = α*; "no-valid" leaves ᾱ as is."""
        if solver == "no-valid":
            return
        if self.alpha_ema is None:
            self.alpha_ema = alpha_raw.copy()
        else:
            rho = float(self.config.ema_rho)
            self.alpha_ema = rho * self.alpha_ema + (1.0 - rho) * alpha_raw

    # -- state --
    def state_dict(self) -> dict:
        state = super().state_dict()
        state.update(alpha_ema=None if self.alpha_ema is None else [float(a) for a in self.alpha_ema],
                     last_harmonized_step=self.last_harmonized_step, num_solves=self.num_solves)
        return state

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        alpha = state.get("alpha_ema")
        if alpha is not None:
            alpha = np.asarray(alpha, dtype=np.float64).reshape(-1)
            if (alpha.size != self.num_rewards or not np.isfinite(alpha).all() or (alpha < 0).any()
                    or abs(alpha.sum() - 1.0) > 1e-6):
                raise ValueError(f"alpha_ema must be {self.num_rewards} numbers >= 0 summing to 1; "
                                 f"got {state.get('alpha_ema')!r}")
        last = state.get("last_harmonized_step", state.get("last_full_step"))  # the old name in older checkpoints
        if last is not None and (isinstance(last, bool) or not isinstance(last, int) or last < 0):
            raise ValueError(f"last_harmonized_step must be null or an integer >= 0; got {last!r}")
        solves = state.get("num_solves", 0)
        if isinstance(solves, bool) or not isinstance(solves, int) or solves < 0:
            raise ValueError(f"num_solves must be an integer >= 0; got {solves!r}")
        self.alpha_ema, self.last_harmonized_step, self.num_solves = alpha, last, solves


@register_balancer
class MarbleFullBalancer(MarbleBalancer):
    """MARBLE without amortization: the QP is solved on every step (spec §7 ablation)."""

    name = "marble_full"
    description = "MARBLE solving the QP on every step (no amortization; K+1 backward passes per step)"

    def harmonizes(self, step: int) -> bool:
        _check_step(step)
        return True


# ---- fixed-α baselines (spec §7) --------------------------------------------------------------------

@register_balancer
class WeightedSumBalancer(Balancer):
    """Weighted-sum baseline: one scalar reward Σ w_k R_k (NaN-aware mean), one advantage.

    ``scalarize`` tells the trainer to combine the rewards before the advantage
    (:func:`core.advantages.weighted_sum_rewards`). :meth:`advantage_weights` is informational (w / Σw);
    :meth:`balance` returns the "fixed" decision with α = w / Σw for diagnostics only — the true
    weighted-sum update is the gradient of the scalar-advantage loss, which the trainer measures itself.
    """

    name = "weighted_sum"
    description = "Weighted-sum baseline: one scalar reward Σ w_k R_k, one advantage (DiffusionNFT default)"
    scalarize = True

    def __init__(self, reward_names: list[str], config: BalanceConfig,
                 reward_weights: list[float] | None = None):
        super().__init__(reward_names, config, reward_weights)
        if not self.reward_weights.sum() > 0:
            raise ValueError(f"weighted_sum needs at least one reward weight > 0; "
                             f"got {self.reward_weights.tolist()}")

    def advantage_weights(self, step: int) -> np.ndarray:
        _check_step(step)
        return self.reward_weights / self.reward_weights.sum()


@register_balancer
class EqualBalancer(Balancer):
    """Per-reward advantages mixed with fixed α = 1/K (no QP)."""

    name = "equal"
    description = "Per-reward advantages mixed with fixed equal α = 1/K (no QP)"

    def advantage_weights(self, step: int) -> np.ndarray:
        _check_step(step)
        return _uniform(self.num_rewards)


@register_balancer
class SingleBalancer(Balancer):
    """Specialist baseline: α one-hot on ``config.single_reward``."""

    name = "single"
    description = "Single-reward specialist: α one-hot on balance.single_reward"

    def __init__(self, reward_names: list[str], config: BalanceConfig,
                 reward_weights: list[float] | None = None):
        super().__init__(reward_names, config, reward_weights)
        if config.single_reward not in self.reward_names:
            raise ValueError(f"balance.single_reward={config.single_reward!r}: strategy 'single' needs one of "
                             f"the run's rewards: {', '.join(self.reward_names)}")
        self.index = self.reward_names.index(config.single_reward)

    def advantage_weights(self, step: int) -> np.ndarray:
        _check_step(step)
        alpha = np.zeros(self.num_rewards)
        alpha[self.index] = 1.0
        return alpha


@register_balancer
class SequentialBalancer(Balancer):
    """Sequential baseline: stage i trains on its rewards (α uniform over them) for its steps; after the
    last stage ends, the last stage continues."""

    name = "sequential"
    description = "Sequential stages: each trains on a subset of rewards for a number of steps"

    def __init__(self, reward_names: list[str], config: BalanceConfig,
                 reward_weights: list[float] | None = None):
        super().__init__(reward_names, config, reward_weights)
        if not config.stages:
            raise ValueError("balance.stages=[]: strategy 'sequential' needs at least one stage")
        self.stage_ends = np.cumsum([st.steps for st in config.stages])   # exclusive end step of each stage

    def current_stage(self, step: int) -> int:
        """Index of the stage that step belongs to (the last stage after the schedule ends)."""
        step = _check_step(step)
        return min(int(np.searchsorted(self.stage_ends, step, side="right")), len(self.stage_ends) - 1)

    def advantage_weights(self, step: int) -> np.ndarray:
        rewards = self.config.stages[self.current_stage(step)].rewards
        alpha = np.array([1.0 if name in rewards else 0.0 for name in self.reward_names])
        return alpha / alpha.sum()


# ---- optional: torchjd Gramian weightings with MARBLE's schedule -------------------------------------

def _torchjd_available() -> bool:
    """torchjd with its quadprog projector extra (``torchjd[quadprog-projector]``), found without importing."""
    import importlib.util

    return all(importlib.util.find_spec(m) is not None for m in ("torchjd", "qpsolvers", "quadprog"))


class TorchJDBalancer(MarbleBalancer):
    """MARBLE's schedule, EMA and normalization with another Gramian weighting from torchjd in place of
    the min-norm QP (spec §4.3 swapped). The weighting's raw weights w on the normalized gradients give
    grad_weights c_k = w_k · mean‖g‖/‖g_k‖ (c = w with ``normalize=False``) and α = w / Σw feeds the EMA
    for the amortized steps (:class:`TorchJDWeighting`).
    """


if _torchjd_available():

    @register_balancer
    class UPGradBalancer(TorchJDBalancer):
        name = "upgrad"
        description = "UPGrad (torchjd) weights on normalized gradients, with MARBLE's schedule and EMA"
        weighting = TorchJDWeighting("UPGradWeighting")

    @register_balancer
    class DualProjBalancer(TorchJDBalancer):
        name = "dualproj"
        description = "DualProj (torchjd) weights on normalized gradients, with MARBLE's schedule and EMA"
        weighting = TorchJDWeighting("DualProjWeighting")
