"""The Dashboard's samples: the progression strip (one prompt at every sample step, left to right) and the
gallery of one step with its specialist-structure heatmap."""

from __future__ import annotations

import math
from html import escape
from typing import Any
from urllib.parse import quote

from app import context, plots

MAX_COLUMNS = 24  # strip columns; a run with more sample steps shows this many, evenly spaced, first and last kept
NO_SAMPLES = "No samples stored yet: a run saves them every sample_every steps (and at step 1)."


def scores_text(sample: dict, names: list[str], sep: str = " · ") -> str:
    """Full reward names with their scores ("colorfulness 0.412"); a reward that does not apply is left out."""
    return sep.join(f"{n} {v:.3g}" for n in names
                    if isinstance(v := (sample.get("rewards") or {}).get(n), (int, float)) and math.isfinite(v))


def _strip_prompts(run_id: int) -> tuple[bool, list[tuple[str, int]]]:
    """(whether the run has preview images, the strip's prompts with their step counts): the fixed preview
    prompts when the run rendered them (TrainConfig.preview_prompts), else the rollout samples' prompts (runs
    made before previews existed, or with preview_prompts = 0)."""
    store = context.store()
    previews = store.preview_prompts(run_id)
    return (True, previews) if previews else (False, store.sample_prompts(run_id))


def prompt_choices(run_id: int) -> list[tuple[str, str]]:
    """The strip's prompt picker: every strip prompt with the number of sample steps it appears at."""
    _, prompts = _strip_prompts(run_id)
    return [(f"{p} ({n} step{'s' if n != 1 else ''})", p) for p, n in prompts]


def _lines(text: str) -> str:
    return escape(text).replace("\n", "<br>")


def _spaced(items: list, n: int) -> list:
    if len(items) <= n:
        return items
    idx = sorted({round(i * (len(items) - 1) / (n - 1)) for i in range(n)})
    return [items[i] for i in idx]


def strip(run_id: int, prompt: str | None, names: list[str]) -> tuple[str, str | None]:
    """(HTML of the strip, the prompt shown). ``prompt`` None or not in the strip: its first prompt. A run with
    preview images shows the preview of that prompt at every sample step (one prompt, one seed, rendered for the
    strip). An older run shows its rollout samples of the prompt sampled at the most steps: per step the sample
    with the seed the prompt had at its first step when that seed is there again, else its first sample of the
    prompt; the caption says the seed, so a change of seed is never hidden."""
    store = context.store()
    has_previews, prompts = _strip_prompts(run_id)
    if not prompts:
        return f"<p class='strip-empty'>{escape(NO_SAMPLES)}</p>", None
    known = {p for p, _ in prompts}
    prompt = prompt if prompt in known else prompts[0][0]
    steps_all = store.sample_steps(run_id)
    by_step: dict[int, list[dict]] = {}
    for s in (store.previews(run_id, prompt=prompt) if has_previews else store.samples(run_id, prompt=prompt)):
        by_step.setdefault(s["step"], []).append(s)
    steps = sorted(by_step)
    seed = by_step[steps[0]][0]["seed"]
    chosen = [next((s for s in by_step[st] if s["seed"] == seed), by_step[st][0]) for st in steps]
    same_seed = all(c["seed"] == seed for c in chosen)
    shown = _spaced(chosen, MAX_COLUMNS)
    head = "".join(f"<th>step {c['step']}</th>" for c in shown)
    cells = "".join(
        f"<td><img src='gradio_api/file={quote(c['image'])}' alt='step {c['step']}' title='{escape(prompt)}'>"
        f"<div class='strip-caption'>seed {c['seed']}<br>{_lines(scores_text(c, names, chr(10)))}</div></td>"
        for c in shown)
    missing = len(steps_all) - len(steps)
    note = [f"<b>{escape(prompt)}</b> at {len(steps)} of {len(steps_all)} sample steps"]
    if len(shown) < len(chosen):
        note.append(f"{len(shown)} of them shown, evenly spaced (first and last kept)")
    if has_previews:
        note.append(f"a fixed preview: the same prompt and seed ({seed}) rendered by the rollout policy at every "
                    f"sample step, so the change from left to right is training's alone")
    else:
        note.append(f"same seed {seed} at every step" if same_seed else
                    "the seed changes between steps (training draws new seeds every step; each image is captioned "
                    "with its own), so differences mix the policy's change with the seed's")
    if missing:
        note.append(f"not {'rendered' if has_previews else 'sampled'} at the other {missing} "
                    f"step{'s' if missing != 1 else ''}")
    html = (f"<div class='strip-note'>{'; '.join(note)}.</div>"
            f"<div class='strip-scroll'><table class='strip'><thead><tr>{head}</tr></thead>"
            f"<tbody><tr>{cells}</tr></tbody></table></div>")
    return html, prompt


def gallery_items(run_id: int, step: int | None) -> tuple[list, Any]:
    """The gallery's (image, caption) items and the specialist-structure heatmap of one sample step
    (the newest when ``step`` is not one of the run's sample steps). Captions carry full reward names."""
    store = context.store()
    steps = store.sample_steps(run_id)
    if not steps:
        return [], plots.empty_figure("Specialist structure", NO_SAMPLES)
    step = step if step in steps else steps[-1]
    samples = store.samples(run_id, step=step)
    names = [r["name"] for r in store.get_run(run_id).config.get("rewards", [])]
    items = [(s["image"], f"{s['prompt']} (seed {s['seed']})\n{scores_text(s, names)}") for s in samples]
    return items, plots.specialist_structure(samples, names)
