"""Score trained runs against their base model on held-out prompts, and compare runs like the paper's Table 1.

    python -m core.evaluate --run DIR [--prompts test] [--prompts-per-source 16] [--seeds 4]
    python -m core.evaluate --study RUN1 RUN2 ... --out docs/study/
    python -m core.evaluate --curve RUN1 RUN2 ... --out docs/study/curve/

``--run``: generates images for the first N prompts of each of the run's prompt sources (the chosen
split) with fixed evaluation seeds, once with the base model and once with the run's last checkpoint
(its LoRA loaded with ``core.models.load_lora``), scores both with every offline reward — the run's
training rewards and the held-out ones it did not train on — and prints a table (also written to
DIR/eval_<split>.json and .md).

``--study``: evaluates every run against one shared base evaluation and writes study.md/study.json
with the Table-1 style comparison — per-reward means and the composite, the sum over rewards of the
improvement over the base model in units of the base model's std (spec §8) — plus PNG figures made
from each run's events.jsonl, drawn with matplotlib (core/figures.py): α over steps, the worst reward's
gradient cosine with the applied update (spec §4's headline diagnostic) and, when a strategy has several
runs (seeds), every run's improvement.

``--curve``: the same held-out comparison at every checkpoint a run kept, against one base evaluation:
curve.md / curve.json (each strategy's mean ± standard error over its runs at each step) and curve.png. It shows
when a strategy's gains appear and whether the end of the run keeps them; nothing is written into the runs.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from matplotlib.figure import Figure

EVAL_SEED = 1_000_003  # evaluation seeds are fixed and distinct from any training draw
SKIP_REWARDS = ("remote",)
OPPOSITES = {"jpeg_incompressibility": "jpeg_compressibility", "jpeg_compressibility": "jpeg_incompressibility"}
"""Of two rewards that are exactly minus each other, only the first (or the trained one) is evaluated."""


@dataclass
class EvalSettings:
    """What an evaluation samples. Sampling knobs default to the run's own config."""

    split: str = "test"
    prompts_per_source: int = 16
    seeds_per_prompt: int = 4
    num_steps: int | None = None
    guidance_scale: float | None = None
    weights: str = "ema"
    """Which LoRA of a checkpoint: "ema" (the parameter EMA, as the release evaluates; a checkpoint without
    one gives its raw weights) or "raw"."""

    def validate(self) -> None:
        if self.weights not in ("ema", "raw"):
            raise ValueError(f"--weights={self.weights!r}: valid choices: ema, raw")
        if self.split not in ("train", "test"):
            raise ValueError(f"--prompts={self.split!r}: valid choices: train, test")
        if self.prompts_per_source < 1 or self.seeds_per_prompt < 1:
            raise ValueError(f"prompts_per_source={self.prompts_per_source}, seeds_per_prompt="
                             f"{self.seeds_per_prompt}: both must be integers >= 1")


# ---- pieces ----------------------------------------------------------------------------------------

def eval_items(sources: list[str], split: str, per_source: int) -> list:
    """The first ``per_source`` prompts of each source's split (fixed order, so runs are comparable)."""
    from core.prompts import load_source

    items = []
    for name in sources:
        items.extend(load_source(name).split(split)[:per_source])
    return items


def eval_reward_names(train_rewards: list[str], prompts: list[str]) -> list[str]:
    """The training rewards first, then every other reward that can run offline from its defaults (model-
    based rewards need weights and are left out; OCR only when some prompt quotes text)."""
    from core.rewards import EXTERNAL_REWARDS, available_rewards
    from core.rewards.ocr import quoted_text

    extra: list[str] = []
    for n in available_rewards():
        if n in train_rewards or n in EXTERNAL_REWARDS or n in SKIP_REWARDS:
            continue
        if OPPOSITES.get(n) in list(train_rewards) + extra:
            continue
        extra.append(n)
    if not any(quoted_text(p) for p in prompts):
        extra = [n for n in extra if n != "ocr"]
    return list(train_rewards) + extra


def latest_checkpoint(run_dir: Path) -> Path:
    found = sorted(p for p in (run_dir / "checkpoints").glob("step_*") if (p / "pytorch_lora_weights.safetensors")
                   .is_file()) if (run_dir / "checkpoints").is_dir() else []
    if not found:
        raise FileNotFoundError(f"run {str(run_dir)!r} has no checkpoint with pytorch_lora_weights.safetensors "
                                f"under checkpoints/; train it first (python -m core.train ... --out {run_dir})")
    return found[-1]


def generate(pipe, items: list, settings: EvalSettings, config, batch: int = 64):
    """Images [N, 3, H, W] for items × seeds, with the run's sampler settings."""
    import torch

    from core.sampling import generate_images

    s = config.sampling
    steps = settings.num_steps or s.num_steps
    guidance = settings.guidance_scale if settings.guidance_scale is not None else s.guidance_scale
    prompts = [it.text for it in items for _ in range(settings.seeds_per_prompt)]
    seeds = [EVAL_SEED + i for i in range(len(prompts))]
    out = []
    for i in range(0, len(prompts), batch):
        out.append(generate_images(pipe, prompts[i:i + batch], seeds[i:i + batch], num_steps=steps,
                                   guidance_scale=guidance, resolution=s.resolution,
                                   max_sequence_length=s.max_sequence_length, sampler=s.sampler))
    return torch.cat(out)


def score_all(images, items: list, settings: EvalSettings, reward_names: list[str]) -> dict[str, list[float]]:
    """reward name -> one score per image (NaN where it does not apply)."""
    from core.rewards import make_reward

    prompts = [it.text for it in items for _ in range(settings.seeds_per_prompt)]
    metadata = [dict(it.metadata) for it in items for _ in range(settings.seeds_per_prompt)]
    return {n: make_reward(n)(images, prompts, metadata).tolist() for n in reward_names}


def _stats(values: list[float]) -> tuple[float, float, int]:
    v = np.asarray([x for x in values if x is not None and math.isfinite(x)], dtype=np.float64)
    if v.size == 0:
        return float("nan"), float("nan"), 0
    return float(v.mean()), float(v.std(ddof=1)) if v.size > 1 else 0.0, int(v.size)


def compare(base: dict[str, list[float]], run: dict[str, list[float]], train_rewards: list[str]) -> dict:
    """Per reward: base/run mean and std, the improvement and the improvement in base-std units (Table 1's
    z); composite = Σ z over the training rewards, and over every reward that applied."""
    rows = {}
    for name in base:
        bm, bs, n = _stats(base[name])
        rm, rs, _ = _stats(run.get(name, []))
        z = (rm - bm) / bs if n and bs > 1e-12 else float("nan")
        rows[name] = {"base_mean": bm, "base_std": bs, "mean": rm, "std": rs, "delta": rm - bm, "z": z, "n": n,
                      "trained_on": name in train_rewards}
    z_train = [r["z"] for n, r in rows.items() if r["trained_on"] and math.isfinite(r["z"])]
    z_all = [r["z"] for r in rows.values() if math.isfinite(r["z"])]
    return {"rewards": rows, "composite_train": float(sum(z_train)), "composite_all": float(sum(z_all))}


def by_source(scores: dict[str, list[float]], items: list, settings: EvalSettings) -> dict[str, dict[str, float]]:
    """Mean of each reward per prompt source (NaN-aware)."""
    sources = [it.metadata.get("source", "?") for it in items for _ in range(settings.seeds_per_prompt)]
    out: dict[str, dict[str, float]] = {}
    for src in dict.fromkeys(sources):
        idx = [i for i, s in enumerate(sources) if s == src]
        out[src] = {n: _stats([v[i] for i in idx])[0] for n, v in scores.items()}
    return out


# ---- one run ---------------------------------------------------------------------------------------

@dataclass
class BaseEvaluation:
    """The base model's scores on a prompt set, shared by the runs of a study."""

    model: str
    items: list
    reward_names: list[str]
    scores: dict[str, list[float]]
    key: dict


def _key(config, settings: EvalSettings) -> dict:
    s = config.sampling
    shared = {k: v for k, v in asdict(settings).items() if k != "weights"}  # the base model has no LoRA
    return {"model": config.model.name, "sources": list(config.prompts.sources), **shared,
            "num_steps": settings.num_steps or s.num_steps,
            "guidance_scale": settings.guidance_scale if settings.guidance_scale is not None else s.guidance_scale,
            "resolution": s.resolution, "max_sequence_length": s.max_sequence_length,
            **({"sampler": s.sampler} if s.sampler != "euler" else {})}


def evaluate_base(config, settings: EvalSettings, reward_names: list[str] | None = None) -> BaseEvaluation:
    from core.models import load_pipeline

    items = eval_items(config.prompts.sources, settings.split, settings.prompts_per_source)
    names = reward_names or eval_reward_names(config.reward_names, [it.text for it in items])
    pipe = load_pipeline(config.model.name)
    images = generate(pipe, items, settings, config)
    return BaseEvaluation(config.model.name, items, names, score_all(images, items, settings, names),
                          _key(config, settings))


def evaluate_run(run_dir: str | Path, settings: EvalSettings, base: BaseEvaluation | None = None,
                 checkpoint: str | Path | None = None, write: bool = True, events: list[dict] | None = None) -> dict:
    """Evaluate one run (its last checkpoint unless ``checkpoint``) against its base model; returns the result
    and, with ``write``, also keeps it as DIR/eval_<split>.json and .md. ``events``: the run's parsed log when the
    caller has already read it."""
    from core.config import TrainConfig
    from core.models import load_lora, load_pipeline

    settings.validate()
    run_dir = Path(run_dir)
    config = TrainConfig.load(run_dir / "config.json")
    if base is None:
        base = evaluate_base(config, settings)
    elif base.key != _key(config, settings):
        raise ValueError(f"run {str(run_dir)!r} was not made with the study's model/prompts/sampler: "
                         f"{_key(config, settings)} vs {base.key}")
    ckpt = Path(checkpoint) if checkpoint else latest_checkpoint(run_dir)
    t0 = time.perf_counter()
    pipe = load_pipeline(config.model.name)
    weights = load_lora(pipe, ckpt, settings.weights)
    images = generate(pipe, base.items, settings, config)
    scores = score_all(images, base.items, settings, base.reward_names)
    result = {
        "run": str(run_dir), "checkpoint": str(ckpt), "weights": weights, "weights_asked": settings.weights,
        "strategy": config.balance.strategy,
        "train_rewards": config.reward_names, "settings": base.key, "images": len(images),
        **compare(base.scores, scores, config.reward_names),
        "by_source": {"base": by_source(base.scores, base.items, settings),
                      "run": by_source(scores, base.items, settings)},
        "training": training_summary(run_dir, events), "seconds": time.perf_counter() - t0,
    }
    if write:
        (run_dir / f"eval_{settings.split}.json").write_text(json.dumps(result, indent=2) + "\n")
        (run_dir / f"eval_{settings.split}.md").write_text(run_table(result) + "\n")
    return result


def run_table(result: dict) -> str:
    lines = [f"Run `{result['run']}` ({result['strategy']}), checkpoint `{Path(result['checkpoint']).name}`, "
             f"{result['images']} images per model on the {result['settings']['split']} prompts.", "",
             "| reward | trained on | base | run | Δ | Δ / base std |", "|---|:-:|---:|---:|---:|---:|"]
    for name, r in result["rewards"].items():
        if r["n"] == 0:
            continue
        lines.append(f"| {name} | {'✓' if r['trained_on'] else ''} | {r['base_mean']:.4f} | {r['mean']:.4f} | "
                     f"{r['delta']:+.4f} | {signed(r['z'])} |")
    lines += ["", f"Composite (Σ Δ/std) over the training rewards: {result['composite_train']:+.3f}; "
              f"over all rewards: {result['composite_all']:+.3f}."]
    return "\n".join(lines)


# ---- training logs ---------------------------------------------------------------------------------

def read_events(run_dir: Path) -> list[dict]:
    """A run's training log: events.jsonl, or events.jsonl.gz where a study archive keeps it compressed (a
    200-step log is ~0.6 MB of text, ~0.13 MB gzipped). Lines that are not JSON (a log cut mid-write) are skipped."""
    import gzip

    path, packed = run_dir / "events.jsonl", run_dir / "events.jsonl.gz"
    if path.is_file():
        text = path.read_text()
    elif packed.is_file():
        text = gzip.decompress(packed.read_bytes()).decode()
    else:
        return []
    events = []
    for line in text.splitlines():
        try:
            events.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return events


def worst_cosines(events: list[dict]) -> list[tuple[int, float]]:
    """(step, min over valid rewards of cos(g_k, applied update)) for every diagnosed step."""
    out = []
    for ev in events:
        if ev.get("event") != "balance":
            continue
        vals = [v for v in (ev.get("cos_to_update") or {}).values() if v is not None and math.isfinite(v)]
        if vals:
            out.append((int(ev["step"]), min(vals)))
    return out


def training_summary(run_dir: Path, events: list[dict] | None = None) -> dict:
    """From a run's log: steps and training time, the worst-cosine diagnostics, and ``kl_end``, the mean of the
    logged KL to the reference model (mean squared velocity difference) over the last 10% of steps: how far
    the policy has drifted by the end, which a late collapse shows as a jump. ``events``: the parsed log, when
    the caller has already read it (else it is read from ``run_dir``)."""
    events = read_events(run_dir) if events is None else events
    steps = [e for e in events if e.get("event") == "step"]
    worst = [c for _, c in worst_cosines(events)]
    tail = _finite(e.get("kl") for e in steps[-max(1, len(steps) // 10):])
    return {"steps": len(steps), "train_seconds": float(sum(e.get("seconds", 0.0) for e in steps)),
            "diagnosed_steps": len(worst),
            "worst_cos_mean": float(np.mean(worst)) if worst else float("nan"),
            "worst_cos_negative_share": float(np.mean([c < 0 for c in worst])) if worst else float("nan"),
            "kl_end": float(np.mean(tail)) if tail else float("nan")}


# ---- study -----------------------------------------------------------------------------------------

def shared_base(runs: list[Path], settings: EvalSettings) -> BaseEvaluation:
    """One base evaluation for several runs: the first run's model, prompts and sampler, scored with every
    run's training rewards and the held-out ones."""
    from core.config import TrainConfig

    settings.validate()
    configs = [TrainConfig.load(r / "config.json") for r in runs]
    union = list(dict.fromkeys(n for c in configs for n in c.reward_names))
    items_text = [it.text for it in eval_items(configs[0].prompts.sources, settings.split,
                                                settings.prompts_per_source)]
    return evaluate_base(configs[0], settings, eval_reward_names(union, items_text))


def study(run_dirs: list[str | Path], out_dir: str | Path, settings: EvalSettings) -> dict:
    """Evaluate runs that share a model, prompts and sampler against one base evaluation; write
    study.md, study.json, alpha.png and worst_cosine.png into ``out_dir``."""
    runs = [Path(r) for r in run_dirs]
    refuse_unpoolable(runs, "a study")
    base = shared_base(runs, settings)
    logs = [read_events(r) for r in runs]  # each log read once: a 200-step log is ~0.6 MB of JSON lines
    results = [evaluate_run(r, settings, base, events=ev) if _has_checkpoint(r)
               else archived_evaluation(r, settings, base) for r, ev in zip(runs, logs)]
    for r, res, ev in zip(runs, results, logs):  # from the log: also for an archive evaluated before a field existed
        res["mean_alpha"] = mean_alpha(ev)
        res["training"] = training_summary(r, ev)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    write_figures(runs, results, out, logs)
    doc = {"settings": base.key, "runs": results, "strategies": strategy_stats(results),
           "base": {n: _stats(v)[:2] for n, v in base.scores.items()}}
    (out / "study.json").write_text(json.dumps(doc, indent=2) + "\n")
    summary = strategy_summary(results)
    (out / "study.md").write_text(study_table(results, base) + ("\n\n" + summary if summary else "") + "\n")
    return doc


def refuse_unpoolable(runs: list[Path], what: str) -> None:
    """ValueError naming every strategy whose runs are not independent seeds of one design (:func:`unpoolable`)."""
    from core.config import TrainConfig

    configs = [TrainConfig.load(r / "config.json") for r in runs]  # each read once, old field names mapped
    refused = unpoolable([(str(r), c.balance.strategy, c.to_dict()) for r, c in zip(runs, configs)])
    if refused:
        raise ValueError(f"{what} pools each strategy's runs as seeds of one design; "
                         + "; ".join(f"{s}: {why}" for s, why in refused.items()))


def curve(run_dirs: list[str | Path], out_dir: str | Path, settings: EvalSettings) -> dict:
    """Held-out Δ/std of every training reward (and the composite) at every checkpoint each run kept, against
    one base evaluation; writes curve.json (one point per run and checkpoint, and each strategy's mean ± standard
    error over its runs at each step), curve.md and curve.png. Runs are not written to."""
    runs = [Path(r) for r in run_dirs]
    missing = [str(r) for r in runs if not _has_checkpoint(r)]
    if missing:
        raise FileNotFoundError(f"no checkpoints to evaluate in {', '.join(missing)}; a curve needs the run folders "
                                f"with their checkpoints/, not a study archive")
    refuse_unpoolable(runs, "a curve")
    from core.checkpoint import checkpoints_in, step_of

    base = shared_base(runs, settings)
    points = []
    for r in runs:
        for ckpt in checkpoints_in(r):
            res = evaluate_run(r, settings, base, checkpoint=ckpt, write=False)
            points.append({"run": r.name, "strategy": res["strategy"], "step": step_of(ckpt),
                           "train_rewards": res["train_rewards"], "composite_train": res["composite_train"],
                           "z": {n: res["rewards"][n]["z"] for n in res["train_rewards"]}})
    summary = curve_summary(points)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    doc = {"settings": base.key, "points": points, "strategies": summary}
    (out / "curve.json").write_text(json.dumps(doc, indent=2) + "\n")
    (out / "curve.md").write_text(curve_table(summary, base.key) + "\n")
    from core.figures import save_png

    save_png(curve_figure(summary), out / "curve.png")
    return doc


def curve_summary(points: list[dict]) -> dict[str, dict[int, dict]]:
    """strategy -> step -> {"runs": n, "rewards": {name: {mean, se, n}}, "composite": {mean, se, n}} over the
    runs of that strategy evaluated at that step."""
    train = list(dict.fromkeys(n for p in points for n in p["train_rewards"]))
    by: dict[str, dict[int, list[dict]]] = {}
    for p in points:
        by.setdefault(p["strategy"], {}).setdefault(p["step"], []).append(p)
    out: dict[str, dict[int, dict]] = {}
    for strategy, steps in by.items():
        for step, ps in sorted(steps.items()):
            rewards, _ = reward_spread({n: [p["z"].get(n) for p in ps] for n in train})
            composite, _ = reward_spread({"composite": [p["composite_train"] for p in ps]})
            out.setdefault(strategy, {})[step] = {"runs": len(ps), "rewards": rewards,
                                                  "composite": composite.get("composite")}
    return out


def curve_table(summary: dict[str, dict[int, dict]], key: dict) -> str:
    names = list(dict.fromkeys(n for steps in summary.values() for st in steps.values() for n in st["rewards"]))
    lines = ["| strategy | step | runs | " + " | ".join(f"{n} Δ/std" for n in names) + " | composite (train) |",
             "|---|---:|---:|" + "---:|" * (len(names) + 1)]
    for strategy, steps in summary.items():
        for step, st in steps.items():
            cells = [_pm(st["rewards"][n]) if n in st["rewards"] else "n/a" for n in names]
            composite = _pm(st["composite"]) if st["composite"] else "n/a"
            lines.append(f"| {strategy} | {step} | {st['runs']} | " + " | ".join(cells) + f" | {composite} |")
    lines += ["", f"Held-out ({key['split']}) prompts: first {key['prompts_per_source']} of each of "
              f"{', '.join(key['sources'])}; {key['seeds_per_prompt']} seeds each; the {key.get('weights', 'ema')} "
              "LoRA of each checkpoint. Cells: Δ over the base model in base-std units, mean ± standard error over "
              "the strategy's runs (seeds) evaluated at that step."]
    return "\n".join(lines)


def curve_figure(summary: dict[str, dict[int, dict]]) -> Figure:
    """One panel per training reward and one for the composite: each strategy's mean over its runs by step."""
    from core.figures import line_figure

    names = list(dict.fromkeys(n for steps in summary.values() for st in steps.values() for n in st["rewards"]))
    panels = [(f"{n} (held-out Δ / base std)", {s: [(step, st["rewards"][n]["mean"]) for step, st in steps.items()
                                                    if n in st["rewards"]] for s, steps in summary.items()})
              for n in names]
    panels.append(("composite over the training rewards",
                   {s: [(step, st["composite"]["mean"]) for step, st in steps.items() if st["composite"]]
                    for s, steps in summary.items()}))
    return line_figure(panels, ylabel="Δ / base std", hline=0.0,
                       title="Held-out improvement at each checkpoint: each strategy's mean over its runs")


def _has_checkpoint(run_dir: Path) -> bool:
    try:
        latest_checkpoint(run_dir)
        return True
    except FileNotFoundError:
        return False


BASE_TOLERANCE = 1e-4
"""How far a reward's base-model mean may differ between an archived evaluation and today's base evaluation
(float sums on another CPU differ in the last digits; a different model or prompt set differs by far more)."""


def archived_evaluation(run_dir: Path, settings: EvalSettings, base: BaseEvaluation) -> dict:
    """A run kept without its checkpoints (config.json, events.jsonl[.gz] and eval_<split>.json: what a study
    commits of each run, since run folders do not outlive a session): its stored evaluation, accepted only
    when it was made with this study's settings and its base model scored what ``base`` scores now."""
    path = run_dir / f"eval_{settings.split}.json"
    if not path.is_file():
        raise FileNotFoundError(f"run {str(run_dir)!r} has neither a checkpoint to evaluate nor an evaluation "
                                f"({path.name}); evaluate it with `python -m core.evaluate --run` while its "
                                f"checkpoints exist")
    result = json.loads(path.read_text())
    if result.get("settings") != base.key:
        raise ValueError(f"{path}: was evaluated with {result.get('settings')}, this study with {base.key}; "
                         f"evaluate the run again with the study's settings")
    asked = result.get("weights_asked", result.get("weights"))
    if asked != settings.weights:
        raise ValueError(f"{path}: scored the {asked!r} LoRA; this study scores {settings.weights!r}")
    rows = result.get("rewards", {})
    missing = [n for n in base.reward_names if n not in rows]
    if missing:
        raise ValueError(f"{path}: has no score for {', '.join(missing)}, which this study evaluates; evaluate the "
                         f"run again with the study's rewards")
    for name in base.reward_names:
        now, then = _stats(base.scores[name])[0], rows[name].get("base_mean", float("nan"))
        if math.isnan(now) and math.isnan(then):  # the reward applies to none of the prompts, then and now
            continue
        if not abs(now - then) <= BASE_TOLERANCE:
            raise ValueError(f"{path}: the base model scored {name} {then:.6f} then and {now:.6f} now; the "
                             f"archived evaluation is not comparable with this study's base")
    return result


def _mean_series(series: list[list[tuple[float, float]]]) -> list[tuple[float, float]]:
    """The mean over several runs' (step, value) series at every step any of them has."""
    at: dict[float, list[float]] = {}
    for s in series:
        for x, y in s:
            at.setdefault(x, []).append(y)
    return [(x, float(np.mean(ys))) for x, ys in sorted(at.items())]


def write_figures(runs: list[Path], results: list[dict], out: Path,
                  logs: list[list[dict]] | None = None) -> list[Path]:
    """Save :func:`study_figures` as PNG files in ``out``; returns their paths in order."""
    from core.figures import save_png

    return [save_png(fig, out / name) for name, fig in study_figures(runs, results, logs).items()]


def study_figures(runs: list[Path], results: list[dict], logs: list[list[dict]] | None = None) -> dict[str, Figure]:
    """The study's matplotlib figures by file name: alpha.png and worst_cosine.png from the runs'
    events.jsonl. When a strategy has several runs (seeds), its runs are drawn as one panel / one line —
    their mean at each step — and seeds.png shows every run's Δ/std per training reward, one column per
    strategy (bar = mean ± standard error), so a seed study stays readable. ``logs``: the runs' parsed events in
    the order of ``runs``, when the caller has already read them."""
    from core.figures import line_figure, literal, strip_figure

    log_of = dict(zip(runs, logs)) if logs is not None else {}
    groups: dict[str, list[tuple[Path, dict]]] = {}
    for r, res in zip(runs, results):
        groups.setdefault(res["strategy"], []).append((r, res))
    seeded = any(len(g) > 1 for g in groups.values())
    if seeded:  # (panel title, line label, runs)
        units = [(f"{s} (mean of {len(g)} runs)" if len(g) > 1 else f"{literal(g[0][0].name)} ({s})",
                  f"{s} (mean of {len(g)})" if len(g) > 1 else g[0][0].name, g) for s, g in groups.items()]
    else:  # panel titles are matplotlib markup, a run's folder name is not; line labels are escaped by line_figure
        units = [(f"{literal(r.name)} ({res['strategy']})", r.name, [(r, res)]) for r, res in zip(runs, results)]
    alpha_panels, cos_series = [], {}
    for title, label, members in units:
        alphas: dict[str, list[list[tuple[float, float]]]] = {}
        cosines = []
        for r, _ in members:
            events = log_of[r] if r in log_of else read_events(r)
            per_run: dict[str, list[tuple[float, float]]] = {}
            for ev in events:
                if ev.get("event") == "step":
                    for n, a in (ev.get("alpha") or {}).items():
                        per_run.setdefault(n, []).append((ev["step"], a))
            for n, s in per_run.items():
                alphas.setdefault(n, []).append(s)
            cosines.append(worst_cosines(events))
        alpha_panels.append((title, {n: _mean_series(s) for n, s in alphas.items()}))
        cos_series[label] = _mean_series(cosines)
    figures = {
        "alpha.png": line_figure(
            alpha_panels, ylabel=r"$\alpha_k$", y_range=(0.0, 1.0),
            title=r"Reward coefficients $\alpha_k$ applied at each step (the EMA-smoothed QP weights for MARBLE)"
                  + ("; strategies with several runs: their mean" if seeded else "")),
        "worst_cosine.png": line_figure(
            [(r"worst reward: $\min_k \cos(g_k, \mathrm{update})$"
              + (", mean over a strategy's runs" if seeded else ""), cos_series)],
            ylabel="cosine", y_range=(-1.0, 1.0), hline=0.0, columns=1, panel_size=(7.6, 3.6),
            title="Worst per-reward gradient cosine with the applied update (diagnosed steps)")}
    if seeded:
        train = list(dict.fromkeys(n for res in results for n in res["train_rewards"]))
        panels = [(f"{n} (trained on)", {s: [res["rewards"][n]["z"] for _, res in g if n in res["train_rewards"]]
                                         for s, g in groups.items()}) for n in train]
        panels.append(("composite over the training rewards",
                       {s: [res["composite_train"] for _, res in g] for s, g in groups.items()}))
        figures["seeds.png"] = strip_figure(
            panels, ylabel="Δ / base std",
            title="Held-out improvement over the base model: one dot per run (seed), bar = mean ± standard error")
    return figures


def study_table(results: list[dict], base: BaseEvaluation) -> str:
    names = [n for n in base.reward_names if _stats(base.scores[n])[2] > 0]
    train = list(dict.fromkeys(n for r in results for n in r["train_rewards"]))
    header = "| method | " + " | ".join(f"{n}{' *' if n in train else ''}" for n in names) + \
             " | composite (train) | composite (all) | train rewards up | worst train Δ/std | worst cos < 0 " \
             "| mean worst cos | KL at end | train min |"
    lines = [header, "|---|" + "---:|" * (len(names) + 8)]
    lines.append("| base model | " + " | ".join(f"{_stats(base.scores[n])[0]:.3f}" for n in names) +
                 " | 0 | 0 | | | | | | |")
    for r in results:
        t = r["training"]
        cells = [f"{r['rewards'][n]['mean']:.3f} ({signed(r['rewards'][n]['z'])})" for n in names]
        z_train = [r["rewards"][n]["z"] for n in r["train_rewards"] if math.isfinite(r["rewards"][n]["z"])]
        lines.append(f"| {Path(r['run']).name} ({r['strategy']}) | " + " | ".join(cells) +
                     f" | **{r['composite_train']:+.3f}** | {r['composite_all']:+.3f} | "
                     f"{sum(z > 0 for z in z_train)} of {len(z_train)} | {signed(min(z_train, default=math.nan))} | "
                     f"{t['worst_cos_negative_share'] * 100:.0f}% of {t['diagnosed_steps']} | "
                     f"{t['worst_cos_mean']:+.3f} | {t.get('kl_end', math.nan):.2f} | {t['train_seconds'] / 60:.1f} |")
    s = base.key
    lines += ["", f"Held-out ({s['split']}) prompts: first {s['prompts_per_source']} of each of "
              f"{', '.join(s['sources'])}; {s['seeds_per_prompt']} seeds each; {s['num_steps']} sampling steps, "
              f"guidance {s['guidance_scale']}. Cells: mean (Δ over the base model in base-std units). "
              "`*` = trained on. Composite = Σ of those Δ/std (paper's Table 1), over the training rewards and "
              "over all rewards; a composite can be carried by one reward, so the table also counts the training "
              "rewards that improved and gives the worst one. Worst cos: the share of diagnosed steps where some reward's gradient points "
              "against the applied update, and the mean of that worst cosine. KL at end: the logged KL to the reference "
              "model over the last 10% of steps (how far the policy has drifted; a late collapse shows as a jump)."]
    return "\n".join(lines)


def _finite(values) -> list[float]:
    return [float(x) for x in values if x is not None and math.isfinite(x)]


def mean_se(values) -> tuple[float, float]:
    """Mean and standard error (sample std / √n; NaN for fewer than two values) of the finite values."""
    v = _finite(values)
    if not v:
        return float("nan"), float("nan")
    return float(np.mean(v)), float(np.std(v, ddof=1) / math.sqrt(len(v))) if len(v) > 1 else float("nan")


def mean_pm_se(values, digits: int = 2, empty: str = "n/a") -> str:
    """"+m ± se" over the finite values (standard error of the mean), "+m" for one value, ``empty`` for none."""
    m, se = mean_se(values)
    return _pm({"mean": m, "se": se}, digits, empty)


def mean_alpha(events: list[dict]) -> dict[str, float]:
    """Each reward's α averaged over the run's training steps (the coefficients applied, EMA-smoothed for
    MARBLE; a sequential run's stage shares)."""
    values: dict[str, list[float]] = {}
    for ev in events:
        if ev.get("event") == "step":
            for n, a in (ev.get("alpha") or {}).items():
                values.setdefault(n, []).append(a)
    return {n: float(np.mean(v)) for n, v in ((n, _finite(v)) for n, v in values.items()) if v}


SEED_FREE_FIELDS = ("seed", "num_threads", "report_to", "checkpoint_every", "sample_every", "preview_prompts",
                    "model.device")
"""Config fields that may differ between the seeds of one design: the seed itself and what does not change the
training (threads, logging, how often checkpoints and previews are kept, the device)."""


def _flat(config: dict) -> dict[str, Any]:
    """A config as {"section.field": value} (one level deep, as TrainConfig nests), for a field-by-field diff."""
    return {f"{k}.{kk}" if isinstance(v, dict) else k: vv
            for k, v in config.items() for kk, vv in (v.items() if isinstance(v, dict) else [(None, v)])}


def unpoolable(runs: list[tuple[str, str, dict]]) -> dict[str, str]:
    """Which strategies' runs cannot be pooled as seeds, and why. ``runs``: (label, strategy, config as a dict)
    per run. A strategy's runs pool into a mean ± standard error only when they are independent seeds of one
    design: no seed picked twice (two runs of one seed are one measurement counted twice, with a standard error
    of about 0) and no config field apart from :data:`SEED_FREE_FIELDS` differing between them (another budget,
    model or reward set is another experiment)."""
    groups: dict[str, list[tuple[str, dict]]] = {}
    for label, strategy, config in runs:
        groups.setdefault(strategy, []).append((label, _flat(config)))
    out = {}
    for strategy, members in groups.items():
        if len(members) < 2:
            continue
        by_seed: dict[Any, list[str]] = {}
        for label, flat in members:
            by_seed.setdefault(flat.get("seed"), []).append(label)
        twice = [f"seed {seed} is picked {len(labels)} times ({', '.join(labels)})"
                 for seed, labels in by_seed.items() if len(labels) > 1]
        fields = list(dict.fromkeys(k for _, flat in members for k in flat))
        differ = [k for k in fields if k not in SEED_FREE_FIELDS
                  and len({json.dumps(flat.get(k), sort_keys=True) for _, flat in members}) > 1]
        reasons = twice + ([f"its runs differ in more than the seed: {', '.join(differ[:5])}"
                            + (f" and {len(differ) - 5} more" if len(differ) > 5 else "")] if differ else [])
        if reasons:
            out[strategy] = "; ".join(reasons)
    return out


def _group(results: list[dict]) -> dict[str, list[dict]]:
    groups: dict[str, list[dict]] = {}
    for r in results:
        groups.setdefault(r["strategy"], []).append(r)
    return groups


def reward_spread(values: dict[str, list]) -> tuple[dict[str, dict], str | None]:
    """Per reward, mean, standard error and count of its finite values (rewards without one are left out), and
    the reward whose mean is lowest (None when none has a value)."""
    cells = {}
    for n, v in values.items():
        v = _finite(v)
        if v:
            m, se = mean_se(v)
            cells[n] = {"mean": m, "se": se, "n": len(v)}
    return cells, (min(cells, key=lambda n: cells[n]["mean"]) if cells else None)


def strategy_stats(results: list[dict]) -> dict[str, dict]:
    """Per strategy (runs differing only in their seed): mean, standard error and count over its runs of each
    training reward's Δ/std, of the composite and — where the results carry ``mean_alpha`` — of each reward's
    mean α; ``worst`` names the training reward whose mean is lowest, ``all_up`` counts the runs that improved
    every training reward."""
    train = list(dict.fromkeys(n for r in results for n in r["train_rewards"]))
    out = {}
    for strategy, runs in _group(results).items():
        rewards, worst = reward_spread({n: [r["rewards"][n]["z"] for r in runs if n in r["train_rewards"]]
                                        for n in train})
        alpha_names = list(dict.fromkeys(n for r in runs for n in r.get("mean_alpha") or {}))
        out[strategy] = {
            "runs": len(runs), "rewards": rewards,
            "composite_train": dict(zip(("mean", "se"), mean_se([r["composite_train"] for r in runs]))),
            "worst": worst,
            "all_up": sum(all(r["rewards"][n]["z"] > 0 for n in r["train_rewards"]) for r in runs),
            "mean_alpha": {n: dict(zip(("mean", "se"), mean_se([(r.get("mean_alpha") or {}).get(n) for r in runs])))
                           for n in alpha_names}}
    return out


def _pm(cell: dict, digits: int = 2, empty: str = "n/a") -> str:
    """A {"mean", "se"} cell as "+m ± se", "+m" without a standard error, ``empty`` without a mean."""
    m, se = cell["mean"], cell["se"]
    if not math.isfinite(m):
        return empty
    return f"{m:+.{digits}f}" + (f" ± {se:.{digits}f}" if math.isfinite(se) else "")


def _worst_cell(st: dict) -> str:
    return f"{st['worst']} {_pm(st['rewards'][st['worst']])}" if st["worst"] else "n/a"


def strategy_summary(results: list[dict]) -> str:
    """Runs grouped by strategy (several seeds of one preset): mean ± standard error over the runs of each
    training reward's Δ/std and of the composite, the training reward whose mean is lowest (the worst reward,
    the issue-16 criterion), and how many runs improved every training reward; then the findings by the
    one-standard-error rule (:func:`strategy_findings`) and, where the runs' logs give it, each strategy's mean
    α. Empty when no strategy has two runs."""
    if all(len(g) < 2 for g in _group(results).values()):
        return ""
    stats = strategy_stats(results)
    train = list(dict.fromkeys(n for r in results for n in r["train_rewards"]))
    lines = ["| strategy | runs | " + " | ".join(f"{n} Δ/std" for n in train) +
             " | composite (train) | worst training reward | runs with every training reward up |",
             "|---|---:|" + "---:|" * (len(train) + 3)]
    for strategy, st in stats.items():
        cells = [_pm(st["rewards"][n]) if n in st["rewards"] else "n/a" for n in train]
        lines.append(f"| {strategy} | {st['runs']} | " + " | ".join(cells) +
                     f" | {_pm(st['composite_train'])} | {_worst_cell(st)}"
                     f" | {st['all_up']} of {st['runs']} |")
    lines += ["", "Mean ± standard error (sample std / √runs) over the runs of each strategy (runs differing only in "
                  "their seed). Worst training reward: the one whose mean over the runs is lowest."]
    findings = strategy_findings(stats)
    return "\n".join(lines) + ("\n\n" + findings if findings else "")


def strategy_findings(stats: dict[str, dict]) -> str:
    """What the seeds support, by one rule: a difference counts when it exceeds one standard error (of the mean
    over runs; of a difference between two strategies, √(se_a² + se_b²)). Per strategy, the training rewards it
    raised, lowered, or left within one standard error of zero; whose worst training reward it beats; and,
    where the logs give it, its mean α against 1/K."""
    multi = {s: st for s, st in stats.items() if st["runs"] > 1}
    if not multi:
        return ""
    lines = ["Findings, by one rule: a mean counts as up or down when it is more than one standard error from 0, and "
             "one strategy's worst training reward beats another's when the difference of their means exceeds "
             "√(se₁² + se₂²).", "",
             "| strategy | up by > 1 SE | down by > 1 SE | within 1 SE of 0 | worst training reward | beats the worst of |"
             " does not beat |", "|---|---|---|---|---|---|---|"]
    for strategy, st in multi.items():
        groups: dict[str, list[str]] = {"up": [], "down": [], "flat": []}
        for n, c in st["rewards"].items():
            key = "flat" if not math.isfinite(c["se"]) or abs(c["mean"]) <= c["se"] else \
                ("up" if c["mean"] > 0 else "down")
            groups[key].append(n)
        worst = st["worst"]
        beats, not_beats = [], []
        for other, ot in multi.items():
            if other == strategy or worst is None or ot["worst"] is None:
                continue
            a, b = st["rewards"][worst], ot["rewards"][ot["worst"]]
            diff, se = a["mean"] - b["mean"], math.hypot(a["se"], b["se"])
            (beats if math.isfinite(se) and diff > se else not_beats).append(f"{other} ({diff:+.2f} ± {se:.2f})")
        lines.append(f"| {strategy} | " + " | ".join(", ".join(groups[k]) or "—" for k in ("up", "down", "flat")) +
                     f" | {_worst_cell(st)} | "
                     f"{', '.join(beats) or '—'} | {', '.join(not_beats) or '—'} |")
    alphas = {s: st["mean_alpha"] for s, st in multi.items() if st["mean_alpha"]}
    if alphas:
        names = list(dict.fromkeys(n for a in alphas.values() for n in a))
        lines += ["", f"Mean α over each run's steps, mean ± standard error over the runs (1/K = {1 / len(names):.2f}):",
                  "", "| strategy | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names)]
        for s, a in alphas.items():
            lines.append(f"| {s} | " + " | ".join(
                (f"{a[n]['mean']:.2f}" + (f" ± {a[n]['se']:.2f}" if math.isfinite(a[n]["se"]) else ""))
                if n in a else "n/a" for n in names) + " |")
    return "\n".join(lines)


def signed(z: float) -> str:
    """A Δ/std cell: +0.52, or n/a when undefined."""
    return f"{z:+.2f}" if math.isfinite(z) else "n/a"


def _check_args(args: argparse.Namespace) -> None:
    """Bounds and folders checked before torch loads (--threads 0 and a --checkpoint without weights ended
    in tracebacks)."""
    from core.cli_checks import UsageError, int_in, number_in, writable_dir

    int_in("--threads", args.threads, 1, 1024)
    int_in("--prompts-per-source", args.prompts_per_source, 1, 100_000)
    int_in("--seeds", args.seeds, 1, 256)
    if args.num_steps is not None:
        int_in("--num-steps", args.num_steps, 2, 1000)
    if args.guidance is not None:
        number_in("--guidance", args.guidance, 1.0, 100.0)
    flag, runs = next((f, v) for f, v in (("--run", [args.run] if args.run else None), ("--study", args.study),
                                           ("--curve", args.curve)) if v)
    for run in runs:
        if not (Path(run) / "config.json").is_file():
            raise UsageError(f"{flag}={run!r}: is not a run folder (no config.json)")
    if args.checkpoint is not None:
        ckpt = Path(args.checkpoint)
        if not (ckpt / "pytorch_lora_weights.safetensors").is_file():
            raise UsageError(f"--checkpoint={args.checkpoint!r}: holds no pytorch_lora_weights.safetensors; pass "
                             f"a checkpoint folder such as RUN/checkpoints/step_000010")
    if args.run and args.out:  # it was ignored: the scores went into the run folder, and nothing into --out
        raise UsageError(f"--out={args.out!r}: only --study and --curve write to a folder; --run writes "
                         f"eval_<split>.json and .md into the run folder")
    if (args.study or args.curve) and args.out:
        writable_dir("--out", Path(args.out))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m core.evaluate", description=__doc__.split("\n")[0])
    what = ap.add_mutually_exclusive_group(required=True)
    what.add_argument("--run", help="a run folder (config.json + checkpoints/)")
    what.add_argument("--study", nargs="+", metavar="RUN", help="several run folders to compare")
    what.add_argument("--curve", nargs="+", metavar="RUN",
                      help="several run folders, each evaluated at every checkpoint it kept")
    ap.add_argument("--out", help="--study / --curve: folder for the tables, JSON and figures")
    ap.add_argument("--prompts", default="test", choices=("train", "test"), help="prompt split (default test)")
    ap.add_argument("--prompts-per-source", type=int, default=16)
    ap.add_argument("--seeds", type=int, default=4, help="images per prompt")
    ap.add_argument("--num-steps", type=int, default=None, help="sampling steps (default: the run's)")
    ap.add_argument("--guidance", type=float, default=None, help="guidance scale (default: the run's)")
    ap.add_argument("--checkpoint", help="--run: a checkpoint folder instead of the last one")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    ap.add_argument("--weights", default="ema", choices=("ema", "raw"),
                    help="a checkpoint's parameter-EMA LoRA (default; raw when it has none) or its raw LoRA")
    args = ap.parse_args(argv)
    try:
        _check_args(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    import torch

    torch.set_num_threads(args.threads)
    settings = EvalSettings(args.prompts, args.prompts_per_source, args.seeds, args.num_steps, args.guidance,
                            args.weights)
    try:
        if args.run:
            print(run_table(evaluate_run(args.run, settings, checkpoint=args.checkpoint)))
        else:
            if not args.out:
                ap.error(f"{'--study' if args.study else '--curve'} needs --out DIR")
            if args.study:
                study(args.study, args.out, settings)
            else:
                curve(args.curve, args.out, settings)
            print((Path(args.out) / ("study.md" if args.study else "curve.md")).read_text())
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}")
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
