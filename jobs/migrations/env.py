"""Alembic environment: always run programmatically by jobs.storage with an open connection
(``config.attributes["connection"]``), never from an alembic.ini."""

from alembic import context

from jobs.schema import metadata

connection = context.config.attributes["connection"]
context.configure(connection=connection, target_metadata=metadata,
                  render_as_batch=connection.dialect.name == "sqlite")  # SQLite alters tables by copy
with context.begin_transaction():
    context.run_migrations()
