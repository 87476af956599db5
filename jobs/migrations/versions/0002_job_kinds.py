"""One queue for every kind of job: runs.kind (train / evaluate / compare) and runs.subject_id (the run an
evaluate job scores); runs.origin (the folder an imported run was copied from); comparisons.job_id (the compare job that makes the grid). Comparisons made before they
were jobs keep their grid; their own status words become the runs' (done -> succeeded; queued or running ones
were separate processes the worker cannot see: interrupted).

Columns are added in place (ALTER TABLE ... ADD COLUMN), never by copying a table: on SQLite a copy drops the
old runs table, and with foreign keys on that would cascade into every per-step row.

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-03
"""

import json

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

_OLD_STATUS = {"done": "succeeded", "queued": "interrupted", "running": "interrupted"}


def upgrade() -> None:
    op.add_column("runs", sa.Column("kind", sa.String(16), nullable=False, server_default="train"))
    op.add_column("runs", sa.Column("subject_id", sa.Integer()))
    op.add_column("runs", sa.Column("origin", sa.String(1000)))
    op.add_column("comparisons", sa.Column("job_id", sa.Integer()))
    conn = op.get_bind()
    table = sa.table("comparisons", sa.column("id", sa.Integer()), sa.column("result", sa.JSON()))
    for cid, result in conn.execute(sa.select(table.c.id, table.c.result)).all():
        if isinstance(result, str):  # some drivers hand JSON back as text
            result = json.loads(result)
        old = (result or {}).get("status")
        if old in _OLD_STATUS:
            new = {**result, "status": _OLD_STATUS[old]}
            if _OLD_STATUS[old] == "interrupted":
                new["error"] = (f"this comparison was {old} in a process of its own when comparisons became worker "
                                f"jobs; start it again")
            conn.execute(sa.update(table).where(table.c.id == cid).values(result=new))


def downgrade() -> None:
    op.drop_column("comparisons", "job_id")  # in place (SQLite >= 3.35 drops a plain column without a copy)
    op.drop_column("runs", "origin")
    op.drop_column("runs", "subject_id")
    op.drop_column("runs", "kind")
