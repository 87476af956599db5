"""Alembic migrations, shipped in the package and applied programmatically by ``jobs.storage.Store``."""
