"""A run's plotted metric series, read once down-sampled and then incrementally: the cache the Dashboard and
the Overlay keep per run in their typed ``gr.State`` (no dict of string keys)."""

from __future__ import annotations

from dataclasses import dataclass, field

from app import context

MAX_POINTS = 600  # per metric key (~1 point per 2 px of a wide plot): beyond, the series is re-read down-sampled

Series = dict[str, tuple[list[int], list[float | None]]]


def reward_names_of(config: dict) -> list[str]:
    return [r["name"] for r in config.get("rewards", [])]


def plotted_keys(names: list[str]) -> list[str]:
    """The metric keys the figures draw: each reward's mean and its applied α."""
    return [f"{prefix}/{n}" for n in names for prefix in ("reward", "alpha")]


@dataclass
class RunSeries:
    """One run's reward and α series as drawn: ``series`` maps a metric key to (steps, values); ``last_step`` is
    where the next incremental read starts."""

    run_id: int
    names: list[str]
    series: Series = field(default_factory=dict)
    last_step: int = 0

    @property
    def points(self) -> int:
        return max((len(x) for x, _ in self.series.values()), default=0)

    @classmethod
    def load(cls, run_id: int, names: list[str] | None = None) -> "RunSeries":
        """The whole run, down-sampled to MAX_POINTS steps per key (RunNotFound for a deleted run)."""
        store = context.store()
        if names is None:
            names = reward_names_of(store.get_run(run_id).config)
        read = store.metrics(run_id, keys=plotted_keys(names), max_points=MAX_POINTS)
        return cls(run_id, names, {k: (list(x), list(y)) for k, (x, y) in read.by_key().items()}, read.last_step)

    def update(self) -> bool:
        """Append the steps stored since the last read; True when there were any. Past 2 × MAX_POINTS points
        the run is re-read down-sampled (the browser stays light on very long runs)."""
        read = context.store().metrics(self.run_id, since_step=self.last_step, keys=plotted_keys(self.names))
        if not read.rows:
            return False
        for key, (xs, ys) in read.by_key().items():
            old = self.series.setdefault(key, ([], []))
            old[0].extend(xs)
            old[1].extend(ys)
        self.last_step = max(self.last_step, read.last_step)
        if self.points > 2 * MAX_POINTS:
            fresh = RunSeries.load(self.run_id, self.names)
            self.series, self.last_step = fresh.series, fresh.last_step
        return True
