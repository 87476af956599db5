"""MARBLE training on the DiffusionNFT loss, one readable loop (MARBLE_SPEC §2-§6).

Per step:  rollout (old adapter) -> rewards R [B, K] -> per-reward advantages A [B, K] -> r [B, K]
-> for each unit (a micro-batch of samples at one of their training timesteps):
     forward once: v_old, v_θ, v_ref -> L⁺, L⁻, KL                           (shared by all K rewards)
     harmonized unit: K backward passes -> g_k, Gram, QP -> d = Σ c_k g_k, plus ∇KL
     amortized unit: one backward of Σ_k ᾱ_k ℓ_k + λ_KL·KL                   (§5, single-reward cost)
-> clip, AdamW, θ_old ← η·θ_old + (1-η)·θ.
The trainer knows nothing about storage: it emits events (core.events) and checks ``should_stop``.
Every random draw of step s comes from (seed, s) — per sample from (seed, s, global sample index) —
which makes resume exact and a W-process step equal to a 1-process step on the same global batch.

Under torchrun (core.distributed, spec §9) each process rolls out, scores and trains B/W samples; R is
gathered so the advantages see the whole batch; per-reward gradients are computed under DDP's no_sync()
and all-reduced together once; ordinary backward passes are DDP's. Rank 0 alone emits events and writes.
"""

from __future__ import annotations

import logging
import math
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from core.advantages import per_reward_advantages, weighted_sum_rewards
from core import checkpoint as ckpt_io
from core.balancing import make_balancer
from core.config import TrainConfig
from core.distributed import check_batch_split, setup as setup_distributed
from core.events import (BalanceEvent, CheckpointEvent, EndEvent, Event, NoticeEvent, PreviewEvent, SampleEvent,
                         StartEvent, StepEvent)
from core.loss import advantage_to_r, amortized_objective, kl_loss, nft_loss_terms, per_reward_objectives
from core.models import Policy, VelocityInputs, load_pipeline
from core.per_sample import (PerSampleGradients, available_memory, conflict_attribution, jacobian_bytes,
                             per_reward_gradients)
from core.prompts import PromptItem, PromptSampler
from core.rewards import make_reward
from core.sampling import Rollout, decode_latents, encode_prompts, generate_latents, sampler_sigmas

log = logging.getLogger(__name__)

EMA_FOLDER = ckpt_io.EMA_FOLDER
STATE_FILE = ckpt_io.STATE_TENSORS_FILE  # + training_state.json and manifest.json (core.checkpoint)
# Fields that may change when a run is resumed; anything else must match the checkpoint.
RESUMABLE_CHANGES = ("steps", "checkpoint_every", "sample_every", "preview_prompts", "num_threads")


class StopTraining(Exception):
    pass


@dataclass
class TrainResult:
    status: str  # "completed" or "stopped"
    step: int
    out_dir: Path
    last_checkpoint: Path | None


# Independent random streams of a step beyond its rollout (which draws from default_rng([seed, step])).
_ORDER, _TIMESTEPS, _NOISE, _DROPOUT = 0, 1, 2, 3


def _generator(*keys: int) -> torch.Generator:
    """A CPU generator seeded from integer keys, e.g. (seed, step, _NOISE, sample, j): no shared state."""
    return torch.Generator().manual_seed(int(np.random.SeedSequence(list(keys)).generate_state(1)[0]))


def _timestep_order(seed: int, step: int, sample: int, grid: int) -> torch.Tensor:
    """[grid] the order in which global sample ``sample`` visits the σ grid at ``step`` (spec §2)."""
    return torch.randperm(grid, generator=_generator(seed, step, _TIMESTEPS, sample))


def _noise(seed: int, step: int, sample: int, j: int, shape: torch.Size) -> torch.Tensor:
    """ε of global sample ``sample`` at its j-th training timestep of ``step``."""
    return torch.randn(shape, generator=_generator(seed, step, _NOISE, sample, j))


def _flat(grads: tuple[torch.Tensor | None, ...], params: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([(g if g is not None else torch.zeros_like(p)).reshape(-1) for g, p in zip(grads, params)])


def _add_flat_to_grad(params: list[torch.nn.Parameter], flat: torch.Tensor) -> None:
    offset = 0
    for p in params:
        n = p.numel()
        view = flat[offset:offset + n].view_as(p).to(p.dtype)
        p.grad = view.clone() if p.grad is None else p.grad.add_(view)
        offset += n


def _cos(a: torch.Tensor, b: torch.Tensor) -> float:
    na, nb = a.norm().item(), b.norm().item()
    if not (na > 1e-12 and nb > 1e-12 and math.isfinite(na) and math.isfinite(nb)):
        return float("nan")
    return float((a @ b).item() / (na * nb))


@dataclass
class _HarmonizedSums:
    """Σ over a step's harmonized units of g [K, P], ∇KL [P] and ℓ_k [K] (harmonize_scope "step")."""

    g: torch.Tensor
    g_kl: torch.Tensor
    losses: torch.Tensor

    @classmethod
    def zeros(cls, K: int, P: int, device) -> "_HarmonizedSums":
        def z(*shape):
            return torch.zeros(*shape, dtype=torch.float64, device=device)
        return cls(z(K, P), z(P), z(K))

    def add(self, g: torch.Tensor, g_kl: torch.Tensor, losses: torch.Tensor) -> None:
        self.g += g
        self.g_kl += g_kl
        self.losses += losses


def harmonized_order(valid: torch.Tensor, m: int) -> tuple[torch.Tensor, list[int]]:
    """An order of a process's n samples whose first micro-batch (its first m) holds at least one valid sample
    of every reward that has one anywhere (spec §4: a reward absent from the harmonized unit would get a zero
    gradient, α = 0 and an EMA cut). Samples move only when a reward is missing: greedily, a valid sample of
    the missing reward swaps with a first-micro-batch sample no other present reward depends on alone.
    Returns (order [n], the rewards it could not bring in). Shapes: valid [n, K] bool."""
    n, K = valid.shape
    order = torch.arange(n)
    missing = []
    for k in range(K):
        head = order[:m]
        if not valid[order, k].any() or valid[head, k].any():
            continue
        counts = valid[head].sum(dim=0)  # [K] valid samples per reward in the first micro-batch
        victims = [p for p in range(min(m, n)) if not bool(((counts == 1) & valid[order[p]]).any())]
        donor = next(p for p in range(m, n) if valid[order[p], k])
        if not victims:
            missing.append(k)
            continue
        p = victims[0]
        order[p], order[donor] = order[donor].clone(), order[p].clone()
    return order, missing


class Trainer:
    def __init__(self, config: TrainConfig, out_dir: str | Path,
                 on_event: Callable[[Event], None] | None = None,
                 should_stop: Callable[[], bool] | None = None):
        self.config = config
        self.out_dir = Path(out_dir)
        self.on_event = on_event
        self.should_stop = should_stop or (lambda: False)
        self._observer_failed = False
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.dist = setup_distributed(config.model.device)  # inactive outside torchrun
        if not self.dist.is_main:
            self.on_event = None  # rank 0 alone reports
        try:
            self.micro_batch_size = check_batch_split(config, self.dist.world_size)  # adapted to B/W
            if len(set(self.dist.all_gather_objects(config.to_json()))) > 1:
                raise ValueError("the processes of this run were given different configs; every rank must "
                                 "run the same one")
            from core.preflight import check_device_memory

            check_device_memory(config, self.dist.device, self.dist.world_size)  # refused before the model loads
        except ValueError:
            self.dist.close()
            raise
        self.device = self.dist.device
        self.pipe = load_pipeline(config.model.name, config.model.dtype, str(self.device))
        self.policy = Policy(self.pipe, config.model, self.device, seed=config.seed)
        self.policy.train_module = self.dist.wrap(self.policy.transformer)  # DDP under torchrun
        self.params = self.policy.parameters
        o = config.optim
        self.optimizer = torch.optim.AdamW(self.params, lr=o.lr, betas=(o.beta1, o.beta2),
                                           weight_decay=o.weight_decay, eps=o.eps)
        self.reward_names = config.reward_names
        self.rewards = [make_reward(r.name, **r.kwargs) for r in config.rewards]
        self.reward_weights = [r.weight for r in config.rewards]
        self.balancer = make_balancer(config.balance.strategy, self.reward_names, config.balance, self.reward_weights)
        self.prompts = PromptSampler(config.prompts.sources, config.prompts.split)
        self._stage_prompts: dict[tuple[str, ...], PromptSampler] = {}  # sequential stages' own sources
        # the rollout sampler's σ grid without the final 0: the training timesteps (spec §2)
        self.sigmas = sampler_sigmas(self.pipe, config.sampling.num_steps, sampler=config.sampling.sampler)[:-1]
        self.step = 0
        self.gradient_path, self._per_sample = self._choose_gradient_path()
        self._attribution = None  # the current unit's conflict attribution (core.per_sample.conflict_attribution)
        # θ_ema of the LoRA parameters (OptimConfig.ema_decay; None when off), starting at the initial adapter
        self.ema = (None if config.optim.ema_decay == 0 else
                    {n: p.detach().clone() for n, p in self.policy.named_trainable.items()})

    # ---- events -----------------------------------------------------------------------------------
    def emit(self, event: Event) -> None:
        """Deliver an event; a failing observer is logged once and never stops training."""
        if self.on_event is None:
            return
        try:
            self.on_event(event)
        except Exception:  # noqa: BLE001 - observers must not kill training
            if not self._observer_failed:
                log.exception("event observer failed on %s; training continues", event.kind)
            self._observer_failed = True

    # ---- rollout and rewards ----------------------------------------------------------------------
    def rollout(self, step: int, indices: torch.Tensor | None = None) -> Rollout:
        """Step ``step``'s batch: B = prompts_per_step × images_per_prompt samples drawn from (seed, step).
        Only the samples at the global positions ``indices`` (default: all, in order) are generated —
        a process's share; each image depends only on its prompt and its own seed."""
        c = self.config.sampling
        rng = np.random.default_rng([self.config.seed, step])
        items = self._prompt_sampler(step).sample(c.prompts_per_step, rng, step)
        prompts = [it.text for it in items for _ in range(c.images_per_prompt)]
        metadata = [dict(it.metadata) for it in items for _ in range(c.images_per_prompt)]
        seeds = [int(s) for s in rng.integers(0, 2**31 - 1, size=len(prompts))]
        groups = self._groups()
        if indices is not None:
            pick = indices.tolist()
            prompts, metadata, seeds = [prompts[i] for i in pick], [metadata[i] for i in pick], [seeds[i] for i in pick]
            groups = groups[indices]
        emb = encode_prompts(self.pipe, prompts, c.max_sequence_length, c.guidance_scale, self.device)
        chunk = c.rollout_batch_size or len(prompts)  # bounds sampler memory; images depend on seeds only
        x0_parts, image_parts = [], []
        for start in range(0, len(prompts), chunk):
            part = list(range(start, min(start + chunk, len(prompts))))
            x0 = generate_latents(self.pipe, self.policy.velocity_old, emb.index(part), seeds[start:start + chunk],
                                  c.num_steps, c.guidance_scale, c.resolution, self.device, c.sampler)
            x0_parts.append(x0)
            image_parts.append(decode_latents(self.pipe, x0))
        x0, images = torch.cat(x0_parts), torch.cat(image_parts)
        return Rollout(x0, images, prompts, metadata, seeds, groups, emb, self.sigmas)

    def _prompt_sampler(self, step: int) -> PromptSampler:
        """The run's sampler, or a sequential stage's own sources (StageConfig.sources)."""
        if not hasattr(self.balancer, "current_stage"):
            return self.prompts
        sources = self.config.balance.stages[self.balancer.current_stage(step)].sources
        if not sources:
            return self.prompts
        key = tuple(sources)
        if key not in self._stage_prompts:
            self._stage_prompts[key] = PromptSampler(list(sources), self.config.prompts.split)
        return self._stage_prompts[key]

    def _groups(self) -> torch.Tensor:
        """[B] the prompt group of each sample of a step's global batch."""
        c = self.config.sampling
        return torch.arange(c.prompts_per_step).repeat_interleave(c.images_per_prompt)

    def score(self, batch: Rollout) -> torch.Tensor:
        """R [B, K] on CPU, NaN where a reward does not apply."""
        cols = [reward(batch.images, batch.prompts, batch.metadata).float().cpu() for reward in self.rewards]
        return torch.stack(cols, dim=1)

    # ---- one unit's forward -----------------------------------------------------------------------
    def _forward(self, batch: Rollout, idx: torch.Tensor, t: torch.Tensor, noise: torch.Tensor,
                 record: bool = False):
        """L⁺, L⁻ and KL [b] for samples ``idx`` at σ = t [b], sharing one set of predictions. With ``record``
        (a unit that needs the per-reward gradients, on the per-sample path) v_θ's forward is recorded."""
        nft = self.config.nft
        x0 = batch.x0[idx]
        t_dev = t.to(self.device)
        tb = t_dev.view(-1, 1, 1, 1)
        x_t = (1 - tb) * x0 + tb * noise.to(self.device)
        emb = batch.embeddings
        inp = VelocityInputs(x_t, t_dev, emb.prompt_embeds[idx], emb.pooled[idx])
        v_old = self.policy.velocity_old(inp)
        if record and self._per_sample is not None:
            with self._per_sample.recording(len(idx), passes=2, device=self.device):
                v_theta = self.policy.velocity(inp)
        else:
            v_theta = self.policy.velocity(inp)
        l_pos, l_neg = nft_loss_terms(v_theta, v_old, x_t, x0, t_dev, nft.nft_beta)
        if nft.kl_coef > 0:
            kl = kl_loss(v_theta, self.policy.velocity_ref(inp))
        else:
            kl = torch.zeros_like(l_pos)
        return l_pos, l_neg, kl

    def _grads(self, loss: torch.Tensor, retain: bool = True) -> torch.Tensor:
        g = torch.autograd.grad(loss, self.params, retain_graph=retain, allow_unused=True)
        return _flat(g, self.params).double()

    # ---- one training step ------------------------------------------------------------------------
    def train_step(self, step: int) -> None:
        cfg, nft, bal, dist = self.config, self.config.nft, self.config.balance, self.dist
        t0 = time.perf_counter()
        # This process's share of the global batch: B/W consecutive samples of one permutation drawn from
        # (seed, step). Micro-batches are consecutive runs of that permutation, so a W-process step trains
        # exactly the units of a 1-process step, spread over the processes (spec §9).
        B, K = cfg.sampling.batch_size, len(self.reward_names)
        order = torch.randperm(B, generator=_generator(cfg.seed, step, _ORDER))  # [B] global sample indices
        n = B // dist.world_size
        shard = order[dist.rank * n:(dist.rank + 1) * n]  # [n] the samples this process generates and trains
        batch = self.rollout(step, shard)
        R = torch.empty(B, K)
        R[order] = dist.all_gather_rows(self.score(batch))  # [B, K] the whole batch, NaN = not applicable
        groups = self._groups()
        A = per_reward_advantages(R, groups, cfg.advantage.std_mode, cfg.advantage.eps)  # [B, K]
        r_rewards = advantage_to_r(A[shard], nft.adv_clip_max).to(self.device)  # [n, K], NaN = not applicable
        if self.balancer.scalarize:  # weighted sum: one scalar reward, one advantage
            R_ws = weighted_sum_rewards(R, self.reward_weights)
            A_ws = per_reward_advantages(R_ws[:, None], groups, cfg.advantage.std_mode, cfg.advantage.eps)
            A_train = A_ws[shard].to(self.device)  # [n, 1]
        else:
            A_train = A[shard].to(self.device)  # [n, K]

        # Units: micro-batches x each sample's permuted timesteps (spec §2); the permutation and the noise
        # of sample i come from (seed, step, i), whichever process trains it.
        T_grid = len(self.sigmas)
        T = max(1, int(T_grid * nft.timestep_fraction))
        t_index = torch.stack([_timestep_order(cfg.seed, step, i, T_grid)[:T] for i in shard.tolist()])  # [n, T]
        harmonize = self.balancer.harmonizes(step) and not self.balancer.scalarize
        local = torch.arange(n)  # the order in which this process's samples form micro-batches
        if harmonize and bal.harmonize_scope == "first_microbatch" and step >= bal.warmup_steps:
            local = self._stratify_harmonized(r_rewards, step)
        units = [(mb, j) for mb in local.split(self.micro_batch_size) for j in range(T)]
        U = len(units)  # this process's units; every process has as many (core.distributed.check_batch_split)
        kinds = self._unit_kinds(step, U, harmonize)
        whole_step = harmonize and bal.harmonize_scope == "step"
        acc = _HarmonizedSums.zeros(K, self.policy.num_trainable, self.device) if whole_step else None
        diag: dict | None = None
        attribution: dict | None = None  # of the unit the diagnostics describe (whole step: of its last unit)
        loss_total, kl_total = 0.0, 0.0
        for p in self.params:
            p.grad = None

        for ui, (idx, j) in enumerate(units):
            if self._stop_requested():
                raise StopTraining()
            t = self.sigmas[t_index[idx, j]]
            noise = torch.stack([_noise(cfg.seed, step, i, j, batch.x0.shape[1:]) for i in shard[idx].tolist()])
            kind = kinds[ui]
            # Per-reward gradients never go through DDP's reducer: they are all-reduced by hand, once. So every
            # unit runs under no_sync() except the step's last amortized backward, which reduces all of .grad.
            self._attribution = None
            with dist.sync_context(self.policy.train_module, sync=kind == "amortized" and ui == U - 1):
                l_pos, l_neg, kl = self._forward(batch, idx, t, noise, record=kind != "amortized")
                kl_total += kl.mean().item() / U
                r_unit, A_unit, dropped = self._reward_dropout(step, j, r_rewards[idx], A_train[idx])
                if kind == "harmonized":
                    unit_diag, loss = self._harmonized_unit(l_pos, l_neg, kl, r_unit, step, U, acc)
                    diag = unit_diag or diag
                elif kind == "diagnostic":
                    diag, loss = self._diagnostic_unit(l_pos, l_neg, kl, r_unit, A_unit, step, U)
                else:
                    loss = self._amortized_unit(l_pos, l_neg, kl, A_unit, step, U)
                if kind != "amortized" and diag is not None:
                    diag["dropped"] = dropped
                if self._attribution is not None:  # this unit's gradients are the recorded ones (or one of the step's)
                    attribution = self._attribution_record(self._attribution, batch, idx, t, j, whole_step)
                loss_total += loss

        if whole_step:  # one solve on the whole step's mean gradients
            diag, loss_part = self._apply_harmonized(acc.g / U, acc.g_kl / U, acc.losses / U, 1.0, step)
            loss_total += loss_part

        grad_norm = self._clip_and_step(step)
        (stats,) = dist.all_reduce_mean(torch.tensor([loss_total, kl_total], dtype=torch.float64))  # logging only
        loss_total, kl_total = stats.tolist()
        seconds = time.perf_counter() - t0
        self.step = step + 1
        alpha_now = self.balancer.advantage_weights(step)
        valid = torch.isfinite(R)
        self.emit(StepEvent(
            step=self.step,
            rewards={n: _nanmean(R[:, k]) for k, n in enumerate(self.reward_names)},
            alpha={n: float(a) for n, a in zip(self.reward_names, alpha_now)},
            seconds=seconds, loss=loss_total + nft.kl_coef * kl_total, kl=kl_total, grad_norm=grad_norm,
            phase="harmonized" if harmonize else ("diagnostic" if "diagnostic" in kinds else "amortized"),
            valid_counts={n: int(valid[:, k].sum()) for k, n in enumerate(self.reward_names)},
            reward_std={n: _nanstd(R[:, k]) for k, n in enumerate(self.reward_names)},
            stage=self.balancer.current_stage(step) if hasattr(self.balancer, "current_stage") else None))
        if diag is not None:
            self.emit(BalanceEvent(step=self.step, **diag, attribution=attribution or {}))
        if cfg.sample_every and (self.step % cfg.sample_every == 0 or self.step == 1) and dist.is_main:
            self._save_samples(batch, shard, R[shard], A[shard])
            if cfg.preview_prompts:
                self._save_previews()

    def _attribution_record(self, att, batch: Rollout, idx: torch.Tensor, t: torch.Tensor, j: int,
                            whole_step: bool) -> dict:
        """The BalanceEvent's ``attribution``: the unit's worst pair, its cosine, and per sample (this process's
        micro-batch at training timestep j) its prompt, source, seed, σ and share of that cosine. ``scope``
        "solve": the unit is the one the diagnostics describe (its cosine is the heatmap's); "unit": the step was
        solved as a whole (harmonize_scope = step), and this is its last unit's own conflict."""
        names = self.reward_names
        return {"pair": [names[att.k], names[att.l]], "cosine": att.cosine, "timestep_index": int(j),
                "scope": "unit" if whole_step else "solve",
                "samples": [{"prompt": batch.prompts[i], "source": batch.metadata[i].get("source"),
                             "seed": batch.seeds[i], "sigma": float(t[n]), "share": float(att.shares[n])}
                            for n, i in enumerate(idx.tolist())]}

    def _stratify_harmonized(self, r: torch.Tensor, step: int) -> torch.Tensor:
        """The sample order that puts every reward with a valid sample on this process into the harmonized
        first micro-batch (:func:`harmonized_order`); a reward that cannot be brought in is said in a notice."""
        order, missing = harmonized_order(torch.isfinite(r).cpu(), self.micro_batch_size)
        if missing:
            self.notice(f"step {step}: the harmonized micro-batch of {self.micro_batch_size} samples could not hold a "
                        f"valid sample of {', '.join(self.reward_names[k] for k in missing)} (each of its samples is "
                        f"another reward's only one); they get α* = 0 on this solve")
        return order

    def _reward_dropout(self, step: int, j: int, r: torch.Tensor, A: torch.Tensor):
        """The release's reward dropout (balance.reward_dropout, off by default): on the units at training
        timestep j of step s, each listed reward is dropped with its probability (ramped over
        reward_dropout_warmup_steps), the same draw on every process and micro-batch, from (seed, s, j). A dropped
        reward loses the samples some unlisted reward applies to (r, A → NaN there), keeping its signal only on
        samples no unlisted reward covers. Returns (r [b, K], A [b, K], names dropped)."""
        bal, names = self.config.balance, self.reward_names
        if not bal.reward_dropout or self.balancer.scalarize:
            return r, A, []
        warm = bal.reward_dropout_warmup_steps
        ramp = min(step / warm, 1.0) if warm > 0 else 1.0
        u = torch.rand(len(names), generator=_generator(self.config.seed, step, _DROPOUT, j))
        dropped = [k for k, n in enumerate(names) if u[k] < bal.reward_dropout.get(n, 0.0) * ramp]
        if not dropped:
            return r, A, []
        others = [k for k, n in enumerate(names) if n not in bal.reward_dropout]
        covered = (torch.isfinite(r[:, others]).any(dim=1) if others
                   else torch.zeros(len(r), dtype=torch.bool, device=r.device))
        r, A = r.clone(), A.clone()
        for k in dropped:
            r[covered, k] = math.nan
            A[covered, k] = math.nan
        return r, A, [names[k] for k in dropped]

    # ---- the three kinds of unit --------------------------------------------------------------------
    def _unit_kinds(self, step: int, U: int, harmonize: bool) -> list[str]:
        """What each of the step's U units does (spec §5):
        - "harmonized": K backward passes on its shared forward, a min-norm solve, the harmonized update.
          On a harmonized step: every unit during the warm-up steps (each solve updates ᾱ, as the authors' code
          does) and with ``harmonize_scope="step"`` (one solve on their sum); otherwise the first unit only,
          the rest of the step using the fresh ᾱ;
        - "diagnostic": an amortized unit that also measures the K per-reward gradients (first unit of every
          diagnose_every-th step that is not harmonized);
        - "amortized": one backward of the ᾱ-combined loss."""
        bal = self.config.balance
        if harmonize:
            if bal.harmonize_scope == "step" or step < bal.warmup_steps:
                return ["harmonized"] * U
            return ["harmonized"] + ["amortized"] * (U - 1)
        diagnose = bal.diagnose_every > 0 and step % bal.diagnose_every == 0
        return (["diagnostic"] if diagnose else ["amortized"]) + ["amortized"] * (U - 1)

    def _choose_gradient_path(self) -> tuple[str, PerSampleGradients | None]:
        """balance.gradients, or "per_reward" when a unit's per-sample gradients J [2b, P] would take more than
        a quarter of the memory available now (the fallback is said in the log and in every BalanceEvent)."""
        if self.config.balance.gradients != "per_sample":
            return "per_reward", None
        need = jacobian_bytes(self.micro_batch_size, self.policy.num_trainable)
        free = available_memory(self.device)
        if free is not None and need > free / 4:
            log.warning("balance.gradients=per_sample: one unit's per-sample gradients need %.2f GB, more than a "
                        "quarter of the %.2f GB available; using one backward pass per reward", need / 1e9, free / 1e9)
            return "per_reward", None
        return "per_sample", PerSampleGradients(self.policy.transformer, self.params)

    def _reward_gradients(self, l_pos, l_neg, kl, r):
        """(g [K, P], ∇(λ_KL·KL) [P], ℓ_k [K]) on one shared forward (graph kept): from the unit's per-sample
        gradients (two backward passes, core/per_sample.py) or from K backward passes."""
        nft = self.config.nft
        per_reward = per_reward_objectives(l_pos, l_neg, r, nft.nft_beta, nft.adv_clip_max)
        if self._per_sample is not None:
            psg = self._per_sample
            psg.backward(l_pos.sum(), 0)
            psg.backward(l_neg.sum(), 1)
            g, mixing = per_reward_gradients(psg.jacobian, r, nft.nft_beta, nft.adv_clip_max)
            self._attribution = conflict_attribution(psg.jacobian, mixing, g)  # who drives this unit's conflict
            psg.release()
        else:
            g = torch.stack([self._grads(per_reward[k]) for k in range(len(self.reward_names))])
        g_kl = (self._grads(nft.kl_coef * kl.mean()) if nft.kl_coef > 0
                else torch.zeros(g.shape[1], dtype=g.dtype, device=g.device))
        return g, g_kl, per_reward.detach().double()

    def _harmonized_unit(self, l_pos, l_neg, kl, r, step: int, U: int, acc: "_HarmonizedSums | None"):
        """Solve on this unit's gradients and add its update (weight 1/U), or add them to ``acc`` for the
        whole step's solve. Returns (diagnostics or None, loss contribution)."""
        g, g_kl, losses = self._reward_gradients(l_pos, l_neg, kl, r)
        if acc is not None:
            acc.add(g, g_kl, losses)
            return None, 0.0
        return self._apply_harmonized(g, g_kl, losses, 1.0 / U, step)

    def _amortized_objective(self, l_pos, l_neg, A, step: int) -> torch.Tensor:
        nft = self.config.nft
        alpha = torch.as_tensor(self._train_alpha(step), dtype=torch.float32, device=self.device)
        return amortized_objective(l_pos, l_neg, A, alpha, self.config.balance.amortized_combination,
                                   nft.nft_beta, nft.adv_clip_max)

    def _amortized_unit(self, l_pos, l_neg, kl, A, step: int, U: int) -> float:
        """One backward of the ᾱ-combined loss + λ_KL·KL, weight 1/U. Returns the loss contribution."""
        loss = self._amortized_objective(l_pos, l_neg, A, step)
        ((loss + self.config.nft.kl_coef * kl.mean()) / U).backward()
        return loss.item() / U

    def _diagnostic_unit(self, l_pos, l_neg, kl, r, A, step: int, U: int) -> tuple[dict, float]:
        """An amortized unit that also measures each reward's gradient against the update it applies."""
        g, _, _ = self._reward_gradients(l_pos, l_neg, kl, r)
        loss = self._amortized_objective(l_pos, l_neg, A, step)
        update = self._grads(loss + self.config.nft.kl_coef * kl.mean(), retain=False)
        g, update = self.dist.all_reduce_mean(g, update)  # one all-reduce: global diagnostics
        _add_flat_to_grad(self.params, update / U)
        return self._diagnostics(g, update, "diagnostic", None, step), loss.item() / U

    def _stop_requested(self) -> bool:
        """The stop flag; under torchrun rank 0's, broadcast, so every process stops at the same unit."""
        return self.dist.broadcast_flag(self.dist.is_main and self.should_stop())

    def _apply_harmonized(self, g: torch.Tensor, g_kl: torch.Tensor, losses: torch.Tensor, scale: float,
                          step: int) -> tuple[dict, float]:
        """Harmonized step (spec §4): QP on the Gram of the per-reward gradients g [K, P]; the update
        d + ∇KL (d = Σ c_k g_k) is added to .grad with ``scale``. Returns the diagnostics and the loss.
        Under torchrun g, ∇KL and the losses are first averaged over the processes with ONE all-reduce, so
        every process solves the same QP and writes the same update (spec §9)."""
        g, g_kl, losses = self.dist.all_reduce_mean(g, g_kl, losses)
        decision = self.balancer.balance(g.matmul(g.T).cpu().numpy(), step)
        weights = torch.as_tensor(decision.grad_weights, dtype=torch.float64, device=self.device)
        update = weights @ g + g_kl
        _add_flat_to_grad(self.params, update * scale)
        alpha_raw = torch.as_tensor(decision.alpha_raw, dtype=torch.float64, device=self.device)
        return self._diagnostics(g, update, "harmonized", decision, step), float(alpha_raw @ losses) * scale

    def _train_alpha(self, step: int) -> np.ndarray:
        return np.asarray([1.0]) if self.balancer.scalarize else np.asarray(self.balancer.advantage_weights(step))

    def _clip_and_step(self, step: int) -> float:
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        clip = self.config.optim.grad_clip
        max_norm = clip if clip > 0 else float("inf")
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.params, max_norm))
        self.optimizer.step()
        if not bool(torch.stack([torch.isfinite(p).all() for p in self.params]).all()):  # one sync, not one a tensor
            raise FloatingPointError(
                f"training diverged at step {step + 1}: the LoRA weights are no longer finite after the optimizer "
                f"step (optim.lr={self.config.optim.lr}, optim.grad_clip={clip}, gradient norm {grad_norm:.3g}); "
                f"lower optim.lr or set optim.grad_clip")
        self.optimizer.zero_grad(set_to_none=True)
        nft = self.config.nft
        self.policy.soft_update_old(min(nft.old_decay_rate * step, nft.old_decay_max))
        self._update_parameter_ema(step + 1)
        return grad_norm

    @torch.no_grad()
    def _update_parameter_ema(self, k: int) -> None:
        """θ_ema ← d·θ_ema + (1 − d)·θ after optimizer step k (1-based), d = min((1 + k)/(10 + k), ema_decay):
        the release's EMAModuleWrapper schedule, updated once per optimizer step."""
        if self.ema is None:
            return
        d = min((1 + k) / (10 + k), self.config.optim.ema_decay)
        for n, p in self.policy.named_trainable.items():
            self.ema[n].lerp_(p.detach(), 1.0 - d)

    def save_ema_lora(self, directory: Path) -> None:
        """The parameter EMA in the diffusers LoRA format (``directory``/pytorch_lora_weights.safetensors)."""
        if self.ema is None:
            return
        directory.mkdir(parents=True, exist_ok=True)
        params = self.policy.named_trainable
        raw = {n: p.detach().clone() for n, p in params.items()}
        with torch.no_grad():
            try:
                for n, p in params.items():
                    p.copy_(self.ema[n])
                self.policy.save_diffusers_lora(directory)
            finally:
                for n, p in params.items():
                    p.copy_(raw[n])

    def _diagnostics(self, g: torch.Tensor, update: torch.Tensor, phase: str, decision, step: int) -> dict:
        """Gram/cosine matrix of the per-reward gradients and each one's cosine with the applied update."""
        names = self.reward_names
        norms = g.norm(dim=1)
        valid = torch.isfinite(norms) & (norms > 1e-12)
        gram = g @ g.T
        denom = torch.outer(norms, norms)
        cos = torch.where(torch.outer(valid, valid), gram / denom.clamp(min=1e-300), torch.full_like(gram, math.nan))
        if decision is None:
            alpha_raw = alpha_ema = self.balancer.advantage_weights(step)
            solver, seconds = "diagnostic", 0.0
        else:
            alpha_raw, alpha_ema = decision.alpha_raw, decision.alpha_ema
            solver, seconds = decision.solver, float(decision.seconds)
        return dict(
            alpha_raw={n: float(a) for n, a in zip(names, alpha_raw)},
            alpha_ema={n: float(a) for n, a in zip(names, alpha_ema)},
            cosine={"names": list(names), "matrix": cos.cpu().tolist()},
            cos_to_update={n: _cos(g[k], update) if valid[k] else float("nan") for k, n in enumerate(names)},
            # the paper's Fig. S2 reference: the weighted-sum direction (1/K)·Σ_k g_k (over the valid rewards)
            cos_to_mean={n: _cos(g[k], g[valid].mean(dim=0)) if valid[k] else float("nan")
                         for k, n in enumerate(names)},
            grad_norms={n: float(norms[k]) for k, n in enumerate(names)},
            valid={n: bool(valid[k]) for k, n in enumerate(names)},
            solver=solver, phase=phase, update_norm=float(update.norm()), solve_seconds=seconds,
            gradients=self.gradient_path)

    def _save_samples(self, batch: Rollout, indices: torch.Tensor, R: torch.Tensor, A: torch.Tensor) -> None:
        """The rollout images of this process (all of them in a 1-process run), named by global index.
        Shapes: indices [n] (global positions of batch's samples); R, A [n, K]."""
        order = torch.argsort(indices).tolist()
        paths = self._write_pngs("samples", batch.images[order], [int(indices[i]) for i in order])
        items = [{"prompt": batch.prompts[i], "source": batch.metadata[i].get("source"), "seed": batch.seeds[i],
                  "group": int(batch.groups[i]), "path": path,
                  "rewards": {n: float(R[i, k]) for k, n in enumerate(self.reward_names)},
                  "advantages": {n: float(A[i, k]) for k, n in enumerate(self.reward_names)}}
                 for i, path in zip(order, paths)]
        self.emit(SampleEvent(step=self.step, items=items))

    def _write_pngs(self, kind: str, images: torch.Tensor, numbers: list[int]) -> list[str]:
        """``images`` [n, 3, H, W] in [0, 1] as kind/step_NNNNNN/<number>.png; their paths, relative to the run
        folder (what sample and preview events carry)."""
        from PIL import Image

        rel = Path(kind) / f"step_{self.step:06d}"
        (self.out_dir / rel).mkdir(parents=True, exist_ok=True)
        arr = (images.permute(0, 2, 3, 1).numpy() * 255).round().astype(np.uint8)
        paths = [str(rel / f"{number:03d}.png") for number in numbers]
        for image, path in zip(arr, paths):
            Image.fromarray(image).save(self.out_dir / path)
        return paths

    def preview_items(self) -> tuple[list[PromptItem], list[int]]:
        """The fixed preview prompts and seeds (TrainConfig.preview_prompts): held-out prompts of the run's
        sources in turn (the i-th preview is the (i // S)-th test prompt of source i mod S), seeds 0, 1, ...
        Nothing depends on the run's seed or step, so every sample step, and every run on the same sources,
        renders the same prompt from the same noise."""
        n, sources = self.config.preview_prompts, self.prompts.sources
        items = []
        for i in range(n):
            src = sources[i % len(sources)]
            pool = src.test or src.train
            items.append(pool[(i // len(sources)) % len(pool)])
        return items, list(range(n))

    def _save_previews(self) -> None:
        """Render the preview prompts with the rollout policy (the sampler training uses), score them and emit
        a PreviewEvent; the images go to previews/step_NNNNNN/."""
        c = self.config.sampling
        items, seeds = self.preview_items()
        prompts, metadata = [it.text for it in items], [dict(it.metadata) for it in items]
        emb = encode_prompts(self.pipe, prompts, c.max_sequence_length, c.guidance_scale, self.device)
        x0 = generate_latents(self.pipe, self.policy.velocity_old, emb, seeds, c.num_steps, c.guidance_scale,
                              c.resolution, self.device, c.sampler)
        images = decode_latents(self.pipe, x0)
        R = self.score(Rollout(x0, images, prompts, metadata, seeds, torch.zeros(len(prompts), dtype=torch.long),
                               emb, self.sigmas))
        paths = self._write_pngs("previews", images, list(range(len(prompts))))
        self.emit(PreviewEvent(step=self.step, items=[
            {"prompt": prompt, "source": meta.get("source"), "seed": seed, "path": path,
             "rewards": {n: float(R[i, k]) for k, n in enumerate(self.reward_names)}}
            for i, (prompt, meta, seed, path) in enumerate(zip(prompts, metadata, seeds, paths))]))

    # ---- checkpoints ------------------------------------------------------------------------------
    def save_checkpoint(self) -> Path:
        """checkpoints/step_NNNNNN/: the diffusers LoRA (pytorch_lora_weights.safetensors, with its alpha
        metadata), training_state.safetensors + .json (old adapter, optimizer, balancer state, step, config;
        no pickle) and manifest.json, written last (core.checkpoint). Under torchrun rank 0 alone writes it
        (the state is the same on every rank); all return its path."""
        root = self.out_dir / "checkpoints"
        final = root / f"step_{self.step:06d}"
        if not self.dist.is_main:
            return final
        tmp = root / f"{ckpt_io.TMP_PREFIX}{self.step:06d}_{os.getpid()}"
        try:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
            self.policy.save_diffusers_lora(tmp)
            self.save_ema_lora(tmp / EMA_FOLDER)  # beside the raw LoRA: what evaluation loads by default
            tensors, meta = self.training_state()
            ckpt_io.save_state(tmp, tensors, meta)
            self.config.save(tmp / "config.json")
            ckpt_io.write_manifest(tmp)  # last: a folder with a valid manifest is complete
            if final.exists():
                shutil.rmtree(final)
            tmp.rename(final)  # atomic: a checkpoint folder is complete or absent
            ckpt_io.fsync_dir(root)
        except Exception as e:
            shutil.rmtree(tmp, ignore_errors=True)  # give the space back; a partial folder is never used
            if ckpt_io.is_disk_full(e):
                raise ckpt_io.disk_full_error(tmp, e) from e
            raise
        self.emit(CheckpointEvent(step=self.step, path=str(final)))
        return final

    def training_state(self) -> tuple[dict[str, torch.Tensor], dict]:
        """What a resume needs: named tensors (one safetensors file) and JSON. Add new state as a tensor
        prefix or a JSON key here and read it back in :meth:`load_checkpoint`."""
        opt_tensors, opt_meta = ckpt_io.split_optimizer_state(self.optimizer.state_dict())
        tensors = {**ckpt_io.with_prefix("policy/", self.policy.lora_state("policy")),
                   **ckpt_io.with_prefix("old/", self.policy.lora_state("old")), **opt_tensors,
                   **({} if self.ema is None else ckpt_io.with_prefix("ema/", {n: t.detach().cpu().clone()
                                                                                 for n, t in self.ema.items()}))}
        meta = {"step": self.step, "config": self.config.to_dict(), "balancer": self.balancer.state_dict(),
                "optimizer": opt_meta}
        return tensors, meta

    def load_checkpoint(self, path: str | Path) -> None:
        """Restore a checkpoint folder after checking every file against its manifest; nothing is unpickled
        (a pickled training_state.pt of an older version is refused). CheckpointError names the file."""
        path = Path(path)
        ckpt_io.verify(path)
        tensors, meta = ckpt_io.load_state(path)
        try:
            _check_resumable(meta["config"], self.config.to_dict())
            self.policy.load_lora_state(ckpt_io.strip_prefix("policy/", tensors), ckpt_io.strip_prefix("old/", tensors))
            self.optimizer.load_state_dict(ckpt_io.join_optimizer_state(tensors, meta["optimizer"]))
            self.balancer.load_state_dict(meta["balancer"])
            if self.ema is not None:
                self._load_parameter_ema(ckpt_io.strip_prefix("ema/", tensors), path)
            self.step = int(meta["step"])
        except (KeyError, TypeError) as e:
            raise ckpt_io.CheckpointError(f"{str(path / ckpt_io.STATE_JSON_FILE)!r} lacks what a resume needs "
                                          f"({type(e).__name__}: {e})") from None

    @torch.no_grad()
    def _load_parameter_ema(self, ema: dict[str, torch.Tensor], path: Path) -> None:
        if not ema:  # a checkpoint written before the parameter EMA existed: it starts from the resumed weights
            for n, p in self.policy.named_trainable.items():
                self.ema[n].copy_(p.detach())
            self.notice(f"resume: {path.name} holds no parameter EMA (an older checkpoint); it starts from the "
                        f"resumed weights")
            return
        if set(ema) != set(self.ema):
            raise ckpt_io.CheckpointError(f"the checkpoint's parameter EMA does not match this model's LoRA layout "
                                          f"({len(ema)} tensors for {len(self.ema)} parameters)")
        for n, t in self.ema.items():
            t.copy_(ema[n].to(t.device))

    def _resolve_resume(self, resume_from: Path) -> Path:
        """A checkpoint folder as given (verified on load), or a run folder's newest checkpoint that verifies;
        newer ones that do not are skipped, and the run's events and log say so."""
        if ckpt_io.is_checkpoint_folder(resume_from):
            return resume_from
        if not resume_from.is_dir():
            raise FileNotFoundError(f"resume: {str(resume_from)!r} is neither a checkpoint folder nor a run folder")
        chosen, skipped = ckpt_io.pick(ckpt_io.checkpoints_in(resume_from))
        for folder, reason in skipped:
            self.notice(f"resume: skipped checkpoint {folder.name} ({reason}); resuming from {chosen.name}")
        return chosen

    def notice(self, message: str) -> None:
        log.warning("%s", message)
        self.emit(NoticeEvent(step=self.step, message=message))

    # ---- the loop ---------------------------------------------------------------------------------
    def run(self, resume_from: str | Path | None = None) -> TrainResult:
        """Train to ``config.steps``. ``resume_from``: a checkpoint folder, or a run folder (its newest good
        checkpoint). Orphan temp folders of a checkpoint write that was killed are removed first."""
        if self.dist.is_main:
            for orphan in ckpt_io.remove_orphans(self.out_dir):
                self.notice(f"removed {str(orphan)!r}, a checkpoint write that never finished")
        resume_from = self._same_on_every_rank(resume_from)
        if resume_from is not None:
            resolved = self._resolve_resume(resume_from) if self.dist.is_main else None
            resume_from = Path(self.dist.broadcast_object(None if resolved is None else str(resolved)))
            self.load_checkpoint(resume_from)  # every rank loads the same checkpoint
        if self.dist.is_main:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            self.config.save(self.out_dir / "config.json")
        started = time.perf_counter()
        self.emit(StartEvent(step=self.step, total_steps=self.config.steps, reward_names=self.reward_names,
                             strategy=self.config.balance.strategy,
                             trainable_parameters=self.policy.num_trainable, device=str(self.device),
                             resumed_from=None if resume_from is None else str(resume_from),
                             world_size=self.dist.world_size))
        last_ckpt: Path | None = Path(resume_from) if resume_from is not None else None
        status = "completed"
        every = self.config.checkpoint_every
        try:
            while self.step < self.config.steps:
                if self._stop_requested():
                    raise StopTraining()
                self.train_step(self.step)
                if every and self.step % every == 0:
                    last_ckpt = self.save_checkpoint()
        except StopTraining:
            status = "stopped"
        if last_ckpt is None or not last_ckpt.name.endswith(f"{self.step:06d}"):
            if self.step > 0:
                last_ckpt = self.save_checkpoint()
        self.dist.barrier()  # when run() returns on any rank, rank 0's last checkpoint is on disk
        self.emit(EndEvent(step=self.step, status=status, seconds=time.perf_counter() - started))
        return TrainResult(status, self.step, self.out_dir, last_ckpt)

    def _same_on_every_rank(self, resume_from: str | Path | None) -> Path | None:
        """Rank 0's resume checkpoint on every rank; the others may pass None (or the same path)."""
        mine = None if resume_from is None else str(resume_from)
        chosen = self.dist.broadcast_object(mine)
        if mine is not None and mine != chosen:
            raise ValueError(f"resume: rank {self.dist.rank} was given {mine!r} but rank 0 resumes from {chosen!r}")
        return None if chosen is None else Path(chosen)


def _check_resumable(saved: dict, current: dict) -> None:
    try:  # a checkpoint of an older version lacks newer fields: they mean their defaults
        saved = TrainConfig.from_dict(saved).to_dict()
    except ValueError:
        pass  # compared as stored: the difference is named below
    saved = {k: v for k, v in saved.items() if k not in RESUMABLE_CHANGES}
    current = {k: v for k, v in current.items() if k not in RESUMABLE_CHANGES}
    diffs = [k for k in current if saved.get(k) != current.get(k)]
    if diffs:
        raise ValueError(f"resume: the config differs from the checkpoint's in {', '.join(diffs)}; only "
                         f"{', '.join(RESUMABLE_CHANGES)} may change on resume")


def _nanmean(x: torch.Tensor) -> float:
    v = x[torch.isfinite(x)]
    return float(v.mean()) if v.numel() else float("nan")


def _nanstd(x: torch.Tensor) -> float:
    v = x[torch.isfinite(x)]
    return float(v.std(unbiased=False)) if v.numel() else float("nan")


def train(config: TrainConfig, out_dir: str | Path, on_event: Callable[[Event], None] | None = None,
          should_stop: Callable[[], bool] | None = None, resume_from: str | Path | None = None) -> TrainResult:
    """Run (or resume) a training run; events go to ``on_event``; ``should_stop`` is polled between units.

    Under torchrun every rank calls this with the same config: rank 0's ``on_event``, ``should_stop`` and
    ``resume_from`` are the ones used (the others may pass None); the process group is joined here and,
    when this call started it, destroyed on return."""
    trainer = Trainer(config, out_dir, on_event, should_stop)
    try:
        return trainer.run(resume_from)
    finally:
        trainer.dist.close()
