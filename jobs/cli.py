"""``python -m jobs``: background training runs for headless use and scripting.

    python -m jobs submit (--preset NAME | --config FILE) [--set k=v ...] [--name TEXT] [--wait]
    python -m jobs list [--status S] [--json]
    python -m jobs show RUN [--json]
    python -m jobs cancel RUN [--no-wait]
    python -m jobs resume RUN [--steps N] [--from-step N]
    python -m jobs logs RUN [--lines N]
    python -m jobs export RUN --format csv|parquet [--out FILE]
    python -m jobs export RUN --format hub --out DIR [--checkpoint STEP] [--push REPO_ID] [--license ID]
    python -m jobs evaluate RUN [--checkpoint STEP] [--prompts test] [--prompts-per-source N] [--seeds N] [--queue]
    python -m jobs import DIR [--name TEXT]
    python -m jobs worker [--once] [--slots N] | worker --stop

Everything lives under the data directory: --home, else $MARBLE_HOME, else ./runs (the database
marble.db, one folder per run with its config, job.log, samples and checkpoints). --db (or
$MARBLE_DATABASE_URL) points the database elsewhere, e.g. postgresql+psycopg://user@host/db.
Submitted runs wait in the queue until a worker runs them: start one with `python -m jobs worker`, or
pass --wait to submit to run the job right here.
Exit codes: 0 ok, 1 the run failed, 2 bad input (the message names the rule).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time

from jobs import schema as s
from jobs.storage import RunNotFound, Store, TransitionError

DEFAULT_TIME_LIMIT_MIN = 24 * 60  # worker --time-limit: minutes per Slurm job
DEFAULT_CPUS_PER_GPU = 8  # worker --cpus-per-gpu


def _fmt_seconds(x: float | None) -> str:
    if x is None:
        return "-"
    x = int(round(x))
    h, rem = divmod(x, 3600)
    m, sec = divmod(rem, 60)
    return f"{h}h{m:02d}m" if h else (f"{m}m{sec:02d}s" if m else f"{sec}s")


def _fmt_rewards(headline: dict) -> str:
    return " ".join(f"{k}={v:.3g}" for k, v in headline.items() if v is not None)


def _fmt_time(t: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t)) if t else "-"


def cmd_submit(store: Store, args) -> int:
    from core.config import TrainConfig, preset
    from jobs.runner import submit

    config = TrainConfig.load(args.config) if args.config else preset(args.preset or "tiny")
    if args.set:
        config = config.with_overrides(args.set)
    run_id = submit(store, config, preset=None if args.config else (args.preset or "tiny"), name=args.name,
                    num_processes=args.num_processes, num_nodes=args.num_nodes, immediate=args.wait)
    if args.wait:
        run = store.get_run(run_id)
        print(f"run {run_id} {run.status}" + (f": {run.error}" if run.error else ""))
        return 0 if run.status in (s.SUCCEEDED, s.CANCELLED) else 1
    print(run_id)
    return 0


def cmd_list(store: Store, args) -> int:
    runs = store.list_runs(status=args.status, limit=args.limit)
    if args.json:
        print(json.dumps([r.to_dict() for r in runs], indent=2))
        return 0
    print(f"{'ID':>5}  {'STATUS':<11} {'STEP':>11}  {'STRATEGY/KIND':<14} {'ETA':>7}  REWARDS")
    for r in runs:
        name = f"  [{r.name}]" if r.name else ""
        print(f"{r.id:>5}  {r.status:<11} {f'{r.step}/{r.total_steps}':>11}  "
              f"{r.strategy if r.kind == s.TRAIN else r.kind:<14} "
              f"{_fmt_seconds(r.eta_seconds):>7}  {_fmt_rewards(r.headline)}{name}")
    return 0


def cmd_show(store: Store, args) -> int:
    run = store.get_run(args.run)
    checkpoints = store.checkpoints(run.id)
    if args.json:
        print(json.dumps({**run.to_dict(), "checkpoints": checkpoints}, indent=2))
        return 0
    print(f"run {run.id}{f' [{run.name}]' if run.name else ''}: {run.status}, step {run.step}/{run.total_steps}"
          f" ({run.progress:.0%}), strategy {run.strategy}, attempt {run.attempt}")
    print(f"  preset {run.preset or '-'}; code {run.code_version or '-'}; device {run.device or '-'}")
    print(f"  created {_fmt_time(run.created_at)}, started {_fmt_time(run.started_at)}, "
          f"finished {_fmt_time(run.finished_at)}; ETA {_fmt_seconds(run.eta_seconds)}")
    if run.headline:
        print(f"  latest rewards: {_fmt_rewards(run.headline)}")
    print(f"  folder {run.run_dir}\n  log {run.log_path}")
    if checkpoints:
        print(f"  checkpoints: {', '.join(str(c['step']) for c in checkpoints)} (latest {checkpoints[-1]['path']})")
    if run.error:
        print(f"  error: {run.error}")
    return 0


def cmd_cancel(store: Store, args) -> int:
    from jobs.runner import cancel

    print(f"run {args.run} {cancel(store, args.run, wait=not args.no_wait)}")
    return 0


def cmd_resume(store: Store, args) -> int:
    from jobs.runner import resume

    resume(store, args.run, steps=args.steps, from_step=args.from_step)
    where = f"checkpoint {args.from_step}" if args.from_step is not None else "last good checkpoint"
    print(f"run {args.run} queued to resume from its {where}")
    return 0


def cmd_logs(store: Store, args) -> int:
    store.get_run(args.run)
    print(store.log_tail(args.run, args.lines))
    return 0


def cmd_evaluate(store: Store, args) -> int:
    """Held-out evaluation of a finished run's checkpoint (core.evaluate), recorded in the store for the app's
    dashboard and Study: here and now, or with --queue as a job of the worker (as the app's Evaluate button)."""
    from core.evaluate import EvalSettings, run_table
    from jobs.evaluations import evaluate, queue

    settings = EvalSettings(args.prompts, args.prompts_per_source, args.seeds, weights=args.weights)
    settings.validate()
    if args.queue:
        job_id = queue(store, args.run, args.checkpoint, settings, field="--checkpoint")
        print(f"evaluate job {job_id} queued for run {args.run}; a worker runs it (`python -m jobs worker`)")
        return 0
    eval_id, result = evaluate(store, args.run, settings, checkpoint_step=args.checkpoint)
    print(run_table(result))
    print(f"recorded as evaluation {eval_id} of run {args.run}")
    return 0


def cmd_import(store: Store, args) -> int:
    """Register a run folder trained by ``python -m core.train --out DIR`` as a finished run (jobs.importer)."""
    from jobs.importer import import_run

    run_id, created, evaluations = import_run(store, args.dir, name=args.name)
    if not created:
        print(f"{args.dir} is already run {run_id}; nothing imported again"
              + (f" (recorded {evaluations} new evaluation(s) from its eval_*.json)" if evaluations else ""))
        return 0
    run = store.get_run(run_id)
    print(f"imported {args.dir} as run {run_id} ({run.strategy}, {run.step}/{run.total_steps} steps, "
          f"{len(store.checkpoints(run_id))} checkpoint(s), {len(store.sample_steps(run_id))} sample step(s)"
          + (f", {evaluations} evaluation(s)" if evaluations else "") + ")")
    return 0


def cmd_export(store: Store, args) -> int:
    from jobs.export import export_metrics

    store.get_run(args.run)
    if args.format == "hub":
        return _export_hub(store, args)
    for flag in ("checkpoint", "push", "license"):
        if getattr(args, flag) is not None:
            raise ValueError(f"--{flag}: only --format hub takes it")
    print(export_metrics(store, args.run, args.format, args.out))
    return 0


def _export_hub(store: Store, args) -> int:
    """The Hub-ready folder (jobs.hub_export); a push that cannot happen is one sentence and exit code 2."""
    from jobs.hub_export import PushError, export_hub, push_folder

    if not args.out:
        raise ValueError("--out: --format hub writes a folder; name it, e.g. --out exports/my-lora")
    done = export_hub(store, args.run, args.out, checkpoint_step=args.checkpoint, license_id=args.license,
                      repo_id=args.push)
    ema = " (with its EMA in ema/)" if done.has_ema else ""
    print(f"run {args.run} checkpoint {done.checkpoint_step}{ema} exported to {done.folder}: {', '.join(done.files)}")
    if args.push:
        try:
            print(f"pushed to {push_folder(done.folder, args.push)}")
        except PushError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    return 0


def cmd_worker(store: Store, args) -> int:
    from jobs.runner import RunnerSettings, Worker, WorkerBusy, active_runs_line, stop_worker

    if args.stop:  # the worker leaves; its running jobs go on (each in its own process group)
        print(stop_worker(store.home))
        line = active_runs_line(store)
        if line:
            print(f"still queued or running: {line}; `python -m jobs cancel RUN` stops one")
        return 0
    settings = RunnerSettings.from_env(poll_seconds=args.poll)
    if args.executor == "process":  # the cluster flags configure Slurm jobs; here they would be silently ignored
        given = [flag for flag, value, default in (
            ("--partition", args.partition, None), ("--time-limit", args.time_limit, DEFAULT_TIME_LIMIT_MIN),
            ("--cpus-per-gpu", args.cpus_per_gpu, DEFAULT_CPUS_PER_GPU), ("--mem-gb", args.mem_gb, None),
            ("--account", args.account, None), ("--qos", args.qos, None), ("--constraint", args.constraint, None),
            ("--submitit-folder", args.submitit_folder, None)) if value != default]
        if given:
            print(f"error: {', '.join(given)}: only --executor slurm or submitit-local takes "
                  f"{'it' if len(given) == 1 else 'them'} (this worker runs jobs as local processes)", file=sys.stderr)
            return 2
    try:
        if args.executor == "process":
            worker = Worker(store, slots=args.slots, settings=settings)
        else:  # hand the runs to Slurm (or submitit's local executor) instead: jobs/slurm.py, docs/cluster.md
            from jobs.slurm import ClusterSettings, SlurmWorker

            cluster = ClusterSettings(executor="local" if args.executor == "submitit-local" else "slurm",
                                      partition=args.partition, time_limit_min=args.time_limit,
                                      cpus_per_gpu=args.cpus_per_gpu, mem_gb=args.mem_gb, account=args.account,
                                      qos=args.qos, constraint=args.constraint, folder=args.submitit_folder)
            worker = SlurmWorker(store, cluster, slots=args.slots or 64, settings=settings)
        worker.run(once=args.once)
    except WorkerBusy as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


def _check_args(args) -> None:
    """Bounds of the numeric flags and the shape of --out, checked before anything runs (``worker --poll -1``
    used to start a job before refusing)."""
    import math
    from pathlib import Path

    def bad(flag: str, value, rule: str) -> None:
        raise ValueError(f"{flag}={value!r}: {rule}")

    if getattr(args, "limit", None) is not None and args.limit < 1:
        bad("--limit", args.limit, "must be an integer >= 1 (leave it out for every run)")
    if args.command == "logs" and not 1 <= args.lines <= 100_000:
        bad("--lines", args.lines, "must be an integer in [1, 100000]")
    if args.command == "worker":
        if args.poll is not None and not (math.isfinite(args.poll) and 0 < args.poll <= 3600):
            bad("--poll", args.poll, "must be a number of seconds in (0, 3600]")
        if args.slots is not None and not 1 <= args.slots <= 256:
            bad("--slots", args.slots, "must be an integer in [1, 256]")
    if args.command == "export" and args.format != "hub" and args.out and Path(args.out).is_dir():
        bad("--out", args.out, f"is a folder; --format {args.format} writes one file, e.g. {args.out}/metrics.{args.format}")
    if getattr(args, "run", None) is not None and args.run < 1:
        bad("RUN", args.run, "run ids are integers >= 1 (see `python -m jobs list`)")


def _open_store(args) -> Store:
    """Store.open with its failures as one sentence naming --home / --db: a bad URL, a SQLite file in a missing
    folder, a file that is not a database, a --home that is a file."""
    import os
    from pathlib import Path

    from sqlalchemy.exc import SQLAlchemyError

    from jobs.paths import DATABASE_URL_ENV, HOME_ENV

    home = args.home or os.environ.get(HOME_ENV)
    flag = "--home" if args.home else HOME_ENV
    if home and Path(home).expanduser().exists() and not Path(home).expanduser().is_dir():
        raise ValueError(f"{flag}={home!r}: is a file; the data directory must be a folder")
    url = args.db or os.environ.get(DATABASE_URL_ENV)
    where = f"--db={url!r}" if args.db else (f"{DATABASE_URL_ENV}={url!r}" if url else "the database")
    try:
        return Store.open(args.home, args.db)
    except SQLAlchemyError as e:
        reason = str(getattr(e, "orig", None) or e).splitlines()[0]
        raise ValueError(f"{where}: cannot open it ({reason}); give a URL such as sqlite:////path/to/marble.db "
                         f"(its folder must exist) or postgresql+psycopg://user@host/db") from None
    except OSError as e:
        raise ValueError(f"{flag}={home!r}: cannot use it as the data directory ({e.strerror or e})") from None


def build_parser() -> argparse.ArgumentParser:
    from jobs.export import FORMATS

    parser = argparse.ArgumentParser(prog="python -m jobs", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--home", help="the data directory (default: $MARBLE_HOME or ./runs)")
    parser.add_argument("--db", help="database URL (default: $MARBLE_DATABASE_URL or <home>/marble.db)")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("submit", help="queue a training run")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--preset", help="a preset name (default: tiny)")
    src.add_argument("--config", help="a TrainConfig JSON file")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a field, e.g. steps=50 (repeatable)")
    p.add_argument("--name", help="a label for the runs list")
    p.add_argument("--num-processes", type=int, default=1, help="processes (GPUs) per node; > 1 runs under torchrun")
    p.add_argument("--num-nodes", type=int, default=1)
    p.add_argument("--wait", action="store_true", help="run the job here and now (immediate mode) instead of queueing")
    p.set_defaults(func=cmd_submit)

    p = sub.add_parser("list", help="runs, newest first")
    p.add_argument("--status", choices=s.STATUSES)
    p.add_argument("--limit", type=int)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_list)

    p = sub.add_parser("show", help="one run in full")
    p.add_argument("run", type=int)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_show)

    p = sub.add_parser("cancel", help="stop a run: stop flag, then SIGTERM, then SIGKILL")
    p.add_argument("run", type=int)
    p.add_argument("--no-wait", action="store_true", help="only raise the stop flag; the worker escalates")
    p.set_defaults(func=cmd_cancel)

    p = sub.add_parser("resume", help="queue a stopped run to continue from its last checkpoint")
    p.add_argument("run", type=int)
    p.add_argument("--steps", type=int, help="extend the run to this many steps")
    p.add_argument("--from-step", type=int, metavar="N", help="resume from the checkpoint of step N (default: "
                   "the newest one whose files match its manifest); the steps after N are run again")
    p.set_defaults(func=cmd_resume)

    p = sub.add_parser("logs", help="the tail of a run's job log")
    p.add_argument("run", type=int)
    p.add_argument("--lines", type=int, default=50)
    p.set_defaults(func=cmd_logs)

    p = sub.add_parser("evaluate", help="score a run's checkpoint and its base model on held-out prompts; stored "
                                        "for the app's Study (core.evaluate)")
    p.add_argument("run", type=int)
    p.add_argument("--checkpoint", type=int, metavar="STEP", help="the checkpoint's step (default: the newest)")
    p.add_argument("--prompts", choices=("train", "test"), default="test", help="the prompt split (default test)")
    p.add_argument("--prompts-per-source", type=int, default=16, help="prompts per source (default 16)")
    p.add_argument("--seeds", type=int, default=4, help="seeds per prompt (default 4)")
    p.add_argument("--weights", choices=("ema", "raw"), default="ema",
                   help="the checkpoint's parameter EMA (default) or its raw LoRA")
    p.add_argument("--queue", action="store_true", help="queue it as a job for the worker instead of running it here")
    p.set_defaults(func=cmd_evaluate)

    p = sub.add_parser("import", help="register a run folder trained by `python -m core.train --out DIR` as a "
                                      "finished run (dashboard, evaluate, compare, study)")
    p.add_argument("dir", help="the run folder: config.json, events.jsonl, checkpoints/, samples/")
    p.add_argument("--name", help="a label for the runs list (default: the folder's name)")
    p.set_defaults(func=cmd_import)

    p = sub.add_parser("export", help="per-step metrics as one wide table, or a Hub-ready LoRA folder (hub)")
    p.add_argument("run", type=int)
    p.add_argument("--format", required=True, choices=(*FORMATS, "hub"))
    p.add_argument("--out", help="output file (default: <run folder>/metrics.<format>); hub: the new folder")
    p.add_argument("--checkpoint", type=int, metavar="STEP", help="hub: the checkpoint's step (default: the newest)")
    p.add_argument("--push", metavar="REPO_ID", help="hub: also upload the folder to this Hub model repo (needs a token)")
    p.add_argument("--license", metavar="ID", help="hub: the card's license (default: left for you to set)")
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("worker", help="run the queue without the UI")
    p.add_argument("--once", action="store_true", help="exit when nothing is queued or running")
    p.add_argument("--stop", action="store_true", help="stop the worker that serves this data directory (running "
                                                       "jobs go on; `cancel RUN` stops one) and exit")
    p.add_argument("--slots", type=int, help="concurrent jobs (default: one per GPU, one on CPU)")
    p.add_argument("--poll", type=float, help="seconds between queue checks (default 1)")
    p.add_argument("--executor", choices=("process", "slurm", "submitit-local"), default="process",
                   help="process: a local process per job (default); slurm: submit each run to Slurm through "
                        "submitit (docs/cluster.md); submitit-local: submitit's local executor")
    p.add_argument("--partition", help="slurm: the partition")
    p.add_argument("--time-limit", type=int, default=DEFAULT_TIME_LIMIT_MIN, metavar="MIN",
                   help=f"slurm: minutes per job (default {DEFAULT_TIME_LIMIT_MIN})")
    p.add_argument("--cpus-per-gpu", type=int, default=DEFAULT_CPUS_PER_GPU,
                   help=f"slurm: CPUs per GPU (default {DEFAULT_CPUS_PER_GPU})")
    p.add_argument("--mem-gb", type=int, help="slurm: memory per node in GB")
    p.add_argument("--account", help="slurm: the account to charge")
    p.add_argument("--qos", help="slurm: the quality of service")
    p.add_argument("--constraint", help="slurm: a node feature constraint, e.g. h100")
    p.add_argument("--submitit-folder", metavar="DIR",
                   help="slurm: submitit's private folder, on a filesystem the nodes see, outside the data directory "
                        "(default ~/.marble-studio/submitit; created mode 700)")
    p.set_defaults(func=cmd_worker)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    level = logging.INFO if args.command in ("worker", "submit") else logging.WARNING
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("alembic").setLevel(logging.WARNING)
    from core.config import ConfigError

    try:
        _check_args(args)  # before the database is touched: a refused command changes nothing
        opened = _open_store(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        with opened as store:
            if args.command != "worker" and args.command != "submit":
                from jobs.runner import reconcile

                reconcile(store)  # a job that died while nobody watched shows as interrupted
            return args.func(store, args)
    except (ConfigError, RunNotFound, TransitionError, ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
