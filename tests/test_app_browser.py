"""The web app in a real browser (Playwright driving Debian Chromium): a person's path through it.

A server (``python -m app``) runs on a free loopback port with its own data directory; it starts the job
worker itself, exactly as ``make run`` does. Skipped with the reason when Chromium or Playwright is
missing (``make test`` installs both where it can).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = "/usr/bin/chromium"
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-quic",
        "--no-first-run", "--disable-component-update", "--disable-sync", "--disable-dev-shm-usage"]
SCREENSHOTS = os.environ.get("MARBLE_SCREENSHOTS")  # a folder: the test also saves page screenshots there

if not Path(CHROMIUM).exists():
    pytest.skip(f"browser tests need Debian's chromium at {CHROMIUM} (apt-get install chromium)",
                allow_module_level=True)
sync_api = pytest.importorskip("playwright.sync_api", reason="browser tests need `pip install playwright`")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(home: Path, poll_seconds: str = "0.5") -> tuple[subprocess.Popen, str]:
    """``python -m app`` on a free loopback port with data directory ``home`` (its log: home/server.log), as
    ``make run`` starts it; returns (process, url) once it answers."""
    import urllib.request

    port = free_port()
    env = {**os.environ, "MARBLE_HOME": str(home), "GRADIO_SERVER_PORT": str(port), "HF_HUB_OFFLINE": "1",
           "GRADIO_ANALYTICS_ENABLED": "False", "MARBLE_POLL_SECONDS": poll_seconds, "PYTHONPATH": str(ROOT)}
    with open(home / "server.log", "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "app"], cwd=ROOT, env=env, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}/"
    deadline = time.time() + 180
    while time.time() < deadline:
        try:
            urllib.request.urlopen(url, timeout=2)
            return proc, url
        except OSError:
            if proc.poll() is not None:
                raise RuntimeError((home / "server.log").read_text()[-3000:])
            time.sleep(1)
    raise RuntimeError("the app did not answer in 180 s")


def stop_server(proc: subprocess.Popen, home: Path) -> None:
    """Stop the app and the detached worker (and any job it runs) of its data directory."""
    os.killpg(proc.pid, 15)
    subprocess.run(["pkill", "-f", f"MARBLE_HOME={home}"], check=False)
    lock = home / "worker.lock"
    if lock.exists() and lock.read_text().strip().isdigit():
        try:
            os.killpg(int(lock.read_text().strip()), 15)
        except (ProcessLookupError, PermissionError):
            pass
    proc.wait(timeout=30)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    home = tmp_path_factory.mktemp("marble_home")
    proc, url = start_server(home)
    yield {"url": url, "home": home}
    stop_server(proc, home)


@pytest.fixture(scope="module")
def page(server):
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        pg = browser.new_page(viewport={"width": 1400, "height": 1000})
        pg.goto(server["url"])
        pg.wait_for_selector("#app-title", timeout=60_000)
        yield pg
        browser.close()


def shot(page, name: str) -> None:
    if SCREENSHOTS:
        Path(SCREENSHOTS).mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(Path(SCREENSHOTS) / f"{name}.png"), full_page=True)


def tab(page, name: str) -> None:
    page.get_by_role("tab", name=name).click()
    page.wait_for_timeout(300)


def set_field(page, path: str, value) -> None:
    from app.forms import SECTION_TITLES

    box = page.locator(f"#field-{path.replace('.', '-')} input")
    if not box.is_visible():  # its section is folded: open it as a person would
        section = path.split(".")[0] if "." in path else ""
        page.get_by_text(SECTION_TITLES[section], exact=True).first.click()
        box.wait_for(state="visible", timeout=10_000)
    box.fill(str(value))
    box.press("Tab")


def small_run(page, steps: int, name: str, **extra) -> None:
    tab(page, "New run")
    page.locator("#preset input").fill("tiny")
    page.locator("#preset input").press("Enter")
    page.wait_for_timeout(800)
    page.locator("#run-name textarea, #run-name input").first.fill(name)
    fields = {"steps": steps, "sampling.num_steps": 4, "sampling.prompts_per_step": 2,
              "sampling.images_per_prompt": 4, "nft.micro_batch_size": 8, "num_threads": 1,
              "balance.harmonize_every": 2, "sample_every": 1, "checkpoint_every": 1, "preview_prompts": 1,
              **extra}
    for path, value in fields.items():
        set_field(page, path, value)
    # under load the preset's own values can land after ours (the preset change is an event like any other):
    # set again whatever it overwrote, so the run started is the one asked for
    for path, value in fields.items():
        box = page.locator(f"#field-{path.replace('.', '-')} input")
        if box.input_value() != str(value):
            set_field(page, path, value)
    page.locator("#start-run").click()


def wait_queued(page, timeout: float = 60_000) -> None:
    """Wait for New run's "Queued run"; on a timeout fail with what the page said instead."""
    try:
        page.locator("#start-status").get_by_text("Queued run").wait_for(timeout=timeout)
    except Exception:
        said = page.locator("#start-status").inner_text() + " | " + page.locator("#form-error").inner_text()
        raise AssertionError(f"Start did not queue a run; the page said: {said!r}") from None


# Traces that plotly.js actually drew points for: its _fullData holds the decoded arrays (the server
# sends long series as typed arrays, {dtype, bdata}; a trace plotly.js could not decode has none).
DRAWN = ("(p => p && p._fullData ? p._fullData.filter(t => { const v = t.type === 'heatmap' ? t.z : t.y;"
         " return v && v.length > 0; }).length : 0)")


def pick(page, elem: str, *options: str) -> None:
    """Choose ``options`` in the dropdown #elem (one after the other for a multiselect)."""
    for option in options:
        page.locator(f"#{elem} input").click()
        page.get_by_role("option", name=option).first.click()


def plot_traces(page, elem: str) -> int:
    return page.evaluate(f"() => {DRAWN}(document.querySelector('#{elem} .js-plotly-plot'))")


def wait_for_traces(page, elem: str, timeout: float = 90_000, at_least: int = 1) -> None:
    page.wait_for_function(f"() => {DRAWN}(document.querySelector('#{elem} .js-plotly-plot')) >= {at_least}",
                           timeout=timeout)


def test_a_bad_form_value_shows_its_error_and_starts_nothing(page, server):
    tab(page, "New run")
    set_field(page, "balance.ema_rho", 1.5)
    page.locator("#start-run").click()
    error = page.locator("#form-error")
    error.get_by_text("balance.ema_rho=1.5: must be a number in [0, 1)").wait_for(timeout=20_000)
    shot(page, "new-run-error")
    from jobs.storage import Store

    with Store.open(server["home"]) as store:
        assert store.list_runs() == []
    set_field(page, "balance.ema_rho", 0.7)


def test_start_a_run_watch_it_train_then_cancel_it(page, server):
    # long enough never to finish on a loaded CI machine before the test cancels it (200 steps once did)
    small_run(page, steps=2000, name="long run")
    wait_queued(page)
    shot(page, "new-run")
    tab(page, "Dashboard")
    page.locator("#dash-header").get_by_text("long run").wait_for(timeout=60_000)  # picked without a reload
    # The run trains: the header shows progress and the plots fill with data.
    deadline = time.time() + 240
    while time.time() < deadline and not (plot_traces(page, "plot-rewards") > 0
                                          and plot_traces(page, "plot-alpha") > 0
                                          and plot_traces(page, "plot-conflict") > 0):
        page.wait_for_timeout(1000)
    assert plot_traces(page, "plot-rewards") > 0 and plot_traces(page, "plot-alpha") > 0
    assert plot_traces(page, "plot-cosine") > 0 and plot_traces(page, "plot-conflict") > 0
    page.locator("#dash-header").get_by_text("running").wait_for(timeout=30_000)
    page.locator("#gallery img").first.wait_for(timeout=60_000)
    page.locator("#gallery").scroll_into_view_if_needed()  # gallery images load lazily
    page.wait_for_function("() => [...document.querySelectorAll('#gallery img')].some(i => i.naturalWidth > 0)",
                           timeout=30_000)
    shot(page, "dashboard")

    tab(page, "Runs")
    pick(page, "runs-pick", "long run")
    page.keyboard.press("Escape")  # close the picker's option list
    # Cancel is enabled once the pick of a running run is known (issue 18 item 4), and says what it did
    page.wait_for_function("() => { const b = document.querySelector('#run-cancel'); return b && !b.disabled; }",
                           timeout=30_000)
    page.locator("#run-cancel").click(timeout=60_000)
    try:
        page.locator("#runs-message").get_by_text("stop requested").wait_for(timeout=30_000)
    except Exception as e:  # say what the page said instead
        raise AssertionError(f"Cancel answered {page.locator('#runs-message').inner_text()!r}; runs table: "
                             f"{page.locator('#runs-table').inner_text()[:600]!r}") from e
    assert "now running" not in page.locator("#runs-message").inner_text()
    page.wait_for_function("() => document.querySelector('#runs-table').innerText.includes('cancelled')",
                           timeout=90_000)
    shot(page, "runs")


def test_compare_two_checkpoints_side_by_side(page, server):
    small_run(page, steps=2, name="short run")
    wait_queued(page)
    wait_until_done(server["home"], "short run")
    tab(page, "Compare")
    page.locator("#compare-reload").click()
    page.wait_for_timeout(1500)
    pick(page, "compare-entries", "short run · step 1", "short run · step 2")
    page.locator("#compare-prompts textarea").fill("a red circle\na blue square")
    page.locator("#compare-seeds input, #compare-seeds textarea").first.fill("0")
    page.locator("#compare-start").click()
    page.locator("#compare-status").get_by_text("Columns:").wait_for(timeout=240_000)
    images = page.locator("#compare-gallery img")
    images.nth(3).wait_for(timeout=30_000)  # 2 prompts x 2 checkpoints
    assert images.count() >= 4
    page.locator("#compare-gallery").scroll_into_view_if_needed()
    page.wait_for_function("() => [...document.querySelectorAll('#compare-gallery img')]"
                           ".filter(i => i.naturalWidth > 0).length >= 4", timeout=30_000)
    status = page.locator("#compare-status").inner_text()
    assert "step 1" in status and "step 2" in status
    # the A/B slider shows the first row's two columns as soon as the grid is done
    page.locator("#compare-slider").scroll_into_view_if_needed()
    page.wait_for_function("() => [...document.querySelectorAll('#compare-slider img')]"
                           ".filter(i => i.naturalWidth > 0).length >= 2", timeout=30_000)
    # the A and B pickers name the columns they show, by number and checkpoint
    assert page.locator("#compare-a input").input_value().startswith("1. ")
    assert page.locator("#compare-b input").input_value().startswith("2. ")
    assert "step 2" in page.locator("#compare-b input").input_value()
    shot(page, "compare")


def wait_until_done(home, name: str, timeout: float = 240):
    from jobs.storage import Store

    with Store.open(home) as store:
        deadline = time.time() + timeout
        while time.time() < deadline:
            runs = [r for r in store.list_runs() if r.name == name]
            if runs and runs[0].status in ("succeeded", "failed", "cancelled"):
                break
            time.sleep(1)
        assert runs and runs[0].status == "succeeded", runs
        return runs[0].id


def shown_images(page) -> list[str]:
    """MD5 of each image the dashboard gallery shows, fetched as the browser fetched it."""
    import hashlib

    srcs = page.evaluate("() => [...document.querySelectorAll('#gallery img')].map(i => i.src)")
    return [hashlib.md5(page.request.get(src).body()).hexdigest() for src in srcs]


def test_the_gallery_follows_the_picked_run(page, server):
    """Two runs whose newest samples share a step number (2): picking the second shows its images, not the
    first's (the sample-step dropdown's value does not change between them)."""
    import hashlib

    from jobs.storage import Store

    small_run(page, steps=2, name="other seed", seed=1)
    wait_queued(page)
    ids = {name: wait_until_done(server["home"], name) for name in ("short run", "other seed")}
    with Store.open(server["home"]) as store:
        files = {name: [hashlib.md5(Path(s["image"]).read_bytes()).hexdigest() for s in store.samples(i, step=2)]
                 for name, i in ids.items()}
    assert files["short run"] and set(files["short run"]).isdisjoint(files["other seed"])
    tab(page, "Dashboard")
    page.locator("#dash-reload").click()
    page.wait_for_timeout(1500)
    for name in ("short run", "other seed", "short run"):
        pick(page, "dash-run", name)
        page.locator("#dash-header").get_by_text(name).wait_for(timeout=30_000)
        page.wait_for_function(f"() => document.querySelectorAll('#gallery img').length == {len(files[name])}",
                               timeout=30_000)
        deadline = time.time() + 30
        while time.time() < deadline and shown_images(page) != files[name]:
            page.wait_for_timeout(500)
        assert shown_images(page) == files[name], name
        assert page.locator("#sample-step input").input_value() == "2"


def test_delete_asks_before_it_removes_a_run(page, server):
    from jobs.storage import Store

    tab(page, "Runs")
    page.wait_for_function("() => document.querySelector('#runs-table').innerText.includes('other seed')",
                           timeout=30_000)
    pick(page, "runs-pick", "other seed")
    # the picked run's log opens at its newest line (a finished run's log never changes: only the pick scrolls)
    page.wait_for_function("() => { const t = document.querySelector('#run-log textarea');"
                           " return t && t.scrollHeight > t.clientHeight"
                           " && t.scrollTop + t.clientHeight >= t.scrollHeight - 2; }", timeout=20_000)
    page.locator("#run-delete").click()
    page.locator("#runs-message").get_by_text("cannot be undone").wait_for(timeout=20_000)
    with Store.open(server["home"]) as store:
        assert any(r.name == "other seed" for r in store.list_runs())  # asked, not deleted
    page.locator("#run-delete-confirm").click()
    page.locator("#runs-message").get_by_text("deleted with its folder").wait_for(timeout=20_000)
    page.wait_for_function("() => !document.querySelector('#runs-table').innerText.includes('other seed')",
                           timeout=30_000)
    assert not page.locator("#run-delete-confirm").is_visible()
    with Store.open(server["home"]) as store:
        assert not any(r.name == "other seed" for r in store.list_runs())
    page.wait_for_timeout(3000)  # a few timer ticks after the picked run is gone: no error toast
    toasts = page.locator(".toast-body.error")
    assert toasts.count() == 0, toasts.all_inner_texts()


def test_study_and_replay_pages_render_the_runs(page, server):
    tab(page, "Study")
    page.locator("#study-reload").click()
    page.wait_for_timeout(1000)
    pick(page, "study-runs", "long run", "short run")
    page.keyboard.press("Escape")
    # both runs rendered: the Pareto front plus one point per run, and both rows in the table
    wait_for_traces(page, "plot-pareto", at_least=3)
    table = page.locator("#study-table").inner_text()
    assert "long run" in table and "short run" in table and "composite" in table
    # the cancelled run is marked, not taken as a result (issue 18 item 2)
    page.locator("#study-note").get_by_text("Not finished").wait_for(timeout=20_000)
    assert "long run" in page.locator("#study-note").inner_text() and "unfinished: cancelled" in table
    page.wait_for_timeout(1500)
    shot(page, "study")
    # unpick both with their × buttons, then pick one again: the page takes it without an error
    for _ in range(2):
        page.locator("#study-runs .token-remove").first.click()
        page.wait_for_timeout(500)
    page.wait_for_function("() => document.querySelector('#study-table').innerText.includes('Pick two or more')", timeout=20_000)
    page.locator("body").click(position={"x": 5, "y": 5})  # focus elsewhere, as a person moving on would
    pick(page, "study-runs", "short run")
    page.keyboard.press("Escape")
    page.wait_for_function("() => document.querySelector('#study-table').innerText.includes('short run')", timeout=20_000)
    toasts = page.locator(".toast-body.error")
    assert toasts.count() == 0, toasts.all_inner_texts()
    tab(page, "Replay")
    page.locator("#replay-reload").click()
    page.wait_for_timeout(1000)
    pick(page, "replay-run", "long run")
    wait_for_traces(page, "plot-replay")  # the first replay compiles the QP
    shot(page, "replay")


def test_what_a_researcher_checks_after_a_reload(page, server):
    """Issue 18 items 1, 3, 4 after a page reload: saved comparisons are listed without pressing a button and
    their grid has column headers; a click on a Runs row picks that run, and Cancel is off for a finished one;
    the New-run form marks rewards that need weights and refuses one with its download command."""
    page.reload()
    page.wait_for_selector("#app-title", timeout=60_000)
    tab(page, "Compare")
    pick(page, "compare-saved", "· succeeded")  # the runs' status words (a comparison is a job)
    page.wait_for_function("() => { const h = document.querySelector('#compare-gallery thead');"
                           " return h && h.innerText.includes('step 1') && h.innerText.includes('step 2'); }",
                           timeout=30_000)
    page.wait_for_function("() => [...document.querySelectorAll('#compare-gallery img')]"
                           ".filter(i => i.naturalWidth > 0 && i.width <= 128).length >= 4", timeout=30_000)
    assert "seed 0" in page.locator("#compare-gallery").inner_text()

    tab(page, "Runs")
    page.wait_for_function("() => document.querySelector('#runs-table').innerText.includes('short run')",
                           timeout=30_000)
    # Gradio's table keeps hidden copies of its cells (for sizing): click the one the user sees
    page.locator("#runs-table").get_by_text("short run").filter(visible=True).first.click()
    page.wait_for_function("() => document.querySelector('#runs-pick input').value.includes('short run')",
                           timeout=20_000)
    page.wait_for_function("() => document.querySelector('#run-cancel').disabled", timeout=20_000)
    assert "duration" in page.locator("#runs-table").inner_text()

    tab(page, "New run")
    assert "clipscore — needs weights" in page.locator("#rewards").inner_text()
    page.locator("#rewards").get_by_text("clipscore — needs weights").click()
    page.locator("#start-run").click()
    error = page.locator("#form-error")
    error.get_by_text("hf download openai/clip-vit-large-patch14").wait_for(timeout=20_000)
    assert "rewards[" in error.inner_text()
    page.locator("#rewards").get_by_text("clipscore — needs weights").click()  # leave the form as it was
