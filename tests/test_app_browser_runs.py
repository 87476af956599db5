"""Seeing and comparing runs in a real browser (issue 18 part B): two tiny runs overlaid on one chart, a run's
config diffed with another's, tags and notes saved and filtering the Runs table, the progression strip on the
Dashboard, the preset note on New run. The server and browser are tests/test_app_browser.py's (its own app and
data directory for this module)."""

from __future__ import annotations

import pytest

from tests.test_app_browser import page, pick, server, small_run, tab, wait_for_traces, wait_until_done  # noqa: F401

pytestmark = pytest.mark.slow

# names of the traces plotly.js drew (with points) in a plot
DRAWN_NAMES = ("(sel => { const p = document.querySelector(sel + ' .js-plotly-plot');"
               " return p && p._fullData ? p._fullData.filter(t => t.y && t.y.length > 0).map(t => t.name) : []; })")


@pytest.fixture(scope="module")
def two_runs(page, server):  # noqa: F811
    small_run(page, steps=3, name="run a")
    page.locator("#start-status").get_by_text("Queued run").wait_for(timeout=60_000)
    small_run(page, steps=3, name="run b", seed=5, **{"balance.ema_rho": 0.5})
    page.locator("#start-status").get_by_text("Queued run").wait_for(timeout=60_000)
    return {name: wait_until_done(server["home"], name, timeout=420) for name in ("run a", "run b")}


def test_the_new_run_form_says_what_the_tiny_preset_is(page):  # noqa: F811
    tab(page, "New run")
    page.locator("#preset input").fill("tiny")
    page.locator("#preset input").press("Enter")
    page.locator("#preset-note").get_by_text("coloured noise by design").wait_for(timeout=20_000)
    note = page.locator("#preset-note").inner_text()
    assert "coloured noise by design" in note and "Expected duration" in note and "20 steps" in note
    # every field keeps a readable width: the normalize checkbox shrank to "norm" in a row of nine (new-user pass)
    page.locator("#field-balance-normalize").scroll_into_view_if_needed()
    assert page.locator("#field-balance-normalize").bounding_box()["width"] >= 200
    # and what each reward measures is one click away
    page.locator("#reward-glossary").get_by_text("What each reward measures").click()
    page.locator("#reward-glossary-table").get_by_text("minus the image's JPEG size in kB").wait_for(timeout=10_000)


def test_two_runs_overlaid_on_one_chart_with_a_legend_naming_run_and_reward(page, two_runs):  # noqa: F811
    a, b = two_runs["run a"], two_runs["run b"]
    tab(page, "Overlay")
    page.locator("#overlay-reload").click()
    page.wait_for_timeout(1000)
    pick(page, "overlay-runs", "run a", "run b")
    page.keyboard.press("Escape")
    wait_for_traces(page, "plot-overlay-rewards", at_least=12)  # 2 runs x 3 rewards x (raw, smoothed)
    wait_for_traces(page, "plot-overlay-alpha", at_least=6)
    names = set(page.evaluate(f"() => {DRAWN_NAMES}('#plot-overlay-rewards')"))
    for run, label in ((a, "run a"), (b, "run b")):
        for reward in ("jpeg_compressibility", "colorfulness", "brightness"):
            assert f"#{run} {label} · {reward}" in names, names
    legend = page.evaluate("() => [...document.querySelectorAll('#plot-overlay-rewards .legendtext')]"
                           ".map(e => e.textContent)")  # SVG text: no innerText
    assert any("run a · colorfulness" in t for t in legend) and any("run b · colorfulness" in t for t in legend)


def test_tags_notes_and_a_config_diff_on_the_runs_page(page, server, two_runs):  # noqa: F811
    tab(page, "Runs")
    page.wait_for_function("() => document.querySelector('#runs-table').innerText.includes('run b')", timeout=30_000)
    pick(page, "runs-pick", "run a")
    page.keyboard.press("Escape")
    # the pick fills the boxes with the run's own tags and notes: typing before that lands would be overwritten
    page.locator("#run-annotate-message").get_by_text(f"tags and notes of #{two_runs['run a']} run a").wait_for(
        timeout=30_000)
    page.locator("#run-tags textarea, #run-tags input").first.fill("baseline, sweep")
    page.locator("#run-notes textarea").fill("the reference for the rho sweep")
    page.locator("#run-annotate").click()
    page.locator("#run-annotate-message").get_by_text("saved (baseline, sweep").wait_for(timeout=20_000)
    page.wait_for_function("() => document.querySelector('#runs-table').innerText.includes('baseline, sweep')",
                           timeout=30_000)
    pick(page, "runs-tag-filter", "baseline")  # only the tagged run is listed
    page.wait_for_function("() => !document.querySelector('#runs-table').innerText.includes('run b')",
                           timeout=30_000)
    assert "run a" in page.locator("#runs-table").inner_text()
    pick(page, "runs-tag-filter", "(all runs)")
    page.wait_for_function("() => document.querySelector('#runs-table').innerText.includes('run b')", timeout=30_000)
    pick(page, "run-diff-with", "run b")
    page.locator("#run-diff-note").get_by_text("fields differ").wait_for(timeout=20_000)
    diff = page.locator("#run-diff").inner_text()
    assert "balance.ema_rho" in diff and "seed" in diff and "0.7" in diff and "0.5" in diff
    assert "sampling.num_steps" not in diff  # equal fields are not listed
    from jobs.storage import Store

    with Store.open(server["home"]) as st:
        run = st.get_run(two_runs["run a"])
        assert run.tags == ["baseline", "sweep"] and run.notes == "the reference for the rho sweep"


def test_duplicate_fills_the_form_and_the_preset_note_follows(page, two_runs):  # noqa: F811
    """New-user pass: Duplicate set the preset to tiny, but the note under it still described mini-marble."""
    tab(page, "New run")
    page.locator("#preset input").fill("mini-marble")
    page.locator("#preset input").press("Enter")
    page.locator("#preset-note").get_by_text("mini-world").first.wait_for(timeout=20_000)
    tab(page, "Runs")
    pick(page, "runs-pick", "run a")
    page.keyboard.press("Escape")
    page.locator("#run-duplicate").click()
    page.locator("#preset-note").get_by_text("coloured noise by design").wait_for(timeout=20_000)
    assert page.locator("#preset input").input_value() == "tiny"
    assert page.locator("#run-name textarea, #run-name input").first.input_value() == "run a (copy)"


def test_the_dashboard_shows_one_prompt_across_sample_steps(page, two_runs):  # noqa: F811
    tab(page, "Dashboard")
    page.locator("#dash-reload").click()
    page.wait_for_timeout(1000)
    pick(page, "dash-run", "run a")
    page.locator("#dash-header").get_by_text("run a").wait_for(timeout=30_000)
    page.wait_for_function("() => document.querySelectorAll('#strip table.strip th').length >= 1", timeout=30_000)
    note = page.locator("#strip .strip-note").inner_text()
    columns = page.locator("#strip table.strip th").all_inner_texts()
    shown = int(note.split(" at ")[1].split(" of ")[0])
    assert len(columns) == shown and all(c.startswith("step ") for c in columns)
    steps = [int(c.split()[1]) for c in columns]
    assert steps == sorted(steps)  # left to right
    page.locator("#strip").scroll_into_view_if_needed()
    page.wait_for_function("() => [...document.querySelectorAll('#strip img')].every(i => i.naturalWidth > 0)",
                           timeout=30_000)
    assert "colorfulness" in page.locator("#strip").inner_text()  # full reward names under each image
    # the gallery's captions: every reward's full name and score, not cut off
    page.locator("#gallery").scroll_into_view_if_needed()
    page.wait_for_function("() => document.querySelectorAll('#gallery .caption-label').length > 0", timeout=30_000)
    assert page.evaluate("() => [...document.querySelectorAll('#gallery .caption-label')].every(e =>"
                         " e.textContent.includes('jpeg_compressibility') && e.textContent.includes('brightness')"
                         " && e.scrollWidth <= e.clientWidth + 1 && e.scrollHeight <= e.clientHeight + 1)")
    # the α plot's 1/K label sits right of the plotting area, clear of the lines
    wait_for_traces(page, "plot-alpha")
    assert page.evaluate("() => { const p = document.querySelector('#plot-alpha .js-plotly-plot');"
                         " const a = p.layout.annotations.find(x => x.text.startsWith('1/K'));"
                         " return a && a.xref === 'paper' && a.x >= 1; }")
