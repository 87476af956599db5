"""Where everything lives: one data directory (``./runs`` by default, ``MARBLE_HOME`` overrides).

    $MARBLE_HOME/marble.db           the database (unless MARBLE_DATABASE_URL points elsewhere)
    $MARBLE_HOME/worker.lock         held by the one worker of this data directory (its pid inside)
    $MARBLE_HOME/run_000001/         a run folder: config.json, job.log, samples/, checkpoints/
"""

from __future__ import annotations

import os
from pathlib import Path

HOME_ENV = "MARBLE_HOME"
DATABASE_URL_ENV = "MARBLE_DATABASE_URL"
DEFAULT_HOME = "runs"
DATABASE_FILE = "marble.db"
WORKER_LOCK = "worker.lock"
LOG_FILE = "job.log"


def data_home(home: str | Path | None = None) -> Path:
    """The data directory: ``home`` if given, else $MARBLE_HOME, else ./runs (absolute, created)."""
    path = Path(home or os.environ.get(HOME_ENV) or DEFAULT_HOME).expanduser().resolve()
    path.mkdir(parents=True, exist_ok=True)
    return path


def database_url(home: Path, url: str | None = None) -> str:
    """``url`` if given, else $MARBLE_DATABASE_URL, else the SQLite file inside the data directory."""
    return url or os.environ.get(DATABASE_URL_ENV) or f"sqlite:///{home / DATABASE_FILE}"


def run_folder_name(run_id: int) -> str:
    return f"run_{run_id:06d}"
