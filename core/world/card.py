"""Measure a mini-world pipeline's prompt following and write its MODEL_CARD.md with a sample grid.

``python -m core.world.card DIR`` (also run at the end of ``core.pretrain``). The numbers come from
the held-out test prompts of each world source, sampled with the project's own sampler
(core.sampling.generate_images) and judged by the analytic checker (core.world.checker).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from core.world.checker import GRADERS, detect, geneval_pass, relation_holds
from core.world.prompts import TASK_SOURCES, world_source
from core.world.scenes import COLORS, SHAPES, TASK_MIX

MAX_SEQUENCE_LENGTH = 4
GRID_PROMPTS = [
    "a red circle", "a large blue triangle", "a yellow square", "a green circle and a purple triangle",
    "three white squares", "two orange circles", "a red circle left of a blue square",
    "a yellow triangle above a green circle",
]


def sample(pipe, prompts: list[str], seeds: list[int], guidance: float, num_steps: int, batch: int = 64):
    """uint8 [B, 64, 64, 3] images for prompts x seeds (same length lists), in batches."""
    import torch

    from core.sampling import generate_images

    out = []
    for i in range(0, len(prompts), batch):
        with torch.no_grad():
            imgs = generate_images(pipe, prompts[i:i + batch], seeds[i:i + batch], num_steps=num_steps,
                                   guidance_scale=guidance, resolution=64, max_sequence_length=MAX_SEQUENCE_LENGTH)
        out.append((imgs.permute(0, 2, 3, 1).numpy() * 255).round().astype(np.uint8))
    return np.concatenate(out)


def measure(pipe, guidance: float, num_steps: int = 8, prompts_per_source: int = 12, seeds_per_prompt: int = 4,
            seed: int = 0) -> dict:
    """Per source: mean graded score, strict pass rate, and for the first requested object whether a
    detected object has its colour / its shape (colour chance 1/7, shape chance 1/3); on position prompts,
    how often both requested colours are found and how often the relation then holds (chance 1/2)."""
    results = {}
    for source in TASK_SOURCES:
        items = world_source(source).test[:prompts_per_source]
        prompts = [it.text for it in items for _ in range(seeds_per_prompt)]
        specs = [it.metadata for it in items for _ in range(seeds_per_prompt)]
        seeds = [seed * 100003 + i for i in range(len(prompts))]
        t0 = time.perf_counter()
        images = sample(pipe, prompts, seeds, guidance, num_steps)
        seconds = time.perf_counter() - t0
        score, passed, color_ok, shape_ok, both_ok, relation = [], [], [], [], [], []
        for spec, img in zip(specs, images):
            dets = detect(img)
            score.append(GRADERS[spec["task"]](spec, dets))
            passed.append(geneval_pass(spec, dets))
            want = spec["objects"][0]
            color_ok.append(any(d.color == want["color"] for d in dets))
            shape_ok.append(any(d.shape == want["shape"] for d in dets))
            both_ok.append(any(d.color == want["color"] and d.shape == want["shape"] for d in dets))
            if spec["task"] == "position":
                relation.append(relation_holds(spec, dets))
        results[source] = {"images": len(prompts), "score": float(np.mean(score)), "pass": float(np.mean(passed)),
                           "color_present": float(np.mean(color_ok)), "shape_present": float(np.mean(shape_ok)),
                           "object_present": float(np.mean(both_ok)), "seconds": seconds}
        found = [r for r in relation if r is not None]
        if relation:
            results[source]["pair_found"] = len(found) / len(relation)
            results[source]["relation_right"] = float(np.mean(found)) if found else float("nan")
    return {"guidance_scale": guidance, "num_steps": num_steps, "by_source": results,
            "chance": {"color": 1 / len(COLORS), "shape": 1 / len(SHAPES)}}


def sample_grid(pipe, path: Path, guidance: float, num_steps: int = 8, seeds: int = 6, cell: int = 96) -> None:
    """A PNG grid: one row per prompt of GRID_PROMPTS, ``seeds`` columns, the prompt written on the left."""
    from PIL import Image, ImageDraw

    prompts = [p for p in GRID_PROMPTS for _ in range(seeds)]
    images = sample(pipe, prompts, list(range(len(prompts))), guidance, num_steps)
    label_w, pad = 260, 4
    grid = Image.new("RGB", (label_w + seeds * (cell + pad), len(GRID_PROMPTS) * (cell + pad)), (255, 255, 255))
    pen = ImageDraw.Draw(grid)
    for r, prompt in enumerate(GRID_PROMPTS):
        y = r * (cell + pad)
        pen.text((6, y + cell // 2 - 6), prompt, fill=(0, 0, 0))
        for c in range(seeds):
            tile = Image.fromarray(images[r * seeds + c]).resize((cell, cell), Image.Resampling.NEAREST)
            grid.paste(tile, (label_w + c * (cell + pad), y))
    grid.save(path)


def _table(m: dict) -> str:
    rows = ["| source | images | graded score | strict pass | colour present | shape present | object present | "
            "both colours found | relation right |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for source, r in m["by_source"].items():
        pair = f"{r['pair_found']:.3f} | {r['relation_right']:.3f}" if "pair_found" in r else "— | —"
        rows.append(f"| {source} | {r['images']} | {r['score']:.3f} | {r['pass']:.3f} | {r['color_present']:.3f} | "
                    f"{r['shape_present']:.3f} | {r['object_present']:.3f} | {pair} |")
    return "\n".join(rows)


def stage_command(stage: dict, index: int) -> str:
    """The ``core.pretrain`` command line of one recorded stage (its pretrain_log entry), as run."""
    r = stage.get("recipe", {})
    cmd = f"python -m core.pretrain --seed {r.get('seed')} --batch {r.get('batch')} --threads {r.get('threads')}"
    if stage.get("diffusion", {}).get("steps"):
        cmd += f" --lr {r.get('lr')} --max-minutes {r.get('max_minutes')}"
    cmd += f" --init-from <stage {index - 1}>" if r.get("init_from") else f" --vae-max-minutes {r.get('vae_max_minutes')}"
    if r.get("task_mix", TASK_MIX) != TASK_MIX:  # logs written before the option existed used the default
        cmd += " --task-mix " + ",".join(f"{k}={v:g}" for k, v in r["task_mix"].items())
    if stage.get("decoder"):
        cmd += f" --steps 0 --decoder-steps {r.get('decoder_steps')} --decoder-max-minutes {r.get('decoder_max_minutes')}"
    return f"`{cmd}`"


def write_model_card(folder: str | Path, guidances: tuple[float, ...] = (1.0, 4.0), num_steps: int = 8,
                     threads: int = 1) -> dict:
    """Measure, draw the grid (at the first guidance scale) and write MODEL_CARD.md + measurements.json."""
    import torch

    from core.models import load_pipeline

    torch.set_num_threads(threads)
    folder = Path(folder)
    pipe = load_pipeline(str(folder))
    log = json.loads((folder / "pretrain_log.json").read_text()) if (folder / "pretrain_log.json").is_file() else {}
    measurements = [measure(pipe, g, num_steps) for g in guidances]
    sample_grid(pipe, folder / "sample_grid.png", guidances[0], num_steps)
    (folder / "measurements.json").write_text(json.dumps(measurements, indent=2) + "\n")
    params = log.get("parameters", {})
    stages = []  # oldest first: a pretraining continued with --init-from records the one it continued
    node = log
    while node:
        stages.insert(0, node)
        node = node.get("previous")
    total_min = sum(st.get("total_seconds", 0) for st in stages) / 60
    vae = stages[0].get("vae", {}) if stages else {}
    size_mb = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()) / 1e6
    lines = [
        "# mini-world: a tiny SD3 pretrained from scratch on the procedural shapes world",
        "",
        "A `StableDiffusion3Pipeline` (same code path as SD3.5) trained on CPU by "
        "`python -m core.pretrain` on the captioned world of `core/world/` (64×64 coloured circles, squares and "
        "triangles on dark tinted backgrounds; captions about colour, count, size and position). It is the "
        "default model of the MARBLE presets (`mini-*`): small enough to do RL on a laptop, good enough that "
        "its rewards mean something, and imperfect enough to leave room for RL.",
        "",
        "Load it offline with `core.models.load_pipeline(\"mini-world\")` or "
        "`StableDiffusion3Pipeline.from_pretrained(path, text_encoder_3=None, tokenizer_3=None)`; always "
        f"pass `max_sequence_length={MAX_SEQUENCE_LENGTH}` (there is no T5: longer only pads zero tokens).",
        "",
        "## Parameters",
        "",
        "| component | parameters | shape |",
        "|---|---:|---|",
        f"| transformer (`SD3Transformer2DModel`) | {params.get('transformer', 0):,} | width 96 (3 heads × 32), "
        "4 layers, patch 2, 16×16×4 latents → 64 image tokens, qk RMSNorm |",
        f"| VAE (`AutoencoderKL`) | {params.get('vae', 0):,} | blocks 8/16/32, 4 latent channels, factor 4, "
        "no attention |",
        f"| text_encoder, text_encoder_2 (`CLIPTextModelWithProjection`) | {params.get('text_encoder', 0):,} each | "
        "hidden 32, 3 layers, projection 32, 16 tokens; word-level BPE tokenizer (each caption word one token) |",
        f"| total | {sum(params.values()):,} | |",
        "",
        f"Folder size: {size_mb:.1f} MB (float32 safetensors).",
        "",
        "## Recipe (as run)",
        "",
        "Rectified flow (x_t = (1-t)·x0 + t·ε, target ε - x0, t ~ logit-normal(0, 1)) on fresh renders every "
        "step, transformer and both text encoders trained jointly with AdamW (warm-up, then a cosine to 5%), "
        "EMA of the weights (the EMA weights are shipped), captions dropped to \"\" 10% of the time (for CFG). "
        "VAE: MSE + 1e-7·KL on fresh renders, then `shift_factor`/`scaling_factor` set from the latents' "
        "mean/std; last, the decoder alone is refined on the frozen encoder's latents (same latent space, truer "
        "colours). Each stage is time-boxed (`--max-minutes`): the learning-rate schedule follows whichever of "
        "the step budget or the time box binds first, so on a busy machine the run ends on time and fully decayed.",
        "",
        "| stage | command | VAE | transformer + text | wall clock |",
        "|---|---|---|---|---:|",
    ]
    for i, st in enumerate(stages, 1):
        r, v, d = st.get("recipe", {}), st.get("vae", {}), st.get("diffusion", {})
        cmd = stage_command(st, i)
        vae_cell = (f"{v.get('steps')} steps × {r.get('batch')}, {v.get('seconds', 0) / 60:.1f} min, "
                    f"{v.get('psnr_db', float('nan')):.1f} dB PSNR" if v.get("steps") else "kept")
        dec = st.get("decoder")
        if dec:
            vae_cell += (f"; decoder alone refined: {dec['steps']} steps, {dec['seconds'] / 60:.1f} min, "
                         f"{dec['psnr_db']:.1f} dB PSNR")
        diff_cell = (f"{d.get('steps')} steps × {r.get('batch')}, {d.get('seconds', 0) / 60:.1f} min, "
                     f"final loss {d.get('final_loss', float('nan')):.3f}" if d.get("steps") else "kept")
        lines.append(f"| {i} | {cmd} | {vae_cell} | {diff_cell} | {st.get('total_seconds', 0) / 60:.1f} min |")
    lines += [
        "",
        f"Total pretraining: {total_min:.1f} min wall clock, torch {log.get('torch')} on 1 thread of a 2-core CPU "
        "machine shared with other jobs (nice 10; 2 threads measured ~15× slower per step there because the "
        "threads wait on each other). Latents: shift_factor "
        f"{vae.get('shift_factor', 0):.4f}, scaling_factor {vae.get('scaling_factor', 0):.4f}. Scheduler: "
        f"`FlowMatchEulerDiscreteScheduler(shift={log.get('recipe', {}).get('scheduler_shift')})`.",
        "",
        "## Prompt following (measured)",
        "",
        f"Held-out test prompts of each source (12 prompts × 4 seeds), {num_steps} sampling steps, judged by "
        "the analytic checker (`core/world/checker.py`, ~100% right on ground-truth renders). *Graded score* is "
        "the source's specialist reward (general: the single object present and alone); *strict pass* is "
        "`world_geneval`; *colour/shape/object present*: some detected object has the first requested "
        f"object's colour (chance {1 / len(COLORS):.2f}) / shape (chance {1 / len(SHAPES):.2f}) / both; "
        "*both colours found*: position prompts with an object of each requested colour, and *relation right*: of "
        "those, the share where the relation holds between them (chance 0.50: a model deaf to the relation "
        "words is right half the time).",
        "",
    ]
    for m in measurements:
        lines += [f"Guidance scale {m['guidance_scale']}:", "", _table(m), ""]
    lines += [
        "## Samples",
        "",
        f"![sample grid](sample_grid.png) — guidance {guidances[0]}, {num_steps} steps, seeds 0-5 per row.",
        "",
        "## Limitations",
        "",
        "- 64×64 flat-colour shapes only; it cannot render text (the OCR reward is for the SD3.5 path).",
        "- Counts, colour binding and spatial relations are followed far less reliably than single colours. That "
        "is the room the specialist rewards (`count_accuracy`, `color_fidelity`, `spatial_relation`) leave, but "
        "not all of it is reachable by RL at the presets' budget: trained alone on the whole 200-step budget, "
        "count rises and colour binding and relations do not (docs/study-ceiling/ceiling.md).",
        "",
    ]
    (folder / "MODEL_CARD.md").write_text("\n".join(lines))
    return {"measurements": measurements, "size_mb": size_mb}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m core.world.card", description=__doc__.split("\n")[0])
    ap.add_argument("folder")
    ap.add_argument("--guidance", type=float, nargs="+", default=[1.0, 4.0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    result = write_model_card(args.folder, tuple(args.guidance), args.steps, args.threads)
    for m in result["measurements"]:
        print(f"guidance {m['guidance_scale']}:\n{_table(m)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
