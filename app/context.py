"""The web process's one Store, opened lazily (tests point MARBLE_HOME elsewhere before the first use)."""

from __future__ import annotations

import functools
from typing import Any

from jobs.storage import Store


@functools.lru_cache(maxsize=1)
def store() -> Store:
    return Store.open()


def _choice_label(r: Any) -> str:
    """A picker's label for a run: what does not change while it trains. A status and step in the label went stale
    ("queued 0/20" long after the run finished: pickers are filled on Reload, not on every tick); the pages
    beside the pickers show the live status."""
    return f"#{r.id} {r.name} ({r.strategy})" if r.name and r.strategy != "-" else f"#{r.id} {r.name or r.strategy}"


def run_choices(statuses: tuple[str, ...] | None = None) -> list[tuple[str, int]]:
    """Dropdown choices ``("#12 sweep a (marble)", 12)`` of the training runs, newest first (the pickers of the
    Dashboard, Study and Replay: evaluate and compare jobs are not runs to plot)."""
    return [(_choice_label(r), r.id) for r in store().list_runs(status=list(statuses) if statuses else None,
                                                                kind="train")]


def job_choices() -> list[tuple[str, int]]:
    """Dropdown choices of every job of the queue (the Runs page: training runs, evaluations, comparisons)."""
    return [(_choice_label(r), r.id) for r in store().list_runs()]


def a_job_of_its_kind(run) -> str:
    """"#3 is a compare job" / "#4 is an evaluate job": how a refusal names a job that is not a training run."""
    return f"#{run.id} is {'an' if run.kind[0] in 'aeiou' else 'a'} {run.kind} job"


def fmt_seconds(x: float | None) -> str:
    if x is None:
        return "—"
    x = int(round(x))
    return f"{x // 3600}h{x % 3600 // 60:02d}m" if x >= 3600 else f"{x // 60}m{x % 60:02d}s"
