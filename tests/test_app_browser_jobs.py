"""Jobs that are not training runs, in a real browser (issue 18 part A): Evaluate on the Dashboard queues an
evaluate job for the worker and the panel then shows the held-out scores; a comparison is cancelled from the Compare
page. The server and browser are tests/test_app_browser.py's (its own app, worker and data directory here)."""

from __future__ import annotations

import pytest

from tests.test_app_browser import page, pick, server, small_run, tab, wait_until_done  # noqa: F401

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def finished(page, server):  # noqa: F811
    small_run(page, steps=2, name="to evaluate")  # a checkpoint every step
    page.locator("#start-status").get_by_text("Queued run").wait_for(timeout=60_000)
    return wait_until_done(server["home"], "to evaluate", timeout=420)


def test_evaluate_on_the_dashboard_queues_a_job_and_shows_the_scores(page, server, finished):  # noqa: F811
    from jobs import schema as s
    from jobs.evaluations import latest
    from jobs.storage import Store

    tab(page, "Dashboard")
    page.locator("#dash-reload").click()
    page.wait_for_timeout(1000)
    pick(page, "dash-run", "to evaluate")
    page.locator("#eval-status").get_by_text("Not evaluated yet — press Evaluate").wait_for(timeout=30_000)
    for elem, value in (("eval-prompts", "2"), ("eval-seeds", "2")):
        page.locator(f"#{elem} input").fill(value)
        page.locator(f"#{elem} input").press("Tab")
    page.locator("#eval-start").click()
    page.locator("#eval-message").get_by_text("Evaluation queued as job").wait_for(timeout=30_000)
    page.locator("#eval-table").get_by_text("Δ / base σ ± SE").wait_for(timeout=420_000)
    table = page.locator("#eval-table").inner_text()
    assert "colorfulness" in table and "✓" in table and "step 2" in table and "±" in table
    with Store.open(server["home"]) as store:
        job = store.list_runs(kind=s.EVALUATE)[0]
        assert (job.status, job.subject_id, job.step, job.total_steps) == (s.SUCCEEDED, finished, 2, 2)
        ev = latest(store, finished)
        assert ev["details"]["job_id"] == job.id and ev["details"]["images"] == 4
    tab(page, "Runs")  # the job is listed with the runs, its kind where a run's strategy is
    page.wait_for_function("() => document.querySelector('#runs-table').innerText.includes('evaluate #')",
                           timeout=30_000)


def test_a_comparison_is_cancelled_from_the_compare_page(page, server, finished):  # noqa: F811
    from jobs import schema as s
    from jobs.storage import Store

    tab(page, "Compare")
    page.locator("#compare-reload").click()
    page.wait_for_timeout(1500)
    pick(page, "compare-entries", "to evaluate · step 1", "to evaluate · step 2", "base tiny")
    page.keyboard.press("Escape")
    page.locator("#compare-prompts textarea").fill("\n".join(f"a red circle {i}" for i in range(20)))
    page.locator("#compare-seeds input, #compare-seeds textarea").first.fill("0, 1, 2, 3, 4, 5, 6, 7")
    page.locator("#compare-name input, #compare-name textarea").first.fill("to cancel")
    page.locator("#compare-start").click()
    page.locator("#compare-status").get_by_text("queued").wait_for(timeout=30_000)
    page.locator("#compare-cancel").click()
    page.wait_for_function("() => { const t = document.querySelector('#compare-message').innerText;"
                           " return t.includes('stop requested') || t.includes('cancelled before it started'); }",
                           timeout=30_000)
    page.locator("#compare-status").get_by_text("is cancelled").wait_for(timeout=180_000)
    with Store.open(server["home"]) as store:
        row = [c for c in store.comparisons() if c["name"] == "to cancel"][0]
        job = store.get_run(row["job_id"])
        assert (job.kind, job.status) == (s.COMPARE, s.CANCELLED) and job.step < job.total_steps == 3
        assert not (row["result"] or {}).get("rows")
    page.locator("#compare-cancel").click()  # again: nothing left to cancel, said so
    page.locator("#compare-message").get_by_text("is cancelled: there is nothing to cancel").wait_for(timeout=30_000)
