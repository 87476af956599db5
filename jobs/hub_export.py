"""Export a run's checkpoint as a folder ready for the Hugging Face Hub, and push it.

    python -m jobs export RUN --format hub --out DIR [--checkpoint STEP] [--push REPO_ID] [--license ID]

The folder holds
- ``pytorch_lora_weights.safetensors``: the LoRA in the diffusers format with its adapter metadata (rank,
  alpha), loadable with plain ``StableDiffusion3Pipeline.load_lora_weights(DIR)``;
- ``ema/pytorch_lora_weights.safetensors`` when the checkpoint has the LoRA's parameter EMA
  (``<checkpoint>/ema/``), loadable the same way from ``DIR/ema``;
- ``README.md``: a model card made with huggingface_hub's ``ModelCard`` / ``ModelCardData`` — base_model,
  library_name diffusers, tags, the rewards, strategy and key config under ``marble:``, the held-out
  evaluation table when one is stored, and two images: the α trajectory and a grid of training samples;
- ``marble_config.json``: the run's TrainConfig (not ``config.json``, which the Hub and diffusers read as
  a model's own config).

Nothing here unpickles anything: the LoRA files are copied after their safetensors header is checked, and
the rest comes from the store and from JSON / PNG files. No torch import: the web process calls this.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import struct
from dataclasses import dataclass, field
from pathlib import Path

from core.cache import BUILT_IN_MODELS  # built-in pipelines ship with the code, not the Hub
from jobs.storage import Store

LORA_FILE = "pytorch_lora_weights.safetensors"
EMA_DIR = "ema"
CONFIG_FILE = "marble_config.json"
ALPHA_IMAGE = "alpha_trajectory.png"
GRID_IMAGE = "samples.png"
_REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")
_LICENSE_ID = re.compile(r"[a-z0-9][a-z0-9.+-]{0,63}")  # the Hub's license ids (apache-2.0, openrail++, other)


class ExportError(ValueError):
    """A run or checkpoint that cannot be exported; the message names what and why."""


class PushError(RuntimeError):
    """The folder was written but could not be pushed (offline, no token, refused); one clear sentence."""


@dataclass
class HubExport:
    folder: Path
    checkpoint_step: int
    files: list[str] = field(default_factory=list)
    has_ema: bool = False
    pushed_to: str | None = None


# ---- the pieces ----------------------------------------------------------------------------------

def check_safetensors(path: Path) -> dict:
    """The header of a safetensors file (its JSON table of tensors), read without loading any tensor.
    Raises ExportError when the file is not a safetensors file."""
    try:
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) != 8:
                raise ValueError("shorter than the 8-byte header length")
            (n,) = struct.unpack("<Q", raw)
            if n > 100_000_000 or n > path.stat().st_size - 8:
                raise ValueError(f"header length {n} is larger than the file")
            header = json.loads(f.read(n))
        if not isinstance(header, dict):
            raise ValueError("header is not a JSON object")
    except (OSError, ValueError) as e:
        raise ExportError(f"{str(path)!r} is not a readable safetensors file ({e})") from None
    tensors = [k for k in header if k != "__metadata__"]
    if not tensors:
        raise ExportError(f"{str(path)!r} holds no tensors")
    return header


def base_model_id(name: str) -> str:
    """What the card's ``base_model`` says for ``model.name``: a Hub repo id as it is, the repo id of a
    cached snapshot folder (…/models--org--name/snapshots/…), else the built-in name or the folder's name."""
    if _REPO_ID.match(name) and not Path(name).expanduser().exists():
        return name
    for part in Path(name).parts:
        if part.startswith("models--") and part.count("--") >= 2:
            return part[len("models--"):].replace("--", "/", 1)
    return name if name in BUILT_IN_MODELS else Path(name).name


def pick_checkpoint(store: Store, run_id: int, step: int | None = None) -> dict:
    """The checkpoint to export: ``step`` or the newest one on disk."""
    found = [c for c in store.checkpoints(run_id) if c["exists"]]
    if not found:
        raise ExportError(f"run {run_id} has no checkpoint on disk yet (one is written every checkpoint_every "
                          f"steps and at the end of the run)")
    if step is None:
        return found[-1]
    for c in found:
        if c["step"] == step:
            return c
    raise ExportError(f"checkpoint={step!r}: run {run_id} has checkpoints at steps "
                      f"{', '.join(str(c['step']) for c in found)}; pick one of them")


def alpha_series(store: Store, run_id: int, reward_names: list[str], upto: int) -> list[tuple[str, dict]]:
    """Panels for the α trajectory: α* (the QP's solution), ᾱ (its EMA) and the applied α, per reward."""
    rows = [r for r in store.balance(run_id) if r["step"] <= upto]
    raw = {n: [(r["step"], _f((r["alpha_raw"] or {}).get(n))) for r in rows] for n in reward_names}
    ema = {n: [(r["step"], _f((r["alpha_ema"] or {}).get(n))) for r in rows] for n in reward_names}
    applied_keys = [f"alpha/{n}" for n in reward_names]
    series = store.metrics(run_id, keys=applied_keys).by_key()
    applied = {}
    for n in reward_names:
        steps, values = series.get(f"alpha/{n}", ([], []))
        applied[n] = [(s, _f(v)) for s, v in zip(steps, values) if s <= upto]
    # matplotlib mathtext: α* appears only on the steps that solve the QP (lone points between NaNs)
    panels = [(r"$\alpha^*$ (min-norm QP, per solve)", raw), (r"$\bar\alpha$ (EMA of $\alpha^*$)", ema),
              (r"$\alpha$ applied on the step", applied)]
    return [(title, data) for title, data in panels if any(data.values())]


def _f(x) -> float:
    return float("nan") if x is None else float(x)


def sample_grid(store: Store, run_id: int, upto: int, path: Path, max_images: int = 16, tile: int = 128) -> Path | None:
    """A grid of the newest recorded samples at or before step ``upto`` (None when no sample is stored)."""
    from PIL import Image

    steps = [s for s in store.sample_steps(run_id) if s <= upto]
    if not steps:
        return None
    items = [it for it in store.samples(run_id, step=steps[-1]) if Path(it["image"]).is_file()][:max_images]
    if not items:
        return None
    cols = min(4, len(items))
    rows = math.ceil(len(items) / cols)
    grid = Image.new("RGB", (cols * tile, rows * tile), "white")
    for i, it in enumerate(items):
        with Image.open(it["image"]) as im:
            grid.paste(im.convert("RGB").resize((tile, tile), Image.NEAREST), ((i % cols) * tile, (i // cols) * tile))
    grid.save(path)
    return path


def evaluation_markdown(store: Store, run_id: int, run_dir: Path, label: str) -> str | None:
    """The held-out evaluation table: core.evaluate's eval_<split>.json in the run folder when present
    (without the local path), else the store's evaluation rows; None when neither exists."""
    from core.evaluate import run_table

    parts = []
    for path in sorted(run_dir.glob("eval_*.json")):
        try:
            result = json.loads(path.read_text())
            parts.append(run_table({**result, "run": label}))
        except (ValueError, KeyError, TypeError):
            continue  # a file of another shape: the store's rows below still say something
    if parts:
        return "\n\n".join(parts)
    rows = store.evaluations(run_id)
    if not rows:
        return None
    names = sorted({k for r in rows for k in (r["scores"] or {})})
    lines = ["| evaluation | checkpoint | " + " | ".join(names) + " |", "|---|---:|" + "---:|" * len(names)]
    for r in rows:
        cells = [f"{r['scores'][n]:.4f}" if isinstance(r["scores"].get(n), (int, float)) else "" for n in names]
        lines.append(f"| {r['name']} | {r['checkpoint_step'] if r['checkpoint_step'] is not None else ''} | "
                     + " | ".join(cells) + " |")
    return "\n".join(lines)


CARD_TEMPLATE = """---
{{ card_data }}
---

# {{ title }}

A LoRA for `{{ base_model }}` trained with multi-reward RL by MARBLE Studio —
MARBLE (multi-aspect reward balance) on the DiffusionNFT loss: one gradient per reward, harmonized by a
min-norm QP on the simplex, amortized between harmonized steps, EMA-smoothed coefficients.

- **rewards:** {{ rewards }}
- **strategy:** `{{ strategy }}`
- **checkpoint:** step {{ checkpoint_step }} of {{ total_steps }}{{ ema_line }}{{ status_line }}
- **license:** {{ license_line }}

## Use

```python
import torch
from diffusers import StableDiffusion3Pipeline

{{ load_line }}
pipe.load_lora_weights("{{ repo_or_folder }}"){{ ema_use }}
image = pipe("{{ example_prompt }}").images[0]
```

## Training

| setting | value |
|---|---|
{{ config_table }}

The whole configuration is in `marble_config.json` (a MARBLE Studio `TrainConfig`).

## Held-out evaluation

{{ evaluation }}

## α trajectory

{{ alpha_section }}

## Samples

{{ samples_section }}
"""


def key_config(config) -> list[tuple[str, str]]:
    """The settings a reader of the card wants first."""
    b, m, smp, o = config.balance, config.model, config.sampling, config.optim
    rows = [("strategy", b.strategy), ("rewards (weight)", ", ".join(f"{r.name} ({r.weight:g})" for r in config.rewards)),
            ("steps (configured)", config.steps), ("LoRA rank / alpha", f"{m.lora_rank} / {m.lora_alpha:g}"),
            ("LoRA targets", ", ".join(m.lora_targets)), ("learning rate", f"{o.lr:g}"),
            ("prompts × images per step", f"{smp.prompts_per_step} × {smp.images_per_prompt}"),
            ("sampler steps / guidance / resolution", f"{smp.num_steps} / {smp.guidance_scale:g} / {smp.resolution}"),
            ("prompt sources", ", ".join(config.prompts.sources)), ("seed", config.seed)]
    if b.strategy.startswith("marble") or b.strategy in ("upgrad", "dualproj"):
        rows += [("refresh every N / EMA ρ", f"{b.harmonize_every} / {b.ema_rho:g}"), ("normalize", b.normalize),
                 ("refresh scope", b.harmonize_scope)]
    return [(k, str(v)) for k, v in rows]


def build_card(store: Store, run_id: int, config, checkpoint: dict, folder: Path, has_ema: bool,
               license_id: str | None = None, repo_id: str | None = None):
    """The ModelCard of an export (huggingface_hub's ModelCard / ModelCardData)."""
    from huggingface_hub import ModelCard, ModelCardData

    run = store.get_run(run_id)
    base = base_model_id(config.model.name)
    label = run.name or f"run {run_id}"
    data = ModelCardData(
        base_model=base, library_name="diffusers", license=license_id, pipeline_tag="text-to-image",
        tags=["text-to-image", "diffusers", "lora", "sd3", "marble", "reinforcement-learning",
              "multi-reward", f"strategy-{config.balance.strategy}"],
        marble={"strategy": config.balance.strategy, "rewards": config.reward_names,
                "reward_weights": {r.name: r.weight for r in config.rewards},
                "checkpoint_step": checkpoint["step"], "total_steps": config.steps, "seed": config.seed,
                "lora_rank": config.model.lora_rank, "lora_alpha": config.model.lora_alpha,
                "learning_rate": config.optim.lr, "harmonize_every": config.balance.harmonize_every,
                "ema_rho": config.balance.ema_rho, "ema_lora": has_ema, "run_status": run.status,
                "run_step": run.step})
    evaluation = evaluation_markdown(store, run_id, run.run_dir, label)
    alpha = (f"![α trajectory]({ALPHA_IMAGE})\n\nα* is the min-norm QP's solution on harmonized steps, ᾱ its "
             f"exponential moving average (ρ = {config.balance.ema_rho:g}), and the applied α the "
             f"coefficient each step used." if (folder / ALPHA_IMAGE).is_file()
             else "No balancing coefficients were recorded for this run.")
    samples = (f"![training samples]({GRID_IMAGE})\n\nRollout images of the newest sampled step at or before "
               f"the checkpoint." if (folder / GRID_IMAGE).is_file()
               else "No samples were recorded (sample_every = 0).")
    first_prompt = next((s["prompt"] for s in store.samples(run_id)), "a photo of a red apple")
    return ModelCard.from_template(
        data, template_str=CARD_TEMPLATE, title=f"{label}: MARBLE LoRA ({config.balance.strategy})",
        base_model=base, rewards=", ".join(f"`{n}`" for n in config.reward_names),
        strategy=config.balance.strategy, checkpoint_step=checkpoint["step"], total_steps=config.steps,
        ema_line=" (with the EMA of the LoRA's parameters in `ema/`)" if has_ema else "",
        status_line=("" if run.status == "succeeded" else
                     f"\n- **unfinished run:** it was {run.status} at step {run.step} of {config.steps}, so this "
                     f"checkpoint is not the end of the training it was configured for"),
        license_line=f"`{license_id}`" if license_id else ("not set: choose one and add a `license:` line to the "
                                                     "metadata above before publishing"),
        load_line=(f"pipe = StableDiffusion3Pipeline.from_pretrained(\"{base}\", torch_dtype=torch."
                   f"{'bfloat16' if config.model.dtype == 'bfloat16' else 'float32'})" if base not in BUILT_IN_MODELS
                   else f"from core.models import load_pipeline  # {base} ships with MARBLE Studio, not on the Hub\n"
                        f"pipe = load_pipeline(\"{base}\")"),
        repo_or_folder=repo_id or "PATH/TO/THIS/FOLDER",
        ema_use=(f"  # or the parameter EMA: pipe.load_lora_weights(\"{repo_id or 'PATH/TO/THIS/FOLDER'}\", "
                 f"subfolder=\"ema\")") if has_ema else "",
        example_prompt=first_prompt.replace('"', "'"),
        config_table="\n".join(f"| {k} | {v} |" for k, v in key_config(config)),
        evaluation=evaluation or "No held-out evaluation is stored for this run (`python -m core.evaluate --run DIR`).",
        alpha_section=alpha, samples_section=samples)


# ---- the export ----------------------------------------------------------------------------------

def export_hub(store: Store, run_id: int, out: str | Path, checkpoint_step: int | None = None,
               license_id: str | None = None, repo_id: str | None = None) -> HubExport:
    """Write the Hub-ready folder ``out`` for a run's checkpoint (see the module doc); returns what it wrote.
    ``out`` must be empty or absent: an export never mixes with older files."""
    from core.config import TrainConfig
    from core.figures import line_panels, literal

    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ExportError(f"out={str(out)!r}: must be an empty or new folder (it would mix with the files there)")
    if repo_id is not None and not _REPO_ID.match(repo_id):
        raise ExportError(f"push={repo_id!r}: must be a Hub repo id of the form user/name or org/name")
    if license_id is not None and not _LICENSE_ID.fullmatch(license_id):
        raise ExportError(f"license={license_id!r}: must be a Hub license id such as apache-2.0, mit, "
                          f"cc-by-nc-4.0 or other (lowercase letters, digits, '.', '-', '+'; it goes into the "
                          f"card's metadata as written)")
    run = store.get_run(run_id)
    ckpt = pick_checkpoint(store, run_id, checkpoint_step)
    ckpt_dir = Path(ckpt["path"])
    from core.checkpoint import CheckpointError, verify

    try:  # a damaged or partial checkpoint is never published: every file against its manifest
        verify(ckpt_dir)
    except CheckpointError as e:
        raise ExportError(f"not exported: {e}") from None
    lora = ckpt_dir / LORA_FILE
    if not lora.is_file():
        raise ExportError(f"checkpoint {str(ckpt_dir)!r} has no {LORA_FILE}")
    check_safetensors(lora)
    ema = ckpt_dir / EMA_DIR / LORA_FILE
    has_ema = ema.is_file()
    if has_ema:
        check_safetensors(ema)
    config = TrainConfig.from_dict(run.config)  # the stored config, as the job trained it

    out.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(lora, out / LORA_FILE)
    if has_ema:
        (out / EMA_DIR).mkdir()
        shutil.copyfile(ema, out / EMA_DIR / LORA_FILE)
    config.save(out / CONFIG_FILE)
    panels = alpha_series(store, run_id, config.reward_names, ckpt["step"])
    if panels:
        line_panels(panels, out / ALPHA_IMAGE, ylabel=r"$\alpha_k$", y_range=(0.0, 1.0), columns=len(panels),
                    title=f"{literal(run.name or f'run {run_id}')}: balancing coefficients per reward")
    sample_grid(store, run_id, ckpt["step"], out / GRID_IMAGE)
    card = build_card(store, run_id, config, ckpt, out, has_ema, license_id=license_id, repo_id=repo_id)
    card.save(out / "README.md")
    files = sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())
    return HubExport(out, ckpt["step"], files, has_ema)


def push_folder(folder: str | Path, repo_id: str, private: bool = True) -> str:
    """Upload ``folder`` to the model repo ``repo_id`` (created if missing); returns its URL. Raises
    PushError with one sentence when offline, without a token, or when the Hub refuses."""
    import huggingface_hub
    from huggingface_hub import HfApi

    if not _REPO_ID.match(repo_id or ""):
        raise PushError(f"push={repo_id!r}: must be a Hub repo id of the form user/name or org/name")
    if huggingface_hub.is_offline_mode() or os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on"):
        raise PushError(f"not pushed to {repo_id}: HF_HUB_OFFLINE is set, so nothing can reach the Hub; unset it "
                        f"on a machine with network and push the exported folder again")
    token = huggingface_hub.get_token()
    if not token:
        raise PushError(f"not pushed to {repo_id}: no Hugging Face token is configured; run `hf auth login` or set "
                        f"HF_TOKEN, then push again")
    api = HfApi(token=token)
    try:
        api.create_repo(repo_id, repo_type="model", private=private, exist_ok=True)
        api.upload_folder(repo_id=repo_id, folder_path=str(folder), repo_type="model",
                          commit_message="MARBLE Studio export")
    except Exception as e:  # noqa: BLE001 - network, auth, refusal: one sentence for the user, no traceback
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise PushError(f"not pushed to {repo_id}: the Hub refused or could not be reached ({reason})") from None
    return f"https://huggingface.co/{repo_id}"
