"""Run dashboard, live while the run trains: one timer, incremental reads, figures replaced only when
new rows arrived (so nothing flickers), ``uirevision`` keeps the user's zoom.

What the page holds between events is one typed object, :class:`DashState`, in a ``gr.State``; what a
handler sends back is one :class:`View`, whose fields name the components (no positions to count)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from html import escape
from typing import Any

import gradio as gr

from app import context, plots
from app.pages import evaluate as evaluation, progression
from app.series import MAX_POINTS, RunSeries, reward_names_of
from jobs.storage import RunNotFound

REFRESH_SECONDS = 2.0
PICK = "Pick a run. Runs appear here as soon as they are queued (start one in New run, then Reload runs)."
ALPHA_HELP = ("**K** is the number of rewards; 1/K is equal weighting. **α\\*** (circles) are the weights the "
              "min-norm solve gives each reward's (normalized) gradient on a harmonized step: the shortest mix of "
              "them, a direction that no reward's gradient points against. **ᾱ** (lines) is their running "
              "average, ᾱ ← ρ·ᾱ + (1−ρ)·α\\*, with **ρ** = balance.ema_rho (closer to 1: smoother, slower); "
              "the steps in between (amortized) train with ᾱ. Dotted: the α each step actually applied.")
COSINE_HELP = ("Cosine between two rewards' gradients at one diagnosed step: +1 they pull the same way, 0 "
               "unrelated, below 0 they pull against each other. The slider picks the training step (it snaps to "
               "the diagnosed step at or before it).")
ATTRIBUTION_HELP = ("At the slider's step, the pair of rewards whose gradients conflict most (lowest cosine) and each "
                    "sample's share of that cosine: the bars add up to it. A long bar below 0 is a sample whose "
                    "gradient for one of the two rewards points against the other's; the colours say which prompt "
                    "source it came from. Measured exactly from the per-sample gradients of one unit (a micro-batch "
                    "at one timestep), on runs with balance.gradients = per_sample.")


@dataclass
class DashState:
    """The picked run as the page shows it: its series, its balance rows, what the user chose."""

    run_id: int | None = None
    gone: bool = False  # the run was deleted while shown (said once, then nothing is sent)
    data: RunSeries | None = None
    balance: list[dict] = field(default_factory=list)
    last_balance: int = 0  # the step after which the next balance read starts
    sample_steps: list[int] | None = None  # as last sent to the page (None: nothing sent yet)
    preview_steps: list[int] | None = None  # the steps with preview images the strip last showed
    cos_follow: bool = True  # the cosine heatmap follows the newest diagnosed step
    cos_step: int | None = None  # else: the training step the user chose
    strip_prompt: str | None = None  # the progression strip's prompt (None: the most sampled one)

    @property
    def names(self) -> list[str]:
        return self.data.names if self.data else []


@dataclass
class View:
    """What one handler sends: a field per output component, in the order of ``View.components``;
    ``gr.skip()`` leaves a component as it is."""

    state: DashState
    header: Any = field(default_factory=gr.skip)
    rewards: Any = field(default_factory=gr.skip)
    alpha: Any = field(default_factory=gr.skip)
    cosine: Any = field(default_factory=gr.skip)
    conflict: Any = field(default_factory=gr.skip)
    cos_step: Any = field(default_factory=gr.skip)
    strip_prompt: Any = field(default_factory=gr.skip)
    strip: Any = field(default_factory=gr.skip)
    sample_step: Any = field(default_factory=gr.skip)
    gallery: Any = field(default_factory=gr.skip)
    spec: Any = field(default_factory=gr.skip)
    attribution: Any = field(default_factory=gr.skip)

    @staticmethod
    def names() -> list[str]:
        return [f.name for f in fields(View)]

    def outputs(self) -> tuple:
        return tuple(getattr(self, n) for n in self.names())


# ---- reads ---------------------------------------------------------------------------------------

def load(run_id: int) -> DashState:
    """The first read of a run: every series down-sampled to MAX_POINTS steps, its balance rows likewise."""
    state = DashState(run_id=run_id, data=RunSeries.load(run_id))
    state.balance = context.store().balance(run_id, max_points=MAX_POINTS)
    state.last_balance = state.balance[-1]["step"] if state.balance else 0
    return state


def refresh(state: DashState) -> bool:
    """Read what is new since the last refresh into ``state``; True when anything was."""
    assert state.run_id is not None and state.data is not None
    changed = state.data.update()
    rows = context.store().balance(state.run_id, since_step=state.last_balance)
    if rows:
        state.balance.extend(rows)
        state.last_balance = rows[-1]["step"]
        if len(state.balance) > 2 * MAX_POINTS:  # as the series: re-read down-sampled
            state.balance = context.store().balance(state.run_id, max_points=MAX_POINTS)
    return changed or bool(rows)


def reward_names(run_id: int) -> list[str]:
    return reward_names_of(context.store().get_run(run_id).config)


def error_html(error: str) -> str:
    """A failed run's error, whole (a traceback: its last line, the message), escaped: backticks or markup in
    it (an `hf download ...` hint) are shown as written, never taken as formatting."""
    text = error.strip()
    if "Traceback (most recent call last)" in text:
        text = text.splitlines()[-1]
    return f"<div class='run-error'><b>Error:</b> {escape(text)}</div>"


def header(run_id: int) -> str:
    r = context.store().get_run(run_id)
    pct = 100 * r.progress
    eta = f" · ETA {context.fmt_seconds(r.eta_seconds)}" if r.eta_seconds is not None else ""
    if r.status == "running" and r.step == 0:  # no step timed yet: say what it is doing, not "0%" and nothing
        eta = " · starting: loading the model and sampling the first step's images"
    elif r.status == "running" and r.total_steps and r.step >= r.total_steps:  # not "ETA 0m00s" for half a minute
        eta = " · finishing: writing the last checkpoint and samples"
    tags = f" · tags: {', '.join(r.tags)}" if r.tags else ""
    err = f"\n\n{error_html(r.error)}" if r.error else ""
    bar = (f"<div class='progress-outer'><div class='progress-inner' style='width:{pct:.1f}%'></div></div>")
    return (f"### #{r.id} {r.name or ''} — {r.status}\n{r.strategy} · step {r.step}/{r.total_steps} "
            f"({pct:.0f}%){eta} · {r.device or 'device n/a'}{tags}{err}\n\n{bar}")


def cos_row(state: DashState) -> dict | None:
    """The balance row the heatmap shows: the newest, or the last diagnosed at or before the chosen step."""
    rows = state.balance
    if not rows:
        return None
    if state.cos_follow or state.cos_step is None:
        return rows[-1]
    before = [r for r in rows if r["step"] <= state.cos_step]
    return before[-1] if before else rows[0]


def attribution_figure(state: DashState) -> Any:
    """Who drives the worst conflict at the heatmap's step (read for that one step)."""
    row = cos_row(state)
    step = row["step"] if row else None
    return plots.conflict_attribution(context.store().attribution(state.run_id, step) if row else None, step)


def cos_slider(state: DashState) -> Any:
    """The slider in training steps, from the first diagnosed step to the newest (at the newest when following)."""
    rows = state.balance
    if not rows:
        return gr.update(minimum=0, maximum=1, value=0, interactive=False)
    lo, hi = rows[0]["step"], rows[-1]["step"]
    value = hi if state.cos_follow or state.cos_step is None else min(max(state.cos_step, lo), hi)
    # one diagnosed step: a slider needs two ends, so it shows lo..lo+1 but is locked (step lo+1 has no diagnosis)
    return gr.update(minimum=lo, maximum=max(hi, lo + 1), value=value, interactive=hi > lo)


def figures(state: DashState, smoothing: float) -> tuple[Any, ...]:
    """(rewards, α, cosine heatmap, conflicts) of the cached run."""
    names, series = state.names, state.data.series if state.data else {}
    return (plots.reward_curves(series, names, smoothing),
            plots.alpha_trajectories(state.balance, series, names),
            plots.cosine_heatmap(cos_row(state)),
            plots.conflict_panels(state.balance, names))


# ---- handlers ------------------------------------------------------------------------------------

def _empty(state: DashState, head: str, message: str) -> View:
    empty = plots.empty_figure("", message)
    note = f"<p class='strip-empty'>{escape(message)}</p>"
    return View(state, head, empty, empty, empty, empty, gr.update(), gr.update(choices=[], value=None), note,
                gr.update(choices=[], value=None), [], plots.empty_figure("Specialist structure", message), empty)


def _gone(run_id: int) -> View:
    """The empty state for a run that no longer exists; the state remembers it so later ticks send nothing."""
    return _empty(DashState(run_id=run_id, gone=True), f"Run #{run_id} no longer exists (deleted). Pick another run.",
                  f"Run #{run_id} was deleted.")


def _samples(view: View) -> View:
    """Strip, step picker, gallery and specialist plot. New sample steps (or another run) move them to the
    newest step; unchanged ones leave them alone (no reload). The gallery is filled here, not by the step
    picker's change event: a run whose newest sample step has the same number as the last run's would not
    change the picker's value, and the old run's images would stay."""
    state = view.state
    store = context.store()
    steps, previews = store.sample_steps(state.run_id), store.preview_steps(state.run_id)
    if previews != state.preview_steps or steps != state.sample_steps:  # a step's previews land after its samples
        state.preview_steps = previews
        view.strip, state.strip_prompt = progression.strip(state.run_id, state.strip_prompt, state.names)
        view.strip_prompt = gr.update(choices=progression.prompt_choices(state.run_id), value=state.strip_prompt)
    if steps == state.sample_steps:
        return view
    state.sample_steps = steps
    newest = steps[-1] if steps else None
    view.sample_step = gr.update(choices=steps, value=newest)
    view.gallery, view.spec = progression.gallery_items(state.run_id, newest)
    return view


def _render(state: DashState, smoothing: float) -> View:
    """Everything shown for the cached run."""
    rewards, alpha, cosine, conflict = figures(state, smoothing)
    return _samples(View(state, header(state.run_id), rewards, alpha, cosine, conflict, cos_slider(state),
                         attribution=attribution_figure(state)))


def select_run(run_id: int | None, smoothing: float) -> tuple[Any, ...]:
    """Everything the dashboard shows for a newly picked run (or the empty state for none)."""
    if run_id is None:
        return _empty(DashState(), PICK, "No run selected.").outputs()
    try:
        return _render(load(int(run_id)), smoothing).outputs()
    except RunNotFound:
        return _gone(int(run_id)).outputs()


def tick(state: DashState | None, smoothing: float) -> tuple[Any, ...]:
    """A timer tick: only what changed since the last one. The run and the cosine step come from the state, not
    from the picker and the slider: a tick that took them as inputs raced their updates (Gradio checked the new
    value against the old choices / maximum and raised)."""
    if state is None or state.run_id is None or state.gone:  # nothing picked, or the deletion was already said
        return View(state or DashState()).outputs()
    try:
        if not refresh(state):  # no new step; a step's samples and previews may still land after it
            return _samples(View(state, header=header(state.run_id))).outputs()
        return _render(state, smoothing).outputs()
    except RunNotFound:  # deleted from the Runs page (or another tab) while shown here
        return _gone(state.run_id).outputs()


def on_cos(state: DashState | None, step: float) -> tuple[DashState | None, Any, Any]:
    """The cosine slider released at a training step: the heatmap and the conflict attribution of the diagnosed
    step at or before it; back at the right end they follow new steps again."""
    if state is None or not state.balance:
        return state, gr.skip(), gr.skip()
    state.cos_step = int(step)
    state.cos_follow = state.cos_step >= state.balance[-1]["step"]
    try:
        return state, plots.cosine_heatmap(cos_row(state)), attribution_figure(state)
    except RunNotFound:
        return state, gr.skip(), gr.skip()


def on_smooth(state: DashState | None, smoothing: float) -> Any:
    if state is None or state.data is None:
        return gr.skip()
    return plots.reward_curves(state.data.series, state.names, smoothing)


def on_strip_prompt(state: DashState | None, prompt: str | None) -> tuple[DashState | None, Any]:
    if state is None or state.run_id is None or state.gone or not prompt:
        return state, gr.skip()
    try:
        html, state.strip_prompt = progression.strip(state.run_id, prompt, state.names)
    except RunNotFound:
        return state, gr.skip()
    return state, html


def on_sample_step(state: DashState | None, step: int | None) -> tuple[Any, Any]:
    """The user's choice of step only: a new run or new samples fill the gallery themselves (``_samples``)."""
    if state is None or state.run_id is None or state.gone:
        return [], gr.skip()
    try:
        return progression.gallery_items(state.run_id, step)
    except RunNotFound:
        return [], gr.skip()


# ---- layout --------------------------------------------------------------------------------------

def build(timer: gr.Timer) -> dict:
    state = gr.State(None)
    with gr.Row():
        run_box = gr.Dropdown(choices=[], label="Run", elem_id="dash-run", scale=3)
        smoothing = gr.Slider(0, 0.98, value=0.6, step=0.02, label="Reward smoothing", scale=2,
                              info="Exponential moving average of the per-step means (0: raw).")
        reload_btn = gr.Button("Reload runs", scale=1, elem_id="dash-reload")
    head = gr.Markdown(PICK, elem_id="dash-header")
    evaluation.build(run_box, timer)  # the held-out evaluation panel: Evaluate, its progress, the stored scores
    c: dict[str, Any] = {"header": head}
    c["rewards"] = gr.Plot(label="Rewards", elem_id="plot-rewards")
    c["alpha"] = gr.Plot(label="α", elem_id="plot-alpha")
    gr.Markdown(ALPHA_HELP, elem_id="alpha-help", elem_classes=["help-line"])
    with gr.Row():
        c["cosine"] = gr.Plot(label="Cosines", elem_id="plot-cosine")
        c["cos_step"] = gr.Slider(0, 1, value=0, step=1, label="Diagnosed step (training step; right = latest)",
                                  info=COSINE_HELP, elem_id="cos-step")
    c["conflict"] = gr.Plot(label="Conflicts", elem_id="plot-conflict")
    c["attribution"] = gr.Plot(label="Who drives the worst conflict", elem_id="plot-attribution")
    gr.Markdown(ATTRIBUTION_HELP, elem_id="attribution-help", elem_classes=["help-line"])
    gr.Markdown("### Samples across training", elem_id="strip-title")
    c["strip_prompt"] = gr.Dropdown(choices=[], label="Prompt (sample steps it appears at)", elem_id="strip-prompt")
    c["strip"] = gr.HTML(f"<p class='strip-empty'>{PICK}</p>", elem_id="strip")
    with gr.Accordion("One sample step: every image, and which sample informs which reward", open=True):
        c["sample_step"] = gr.Dropdown(choices=[], label="Sample step", elem_id="sample-step")
        c["spec"] = gr.Plot(label="Specialist structure", elem_id="plot-specialist")
        c["gallery"] = gr.Gallery(label="Samples (prompt, seed, every reward's score)", columns=8, height=400,
                                  elem_id="gallery")
    outs = [state, *(c[n] for n in View.names()[1:])]

    def load_choices():
        return follow_new_runs(True, None)

    reload_btn.click(load_choices, None, run_box)
    run_box.change(select_run, [run_box, smoothing], outs)
    timer.tick(tick, [state, smoothing], outs, show_progress="hidden")
    c["cos_step"].release(on_cos, [state, c["cos_step"]], [state, c["cosine"], c["attribution"]])
    smoothing.release(on_smooth, [state, smoothing], c["rewards"])
    c["strip_prompt"].input(on_strip_prompt, [state, c["strip_prompt"]], [state, c["strip"]])
    c["sample_step"].input(on_sample_step, [state, c["sample_step"]], [c["gallery"], c["spec"]])
    return {"run": run_box, "load_choices": load_choices}


def follow_new_runs(select_newest: bool, current: Any) -> Any:
    """The run picker's update: every run as a choice; the newest picked when ``select_newest`` (page load,
    a run just started from New run), else the current pick kept."""
    choices = context.run_choices()
    ids = [rid for _, rid in choices]
    value = (ids[0] if ids else None) if select_newest else (current if current in ids else None)
    return gr.update(choices=choices, value=value)
