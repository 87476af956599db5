"""GPU check: time per training step and peak memory of MARBLE vs weighted sum on SD3.5 Medium's transformer.

    python scripts/gpu_check.py [--out gpu_check.json]      # one CUDA GPU, well under 10 minutes on an H200
    python scripts/gpu_check.py --tiny                      # the same code path on a tiny transformer, CPU

What runs: the real ``core.trainer.Trainer.train_step`` — LoRA policy / old / reference predictions, the
DiffusionNFT loss, per-reward objectives with NaN masks, the per-reward gradients (per-sample: two backward
passes; or K backward passes) and the QP on harmonized steps, one
backward on amortized steps, clipping and AdamW — on ``SD3Transformer2DModel`` built with random weights
from configs/sd35m/transformer_config.json (2.24 B parameters) with the paper's LoRA (r=32, alpha=64 on the
attention projections), bf16. Only the two stages whose cost does not depend on the strategy are replaced:
the rollout (random clean latents at 512 px = 64x64x16, random 205-token prompt embeddings) and the reward
models (K=5 synthetic rewards standing in for PickScore, HPSv2.1, CLIPScore, OCR and GenEval, the last two
applicable to a third of the prompts each, as with the paper's three prompt sources).

Measured per strategy (fresh LoRA each): seconds per training step and the peak CUDA memory allocated,
after one warm-up step, as a mean with its standard error over the timed steps. MARBLE (N=10) is timed over
two whole refresh windows (9 amortized steps + 1 full step, twice), so its mean is the amortized cost the paper reports (0.97x weighted sum's speed, 1.14x its memory);
``marble_full`` solves the QP every step (paper: 0.56x speed). The step here is shorter than the paper's
(fewer units: micro-batches x timesteps), so the JSON also projects each ratio to the paper's per-GPU step
(72 samples in micro-batches of 8, 24 timesteps: 216 units) from the measured per-unit costs; both are
printed, with the setup, as one JSON object.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from core.config import LORA_TARGETS_SD3, TrainConfig  # noqa: E402
from core.models import register_model  # noqa: E402
from core.sampling import PromptEmbeddings, Rollout  # noqa: E402
from core.trainer import Trainer  # noqa: E402

SD35M_CONFIG = REPO / "configs" / "sd35m" / "transformer_config.json"
TINY_CONFIG = dict(sample_size=8, patch_size=2, in_channels=16, out_channels=16, num_layers=2, attention_head_dim=16,
                   num_attention_heads=2, joint_attention_dim=64, caption_projection_dim=32,
                   pooled_projection_dim=64, pos_embed_max_size=16, qk_norm="rms_norm", dual_attention_layers=[0])
# Weight-free registered rewards: only their names and count matter, the scores are synthetic (see score()).
STAND_INS = ("jpeg_compressibility", "brightness", "colorfulness", "contrast", "sharpness")
PAPER_REWARDS = ("pickscore", "hpsv2", "clipscore", "ocr", "geneval")
PAPER = {"marble_speed": 0.97, "marble_memory": 1.14, "marble_full_speed": 0.56}
PAPER_UNITS = (72 // 8) * 24  # per GPU: 72 samples / micro-batch 8, x 24 timesteps (25-step grid, fraction 0.99)
CLIP_TOKENS, T5_TOKENS = 77, 128  # SD3.5 prompt embedding: CLIP-L + CLIP-G (77) then T5 (128 in DiffusionNFT)
TINY_TOKENS = (8, 8)  # --tiny: short embeddings keep the CPU run to seconds


def transformer_config(tiny: bool) -> dict:
    if tiny:
        return dict(TINY_CONFIG)
    cfg = json.loads(SD35M_CONFIG.read_text())
    return {k: v for k, v in cfg.items() if not k.startswith("_")}


def register_random_sd35(tiny: bool, device: torch.device) -> str:
    """Register a pipeline whose transformer is SD3.5-M's (random weights), built on ``device``."""
    from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline

    name = "gpu-check-tiny" if tiny else "gpu-check-sd35m"

    def build():
        torch.manual_seed(0)
        with torch.device(device):  # initialize the 2.2 B parameters where they will live
            transformer = SD3Transformer2DModel.from_config(transformer_config(tiny))
        return StableDiffusion3Pipeline(transformer=transformer, scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
                                        vae=None, text_encoder=None, tokenizer=None, text_encoder_2=None,
                                        tokenizer_2=None, text_encoder_3=None, tokenizer_3=None)

    try:
        register_model(name, "SD3.5-M transformer with random weights (scripts/gpu_check.py)")(build)
    except ValueError:
        pass  # already registered in this process
    return name


class SyntheticTrainer(Trainer):
    """The real trainer with a synthetic rollout and synthetic rewards (their cost is the same for every
    strategy); everything from the advantages to the optimizer step is the trainer's own code."""

    clip_tokens = CLIP_TOKENS

    def rollout(self, step: int, indices: torch.Tensor | None = None) -> Rollout:
        c = self.config.sampling
        B = c.prompts_per_step * c.images_per_prompt
        idx = torch.arange(B) if indices is None else indices
        gen = torch.Generator().manual_seed(1000 + step)
        tcfg = self.pipe.transformer.config
        side = c.resolution // self.pipe.vae_scale_factor
        x0 = torch.randn(B, tcfg.in_channels, side, side, generator=gen)[idx]
        seq = self.clip_tokens + c.max_sequence_length
        embeds = 0.1 * torch.randn(B, seq, tcfg.joint_attention_dim, generator=gen)[idx]
        pooled = 0.1 * torch.randn(B, tcfg.pooled_projection_dim, generator=gen)[idx]
        groups = torch.arange(c.prompts_per_step).repeat_interleave(c.images_per_prompt)[idx]
        n = len(idx)
        return Rollout(x0.to(self.device), torch.zeros(n, 3, 8, 8), [f"prompt {int(g)}" for g in groups],
                       [{"source": ("general", "ocr", "geneval")[int(g) % 3]} for g in groups],
                       [0] * n, groups, PromptEmbeddings(embeds.to(self.device), pooled.to(self.device)),
                       self.sigmas)

    def score(self, batch: Rollout) -> torch.Tensor:
        """R [n, 5] standard normal; OCR valid only on "ocr" prompts, GenEval only on "geneval" ones (NaN)."""
        gen = torch.Generator().manual_seed(len(batch.prompts))
        R = torch.randn(len(batch.prompts), len(STAND_INS), generator=gen)
        sources = [m["source"] for m in batch.metadata]
        R[[s != "ocr" for s in sources], 3] = math.nan
        R[[s != "geneval" for s in sources], 4] = math.nan
        return R


def make_config(strategy: str, args, device: str, model: str, scope: str = "first_microbatch",
                gradients: str = "per_sample") -> TrainConfig:
    data = TrainConfig().to_dict()
    data["model"].update(name=model, lora_rank=32, lora_alpha=64.0, lora_targets=list(LORA_TARGETS_SD3),
                         dtype="float32" if args.tiny else "bfloat16", device=device,
                         gradient_checkpointing=args.gradient_checkpointing)
    data["sampling"].update(num_steps=25, resolution=args.resolution, prompts_per_step=args.prompts,
                            images_per_prompt=args.images_per_prompt,
                            max_sequence_length=TINY_TOKENS[1] if args.tiny else T5_TOKENS)
    data["nft"].update(micro_batch_size=args.micro_batch, timestep_fraction=args.timestep_fraction)
    data["rewards"] = [{"name": n} for n in STAND_INS]
    data["balance"].update(strategy=strategy, harmonize_every=10, warmup_steps=1, ema_rho=0.7,
                           harmonize_scope=scope, diagnose_every=0, gradients=gradients)
    data.update(steps=1000, checkpoint_every=0, sample_every=0, seed=0)
    return TrainConfig.from_dict(data)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(strategy: str, args, device: torch.device, model: str, steps: int, scope: str = "first_microbatch",
            gradients: str = "per_sample") -> dict:
    """Warm-up step 0, then time steps 1..steps; peak memory over the timed steps."""
    config = make_config(strategy, args, str(device), model, scope, gradients)
    with tempfile.TemporaryDirectory() as out:
        trainer = SyntheticTrainer(config, out)
        trainer.clip_tokens = TINY_TOKENS[0] if args.tiny else CLIP_TOKENS
        trainer.train_step(0)
        sync(device)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        times, full = [], []
        for step in range(1, steps + 1):
            is_full = trainer.balancer.harmonizes(step) and not trainer.balancer.scalarize
            sync(device)
            t0 = time.perf_counter()
            trainer.train_step(step)
            sync(device)
            times.append(time.perf_counter() - t0)
            full.append(is_full)
        peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
        units = math.ceil(config.sampling.batch_size / config.nft.micro_batch_size) * max(
            1, int(len(trainer.sigmas) * config.nft.timestep_fraction))
        result = {"seconds_per_step": float(np.mean(times)), "seconds_per_step_se": standard_error(times),
                  "step_seconds": times, "full_steps": full,
                  "gradients": trainer.gradient_path,
                  "peak_memory_gib": peak, "units_per_step": units,
                  "trainable_parameters": trainer.policy.num_trainable,
                  "transformer_parameters": sum(p.numel() for n, p in trainer.policy.transformer.named_parameters()
                                                if "lora_" not in n)}
        if any(full) and not all(full):
            result["full_step_seconds"] = float(np.mean([t for t, f in zip(times, full) if f]))
            result["amortized_step_seconds"] = float(np.mean([t for t, f in zip(times, full) if not f]))
        del trainer
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


def standard_error(values) -> float | None:
    return float(np.std(values, ddof=1) / math.sqrt(len(values))) if len(values) > 1 else None


def ratio(a: dict, b: dict) -> tuple[float, float | None]:
    """b's time over a's (a speed ratio: a is the slower one when < 1) and its standard error (delta method)."""
    r = b["seconds_per_step"] / a["seconds_per_step"]
    if a.get("seconds_per_step_se") is None or b.get("seconds_per_step_se") is None:
        return r, None
    return r, r * math.hypot(a["seconds_per_step_se"] / a["seconds_per_step"],
                             b["seconds_per_step_se"] / b["seconds_per_step"])


def project(results: dict, units: int, N: int = 10) -> dict:
    """Speed ratios at the paper's ``units`` per step from the measured costs.

    An ordinary unit (one backward of the combined objective) costs c = t_ws / U, the same for weighted
    sum and MARBLE's amortized steps; a harmonized step adds e = t_full - t_amortized (MARBLE's timed window:
    one harmonized unit with K backward passes and the QP); solving on every unit (harmonize_scope "step")
    adds e_u = (t_step_scope - t_ws) / U per unit. Then MARBLE = Uc / (Uc + e/N), marble_full =
    Uc / (Uc + e), marble_full with harmonize_scope "step" = c / (c + e_u). Rollouts and reward models,
    identical for every strategy, would pull all three towards 1.
    """
    ws, marble = results["weighted_sum"], results["marble"]
    U = ws["units_per_step"]
    c = ws["seconds_per_step"] / U
    extra = max(0.0, marble.get("full_step_seconds", 0.0) - marble.get("amortized_step_seconds", 0.0))
    out = {"units_per_step": units, "unit_seconds": c, "full_step_extra_seconds": extra,
           "marble_speed": units * c / (units * c + extra / N),
           "marble_full_speed": units * c / (units * c + extra)}
    if "marble_full_step_scope" in results:
        for name in ("marble_full_step_scope", "marble_full_step_scope_per_reward"):
            if name in results:
                e_u = max(0.0, results[name]["seconds_per_step"] - ws["seconds_per_step"]) / U
                out[f"{name}_speed"] = c / (c + e_u)
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="tiny transformer on the CPU (tests, smoke runs)")
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    parser.add_argument("--resolution", type=int, default=None, help="pixels (default 512; 64 with --tiny)")
    parser.add_argument("--prompts", type=int, default=3, help="prompts per step (the paper: 3 per GPU)")
    parser.add_argument("--images-per-prompt", type=int, default=None,
                        help="group size (the paper: 24; default 8, 2 with --tiny)")
    parser.add_argument("--micro-batch", type=int, default=None,
                        help="samples per forward/backward (the preset: 8; default 8, 6 with --tiny)")
    parser.add_argument("--timestep-fraction", type=float, default=0.1,
                        help="share of the 25-step grid each sample trains on (the paper: 0.99; 0.1 = 2 timesteps "
                             "keeps the check short — per-unit costs do not depend on it)")
    parser.add_argument("--marble-steps", type=int, default=20,
                        help="timed MARBLE steps (default 20: two refresh windows of N=10)")
    parser.add_argument("--steps", type=int, default=5, help="timed steps of the other strategies (default 5)")
    parser.add_argument("--gradient-checkpointing", action="store_true")
    parser.add_argument("--skip-step-scope", action="store_true", help="skip marble_full with harmonize_scope=step")
    args = parser.parse_args(argv)
    for name, full, tiny in (("resolution", 512, 64), ("images_per_prompt", 8, 2), ("micro_batch", 8, 6)):
        if getattr(args, name) is None:
            setattr(args, name, tiny if args.tiny else full)
    if args.tiny:
        device = torch.device("cpu")
        torch.set_num_threads(1)  # a tiny model on a shared CPU: more threads only contend
    else:
        if not torch.cuda.is_available():
            parser.error("no CUDA device: run with --tiny for the CPU smoke version")
        device = torch.device("cuda")
        torch.backends.cuda.matmul.allow_tf32 = True
    model = register_random_sd35(args.tiny, device)
    started = time.perf_counter()
    plan = [("weighted_sum", "weighted_sum", args.steps, {}),
            ("marble", "marble", args.marble_steps, {}),
            ("marble_full", "marble_full", args.steps, {})]
    if not args.skip_step_scope:
        # exact MARBLE on every step: per-reward gradients from per-sample ones (two backward passes, the
        # default) and from K backward passes (README, "Exact MARBLE on every step")
        plan += [("marble_full_step_scope", "marble_full", args.steps, {"scope": "step"}),
                 ("marble_full_step_scope_per_reward", "marble_full", args.steps,
                  {"scope": "step", "gradients": "per_reward"})]
    results = {}
    for name, strategy, steps, options in plan:
        results[name] = measure(strategy, args, device, model, steps, **options)
        # progress, and what a run stopped by a time limit still leaves behind
        print(f"[gpu_check] {name}: {results[name]['seconds_per_step']:.3f} s/step, peak "
              f"{results[name]['peak_memory_gib'] or 0:.1f} GiB ({time.perf_counter() - started:.0f} s)",
              file=sys.stderr, flush=True)
        if args.out:
            args.out.write_text(json.dumps({"partial": True, "strategies": results}, indent=2) + "\n")
    ws = results["weighted_sum"]
    ratios = {f"{name}_speed": ratio(r, ws)[0] for name, r in results.items() if name != "weighted_sum"}
    ratios.update({f"{name}_speed_se": ratio(r, ws)[1] for name, r in results.items() if name != "weighted_sum"})
    if ws["peak_memory_gib"]:
        ratios.update({f"{name}_memory": r["peak_memory_gib"] / ws["peak_memory_gib"] for name, r in results.items()
                       if name != "weighted_sum"})
    report = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "setup": {"transformer": "tiny" if args.tiny else str(SD35M_CONFIG.relative_to(REPO)),
                  "transformer_parameters": ws["transformer_parameters"], "lora_parameters": ws["trainable_parameters"],
                  "lora": {"rank": 32, "alpha": 64}, "dtype": "float32" if args.tiny else "bfloat16",
                  "resolution": args.resolution, "samples_per_step": args.prompts * args.images_per_prompt,
                  "micro_batch": args.micro_batch, "units_per_step": ws["units_per_step"], "K": len(STAND_INS),
                  "rewards_stood_in_for": list(PAPER_REWARDS), "harmonize_every": 10,
                  "gradient_checkpointing": args.gradient_checkpointing},
        "strategies": results,
        "ratios_vs_weighted_sum": ratios,
        "projected_to_paper_step": project(results, PAPER_UNITS),
        "paper": PAPER,
        "wall_seconds": time.perf_counter() - started,
    }
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return report


if __name__ == "__main__":
    main()
