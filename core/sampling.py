"""Deterministic rollouts with the pipeline's own flow-matching scheduler.

DiffusionNFT needs no trajectories or log-probs: only each image's clean latent x0, its prompt embedding
and its rewards (spec §2). Each image's initial noise comes from its own seed, so an image depends on
its seed and prompt, not on the batch it was drawn in.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from core.models import VelocityInputs

VelocityFn = Callable[[VelocityInputs], torch.Tensor]


@dataclass
class PromptEmbeddings:
    prompt_embeds: torch.Tensor  # [B, S, D]
    pooled: torch.Tensor  # [B, P]
    negative_embeds: torch.Tensor | None = None  # [B, S, D], only with guidance > 1
    negative_pooled: torch.Tensor | None = None

    def index(self, idx: torch.Tensor | list[int]) -> "PromptEmbeddings":
        pick = (lambda t: None if t is None else t[idx])
        return PromptEmbeddings(pick(self.prompt_embeds), pick(self.pooled), pick(self.negative_embeds),
                                pick(self.negative_pooled))


@dataclass
class Rollout:
    """One batch of generated samples. B = prompts x images per prompt."""

    x0: torch.Tensor  # [B, C, h, w] clean latents (what the transformer sees)
    images: torch.Tensor  # [B, 3, H, W] in [0, 1], on CPU
    prompts: list[str]
    metadata: list[dict]
    seeds: list[int]
    groups: torch.Tensor  # [B] long: the prompt group of each image
    embeddings: PromptEmbeddings
    sigmas: torch.Tensor  # [num_steps + 1] the sampler's σ grid, 1 -> 0
    extra: dict = field(default_factory=dict)


@torch.no_grad()
def encode_prompts(pipe, prompts: list[str], max_sequence_length: int, guidance_scale: float,
                   device: torch.device) -> PromptEmbeddings:
    """Encode each distinct prompt once and index back (rollout groups repeat prompts)."""
    unique = list(dict.fromkeys(prompts))
    cfg = guidance_scale > 1.0
    pe, npe, ppe, nppe = pipe.encode_prompt(unique, None, None, device=device, do_classifier_free_guidance=cfg,
                                            max_sequence_length=max_sequence_length)
    where = torch.tensor([unique.index(p) for p in prompts], device=pe.device)
    emb = PromptEmbeddings(pe.float(), ppe.float(), None if npe is None else npe.float(),
                           None if nppe is None else nppe.float())
    return emb.index(where)


SAMPLERS = ("euler", "dpm2")
"""euler: the pipeline's own flow-matching scheduler (first order). dpm2: diffusers' DPMSolverMultistepScheduler
on flow sigmas (DPM-Solver++, second order, deterministic), the authors' rollout solver ("dpm2")."""


def make_scheduler(pipe, num_steps: int, device: torch.device, sampler: str = "euler"):
    """A fresh scheduler set to ``num_steps``: a copy of the pipeline's ("euler"), or diffusers'
    DPMSolverMultistepScheduler with flow sigmas, flow_prediction, order 2 and the pipeline's shift ("dpm2")."""
    if sampler == "euler":
        scheduler = type(pipe.scheduler).from_config(pipe.scheduler.config)
    elif sampler == "dpm2":
        from diffusers import DPMSolverMultistepScheduler

        cfg = pipe.scheduler.config
        scheduler = DPMSolverMultistepScheduler(
            num_train_timesteps=cfg.num_train_timesteps, solver_order=2, prediction_type="flow_prediction",
            use_flow_sigmas=True, flow_shift=float(cfg.get("shift", 1.0)), algorithm_type="dpmsolver++",
            solver_type="midpoint", lower_order_final=True, final_sigmas_type="zero")
    else:
        raise ValueError(f"sampler={sampler!r}: valid choices: {', '.join(SAMPLERS)}")
    scheduler.set_timesteps(num_steps, device=device)
    return scheduler


def sampler_sigmas(pipe, num_steps: int, device: torch.device | str = "cpu", sampler: str = "euler") -> torch.Tensor:
    """The σ grid of a ``num_steps`` rollout, [num_steps + 1] from ~1 down to 0."""
    return make_scheduler(pipe, num_steps, torch.device(device), sampler).sigmas.float()


def initial_noise(seeds: list[int], shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """[B, *shape] standard normal noise, each row from its own seed (CPU generator: same on any device)."""
    rows = [torch.randn(shape, generator=torch.Generator().manual_seed(int(s))) for s in seeds]
    return torch.stack(rows).to(device)


def latent_shape(pipe, resolution: int) -> tuple[int, int, int]:
    channels = pipe.transformer.config.in_channels
    size = resolution // pipe.vae_scale_factor
    return channels, size, size


@torch.no_grad()
def generate_latents(pipe, velocity_fn: VelocityFn, emb: PromptEmbeddings, seeds: list[int], num_steps: int,
                     guidance_scale: float, resolution: int, device: torch.device,
                     sampler: str = "euler") -> torch.Tensor:
    """Integrate the flow ODE from noise (σ=1) to the clean latent (σ=0) with ``sampler`` (SAMPLERS)."""
    scheduler = make_scheduler(pipe, num_steps, device, sampler)
    latents = initial_noise(seeds, latent_shape(pipe, resolution), device)
    cfg = guidance_scale > 1.0
    if cfg and emb.negative_embeds is None:
        raise ValueError("guidance_scale > 1 needs negative prompt embeddings (encode with that guidance)")
    for i, t in enumerate(scheduler.timesteps):
        if sampler == "euler":
            sigma = (t / scheduler.config.num_train_timesteps).float()
        else:  # the σ the step assumes (dpm2's integer timesteps are rounded)
            sigma = scheduler.sigmas[i].to(device).float()
        if cfg:
            inp = VelocityInputs(torch.cat([latents, latents]), sigma.expand(2 * len(seeds)),
                                 torch.cat([emb.negative_embeds, emb.prompt_embeds]),
                                 torch.cat([emb.negative_pooled, emb.pooled]))
            v_uncond, v_cond = velocity_fn(inp).chunk(2)
            v = v_uncond + guidance_scale * (v_cond - v_uncond)
        else:
            v = velocity_fn(VelocityInputs(latents, sigma.expand(len(seeds)), emb.prompt_embeds, emb.pooled))
        latents = scheduler.step(v, t, latents, return_dict=False)[0]
    return latents.float()


@torch.no_grad()
def decode_latents(pipe, latents: torch.Tensor) -> torch.Tensor:
    """Latents -> images [B, 3, H, W] in [0, 1] on CPU."""
    vae = pipe.vae
    z = latents / vae.config.scaling_factor + (vae.config.shift_factor or 0.0)
    images = vae.decode(z.to(vae.dtype), return_dict=False)[0]
    return (images.float() / 2 + 0.5).clamp(0, 1).cpu()


def transformer_velocity(transformer) -> VelocityFn:
    """The plain transformer as a velocity function (whatever LoRA is loaded into it is active)."""

    def velocity(inp: VelocityInputs) -> torch.Tensor:
        dtype = transformer.dtype
        return transformer(hidden_states=inp.x.to(dtype), timestep=inp.sigma * 1000.0,
                           encoder_hidden_states=inp.prompt_embeds.to(dtype),
                           pooled_projections=inp.pooled.to(dtype), return_dict=False)[0].float()

    return velocity


@torch.no_grad()
def generate_images(pipe, prompts: list[str], seeds: list[int], num_steps: int = 10, guidance_scale: float = 1.0,
                    resolution: int = 64, max_sequence_length: int = 77,
                    velocity_fn: VelocityFn | None = None, sampler: str = "euler") -> torch.Tensor:
    """Prompts + seeds -> images [B, 3, H, W] in [0, 1] with the same sampler as training rollouts."""
    device = pipe.transformer.device
    emb = encode_prompts(pipe, prompts, max_sequence_length, guidance_scale, device)
    fn = velocity_fn or transformer_velocity(pipe.transformer)
    latents = generate_latents(pipe, fn, emb, seeds, num_steps, guidance_scale, resolution, device, sampler)
    return decode_latents(pipe, latents)


def to_pil(images: torch.Tensor) -> list:
    """[B, 3, H, W] in [0, 1] -> PIL images."""
    from PIL import Image

    arr = (images.permute(0, 2, 3, 1).cpu().numpy() * 255).round().astype("uint8")
    return [Image.fromarray(a) for a in arr]
