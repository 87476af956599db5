"""``python -m jobs import DIR``: a run folder trained from the command line becomes a run of the store.

``python -m core.train --out DIR`` writes config.json, events.jsonl, checkpoints/step_NNNNNN/ (each with its
manifest.json) and samples/. :func:`import_run` checks the folder, copies it into the data directory as
``run_NNNNNN`` (a checkpoint's files hard-linked where the filesystem allows: no second copy of them on disk) and registers it
as a finished (succeeded) run with every row a queue-trained run has: metrics, balance diagnostics, samples,
checkpoints, its duration. From then on it is the same kind of record as a run started in the browser: the
dashboard opens it, Evaluate scores it, Compare lists its checkpoints, the Study reads it, delete removes the copy
(never the original folder).

The held-out evaluations that ``core.evaluate --run DIR`` or ``--study`` wrote into the folder (eval_<split>.json)
are recorded through jobs.evaluations.record, the function the evaluate job uses: the app then reads one source
for evaluations, the store. Importing the same folder again imports nothing again; it only records eval files
written since (each is recorded once, by its sha1).

A folder is refused with one line naming it and the rule it breaks: not a folder, no or a bad config.json, no or a
bad events.jsonl, a run that did not finish, a checkpoint whose files do not match its manifest, a path that leaves
the folder. Nothing is ever unpickled: config and events are JSON, checkpoints are only hashed against their
manifests here (core.checkpoint.verify) and later loaded as safetensors.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import uuid
from pathlib import Path

from jobs.storage import Batch, Store
from jobs.writer import event_batch

EVENTS_FILE = "events.jsonl"  # core.train's
CONFIG_FILE = "config.json"


class ImportRefused(ValueError):
    """The folder breaks a rule; the message names the folder and the rule."""


def _refuse(folder: Path, rule: str) -> ImportRefused:
    return ImportRefused(f"{folder}: {rule}")


def read_config(folder: Path) -> dict:
    from core.config import ConfigError, TrainConfig

    path = folder / CONFIG_FILE
    if not path.is_file():
        raise _refuse(folder, f"has no {CONFIG_FILE}: not a run folder of `python -m core.train --out DIR`")
    try:
        return TrainConfig.from_dict(json.loads(path.read_text())).to_dict()
    except json.JSONDecodeError as e:
        raise _refuse(folder, f"{CONFIG_FILE} is not valid JSON (line {e.lineno}: {e.msg})") from None
    except (ConfigError, TypeError, AttributeError) as e:
        raise _refuse(folder, f"{CONFIG_FILE} is not a valid TrainConfig ({e})") from None
    except (OSError, UnicodeDecodeError) as e:
        raise _refuse(folder, f"cannot read {CONFIG_FILE} ({e})") from None


def read_events(folder: Path) -> list[dict]:
    """Every event of events.jsonl; a line that is not a JSON object with an "event" key is refused by number."""
    path = folder / EVENTS_FILE
    if not path.is_file():
        raise _refuse(folder, f"has no {EVENTS_FILE}: core.train writes it as it trains")
    events = []
    try:
        lines = path.read_text().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise _refuse(folder, f"cannot read {EVENTS_FILE} ({e})") from None
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            ev = json.loads(line)
        except json.JSONDecodeError as e:
            raise _refuse(folder, f"{EVENTS_FILE} line {n} is not JSON ({e.msg})") from None
        if not isinstance(ev, dict) or not isinstance(ev.get("event"), str):
            raise _refuse(folder, f"{EVENTS_FILE} line {n} is not an event (a JSON object with an \"event\" key)")
        events.append(ev)
    return events


def _inside(folder: Path, rel: str) -> bool:
    return not Path(rel).is_absolute() and (folder / rel).resolve().is_relative_to(folder.resolve())


def rows_from_events(folder: Path, events: list[dict], total_steps: int) -> tuple[Batch, dict]:
    """(the rows, facts about the run: last step, end status, seconds) from core.train's events. A resumed run
    repeats no step (core.train cuts its events file at the resume point); should one repeat anyway, its last
    record wins. Checkpoint events are ignored: the checkpoints are read from the folder itself."""
    steps, metrics, balance, samples, previews = {}, {}, {}, {}, {}
    run: dict = {}
    ends = []
    for n, ev in enumerate(events, 1):
        kind = ev["event"]
        if kind == "end":
            ends.append(ev)
            continue
        if kind in ("checkpoint", "notice"):
            continue
        try:
            batch = event_batch(ev, folder)
        except (KeyError, TypeError, ValueError) as e:
            raise _refuse(folder, f"{EVENTS_FILE}: the {kind} event #{n} lacks or garbles a field ({e})") from None
        for row in batch.steps:
            steps[row["step"]] = row
        for row in batch.metrics:
            metrics[(row["step"], row["key"])] = row
        for row in batch.balance:
            balance[row["step"]] = row
        for rows, into in ((batch.samples, samples), (batch.previews, previews)):
            for row in rows:
                if not _inside(folder, row["path"]):
                    raise _refuse(folder, f"{EVENTS_FILE}: image path {row['path']!r} (step {row['step']}) leaves "
                                          f"the run folder; image paths are relative to it")
                into[(row["step"], row["idx"])] = row
        run.update(batch.run)
    if not ends:
        raise _refuse(folder, f"the run did not finish: {EVENTS_FILE} has no end event (last step "
                              f"{max(steps, default=0)} of {total_steps}); finish it with `python -m core.train "
                              f"--config {folder / CONFIG_FILE} --out {folder} --resume`, then import it")
    last = ends[-1]
    if last.get("status") != "completed":
        raise _refuse(folder, f"the run did not finish: its last end event says {last.get('status')!r} at step "
                              f"{last.get('step')} of {total_steps}; resume it with `python -m core.train --config "
                              f"{folder / CONFIG_FILE} --out {folder} --resume`, then import it")
    batch = Batch(steps=[steps[k] for k in sorted(steps)], metrics=[metrics[k] for k in sorted(metrics)],
                  balance=[balance[k] for k in sorted(balance)], samples=[samples[k] for k in sorted(samples)],
                  previews=[previews[k] for k in sorted(previews)], run=run)
    seconds = sum(float(e.get("seconds") or 0.0) for e in ends)
    return batch, {"step": int(last.get("step") or max(steps, default=0)), "seconds": seconds}


def checkpoint_rows(folder: Path) -> list[dict]:
    """One row per checkpoints/step_NNNNNN folder, each checked against its manifest (hashes only, no loading)."""
    from core.checkpoint import CheckpointError, checkpoints_in, step_of, verify

    rows = []
    for ckpt in checkpoints_in(folder):
        try:
            verify(ckpt)
        except CheckpointError as e:
            raise _refuse(folder, f"checkpoint {ckpt.name} does not match its manifest ({e}); delete that "
                                  f"checkpoint folder or import the run from an intact copy") from None
        rows.append({"step": step_of(ckpt), "path": f"checkpoints/{ckpt.name}",
                     "created_at": (ckpt / "manifest.json").stat().st_mtime})
    return rows


def _link_or_copy(root: Path):
    """copytree's copy function for ``root``: a checkpoint's files are hard-linked (written once and sealed by their
    manifest, never changed in place: no second copy on disk); every other file is copied, so a file the app rewrites
    in the run's folder (config.json when the run is resumed to more steps) never changes the original folder."""
    def copy(src: str, dst: str) -> None:
        if Path(src).relative_to(root).parts[:1] == ("checkpoints",):
            try:
                os.link(src, dst)
                return
            except OSError:  # another filesystem, or links not allowed: a real copy
                pass
        shutil.copy2(src, dst)
    return copy


def _eval_files(folder: Path) -> list[Path]:
    return sorted(folder.glob("eval_*.json"))


def record_evaluations(store: Store, run_id: int, folder: Path) -> tuple[int, list[str]]:
    """Record every eval_<split>.json of ``folder`` (core.evaluate's result) not recorded yet for ``run_id``;
    returns (how many were recorded, notes on files skipped)."""
    from core.checkpoint import step_of
    from jobs.evaluations import record

    known = {(e.get("details") or {}).get("imported_sha1") for e in store.evaluations(run_id)}
    recorded, notes = 0, []
    for path in _eval_files(folder):
        data = path.read_bytes()
        sha1 = hashlib.sha1(data).hexdigest()
        if sha1 in known:
            continue
        try:
            result = json.loads(data)
            rewards = result["rewards"]
            for name, r in rewards.items():
                for key in ("base_mean", "base_std", "mean", "std", "z", "n", "trained_on"):
                    if key not in r:
                        raise KeyError(f"rewards.{name}.{key}")
            step = step_of(result["checkpoint"])
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError, UnicodeDecodeError) as e:
            notes.append(f"{path.name}: not a core.evaluate result ({type(e).__name__}: {e}); not recorded")
            continue
        record(store, run_id, result, checkpoint_step=step, extra={"imported_from": path.name, "imported_sha1": sha1})
        recorded += 1
    return recorded, notes


def import_run(store: Store, folder: str | Path, name: str | None = None) -> tuple[int, bool, int]:
    """Import a core.train run folder; returns (run id, created, evaluations recorded). ImportRefused (a
    ValueError) names the folder and the rule it breaks."""
    from core.limits import check_name

    if name is not None:
        check_name("--name", name)
    given = Path(folder).expanduser()
    if not given.exists():
        raise _refuse(given, "no such folder")
    if not given.is_dir():
        raise _refuse(given, "is a file; give the run folder (core.train's --out)")
    src = given.resolve()
    if src.is_relative_to(store.home) and src.parent == store.home and src.name.startswith("run_"):
        raise _refuse(given, "is a run folder of this data directory already (the queue's own runs are in the store)")
    existing = store.imported_from(str(src))
    if existing is not None:
        recorded, _ = record_evaluations(store, existing, src)
        return existing, False, recorded
    config = read_config(src)
    events = read_events(src)
    batch, facts = rows_from_events(src, events, config["steps"])
    batch.checkpoints = checkpoint_rows(src)
    staging = store.home / f".import_{uuid.uuid4().hex[:12]}"
    try:
        shutil.copytree(src, staging, copy_function=_link_or_copy(src),  # a checkpoint cut by a kill is not the run's
                        ignore=shutil.ignore_patterns(".tmp_step_*"))
        finished = (src / EVENTS_FILE).stat().st_mtime
        run_id, created = store.import_run(
            config, str(src), strategy=config["balance"]["strategy"], total_steps=config["steps"],
            step=facts["step"], batch=batch, name=name or src.name, started_at=finished - facts["seconds"],
            finished_at=finished)
        if created:
            try:
                os.replace(staging, store.run_dir(run_id))
            except OSError:
                store.delete_run(run_id)  # no row without its folder
                raise
    except OSError as e:
        raise _refuse(given, f"cannot copy it into the data directory {store.home} ({e})") from None
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    recorded, _ = record_evaluations(store, run_id, src)
    return run_id, created, recorded
