"""Export a run's per-step metrics as one wide table: a row per step (step, phase, stage, then one column
per metric key, e.g. ``reward/colorfulness``), as CSV or Parquet."""

from __future__ import annotations

from pathlib import Path

from jobs.storage import Store

FORMATS = ("csv", "parquet")


def metrics_table(store: Store, run_id: int):
    """A pandas DataFrame, one row per stored step."""
    import pandas as pd

    series = store.metrics(run_id)
    long = pd.DataFrame(series.rows, columns=["step", "key", "value"])
    wide = long.pivot(index="step", columns="key", values="value") if len(long) else pd.DataFrame()
    wide.columns.name = None
    steps = pd.DataFrame(store.steps(run_id), columns=["step", "phase", "stage", "at"]).set_index("step")
    table = steps[["phase", "stage"]].join(wide, how="outer").reset_index()
    return table.rename(columns={"index": "step"})


def export_metrics(store: Store, run_id: int, fmt: str, out: str | Path | None = None) -> Path:
    """Write the table to ``out`` (default: ``<run folder>/metrics.<fmt>``); returns the path."""
    if fmt not in FORMATS:
        raise ValueError(f"format={fmt!r}: valid choices: {', '.join(FORMATS)}")
    path = Path(out) if out else store.run_dir(run_id) / f"metrics.{fmt}"
    path.parent.mkdir(parents=True, exist_ok=True)
    table = metrics_table(store, run_id)
    if fmt == "csv":
        table.to_csv(path, index=False)
    else:
        table.to_parquet(path, index=False)
    return path
