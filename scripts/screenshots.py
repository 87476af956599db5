"""The README's screenshots, taken from the default preset's world (issue 18): two full runs of the mini world,
MARBLE and the weighted sum, trained by ``core.train``, imported into a data directory of their own, evaluated on
held-out prompts, then every page of the app photographed in headless Chromium (Playwright) as a user sees it.

    .venv/bin/python scripts/screenshots.py                 # train (resumable), import, evaluate, photograph
    .venv/bin/python scripts/screenshots.py --steps 20      # a quick look at the flow (not for the README)

Training is the long part (two 200-step runs side by side, ~10-20 min on 2 cores); a finished run is not trained
again and a started one resumes. The browser part needs Debian's chromium (``make browser``).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

RUNS = (("mini-marble", "MARBLE"), ("mini-weighted-sum", "weighted sum"))


def train(runs_dir: Path, steps: int) -> list[Path]:
    """Both runs, side by side, one CPU thread each; a finished run is skipped, a started one resumes."""
    procs, folders = [], []
    for preset, _ in RUNS:
        out = runs_dir / preset
        folders.append(out)
        if (out / "checkpoints" / f"step_{steps:06d}").is_dir():
            continue
        cmd = [sys.executable, "-m", "core.train", "--preset", preset, "--set", f"steps={steps}", "--out", str(out),
               "--quiet"] + (["--resume"] if (out / "checkpoints").is_dir() else [])
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
        out.parent.mkdir(parents=True, exist_ok=True)
        log = open(f"{out}.log", "a")
        procs.append((preset, subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)))
    for preset, proc in procs:
        if proc.wait() != 0:
            raise SystemExit(f"training {preset} failed: see {runs_dir / preset}.log")
    return folders


def import_and_evaluate(home: Path, folders: list[Path]) -> None:
    """A fresh data directory holding both runs, each with a held-out evaluation of its last checkpoint."""
    from core.evaluate import EvalSettings
    from jobs.evaluations import evaluate
    from jobs.importer import import_run
    from jobs.storage import Store

    shutil.rmtree(home, ignore_errors=True)
    home.mkdir(parents=True)
    with Store.open(home) as store:
        for folder, (_, label) in zip(folders, RUNS):
            run_id, _, _ = import_run(store, folder, name=label)
            evaluate(store, run_id, EvalSettings("test", 16, 4))


def photograph(home: Path, out: Path, steps: int) -> None:
    from playwright.sync_api import sync_playwright

    from tests.test_app_browser import ARGS, CHROMIUM, pick, start_server, stop_server, tab, wait_for_traces

    out.mkdir(parents=True, exist_ok=True)
    proc, url = start_server(home, poll_seconds="2")
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.goto(url)
            page.wait_for_selector("#app-title", timeout=60_000)

            def shot(name: str) -> None:
                page.wait_for_timeout(1500)  # plotly's transitions and lazy images settle
                page.screenshot(path=str(out / f"{name}.png"), full_page=True)
                print(f"wrote {out / name}.png")

            def open_with(name: str, reload: str, picker: str, *options: str) -> None:
                """Tab ``name``, its run list reloaded, ``options`` picked in ``picker``."""
                tab(page, name)
                page.locator(f"#{reload}").click()
                page.wait_for_timeout(1500)
                pick(page, picker, *options)
                page.keyboard.press("Escape")

            shot("new-run")
            open_with("Dashboard", "dash-reload", "dash-run", "MARBLE")
            for plot in ("plot-rewards", "plot-alpha", "plot-cosine", "plot-conflict"):
                wait_for_traces(page, plot)
            for part in ("#strip", "#gallery"):
                page.locator(part).scroll_into_view_if_needed()
                page.wait_for_function(f"() => [...document.querySelectorAll('{part} img')]"
                                       ".every(i => i.naturalWidth > 0)", timeout=60_000)
            page.evaluate("() => window.scrollTo(0, 0)")
            shot("dashboard")

            tab(page, "Runs")
            page.wait_for_function("() => document.querySelector('#runs-table').innerText.includes('weighted sum')",
                                   timeout=30_000)
            pick(page, "runs-pick", "MARBLE · succeeded")  # the training run, not a comparison that names it
            page.keyboard.press("Escape")
            page.locator("#run-annotate-message").get_by_text("tags and notes of").wait_for(timeout=30_000)
            diff_with = page.locator("#run-diff-with input")  # by keyboard: a click on this option was refused
            diff_with.click()  # as "not stable" (the list opens upwards at the foot of the page)
            diff_with.press_sequentially("weighted")
            diff_with.press("ArrowDown")
            diff_with.press("Enter")
            page.locator("#run-diff-note").get_by_text("the same").wait_for(timeout=20_000)
            shot("runs")

            open_with("Overlay", "overlay-reload", "overlay-runs", "MARBLE", "weighted sum")
            wait_for_traces(page, "plot-overlay-rewards", at_least=8)
            shot("overlay")

            open_with("Compare", "compare-reload", "compare-entries", f"MARBLE · step {steps}",
                      f"weighted sum · step {steps}")
            page.locator("#compare-prompts textarea").fill(  # a held-out prompt of each source
                "a green square\nthree yellow circles\na red circle and a purple triangle\n"
                "a purple triangle left of a green square")
            page.locator("#compare-seeds input, #compare-seeds textarea").first.fill("0")
            page.locator("#compare-start").click()
            page.locator("#compare-status").get_by_text("Columns:").wait_for(timeout=600_000)
            page.locator("#compare-gallery").scroll_into_view_if_needed()
            page.wait_for_function("() => [...document.querySelectorAll('#compare-gallery img')]"
                                   ".filter(i => i.naturalWidth > 0).length >= 8", timeout=60_000)
            page.evaluate("() => window.scrollTo(0, 0)")
            shot("compare")

            open_with("Study", "study-reload", "study-runs", "MARBLE", "weighted sum")
            wait_for_traces(page, "plot-pareto", at_least=3)
            shot("study")

            open_with("Replay", "replay-reload", "replay-run", "MARBLE")
            wait_for_traces(page, "plot-replay")
            shot("replay")
            browser.close()
    finally:
        stop_server(proc, home)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=200, help="training steps of each run (default: the presets' 200)")
    ap.add_argument("--runs-dir", type=Path, default=ROOT / "runs" / "screenshots",
                    help="where core.train writes the two runs (default runs/screenshots)")
    ap.add_argument("--home", type=Path, default=ROOT / "runs" / "screenshots-home",
                    help="the app's data directory for the photographs (made afresh)")
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "screenshots", help="where the PNGs go")
    ap.add_argument("--reuse-home", action="store_true",
                    help="photograph the data directory as it is when it exists (no import or evaluation again)")
    args = ap.parse_args(argv)
    if args.steps < 1:
        ap.error(f"--steps={args.steps}: must be an integer >= 1")
    t0 = time.time()
    folders = train(args.runs_dir, args.steps)
    print(f"trained in {time.time() - t0:.0f} s")
    if not (args.reuse_home and (args.home / "marble.db").is_file()):
        import_and_evaluate(args.home, folders)
    photograph(args.home, args.out, args.steps)
    print(f"done in {time.time() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
