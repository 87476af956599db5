"""``python -m jobs import DIR``: a folder trained by ``python -m core.train --out DIR`` becomes a finished run of the
store (one record of a run, issue 18), on a real tiny CLI run; a bad folder is one line naming it and the rule."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from jobs import schema as s
from jobs.evaluations import check_evaluable, latest
from jobs.storage import Store
from tests.jobs_support import REPO, run_cli, subprocess_env

pytestmark = pytest.mark.slow
TRAIN = ["--preset", "tiny", "--set", "steps=3", "--set", "sampling.num_steps=4", "--set", "sampling.prompts_per_step=2",
         "--set", "sampling.images_per_prompt=4", "--set", "nft.micro_batch_size=4", "--set", "checkpoint_every=2",
         "--set", "sample_every=1", "--set", "num_threads=1", "--quiet"]


@pytest.fixture(scope="module")
def cli_run(tmp_path_factory) -> Path:
    """A run folder written by core.train (3 steps, checkpoints at 2 and 3, samples every step), evaluated by
    core.evaluate --run as a researcher does from the shell."""
    root = tmp_path_factory.mktemp("cli")
    out = root / "my-run"
    env = subprocess_env(root / "unused-home")
    done = subprocess.run([sys.executable, "-m", "core.train", *TRAIN, "--out", str(out)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    done = subprocess.run([sys.executable, "-m", "core.evaluate", "--run", str(out), "--prompts-per-source", "2",
                           "--seeds", "1"], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert (out / "eval_test.json").is_file()
    return out


def copy_of(cli_run: Path, tmp_path: Path, name: str = "copy") -> Path:
    dst = tmp_path / name
    shutil.copytree(cli_run, dst)
    return dst


def test_import_registers_a_cli_run_as_a_finished_run_once(cli_run, tmp_path):
    home = tmp_path / "home"
    code, out, err = run_cli(home, "import", str(cli_run))
    assert code == 0, err
    assert "as run 1 (marble, 3/3 steps, 2 checkpoint(s), 3 sample step(s), 1 evaluation(s))" in out
    with Store.open(home) as store:
        run = store.get_run(1)
        assert (run.kind, run.status, run.step, run.total_steps, run.name) == (s.TRAIN, s.SUCCEEDED, 3, 3, "my-run")
        assert run.run_dir == home.resolve() / "run_000001" and (run.run_dir / "config.json").is_file()
        # a copy: what the app rewrites there never reaches the original; sealed checkpoint files are hard links
        assert not os.path.samefile(run.run_dir / "config.json", cli_run / "config.json")
        assert os.path.samefile(run.run_dir / "checkpoints/step_000003/manifest.json",
                                cli_run / "checkpoints/step_000003/manifest.json")
        assert run.finished_at - run.started_at > 0  # its duration: the end events' seconds
        events = [json.loads(line) for line in (cli_run / "events.jsonl").read_text().splitlines()]
        steps = [e for e in events if e["event"] == "step"]
        series = store.metrics(1).by_key()
        assert series["reward/colorfulness"] == ([1, 2, 3], [e["rewards"]["colorfulness"] for e in steps])
        assert run.headline == steps[-1]["rewards"]
        assert len(store.balance(1)) == sum(e["event"] == "balance" for e in events) >= 1
        assert [c["step"] for c in store.checkpoints(1)] == [2, 3] and all(c["exists"] for c in store.checkpoints(1))
        samples = store.samples(1, step=3)
        assert len(samples) == 8 and all(Path(x["image"]).is_file() for x in samples)
        assert all(Path(x["image"]).is_relative_to(run.run_dir) for x in samples)  # served from the data directory
        # core.evaluate's file is recorded as the evaluate job records its result: one source for the app
        ev = latest(store, 1)
        assert ev["details"]["imported_from"] == "eval_test.json" and ev["checkpoint_step"] == 3
        assert ev["details"]["rewards"]["colorfulness"]["trained_on"] is True
        check_evaluable(store, 1)  # Evaluate and Compare take it like a run of the queue
        rows = len(store.metrics(1).rows)
    code, out, err = run_cli(home, "import", str(cli_run))  # again: nothing doubles
    assert code == 0 and "is already run 1; nothing imported again" in out, err
    with Store.open(home) as store:
        assert [r.id for r in store.list_runs()] == [1] and len(store.metrics(1).rows) == rows
        assert len(store.evaluations(1)) == 1
    code, _, err = run_cli(home, "import", str(home / "run_000001"))
    assert code == 2 and "is a run folder of this data directory already" in err


def test_deleting_an_imported_run_leaves_the_original_folder(cli_run, tmp_path):
    home = tmp_path / "home"
    src = copy_of(cli_run, tmp_path)
    assert run_cli(home, "import", str(src), "--name", "mine")[0] == 0
    with Store.open(home) as store:
        assert store.get_run(1).name == "mine"
        store.delete_run(1)
        assert store.list_runs() == [] and not (home / "run_000001").exists()
    assert (src / "events.jsonl").is_file() and (src / "checkpoints" / "step_000003").is_dir()


def test_import_never_unpickles(cli_run, tmp_path):
    """A pickle in the folder is copied as a file and never loaded (the project reads only JSON and safetensors)."""
    src = copy_of(cli_run, tmp_path)
    sentinel = tmp_path / "unpickled"

    class Payload:
        def __reduce__(self):
            return (Path.touch, (sentinel,))

    (src / "training_state.pt").write_bytes(pickle.dumps(Payload()))
    code, _, err = run_cli(tmp_path / "home", "import", str(src))
    assert code == 0, err
    assert not sentinel.exists()


def _events(folder: Path) -> list[str]:
    return (folder / "events.jsonl").read_text().splitlines()


BAD = {
    "missing": (lambda d: shutil.rmtree(d), "no such folder"),
    "config missing": (lambda d: (d / "config.json").unlink(), "has no config.json: not a run folder"),
    "config not json": (lambda d: (d / "config.json").write_text("{steps: 3"), "config.json is not valid JSON (line 1"),
    "config breaks a rule": (lambda d: (d / "config.json").write_text(
        (d / "config.json").read_text().replace('"ema_rho": 0.7', '"ema_rho": 2.0')),
        "config.json is not a valid TrainConfig (balance.ema_rho=2.0: must be a number in [0, 1)"),
    "events missing": (lambda d: (d / "events.jsonl").unlink(), "has no events.jsonl"),
    "events line not json": (lambda d: (d / "events.jsonl").write_text(
        "\n".join(_events(d)[:2] + ["{oops"] + _events(d)[2:]) + "\n"), "events.jsonl line 3 is not JSON"),
    "unfinished": (lambda d: (d / "events.jsonl").write_text(
        "\n".join(line for line in _events(d) if '"event": "end"' not in line) + "\n"),
        "the run did not finish: events.jsonl has no end event (last step 3 of 3)"),
    "stopped": (lambda d: (d / "events.jsonl").write_text(
        "\n".join(line.replace('"completed"', '"stopped"') for line in _events(d)) + "\n"),
        "its last end event says 'stopped' at step 3 of 3"),
    "damaged checkpoint": (lambda d: (d / "checkpoints" / "step_000002" / "pytorch_lora_weights.safetensors")
                           .write_bytes(b"not the weights"), "checkpoint step_000002 does not match its manifest"),
    "sample path leaves the folder": (lambda d: (d / "events.jsonl").write_text(
        "\n".join(line.replace('"samples/step_000001/000.png"', '"../../etc/passwd"') for line in _events(d)) + "\n"),
        "image path '../../etc/passwd' (step 1) leaves the run folder"),
    "preview path leaves the folder": (lambda d: (d / "events.jsonl").write_text(
        "\n".join(line.replace('"previews/step_000001/000.png"', '"/etc/passwd"') for line in _events(d)) + "\n"),
        "image path '/etc/passwd' (step 1) leaves the run folder"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_a_bad_folder_is_refused_in_one_line_naming_it_and_the_rule(cli_run, tmp_path, case):
    src = copy_of(cli_run, tmp_path)
    spoil, rule = BAD[case]
    spoil(src)
    home = tmp_path / "home"
    code, out, err = run_cli(home, "import", str(src))
    assert code == 2, (out, err)
    assert err.startswith(f"error: {src}: ") and rule in err, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    with Store.open(home) as store:
        assert store.list_runs() == []  # nothing half-registered
    assert [p.name for p in home.iterdir() if p.name.startswith((".import", "run_"))] == []


def test_a_file_is_not_a_run_folder(cli_run, tmp_path):
    code, _, err = run_cli(tmp_path / "home", "import", str(cli_run / "config.json"))
    assert code == 2 and err.strip() == f"error: {cli_run / 'config.json'}: is a file; give the run folder " \
                                       f"(core.train's --out)"
