"""New run: a form generated from TrainConfig; "Start" queues one run, "Start study" the same budget
with several strategies. Validation errors are shown next to the form word for word; nothing starts."""

from __future__ import annotations

import time
from typing import Any

import gradio as gr

from app import context
from app.forms import (SECTION_TITLES, FormField, build_config, config_form_values, default_preset, form_fields,
                       format_stages, section_of, selectable_presets)
from core.config import ConfigError, preset
from core.prompts import available_sources
from core.rewards import available_rewards

STUDY_DEFAULT = ["marble", "weighted_sum", "equal"]


# ---- handlers ------------------------------------------------------------------------------------

def preset_values(preset_name: str, fields: list[FormField]) -> list[Any]:
    """Every widget's value for a preset, in the order of the page's outputs."""
    return config_form_values(preset(preset_name), fields)


def start(preset_name: str, run_name: str, rewards: list[str], weights: str, stages: str, single: str | None,
          sources: list[str], fields: list[FormField], values: list[Any]) -> tuple[str, str]:
    """(error markdown, status markdown). On a bad value: the config's message verbatim, nothing queued."""
    from jobs.runner import ensure_worker, submit

    try:
        cfg = build_config(preset_name, {f.path: v for f, v in zip(fields, values)}, rewards, weights, stages,
                           single, sources)
    except ConfigError as e:
        return _refusal(e), ""
    try:  # the queue's preflight: memory, rewards without prompts, reward servers, name length
        run_id = submit(context.store(), cfg, preset=preset_name, name=(run_name or "").strip() or None)
    except ValueError as e:
        return _refusal(e), ""
    ensure_worker(context.store())
    return "", f"Queued run **#{run_id}** ({cfg.balance.strategy}, {cfg.steps} steps). Open it in *Dashboard*."


MAX_STUDY_SEEDS = 16


def start_study(preset_name: str, run_name: str, rewards: list[str], weights: str, stages: str, single: str | None,
                sources: list[str], strategies: list[str], seeds: float | int | None, fields: list[FormField],
                values: list[Any]) -> tuple[str, str]:
    """The same config and budget once per strategy and seed (seeds = the form's seed, +1, +2, ...); all
    validated before any is queued. One seed per strategy says little on a small model: the spread
    between seeds is as large as the gaps between strategies (docs/mini-world.md), so a study can repeat
    every strategy over seeds."""
    from jobs.runner import ensure_worker, submit

    if len(strategies) < 2:
        return "**Not started.** `study: pick at least two strategies to compare`", ""
    if seeds is None or seeds != int(seeds) or not 1 <= int(seeds) <= MAX_STUDY_SEEDS:
        return (f"**Not started.** `study: seeds per strategy = {seeds!r}: must be an integer from 1 to "
                f"{MAX_STUDY_SEEDS}`", "")
    n_seeds = int(seeds)
    label = (run_name or "").strip() or time.strftime("study %m-%d %H:%M")
    configs = []
    try:
        for strategy in strategies:
            vals = {f.path: (strategy if f.path == "balance.strategy" else v) for f, v in zip(fields, values)}
            cfg = build_config(preset_name, vals, rewards, weights, stages, single, sources)
            configs += [cfg.with_overrides({"seed": cfg.seed + i}) for i in range(n_seeds)]
    except ConfigError as e:
        return _refusal(e, f"Not started (strategy {strategy})."), ""

    def name(c) -> str:
        return f"{label} · {c.balance.strategy}" + (f" · seed {c.seed}" if n_seeds > 1 else "")

    from core.preflight import check_run

    try:  # every run checked before any is queued
        if len(label) > 160:
            raise ValueError(f"study name={label[:40]!r}... ({len(label)} characters): at most 160 characters")
        for c in configs[::n_seeds]:
            check_run(c)
    except ValueError as e:
        return _refusal(e), ""
    ids = [submit(context.store(), c, preset=preset_name, name=name(c)) for c in configs]
    ensure_worker(context.store())
    each = "one per strategy" if n_seeds == 1 else f"{n_seeds} seeds per strategy"
    return "", f"Queued study **{label}**: runs {', '.join(f'#{i}' for i in ids)} (same budget, {each})."


# What a newcomer needs before pressing Start: which model the preset trains and how long it takes. Durations are
# measured on this project's 2-core CPU machine (README "Presets and models"); a preset not listed says so.
MINI_WORLD_MODEL = "the pretrained **mini-world** SD3 (1.6 M parameters, 64 px shapes world)"
PRESET_MODELS = {
    "mini": (MINI_WORLD_MODEL,
             "about 9 minutes on 2 CPU cores (mini-marble measured 8 min 51 s; the baselines train the same budget)"),
    "object150": (MINI_WORLD_MODEL,
                  "about 7 to 9 minutes on 2 CPU cores (measured with a second run beside it, seed 5 of its study: "
                  "object150-marble 7 min 26 s, the three baselines 7 to 7 1/2 min, object150-marble-full 9 min; up "
                  "to 16 min while other jobs shared the cores)"),
    "object": (MINI_WORLD_MODEL,
               "about 14 minutes on 2 CPU cores (measured with a second run beside it: object-marble 13 min 30 s, "
               "the weighted sum, equal and sequential baselines 13 to 14 1/2 min, object-marble-full 15 min 42 s)"),
    "quality": (MINI_WORLD_MODEL, "not measured on quiet cores (a one-seed pilot took 88 minutes on a machine "
                                  "loaded with other jobs)"),
    "tiny": ("a **random-weight** tiny SD3 (0.6 M parameters): its images are coloured noise by design, and its "
             "rewards move in the third decimal. It checks that the machinery runs; it is not meant to learn",
             "seconds per step on 2 quiet CPU cores, so its {steps} steps take a minute or two (more while other "
             "jobs share the cores; not a figure measured for this form)"),
    "sd35m": ("**Stable Diffusion 3.5 Medium** from the local Hugging Face cache (LoRA r32)",
              "hours on GPUs; not measured on this project's machines"),
}


def preset_note(name: str | None) -> str:
    """The preset's description, its model and its expected duration, in words."""
    from core.config import available_presets

    if not name or name not in available_presets():
        return ""
    cfg = preset(name)
    model, duration = next((v for k, v in PRESET_MODELS.items() if name.startswith(k)),
                           (f"model `{cfg.model.name}`", "not measured"))
    batch = f"{cfg.steps} steps × {cfg.sampling.prompts_per_step} prompts × {cfg.sampling.images_per_prompt} images"
    return (f"{available_presets()[name]}\n\n**Model:** {model}. **Budget:** {batch}. "
            f"**Expected duration:** {duration.format(steps=cfg.steps)}.")


def unusable_rewards(names: list[str]) -> dict[str, str]:
    """Reward name -> why it cannot be built here with its default arguments (weights absent, no server url)."""
    from core.preflight import missing_reward_files

    return {n: why for n in names if (why := missing_reward_files(n))}


def reward_choices(names: list[str], unusable: dict[str, str]) -> list[tuple[str, str]]:
    return [(f"{n} — needs weights" if n in unusable and n != "remote" else
             f"{n} — needs a server" if n in unusable else n, n) for n in names]


def reward_glossary() -> str:
    """Every reward's one-line description (``Reward.description``, written for this) as a table: the names alone
    (gray_entropy, palette_purity) and their raw values (jpeg_compressibility −4.24) say little to a newcomer."""
    from html import escape

    rows = "".join(f"<tr><td><code>{escape(n)}</code></td><td>{escape(d)}</td></tr>"
                   for n, d in available_rewards().items())
    return f"<table class='reward-glossary'><thead><tr><th>reward</th><th>what it scores, and its range</th></tr>" \
           f"</thead><tbody>{rows}</tbody></table>"


def unusable_note(unusable: dict[str, str]) -> str:
    lines = "\n".join(f"- **{n}** {why}" for n, why in unusable.items())
    return f"<details><summary>Not usable here: {', '.join(unusable)}</summary>\n\n{lines}\n\n</details>"


def _refusal(e: Exception, prefix: str = "Not started.") -> str:
    """An error as markdown, whole: a double-backtick code span keeps the message's own `commands` inside it."""
    return f"**{prefix}** `` {e} ``"


# ---- layout --------------------------------------------------------------------------------------

def _widget(f: FormField) -> gr.components.Component:
    # every field's width comes from static/style.css ([id^="field-"], min 220 px): Gradio drops a checkbox's
    # min_width, and a row of nine fields squeezed the normalize checkbox to "norm"
    common = dict(label=f.label, info=f.help or None, elem_id=f"field-{f.path.replace('.', '-')}")
    if f.kind == "bool":
        return gr.Checkbox(value=f.default, **common)
    if f.kind == "int":
        return gr.Number(value=f.default, **common)  # no precision=0: it rounds 2.5 to 2 before validation sees it
    if f.kind == "float":
        return gr.Number(value=f.default, **common)
    if f.kind == "choice":
        return gr.Dropdown(choices=list(f.choices), value=f.default, **common)
    if f.kind == "multi":
        return gr.Dropdown(choices=list(f.choices), value=list(f.default), multiselect=True, **common)
    return gr.Textbox(value=str(f.default), **common)


def build() -> dict:
    first = default_preset()
    fields = form_fields(preset(first))
    rewards = list(available_rewards())
    base = preset(first)
    with gr.Column():
        gr.Markdown("Start a training run on the queue. Every field below is a `TrainConfig` field, with what "
                    "it does under its name; a bad value is refused with the rule it breaks.")
        with gr.Row():
            preset_box = gr.Dropdown(choices=selectable_presets(), value=first, label="Preset", elem_id="preset",
                                     info="Fills every field below; change any of them afterwards.")
            name_box = gr.Textbox(label="Run name (optional)", elem_id="run-name")
        note_box = gr.Markdown(preset_note(first), elem_id="preset-note", elem_classes=["help-line"])
        unusable = unusable_rewards(rewards)
        with gr.Row():
            reward_box = gr.CheckboxGroup(choices=reward_choices(rewards, unusable), value=base.reward_names,
                                          label="Rewards", elem_id="rewards",
                                          info="Rewards marked “needs weights” are not usable on this machine "
                                               "(see below); a run with one is refused." if unusable else None)
            source_box = gr.CheckboxGroup(choices=list(available_sources()), value=list(base.prompts.sources),
                                          label="Prompt sources", elem_id="sources")
        if unusable:
            gr.Markdown(unusable_note(unusable), elem_id="rewards-unusable")
        with gr.Accordion("What each reward measures", open=False, elem_id="reward-glossary"):
            gr.Markdown(reward_glossary(), elem_id="reward-glossary-table")
        with gr.Row():
            weights_box = gr.Textbox(label="Reward weights (weighted_sum only)", placeholder="colorfulness=2, "
                                     "brightness=0.5", elem_id="weights")
            stages_box = gr.Textbox(label="Stages (sequential only)", value=format_stages(base.balance.stages),
                                    placeholder="colorfulness:80; jpeg_compressibility+brightness:40",
                                    elem_id="stages")
            single_box = gr.Dropdown(choices=rewards, value=base.balance.single_reward, label="Single reward "
                                     "(single only)", elem_id="single-reward")
        widgets: list[gr.components.Component] = []
        for section in SECTION_TITLES:
            group = [f for f in fields if section_of(f) == section]
            if not group:
                continue
            with gr.Accordion(SECTION_TITLES[section], open=section in ("balance", "")):
                with gr.Row(equal_height=False):
                    for f in group:
                        widgets.append(_widget(f))
        error = gr.Markdown(elem_id="form-error", elem_classes=["form-error"])
        with gr.Row():
            start_btn = gr.Button("Start run", variant="primary", elem_id="start-run")
            study_strats = gr.CheckboxGroup(choices=[c for c in fields[0].choices], value=STUDY_DEFAULT,
                                            label="Study: strategies", elem_id="study-strategies")
            # no precision/minimum/maximum: Gradio would round 2.5 silently or answer 0 with an unnamed toast;
            # start_study names the field and the rule
            study_seeds = gr.Number(value=1, label=f"Study: seeds per strategy (1 to {MAX_STUDY_SEEDS})",
                                    elem_id="study-seeds")
            study_btn = gr.Button("Start study", elem_id="start-study")
        status = gr.Markdown(elem_id="start-status")

    extras = [reward_box, weights_box, stages_box, single_box, source_box]
    preset_box.input(lambda p: preset_values(p, fields), preset_box, widgets + extras)
    preset_box.change(preset_note, preset_box, note_box)  # also when Duplicate sets the preset
    started = start_btn.click(
        lambda p, n, r, w, st, si, so, *vals: start(p, n, r, w, st, si, so, fields, list(vals)),
        [preset_box, name_box, *extras, *widgets], [error, status])
    study_started = study_btn.click(
        lambda p, n, r, w, st, si, so, strats, seeds, *vals: start_study(p, n, r, w, st, si, so, strats, seeds,
                                                                         fields, list(vals)),
        [preset_box, name_box, *extras, study_strats, study_seeds, *widgets], [error, status])
    return {"preset": preset_box, "widgets": widgets, "fields": fields, "extras": extras, "name": name_box,
            "started": [started, study_started], "error": error}
