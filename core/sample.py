"""Sample one image: ``python -m core.sample --model NAME|PATH [--lora DIR] --prompt P --seed S --out FILE.png``.

``--lora`` takes a checkpoint folder written by training (diffusers LoRA format, loaded with
``pipe.load_lora_weights``), so any diffusers user can load the same weights.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m core.sample", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny", help="built-in model name, local folder or cached repo id")
    parser.add_argument("--lora", help="a checkpoint folder with pytorch_lora_weights.safetensors")
    parser.add_argument("--prompt", required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", required=True, help="output .png")
    parser.add_argument("--steps", type=int, default=10, help="denoising steps")
    parser.add_argument("--guidance", type=float, default=1.0)
    parser.add_argument("--resolution", type=int, default=64)
    parser.add_argument("--max-sequence-length", type=int, default=77)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--weights", default="ema", choices=["ema", "raw"],
                        help="--lora's parameter-EMA LoRA (its ema/ folder; default, raw when absent) or its raw LoRA")
    args = parser.parse_args(argv)
    try:
        out = _check_args(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    from core.config import ConfigError
    from core.checkpoint import CheckpointError
    from core.models import ModelNotFoundError, load_lora, load_pipeline, resolve_device
    from core.sampling import generate_images, to_pil

    try:
        pipe = load_pipeline(args.model, args.dtype, str(resolve_device("auto")))
        if args.lora:
            lora = Path(args.lora)
            if not (lora / "pytorch_lora_weights.safetensors").is_file():
                raise FileNotFoundError(f"--lora {str(lora)!r} holds no pytorch_lora_weights.safetensors; pass a "
                                        f"checkpoint folder such as RUN/checkpoints/step_000010")
            print(f"LoRA: {load_lora(pipe, lora, args.weights)} weights of {lora}")
    except (ModelNotFoundError, FileNotFoundError, ConfigError, CheckpointError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    images = generate_images(pipe, [args.prompt], [args.seed], args.steps, args.guidance, args.resolution,
                             args.max_sequence_length)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        to_pil(images)[0].save(out)
    except OSError as e:
        print(f"error: --out={str(out)!r}: cannot write the image ({e.strerror or e})", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0


IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp")


def _check_args(args: argparse.Namespace) -> Path:
    """Every argument checked before the model loads (same bounds as a training config's sampling)."""
    from core import limits
    from core.cli_checks import UsageError, int_in, number_in, writable_file

    int_in("--steps", args.steps, 1, 1000)
    number_in("--guidance", args.guidance, 1.0, 100.0)
    int_in("--resolution", args.resolution, 16, limits.MAX_RESOLUTION)
    if args.resolution % 16:
        raise UsageError(f"--resolution={args.resolution}: must be a multiple of 16 (VAE factor x patch size)")
    int_in("--max-sequence-length", args.max_sequence_length, 1, 512)
    int_in("--seed", args.seed, 0, limits.MAX_SEED)
    if not args.prompt.strip():
        raise UsageError("--prompt='': must not be empty")
    limits.check_prompt(args.prompt, "--prompt")
    if args.lora and not Path(args.lora).is_dir():
        raise UsageError(f"--lora={args.lora!r}: is not a folder; pass a checkpoint folder such as "
                         f"RUN/checkpoints/step_000010")
    return writable_file("--out", Path(args.out), IMAGE_SUFFIXES)

if __name__ == "__main__":
    sys.exit(main())
