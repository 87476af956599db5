"""The Dashboard's typed state, the progression strip (one prompt at every sample step), the cosine slider in
training steps, whole error messages and full reward names in captions: handlers on a real SQLite store,
written through the job's own EventWriter."""

import gradio as gr
import pytest

from core.events import PreviewEvent, SampleEvent
from jobs import schema as s
from jobs.writer import EventWriter
from tests.jobs_support import REWARDS, balance_event, start_event, step_event


@pytest.fixture
def store(web_store):
    return web_store


def shown(out) -> dict:
    from app.pages.dashboard import View

    return dict(zip(View.names(), out, strict=True))


def write_samples(store, writer, run_id: int, step: int, items: list[tuple[str, int]]) -> None:
    """Samples (prompt, seed) at ``step``, each image a distinct file."""
    event = SampleEvent(step=step, items=[{
        "prompt": p, "source": "tiny", "seed": seed, "group": i, "path": f"samples/step_{step:06d}/{i:03d}.png",
        "rewards": {r: 0.1 * step + 0.01 * k for k, r in enumerate(REWARDS)},
        "advantages": {r: 0.5 for r in REWARDS}} for i, (p, seed) in enumerate(items)])
    for item in event.items:
        path = store.run_dir(run_id) / item["path"]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(f"{run_id} {step} {item['path']}".encode())
    writer(event)


def make_run(store, steps: int = 12, diagnose: tuple[int, ...] = (1, 5, 9), total: int = 20):
    run_id = store.create_run({"rewards": [{"name": n} for n in REWARDS]}, strategy="marble", total_steps=total,
                              name="strip")
    writer = EventWriter(store, run_id, store.run_dir(run_id))
    writer(start_event(total))
    for step in range(1, steps + 1):
        writer(step_event(step, phase="harmonized" if step in diagnose else "amortized"))
        if step in diagnose:
            writer(balance_event(step))
    writer.flush()
    return run_id, writer


def test_the_strip_shows_one_prompt_and_seed_at_every_sample_step_left_to_right(store):
    from app.pages.dashboard import select_run

    run_id, writer = make_run(store)
    for step in (1, 5, 10):  # "a red circle" with seed 7 at every sample step, other prompts around it
        write_samples(store, writer, run_id, step, [(f"filler {step}", 100 + step), ("a red circle", 7)])
    writer.flush()
    out = shown(select_run(run_id, 0.6))
    html = out["strip"]
    assert out["strip_prompt"]["value"] == "a red circle"  # the prompt sampled at the most steps
    assert out["strip_prompt"]["choices"][0] == ("a red circle (3 steps)", "a red circle")
    heads = [html.index(f"<th>step {n}</th>") for n in (1, 5, 10)]
    assert heads == sorted(heads)  # left to right
    images = [s["image"] for step in (1, 5, 10) for s in store.samples(run_id, step=step) if s["seed"] == 7]
    positions = [html.index(img.replace(" ", "%20")) for img in images]
    assert positions == sorted(positions) and "filler" not in html.split("</thead>")[1]
    assert "same seed 7 at every step" in html and "at 3 of 3 sample steps" in html
    assert "colorfulness 1.01" in html  # full reward names with scores under each image (step 10)


def write_previews(store, writer, run_id: int, step: int, prompts: list[str]) -> None:
    """The fixed previews (prompt i with seed i) at ``step``, each image a distinct file."""
    event = PreviewEvent(step=step, items=[{
        "prompt": p, "source": "tiny", "seed": i, "path": f"previews/step_{step:06d}/{i:03d}.png",
        "rewards": {r: 0.2 * step for r in REWARDS}} for i, p in enumerate(prompts)])
    for item in event.items:
        path = store.run_dir(run_id) / item["path"]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(f"{run_id} {step} {item['path']}".encode())
    writer(event)


def test_a_run_with_previews_strips_its_fixed_preview_not_the_rollouts(store):
    from app.pages.dashboard import on_strip_prompt, select_run, tick

    run_id, writer = make_run(store)
    for step in (1, 5):  # rollouts draw new prompts and seeds; the previews are the same at every step
        write_samples(store, writer, run_id, step, [(f"rollout {step}", 100 + step), ("a red circle", 50 + step)])
        write_previews(store, writer, run_id, step, ["two blue squares", "a red circle"])
    write_samples(store, writer, run_id, 10, [("rollout 10", 110)])
    writer.flush()  # step 10's previews are not written yet (they render after its rollouts)
    out = shown(select_run(run_id, 0.6))
    assert out["strip_prompt"]["choices"] == [("two blue squares (2 steps)", "two blue squares"),
                                              ("a red circle (2 steps)", "a red circle")]
    html = out["strip"]
    assert "a fixed preview: the same prompt and seed (0)" in html and "not rendered at the other 1 step" in html
    assert "previews/step_000001/000.png" in html and "previews/step_000005/000.png" in html
    assert "samples/" not in html  # no rollout image in the strip
    assert [s["step"] for s in store.samples(run_id, step=10)] == [10]  # the gallery keeps the rollouts
    write_previews(store, writer, run_id, 10, ["two blue squares", "a red circle"])
    writer.flush()
    out = shown(tick(out["state"], 0.6))  # the late previews reach the strip on the next tick
    assert "previews/step_000010/000.png" in out["strip"] and "at 3 of 3 sample steps" in out["strip"]
    assert out["gallery"] == gr.skip()  # no new sample step: the gallery is left alone
    state, html = on_strip_prompt(out["state"], "a red circle")
    assert "previews/step_000010/001.png" in html and "seed 1" in html and "seed 51" not in html


def test_the_strip_says_when_the_seed_changes_and_follows_the_picked_prompt(store):
    from app.pages.dashboard import on_strip_prompt, select_run

    run_id, writer = make_run(store)
    write_samples(store, writer, run_id, 1, [("a blue square", 1), ("a green triangle", 2)])
    write_samples(store, writer, run_id, 5, [("a blue square", 3)])
    writer.flush()
    out = shown(select_run(run_id, 0.6))
    assert out["strip_prompt"]["value"] == "a blue square"
    assert "the seed changes between steps" in out["strip"] and "seed 1" in out["strip"] and "seed 3" in out["strip"]
    state, html = on_strip_prompt(out["state"], "a green triangle")
    assert state.strip_prompt == "a green triangle" and "<th>step 1</th>" in html and "<th>step 5</th>" not in html
    assert "not sampled at the other 1 step" in html


def test_the_state_is_a_typed_object_and_the_cosine_slider_is_in_training_steps(store):
    from app.pages.dashboard import DashState, on_cos, select_run, tick

    run_id, writer = make_run(store)
    out = shown(select_run(run_id, 0.6))
    state = out["state"]
    assert isinstance(state, DashState) and state.run_id == run_id and state.names == REWARDS
    assert out["cos_step"]["minimum"] == 1 and out["cos_step"]["maximum"] == 9 and out["cos_step"]["value"] == 9
    state, heat, _ = on_cos(state, 7)  # between diagnosed steps 5 and 9: the one at or before it
    assert "at step 5" in heat.layout.title.text and not state.cos_follow
    writer(step_event(13, phase="harmonized"))
    writer(balance_event(13))
    writer.flush()
    out = shown(tick(state, 0.6))
    assert out["cos_step"]["maximum"] == 13 and out["cos_step"]["value"] == 7  # the user's choice stays
    assert "at step 5" in out["cosine"].layout.title.text
    state, heat, _ = on_cos(out["state"], 13)  # back at the right end: follows new steps again
    assert state.cos_follow and "at step 13" in heat.layout.title.text


def test_a_failed_runs_error_is_shown_whole_with_its_backticks(store):
    from app.pages.dashboard import select_run

    run_id, _ = make_run(store, steps=1, diagnose=(1,))
    store.claim(run_id)
    message = ("reward clipscore: weights not found in the HF cache; run `hf download openai/clip-vit-large-patch14` "
               "and start again")
    store.finish(run_id, s.FAILED, error=f"Traceback (most recent call last):\n  File x\nValueError: {message}")
    head = shown(select_run(run_id, 0.6))["header"]
    assert "`hf download openai/clip-vit-large-patch14` and start again" in head
    assert "ValueError: reward clipscore" in head and "File x" not in head


def test_gallery_captions_name_every_reward_in_full(store):
    from app.pages.dashboard import select_run

    run_id, writer = make_run(store)
    write_samples(store, writer, run_id, 1, [("a red circle", 7)])
    writer.flush()
    caption = shown(select_run(run_id, 0.6))["gallery"][0][1]
    assert "jpeg_compressibility 0.1" in caption and "colorfulness 0.11" in caption and "brightness 0.12" in caption


def test_a_tick_without_news_sends_only_the_header(store):
    from app.pages.dashboard import select_run, tick

    run_id, _ = make_run(store)
    out = shown(tick(shown(select_run(run_id, 0.6))["state"], 0.6))
    assert out["header"].startswith(f"### #{run_id}")
    assert all(v == gr.skip() for k, v in out.items() if k not in ("state", "header"))


def test_the_dashboard_shows_which_samples_drive_the_worst_conflict_at_the_sliders_step(store):
    from app.pages.dashboard import on_cos, select_run

    run_id, writer = make_run(store, diagnose=())
    shares = [-0.30, 0.05, -0.10, 0.02]  # sum -0.33
    for step, att in ((3, {"pair": ["jpeg_compressibility", "brightness"], "cosine": -0.33, "scope": "solve",
                           "timestep_index": 2,
                           "samples": [{"prompt": f"p{i}", "source": "tiny" if i % 2 else "other", "seed": i,
                                        "sigma": 0.5, "share": v} for i, v in enumerate(shares)]}),
                      (8, {})):  # step 8: the K-backward path recorded none
        event = balance_event(step)
        event.attribution = att
        writer(event)
    writer.flush()
    assert store.balance(run_id)[0].get("attribution") is None  # the per-step reads leave it out
    out = shown(select_run(run_id, 0.6))
    fig = out["attribution"]  # the newest diagnosed step (8) has none: said, not drawn empty
    assert "per-sample gradient path" in fig.layout.annotations[0].text
    state, heat, fig = on_cos(out["state"], 5)  # the slider back at step 3
    assert "at step 3" in heat.layout.title.text and "at step 3" in fig.layout.title.text
    assert "cos(jpeg_compressibility, brightness) = -0.33" in fig.layout.title.text
    bars = {t.name: list(t.y) for t in fig.data}
    assert sorted(bars) == ["other", "tiny"] and sorted(v for ys in bars.values() for v in ys) == sorted(shares)
    assert sum(v for ys in bars.values() for v in ys) == pytest.approx(-0.33)
    first = min(fig.data, key=lambda t: min(t.x))  # most negative share first
    assert first.y[list(first.x).index(0)] == -0.30 and first.customdata[0][0] == "p0"
