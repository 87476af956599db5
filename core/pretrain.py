"""Pretrain the mini-world SD3 from scratch on the procedural world: ``python -m core.pretrain --out DIR``.

Stages of one seeded script (ENV_NOTES' measured recipe):
1. VAE: ``AutoencoderKL`` (blocks 8/16/32, 4 latent channels, factor 4: 64 px -> 16×16 latents)
   trained on fresh world renders with MSE (+ a tiny KL); then ``shift_factor``/``scaling_factor``
   are set from the latents' mean/std so the transformer sees unit-variance latents.
2. Text + transformer, jointly: two tiny CLIP text encoders (word-level tokenizer, see
   core/world/tokenizer.py; no T5) and an ``SD3Transformer2DModel`` (width 96, 4 layers) trained
   with rectified flow: x_t = (1-t)·x0 + t·ε, target v = ε - x0, t ~ logit-normal(0, 1),
   10 % of captions dropped to "" (what classifier-free guidance uses as the negative prompt),
   AdamW, EMA of the weights (the EMA weights are what is saved).
3. Optional (``--decoder-steps``): the VAE decoder alone, on the frozen encoder's latents — sharper,
   truer colours, same latent space (so the transformer stays valid).

``--init-from DIR`` continues a previous run's folder (VAE kept) instead of starting from scratch.

The prompt embeddings come from the pipeline's own ``encode_prompt`` (with gradients), so training
and sampling share one code path. Everything random comes from ``--seed``; ``--max-minutes`` stops a
stage early on a slow machine (the model card records the steps actually run).
The result is a plain diffusers folder: ``StableDiffusion3Pipeline.from_pretrained(DIR)``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from core.world.scenes import TASK_MIX, caption, random_spec, render_batch

MAX_SEQUENCE_LENGTH = 4  # zero "T5" tokens appended by encode_prompt; the model has no T5
TEXT_MAX_LENGTH = 16  # CLIP tokens: the longest caption is 11 words + 2 specials


def count_params(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def build_components(seed: int, scheduler_shift: float):
    """Fresh random-weight components of the mini-world pipeline (shapes documented in MODEL_CARD)."""
    from diffusers import (AutoencoderKL, FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel,
                           StableDiffusion3Pipeline)
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection

    from core.world.tokenizer import build_tokenizer

    torch.manual_seed(seed)
    tokenizer = build_tokenizer(TEXT_MAX_LENGTH)
    vocab = tokenizer.get_vocab()
    text_cfg = CLIPTextConfig(vocab_size=len(vocab), hidden_size=32, intermediate_size=128, num_hidden_layers=3,
                              num_attention_heads=4, max_position_embeddings=TEXT_MAX_LENGTH, projection_dim=32,
                              bos_token_id=vocab["<|startoftext|>"], eos_token_id=vocab["<|endoftext|>"],
                              pad_token_id=vocab["<|endoftext|>"])
    text_encoder = CLIPTextModelWithProjection(text_cfg)
    text_encoder_2 = CLIPTextModelWithProjection(text_cfg)
    vae = AutoencoderKL(
        in_channels=3, out_channels=3, down_block_types=["DownEncoderBlock2D"] * 3,
        up_block_types=["UpDecoderBlock2D"] * 3, block_out_channels=[8, 16, 32], latent_channels=4,
        layers_per_block=1, norm_num_groups=8, use_quant_conv=False, use_post_quant_conv=False,
        mid_block_add_attention=False, scaling_factor=1.0, shift_factor=0.0, sample_size=64)
    transformer = SD3Transformer2DModel(
        sample_size=16, patch_size=2, in_channels=4, out_channels=4, num_layers=4, attention_head_dim=32,
        num_attention_heads=3, joint_attention_dim=64, caption_projection_dim=96, pooled_projection_dim=64,
        pos_embed_max_size=8, qk_norm="rms_norm", dual_attention_layers=())
    return StableDiffusion3Pipeline(
        transformer=transformer, scheduler=FlowMatchEulerDiscreteScheduler(shift=scheduler_shift), vae=vae,
        text_encoder=text_encoder, tokenizer=tokenizer, text_encoder_2=text_encoder_2, tokenizer_2=tokenizer,
        text_encoder_3=None, tokenizer_3=None)


def parse_task_mix(text: str) -> dict[str, float]:
    """``"single=0.1,position=0.6"`` -> how often each task's captions are drawn (the tasks not named get 0).
    Raises ValueError naming the bad entry and the valid tasks."""
    mix = {}
    for item in text.split(","):
        task, sep, value = item.partition("=")
        task = task.strip()
        if task not in TASK_MIX or not sep:
            raise ValueError(f"--task-mix entry {item.strip()!r}: write TASK=WEIGHT with TASK one of "
                             f"{', '.join(TASK_MIX)}")
        try:
            weight = float(value)
        except ValueError:
            raise ValueError(f"--task-mix entry {item.strip()!r}: the weight must be a number") from None
        if not (math.isfinite(weight) and weight >= 0):
            raise ValueError(f"--task-mix entry {item.strip()!r}: the weight must be a finite number >= 0")
        mix[task] = weight
    if sum(mix.values()) <= 0:
        raise ValueError(f"--task-mix {text!r}: at least one weight must be > 0")
    return {task: mix.get(task, 0.0) for task in TASK_MIX}


def world_batch(rng: np.random.Generator, batch: int, mix: dict[str, float] | None = None
                ) -> tuple[torch.Tensor, list[str]]:
    """[B, 3, 64, 64] images in [-1, 1] and their captions, tasks drawn with ``mix`` (default TASK_MIX)."""
    specs = [random_spec(rng, mix) for _ in range(batch)]
    images = torch.from_numpy(render_batch(specs, rng)).permute(0, 3, 1, 2).float() / 127.5 - 1.0
    return images, [caption(s) for s in specs]


def cosine_lr(progress: float, step: int, base: float, warmup: int = 100, floor: float = 0.05) -> float:
    """Linear warm-up over ``warmup`` steps, then a cosine from ``base`` to ``floor·base`` as progress -> 1."""
    if step < warmup:
        return base * (step + 1) / warmup
    frac = min(1.0, max(0.0, progress))
    return base * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * frac)))


def stage_progress(step: int, steps: int, started: float, max_seconds: float) -> float:
    """How far a stage is, in [0, 1]: the step budget or the time box, whichever binds first. With a
    generous time box the schedule (and the result) depend on the seed only; on a slow machine the
    learning rate still decays fully before the box closes."""
    return max(step / steps, (time.perf_counter() - started) / max_seconds)


class Progress:
    """A tqdm bar on stderr plus a plain log line every ``every`` steps on stdout (for log files)."""

    def __init__(self, total: int, label: str, every: int):
        from tqdm import tqdm

        self.bar = tqdm(total=total, desc=label, file=sys.stderr, mininterval=10, dynamic_ncols=True)
        self.label, self.every, self.t0 = label, every, time.perf_counter()

    def update(self, step: int, **values: float) -> None:
        self.bar.update(1)
        if step % self.every == 0:
            self.bar.set_postfix({k: f"{v:.4g}" for k, v in values.items()})
            elapsed = time.perf_counter() - self.t0
            parts = " ".join(f"{k}={v:.5g}" for k, v in values.items())
            print(f"[{self.label}] step {step} {elapsed:.0f}s {parts}", flush=True)

    def close(self) -> None:
        self.bar.close()


def psnr_db(mse: float) -> float:
    """PSNR of images in [-1, 1] (peak² = 4) from their mean squared error."""
    return 10 * math.log10(4 / max(mse, 1e-12))


def run_stage(label: str, opt: torch.optim.Optimizer, lr: float, steps: int, max_seconds: float, log_every: int,
              window: int, step_fn: Callable[[int], float],
              describe: Callable[[float], dict[str, float]]) -> tuple[int, float, float]:
    """The loop all three stages share: for step = 1..steps, set every param group's learning rate from the
    cosine schedule, run ``step_fn(step) -> loss``, log ``describe(mean of the last window losses)``, and stop
    after the step at which the time box closed (that step ran at the schedule's floor).
    Returns (steps done, seconds, mean of the last ``window`` losses)."""
    progress = Progress(steps, label, log_every)
    t0, done, recent = time.perf_counter(), 0, []
    for step in range(1, steps + 1):
        progress_now = stage_progress(step, steps, t0, max_seconds)
        for g in opt.param_groups:
            g["lr"] = cosine_lr(progress_now, step, lr)
        recent = (recent + [step_fn(step)])[-window:]
        done = step
        progress.update(step, **describe(float(np.mean(recent))))
        if progress_now >= 1.0 and step < steps:
            print(f"[{label}] time box reached after {step} steps", flush=True)
            break
    progress.close()
    return done, time.perf_counter() - t0, float(np.mean(recent))


def train_vae(vae, steps: int, batch: int, lr: float, rng: np.random.Generator, max_seconds: float,
              log_every: int) -> dict:
    vae.train()
    opt = torch.optim.AdamW(vae.parameters(), lr=lr, weight_decay=0.0)

    def step_fn(step: int) -> float:
        x, _ = world_batch(rng, batch)
        posterior = vae.encode(x).latent_dist
        recon = vae.decode(posterior.sample()).sample
        mse = F.mse_loss(recon, x)
        loss = mse + 1e-7 * posterior.kl().mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(vae.parameters(), 1.0)
        opt.step()
        return mse.item()

    done, seconds, final_mse = run_stage("vae", opt, lr, steps, max_seconds, log_every, 50, step_fn,
                                         lambda mse: {"mse": mse, "psnr": psnr_db(mse)})
    vae.eval()
    return {"steps": done, "seconds": seconds, "final_mse": final_mse}


@torch.no_grad()
def calibrate_latents(vae, rng: np.random.Generator, batches: int = 4, batch: int = 64) -> dict:
    """Set shift_factor = mean and scaling_factor = 1/std of the latents (SD3's convention:
    z = (latent - shift) * scale). Also measures the reconstruction PSNR on fresh renders."""
    latents, mse = [], []
    for _ in range(batches):
        x, _ = world_batch(rng, batch)
        lat = vae.encode(x).latent_dist.mode()
        latents.append(lat)
        mse.append(F.mse_loss(vae.decode(lat).sample.clamp(-1, 1), x).item())
    lat = torch.cat(latents)
    shift, std = float(lat.mean()), float(lat.std())
    vae.register_to_config(shift_factor=shift, scaling_factor=1.0 / std)
    return {"shift_factor": shift, "scaling_factor": 1.0 / std, "psnr_db": psnr_db(float(np.mean(mse)))}


def refine_decoder(vae, steps: int, batch: int, lr: float, rng: np.random.Generator, max_seconds: float,
                   log_every: int) -> dict:
    """Train the VAE decoder only, on the frozen encoder's latents: the latent space (hence the transformer
    trained on it) is unchanged, while reconstructions get sharper and their colours truer."""
    vae.requires_grad_(False)
    vae.decoder.requires_grad_(True)
    vae.decoder.train()
    params = list(vae.decoder.parameters())
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    t0 = time.perf_counter()

    def step_fn(step: int) -> float:
        x, _ = world_batch(rng, batch)
        with torch.no_grad():
            z = vae.encode(x).latent_dist.sample()
        mse = F.mse_loss(vae.decode(z).sample, x)
        opt.zero_grad(set_to_none=True)
        mse.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        return mse.item()

    done, _, _ = run_stage("decoder", opt, lr, steps, max_seconds, log_every, 50, step_fn,
                           lambda mse: {"mse": mse, "psnr": psnr_db(mse)})
    vae.requires_grad_(False)
    vae.eval()
    with torch.no_grad():  # PSNR on fresh renders, as calibrate_latents measures it
        mse = [F.mse_loss(vae.decode(vae.encode(x).latent_dist.mode()).sample.clamp(-1, 1), x).item()
               for x, _ in (world_batch(rng, 64) for _ in range(4))]
    # "seconds" includes this measurement, as the shipped pretrain_log.json records it
    return {"steps": done, "seconds": time.perf_counter() - t0, "psnr_db": psnr_db(float(np.mean(mse)))}


def train_diffusion(pipe, steps: int, batch: int, lr: float, ema_decay: float, dropout: float,
                    rng: np.random.Generator, gen: torch.Generator, max_seconds: float, log_every: int,
                    mix: dict[str, float] | None = None) -> dict:
    """Rectified-flow training of the transformer and both text encoders (jointly); EMA kept and swapped in."""
    modules = [pipe.transformer, pipe.text_encoder, pipe.text_encoder_2]
    for m in modules:
        m.train()
        m.requires_grad_(True)
    params = [p for m in modules for p in m.parameters()]
    ema = [p.detach().clone() for p in params]
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.99), weight_decay=0.01)
    vae = pipe.vae
    shift, scale = vae.config.shift_factor, vae.config.scaling_factor

    def step_fn(step: int) -> float:
        x, captions = world_batch(rng, batch, mix)
        drop = rng.random(batch) < dropout
        captions = ["" if d else c for c, d in zip(captions, drop)]
        with torch.no_grad():
            z = (vae.encode(x).latent_dist.sample(generator=gen) - shift) * scale  # [B, 4, 16, 16]
        prompt_embeds, _, pooled, _ = pipe.encode_prompt(
            captions, None, None, device=torch.device("cpu"), do_classifier_free_guidance=False,
            max_sequence_length=MAX_SEQUENCE_LENGTH)  # [B, 16 + 4, 64], [B, 64]
        t = torch.sigmoid(torch.randn(batch, generator=gen))  # logit-normal(0, 1)
        noise = torch.randn(z.shape, generator=gen)
        tb = t.view(-1, 1, 1, 1)
        x_t = (1 - tb) * z + tb * noise
        v = pipe.transformer(hidden_states=x_t, timestep=t * 1000.0, encoder_hidden_states=prompt_embeds,
                             pooled_projections=pooled, return_dict=False)[0]
        loss = F.mse_loss(v, noise - z)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        decay = min(ema_decay, (1 + step) / (10 + step))
        with torch.no_grad():
            torch._foreach_lerp_(ema, [p.detach() for p in params], 1 - decay)
        return loss.item()

    done, seconds, final_loss = run_stage("diffusion", opt, lr, steps, max_seconds, log_every, 100, step_fn,
                                          lambda loss: {"loss": loss, "lr": opt.param_groups[0]["lr"]})
    with torch.no_grad():
        for p, e in zip(params, ema):
            p.copy_(e)
    for m in modules:
        m.eval()
        m.requires_grad_(False)
    return {"steps": done, "seconds": seconds, "final_loss": final_loss}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m core.pretrain", description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="output folder (a diffusers pipeline folder)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch CPU threads (default 1: on a shared 2-core machine, 2 threads measured 15x "
                         "slower per step, because the threads wait on each other when cores are oversubscribed)")
    ap.add_argument("--vae-steps", type=int, default=2500)
    ap.add_argument("--vae-lr", type=float, default=2e-3)
    ap.add_argument("--steps", type=int, default=7000, help="transformer + text encoder steps")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--ema", type=float, default=0.999)
    ap.add_argument("--caption-dropout", type=float, default=0.1)
    ap.add_argument("--scheduler-shift", type=float, default=1.0,
                    help="shift of the shipped FlowMatchEulerDiscreteScheduler (sampling only)")
    ap.add_argument("--vae-max-minutes", type=float, default=10.0)
    ap.add_argument("--max-minutes", type=float, default=35.0, help="time box of the diffusion stage")
    ap.add_argument("--decoder-steps", type=int, default=0,
                    help="then train the VAE decoder alone on the frozen encoder's latents (0 = skip)")
    ap.add_argument("--decoder-max-minutes", type=float, default=10.0)
    ap.add_argument("--init-from", help="a folder written by this script: keep its VAE and continue training "
                                         "its transformer and text encoders (a second, warm-started stage)")
    ap.add_argument("--task-mix", type=str, default=None,
                    help="how often the diffusion stage draws each task's captions, e.g. "
                         "single=0.1,color=0.15,count=0.15,position=0.6 (default: "
                         + ",".join(f"{k}={v}" for k, v in TASK_MIX.items()) + ")")
    ap.add_argument("--log-every", type=int, default=100)
    ap.add_argument("--no-card", action="store_true", help="skip the sample grid, measurements and MODEL_CARD.md")
    args = ap.parse_args(argv)
    try:
        mix = parse_task_mix(args.task_mix) if args.task_mix else None
    except ValueError as e:
        ap.error(str(e))

    torch.set_num_threads(args.threads)
    out = Path(args.out)
    rng = np.random.default_rng(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    started = time.perf_counter()
    previous = None
    if args.init_from:  # continue a previous pretraining: its VAE is kept, the diffusion stage goes on
        from diffusers import StableDiffusion3Pipeline

        pipe = StableDiffusion3Pipeline.from_pretrained(args.init_from, local_files_only=True, text_encoder_3=None,
                                                        tokenizer_3=None, use_safetensors=True)  # no pickle
        previous = json.loads((Path(args.init_from) / "pretrain_log.json").read_text())
        vae_stats = dict(previous["vae"], steps=0, seconds=0.0, kept_from=str(args.init_from))
        if previous.get("decoder"):  # the kept VAE is the refined one: its PSNR is the decoder stage's
            vae_stats["psnr_db"] = previous["decoder"]["psnr_db"]
        pipe.vae.requires_grad_(False)
        pipe.vae.eval()
        # build_components seeds torch's global generator on a fresh start; latent_dist.sample() in the
        # decoder stage draws from it, so a continued run seeds it too or it would not repeat.
        torch.manual_seed(args.seed)
    else:
        pipe = build_components(args.seed, args.scheduler_shift)
        vae_stats = train_vae(pipe.vae, args.vae_steps, args.batch, args.vae_lr, rng, args.vae_max_minutes * 60,
                              args.log_every)
        pipe.vae.requires_grad_(False)
        vae_stats.update(calibrate_latents(pipe.vae, rng))
    print(f"[vae] {json.dumps(vae_stats)}", flush=True)
    if args.steps > 0:
        diff_stats = train_diffusion(pipe, args.steps, args.batch, args.lr, args.ema, args.caption_dropout, rng, gen,
                                     args.max_minutes * 60, args.log_every, mix)
    else:
        diff_stats = {"steps": 0, "seconds": 0.0, "final_loss": float("nan")}
    decoder_stats = None
    if args.decoder_steps > 0:
        decoder_stats = refine_decoder(pipe.vae, args.decoder_steps, args.batch, args.vae_lr / 2, rng,
                                       args.decoder_max_minutes * 60, args.log_every)
        print(f"[decoder] {json.dumps(decoder_stats)}", flush=True)
    total = time.perf_counter() - started
    out.mkdir(parents=True, exist_ok=True)
    pipe.save_pretrained(out)
    record = {
        "recipe": {**{k: v for k, v in vars(args).items() if k not in ("out", "no_card", "log_every")},
                   "task_mix": mix or dict(TASK_MIX)},
        "torch_threads": args.threads, "torch": torch.__version__,
        "parameters": {"transformer": count_params(pipe.transformer), "vae": count_params(pipe.vae),
                       "text_encoder": count_params(pipe.text_encoder),
                       "text_encoder_2": count_params(pipe.text_encoder_2)},
        "vae": vae_stats, "diffusion": diff_stats, "decoder": decoder_stats, "total_seconds": total,
        "max_sequence_length": MAX_SEQUENCE_LENGTH,
        "previous": previous,  # the pretraining this one continued (--init-from), else None
    }
    (out / "pretrain_log.json").write_text(json.dumps(record, indent=2) + "\n")
    print(f"saved {out} after {total / 60:.1f} min", flush=True)
    if not args.no_card:
        from core.world.card import write_model_card

        write_model_card(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
