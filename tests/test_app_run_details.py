"""The Runs page's run details: a run's config, the diff of two runs' configs (only what differs, dotted paths,
both values), tags and notes saved in the store and shown in the table, the tag filter."""

import pytest

from core.config import preset


@pytest.fixture
def store(web_store):
    return web_store


def _run(store, name: str, **overrides) -> int:
    cfg = preset("tiny").with_overrides(overrides)
    return store.create_run(cfg.to_dict(), strategy=cfg.balance.strategy, total_steps=cfg.steps, preset="tiny",
                            name=name)


def test_config_diff_lists_only_the_fields_that_differ_with_dotted_paths_and_both_values():
    from app.pages.run_details import ABSENT, config_diff, flatten

    a = {"steps": 20, "balance": {"ema_rho": 0.7, "strategy": "marble"}, "rewards": [{"name": "x"}, {"name": "y"}]}
    b = {"steps": 20, "balance": {"ema_rho": 0.9, "strategy": "marble"}, "rewards": [{"name": "x"}], "new": {}}
    assert flatten(a)["rewards[1].name"] == "y" and flatten(b)["new"] == {}
    assert config_diff(a, b) == [("balance.ema_rho", 0.7, 0.9), ("rewards[1].name", "y", ABSENT),
                                 ("new", ABSENT, {})]
    assert config_diff(a, a) == []


def test_the_diff_of_two_stored_runs_and_the_config_shown(store):
    from app.pages.run_details import config_text, diff_table

    a = _run(store, "base")
    b = _run(store, "rho 0.9", **{"balance.ema_rho": 0.9, "seed": 3})
    df, summary = diff_table(a, b)
    assert list(df.columns) == ["field", f"#{a} base", f"#{b} rho 0.9"]
    assert sorted(df["field"]) == ["balance.ema_rho", "seed"]
    row = df[df["field"] == "balance.ema_rho"].iloc[0]
    assert (row[f"#{a} base"], row[f"#{b} rho 0.9"]) == ("0.7", "0.9")
    assert summary.startswith("2 fields differ")
    assert diff_table(a, _run(store, "seed 4", seed=4))[1].startswith("1 field differs, ")
    same, note = diff_table(a, _run(store, "copy"))
    assert same.empty and note.startswith("The two configs are identical")
    assert diff_table(a, a)[1].endswith("pick another run to diff with.")
    assert diff_table(a, None)[0].empty
    assert '"ema_rho": 0.7' in config_text(a)
    from jobs import schema as s

    ev = store.create_run({"run_id": a}, strategy="-", total_steps=2, kind=s.EVALUATE, subject_id=a)
    table, note = diff_table(ev, b)
    assert table.empty and note == f"#{ev} is an evaluate job: configs are diffed between training runs; pick one above."
    missing, note = diff_table(a, b + 100)
    assert missing.empty and f"run {b + 100} does not exist" in note


def test_tags_and_notes_are_saved_shown_in_the_table_and_filter_it(store):
    from app.pages.run_details import all_tags, annotations, save_annotations
    from app.pages.runs import runs_table

    a, b = _run(store, "first"), _run(store, "second")
    assert save_annotations(a, "baseline, lr sweep", "seed 0 looks odd") == (
        f"Run #{a}: saved (baseline, lr sweep; notes 16 characters).")
    save_annotations(b, "lr sweep", "")
    assert annotations(a) == ("baseline, lr sweep", "seed 0 looks odd") and annotations(b) == ("lr sweep", "")
    table = runs_table()
    assert list(table[table["id"] == a]["tags"]) == ["baseline, lr sweep"]
    assert list(runs_table("baseline")["id"]) == [a] and sorted(runs_table("lr sweep")["id"]) == sorted([a, b])
    assert all_tags() == ["baseline", "lr sweep"]
    refused = save_annotations(a, "a" * 41, "x")
    assert refused.startswith(f"Run #{a}: not saved: tag 'aaaa") and "1 to 40 characters" in refused
    assert annotations(a)[0] == "baseline, lr sweep"  # unchanged
    assert save_annotations(None, "x", "") == "Pick a run first."
    assert "does not exist" in save_annotations(b + 100, "x", "")
