"""A run's tags and notes (issue 18): stored by migration 0003 on every existing database without loss, edited
through Store.set_annotations with its rules, read back by list_runs and get_run."""

import pytest
from alembic import command
from alembic.config import Config
from alembic.script import ScriptDirectory
from sqlalchemy import create_engine, text

from jobs.storage import MAX_TAG_CHARS, MAX_TAGS, RunNotFound, Store
from jobs.writer import EventWriter
from tests.jobs_support import REPO, database_urls, start_event, step_event

TAGS_REVISION = "0003"


@pytest.fixture(params=["sqlite", "postgresql"])
def url(request, tmp_path):
    yield from database_urls(tmp_path, request.param)


def _alembic() -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(REPO / "jobs" / "migrations"))
    return cfg


def test_a_database_from_before_tags_migrates_with_every_run_and_row_kept(url, tmp_path):
    cfg = _alembic()
    before = ScriptDirectory.from_config(cfg).get_revision(TAGS_REVISION).down_revision
    engine = create_engine(url)
    with engine.begin() as conn:  # the schema as it was just before tags and notes
        cfg.attributes["connection"] = conn
        command.upgrade(cfg, before)
    old = Store(url, tmp_path / "home", migrate=False)
    run_id = old.create_run({"steps": 3, "rewards": [{"name": "brightness"}]}, strategy="marble", total_steps=3,
                            name="old run")  # writes only columns the old schema has
    old.close()
    with engine.begin() as conn:
        cols = {c[1] for c in conn.execute(text("PRAGMA table_info(runs)"))} if url.startswith("sqlite") else None
    assert cols is None or "tags" not in cols  # really the old schema
    engine.dispose()

    store = Store(url, tmp_path / "home")  # opening migrates to the head
    assert store.schema_version() == ScriptDirectory.from_config(cfg).get_current_head()
    run = store.get_run(run_id)
    assert (run.name, run.status, run.total_steps, run.config["rewards"]) == ("old run", "queued", 3,
                                                                                 [{"name": "brightness"}])
    assert run.tags == [] and run.notes is None and store.list_runs()[0].tags == []
    writer = EventWriter(store, run_id, store.run_dir(run_id))  # the migrated run still takes rows
    writer(start_event(3))
    writer(step_event(1))
    writer.flush()
    assert store.metrics(run_id).last_step == 1
    store.set_annotations(run_id, ["baseline"], "kept after the migration")
    assert store.get_run(run_id).tags == ["baseline"]
    store.close()


def test_set_annotations_cleans_and_refuses_with_the_rule(url, tmp_path):
    store = Store(url, tmp_path / "home")
    run_id = store.create_run({}, strategy="marble", total_steps=3)
    store.set_annotations(run_id, [" lr-sweep ", "seed 0", "lr-sweep"], "  first try\nsecond line  ")
    run = store.get_run(run_id)
    assert run.tags == ["lr-sweep", "seed 0"] and run.notes == "first try\nsecond line"
    assert store.list_runs()[0].tags == ["lr-sweep", "seed 0"]
    with pytest.raises(ValueError, match="tag 'a,b': a tag is 1 to 40 characters without a comma"):
        store.set_annotations(run_id, ["a,b"])
    with pytest.raises(ValueError, match=f"a tag is 1 to {MAX_TAG_CHARS} characters"):
        store.set_annotations(run_id, ["x" * (MAX_TAG_CHARS + 1)])
    with pytest.raises(ValueError, match=f"tags \\({MAX_TAGS + 1} of them\\): at most {MAX_TAGS} per run"):
        store.set_annotations(run_id, [f"t{i}" for i in range(MAX_TAGS + 1)])
    assert store.get_run(run_id).tags == ["lr-sweep", "seed 0"]  # a refusal changes nothing
    store.set_annotations(run_id, [], "   ")  # cleared
    assert store.get_run(run_id).tags == [] and store.get_run(run_id).notes is None
    with pytest.raises(RunNotFound):
        store.set_annotations(run_id + 99, ["x"])
    store.close()
