"""Background training runs: storage (SQLAlchemy; SQLite by default, PostgreSQL by URL), the job runner
and the ``python -m jobs`` CLI.

Imports flow ``app -> jobs -> core``. ``jobs.storage``, ``jobs.runner`` and ``jobs.cli`` never import torch
at module level: the web process reads runs through :class:`jobs.storage.Store` and starts in seconds.
Only the job process itself (``jobs.job``) loads the training engine.
"""
