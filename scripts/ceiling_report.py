"""One page from single-reward runs: how far RL moves a reward when it has the whole budget.

    python scripts/ceiling_report.py --out docs/study-ceiling/ceiling.md runs/ceiling/*/

Each RUN is a folder made by ``core.train`` with ``balance.strategy=single`` and evaluated by
``core.evaluate --run RUN``. The page has one summary row per run (held-out Δ/std of the trained reward,
from ``eval_test.json``; the training reward's mean over the first and last 20 steps and its best 20-step
mean (``--window``), from ``events.jsonl``) followed by every run's evaluation table as core.evaluate
prints it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a file from anywhere: core is importable

from core.config import TrainConfig  # noqa: E402
from core.evaluate import read_events, run_table, signed  # noqa: E402

HEADER = """# What RL can reach on the mini world: one specialist on the whole budget

Each specialist reward trained alone (`balance.strategy=single`) on its own prompt source only, so all
images of every step carry its advantage (a four-reward preset gives it a quarter). Otherwise the
presets' budget. Held-out test prompts of that source, paired with the base model on the same seeds;
Δ/std = change over the base model in units of the base model's std.

Commands (one run; `REWARD`/`SOURCE` = count_accuracy/world-count, color_fidelity/world-color,
spatial_relation/world-position; add `--set optim.lr=0.002` for the faster rate):

    .venv/bin/python -m core.train --preset mini-marble --set balance.strategy=single \\
        --set balance.single_reward=REWARD --set 'rewards=["REWARD"]' --set 'prompts.sources=["SOURCE"]' \\
        --set seed=0 --out runs/ceiling/REWARD
    .venv/bin/python -m core.evaluate --run runs/ceiling/REWARD --prompts-per-source 48 --seeds 6 --threads 2
    python scripts/ceiling_report.py --out docs/study-ceiling/ceiling.md runs/ceiling/*/

"""


def summarize(run: Path, window: int = 20, label: str | None = None) -> tuple[str, str]:
    """(summary row, full section) for one evaluated single-reward run, named ``label`` (default: its folder's name)."""
    label = label or run.name
    if not (run / "config.json").is_file():
        raise SystemExit(f"{run}: no config.json; not a run folder made by `python -m core.train --out {run}`")
    config = TrainConfig.load(run / "config.json")
    if config.balance.strategy != "single":
        raise SystemExit(f"{run}: balance.strategy is {config.balance.strategy!r}, not 'single'")
    reward = config.balance.single_reward
    evaluation = run / "eval_test.json"
    if not evaluation.exists():
        raise SystemExit(f"{run}: no eval_test.json; run `python -m core.evaluate --run {run}` first")
    result = json.loads(evaluation.read_text())
    values = np.array([e["rewards"][reward] for e in read_events(run) if e["event"] == "step"], dtype=float)
    if len(values) < window:
        raise SystemExit(f"{run}: {len(values)} steps logged, the report needs at least {window}")
    best = np.convolve(values, np.ones(window) / window, mode="valid").max()
    row = (f"| `{label}` | {reward} | {config.optim.lr:g} | {config.sampling.batch_size} × {len(values)} | "
           f"{signed(result['rewards'][reward]['z'])} | "
           f"{values[:window].mean():.3f} → {values[-window:].mean():.3f} ({best:.3f}) |\n")
    return row, f"\n## `{label}`\n\n{run_table(result)}\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", type=Path, help="evaluated single-reward run folders")
    parser.add_argument("--out", type=Path, required=True, help="the markdown page to write")
    parser.add_argument("--window", type=int, default=20, help="steps averaged for first/last/best")
    parser.add_argument("--conclusion", default="", help="a paragraph placed under the summary table")
    parser.add_argument("--header", type=Path, default=None,
                        help="a markdown file to open the page with (title, setup, commands) instead of the "
                             "first ceiling study's")
    args = parser.parse_args(argv)
    several = len({run.resolve().parent for run in args.runs}) > 1   # runs of two studies: say which study each is of
    parts = [summarize(run, args.window, f"{run.resolve().parent.name}/{run.name}" if several else None)
             for run in args.runs]
    summary = ("| run | reward | lr | images/step × steps | held-out Δ/std | training reward, first → last "
               f"{args.window} steps (best {args.window}) |\n|---|---|---:|---:|---:|---|\n")
    summary += "".join(row for row, _ in parts)
    conclusion = f"\n{args.conclusion.strip()}\n" if args.conclusion.strip() else ""
    args.out.parent.mkdir(parents=True, exist_ok=True)
    header = args.header.read_text().rstrip() + "\n\n" if args.header else HEADER
    args.out.write_text(header + summary + conclusion + "".join(section for _, section in parts))
    print(f"wrote {args.out} ({len(parts)} runs)")


if __name__ == "__main__":
    main()
