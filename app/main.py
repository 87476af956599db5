"""The MARBLE Studio web app: layout and wiring of the pages (one module per page in app/pages)."""

from __future__ import annotations

from pathlib import Path

import gradio as gr

from app.pages import compare, dashboard, new_run, overlay, replay, runs, study

STATIC = Path(__file__).resolve().parents[1] / "static"
REFRESH_SECONDS = 2.0


def build_app() -> gr.Blocks:
    with gr.Blocks(title="MARBLE Studio") as demo:
        gr.Markdown("# MARBLE Studio\nMulti-reward RL fine-tuning of diffusion models — watch the rewards "
                    "pull against each other.", elem_id="app-title")
        timer = gr.Timer(REFRESH_SECONDS)
        with gr.Tabs() as tabs:
            with gr.Tab("New run", id="new"):
                new = new_run.build()
            with gr.Tab("Runs", id="runs"):
                runs.build(timer, new, tabs, "new")
            with gr.Tab("Dashboard", id="dashboard"):
                dash = dashboard.build(timer)
            with gr.Tab("Overlay", id="overlay"):
                over = overlay.build(timer)
            with gr.Tab("Compare", id="compare"):
                comp = compare.build(timer)
            with gr.Tab("Study", id="study"):
                stud = study.build()
            with gr.Tab("Replay", id="replay"):
                rep = replay.build()
        # Fill the run pickers once the page loads (and after each reload button).
        demo.load(dash["load_choices"], None, dash["run"])
        # a run started from New run is in the Dashboard's picker at once, picked ("Open it in Dashboard")
        for started in new["started"]:
            started.then(lambda error, current: dashboard.follow_new_runs(not error, current),
                         [new["error"], dash["run"]], dash["run"])
        demo.load(lambda: (gr.update(choices=compare.entry_choices()), gr.update(choices=compare.saved_choices())),
                  None, [comp["entries"], comp["saved"]])  # saved comparisons are there on every (re)load
        from app import context

        demo.load(lambda: gr.update(choices=context.run_choices()), None, stud["runs"])
        demo.load(lambda: gr.update(choices=context.run_choices()), None, over["runs"])
        demo.load(lambda: gr.update(choices=context.run_choices()), None, rep["run"])
    return demo


def css() -> str:
    return (STATIC / "style.css").read_text()
