"""Headless training: ``python -m core.train (--preset NAME | --config FILE) [--set k=v ...] --out DIR``.

Writes DIR/config.json, DIR/events.jsonl (one JSON object per event), DIR/samples/ and
DIR/checkpoints/step_NNNNNN/, with a progress bar on stderr.

Several GPUs: add ``--num-processes G`` (and for several machines ``--num-nodes N --node-rank R
--master-addr HOST``, the same command on each node); the CLI then re-runs itself under torchrun. Or
launch it yourself: ``torchrun --standalone --nproc-per-node=G -m core.train ...``. Rank 0 alone writes
DIR (docs/distributed.md).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from core.checkpoint import checkpoints_in, is_checkpoint_folder, is_disk_full
from core.config import ConfigError, TrainConfig, available_presets, preset
from core.launch import launch_rank, launched_by_torchrun, torchrun_command

EVENTS_FILE = "events.jsonl"


class JsonlWriter:
    """Appends events to DIR/events.jsonl, flushing each line so readers can tail it."""

    def __init__(self, path: Path):
        self.path = path
        self.handle = open(path, "a", buffering=1)

    def __call__(self, event) -> None:
        self.handle.write(json.dumps(event.to_dict()) + "\n")

    def close(self) -> None:
        self.handle.close()


def truncate_events_after(path: Path, step: int) -> int:
    """Drop events of steps after ``step`` (a resumed run repeats them); returns how many were dropped."""
    if not path.exists():
        return 0
    kept, dropped = [], 0
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        try:
            ev = json.loads(line)
        except json.JSONDecodeError:  # a line cut by a crash
            dropped += 1
            continue
        if ev.get("event") in ("start", "end") or int(ev.get("step", 0)) <= step:
            kept.append(line)
        else:
            dropped += 1
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(k + "\n" for k in kept))
    os.replace(tmp, path)
    return dropped


def build_config(args: argparse.Namespace) -> TrainConfig:
    if args.config:
        cfg = TrainConfig.load(args.config)
    else:
        cfg = preset(args.preset or "tiny")
    overrides = list(args.set or [])
    if args.steps is not None:
        overrides.append(f"steps={args.steps}")
    return cfg.with_overrides(overrides) if overrides else cfg


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m core.train", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    src = parser.add_mutually_exclusive_group()
    src.add_argument("--preset", help=f"one of: {', '.join(available_presets())} (default: tiny)")
    src.add_argument("--config", help="a TrainConfig JSON file")
    parser.add_argument("--set", action="append", metavar="KEY=VALUE",
                        help="override a field by dotted path, e.g. --set balance.ema_rho=0.5 (repeatable)")
    parser.add_argument("--out", required=True, help="the run folder")
    parser.add_argument("--steps", type=int, help="shorthand for --set steps=N")
    parser.add_argument("--resume", metavar="DIR", nargs="?", const="latest",
                        help="a checkpoint folder or a run folder, or no value for --out's newest checkpoint; "
                             "a run folder resumes from its newest checkpoint that passes its manifest check")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    launch = parser.add_argument_group("distributed launch (re-runs this command under torchrun)")
    launch.add_argument("--num-processes", type=int, help="processes on this node, one per GPU")
    launch.add_argument("--num-nodes", type=int, default=1, help="machines taking part (default: 1)")
    launch.add_argument("--node-rank", type=int, default=0, help="this machine's place among them, 0 to N-1")
    launch.add_argument("--master-addr", help="node 0's address, reachable from every node (several nodes)")
    launch.add_argument("--master-port", type=int, default=29500, help="node 0's port (several nodes)")
    args = parser.parse_args(argv)

    for flag, value in (("--num-processes", args.num_processes), ("--num-nodes", args.num_nodes)):
        if value is not None and value < 1:  # 0 relaunched as one process and trained anyway
            print(f"error: {flag}={value}: must be an integer >= 1", file=sys.stderr)
            return 2
    if not args.out.strip():  # '' is the current folder: a run written into wherever the command was typed
        print("error: --out='': name the run folder, e.g. --out runs/my-run", file=sys.stderr)
        return 2
    if args.num_processes is not None or args.num_nodes != 1:
        return _relaunch_under_torchrun(args, sys.argv[1:] if argv is None else argv)
    rank = launch_rank()
    prefix = f"rank {rank}: " if rank else ""
    out = Path(args.out)
    resume = None
    try:
        if args.resume is not None and not args.config and not args.preset and (out / "config.json").exists():
            args.config = str(out / "config.json")
        if args.resume is None and _holds_a_run(out):  # a new run here would interleave its events and
            # checkpoints with the old run's and overwrite its config.json
            raise ValueError(f"--out={str(out)!r}: already holds a run (config.json, events or checkpoints); "
                             f"continue it with --resume, or give a new folder")
        config = build_config(args)
        _preflight(config, out)
        if args.resume == "latest":
            resume = out
            if not checkpoints_in(out):
                raise FileNotFoundError(f"--resume: no checkpoint under {out / 'checkpoints'}")
        elif args.resume:
            resume = Path(args.resume)
            if not resume.is_dir():
                what = "is a file, not a folder" if resume.exists() else "no such folder"
                raise FileNotFoundError(f"--resume {args.resume!r}: {what} (give a checkpoint folder "
                                        f"such as RUN/checkpoints/step_000010, or a run folder)")
            if not is_checkpoint_folder(resume) and not (resume / "checkpoints").is_dir():  # refused before the
                # model loads, not after (an empty folder failed only once training had started)
                raise FileNotFoundError(f"--resume {args.resume!r}: holds no checkpoint and no checkpoints/ folder "
                                        f"(give a checkpoint folder such as RUN/checkpoints/step_000010, or a run "
                                        f"folder)")
    except (ConfigError, FileNotFoundError, ValueError) as e:
        print(f"{prefix}error: {e}", file=sys.stderr)
        return 2

    from core.trainer import train

    if rank != 0:  # under torchrun: train this rank's share; rank 0 writes the run folder and reports
        try:
            train(config, out, resume_from=resume)
        except (ValueError, FileNotFoundError) as e:
            print(f"{prefix}error: {e}", file=sys.stderr)
            return 2
        return 0

    from tqdm import tqdm

    out.mkdir(parents=True, exist_ok=True)
    writer: JsonlWriter | None = None
    early: list = []  # events before "start" (notices): written once a resume has cut the events file
    bar = tqdm(total=config.steps, disable=args.quiet, unit="step", dynamic_ncols=True)

    def on_event(event) -> None:
        nonlocal writer
        if event.kind == "notice":
            bar.write(f"note: {event.message}", file=sys.stderr)
        if writer is None:
            if event.kind != "start":
                early.append(event)
                return
            if event.resumed_from is not None:  # the resumed steps are written again
                truncate_events_after(out / EVENTS_FILE, event.step)
            writer = JsonlWriter(out / EVENTS_FILE)
            for e in early:
                writer(e)
        writer(event)
        if event.kind == "start":
            bar.n = event.step
            bar.refresh()
        elif event.kind == "step":
            bar.update(event.step - bar.n)
            bar.set_postfix({k[:12]: f"{v:.3g}" for k, v in event.rewards.items() if v is not None}, refresh=False)

    try:
        result = train(config, out, on_event=on_event, resume_from=resume)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        if not is_disk_full(e):
            raise
        print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        bar.close()
        if writer is not None:
            writer.close()
    print(f"{result.status}: {result.step} steps; events in {out / EVENTS_FILE}; "
          f"checkpoint {result.last_checkpoint}")
    return 0


def _holds_a_run(out: Path) -> bool:
    return out.is_dir() and any(((out / "config.json").exists(), (out / EVENTS_FILE).exists(), checkpoints_in(out)))


def _preflight(config: TrainConfig, out: Path) -> None:
    """Refuse what would fail later, before anything is loaded or written: --out must be a folder this user can
    create or write, and the run must fit the machine, use rewards its prompts can score and reach its reward
    servers (core.preflight)."""
    from core.cli_checks import writable_dir
    from core.preflight import check_run

    writable_dir("--out", out)
    if config.model.device.startswith("cuda"):
        from core.models import resolve_device

        resolve_device(config.model.device)  # no CUDA here: refused before the run folder is made
    check_run(config, world_size=int(os.environ.get("WORLD_SIZE", "1") or 1))


_LAUNCH_FLAGS = {"--num-processes", "--num-nodes", "--node-rank", "--master-addr", "--master-port"}


def _relaunch_under_torchrun(args: argparse.Namespace, argv: list[str]) -> int:
    """Replace this process with torchrun running the same command (launch flags removed) on every process."""
    if launched_by_torchrun():
        print("error: --num-processes/--num-nodes launch torchrun; this process already runs under torchrun "
              "(drop them, or start without torchrun)", file=sys.stderr)
        return 2
    rest, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in _LAUNCH_FLAGS:
            skip = True
        elif a.split("=", 1)[0] not in _LAUNCH_FLAGS:
            rest.append(a)
    try:
        cmd = torchrun_command(args.num_processes or 1, args.num_nodes, args.node_rank, args.master_addr,
                               args.master_port, ["core.train", *rest])
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(cmd[0], cmd)
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main())
