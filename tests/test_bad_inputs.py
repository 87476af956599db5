"""A table of bad inputs (issue 17): each is refused with one clear message naming the field or file, the value
and the rule; no traceback; nothing written outside the test's temp folder; no run queued.

The CLIs run in-process through their ``main(argv)`` (a few as real subprocesses), the web handlers are called
directly as tests/test_app_*.py do. No training step runs: every case is refused before a model is loaded.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from core.config import ConfigError, TrainConfig, preset
from core.limits import check_fits, estimate_memory

ROOT = Path(__file__).resolve().parents[1]
HUGE = 2**70


# ---- the corpus ------------------------------------------------------------------------------------
# (id, cli, argv, expected fragments). {tmp} is the test's temp folder; files named in SETUP are made first.

SETUP = {
    "list.jsonl": b'["a red circle"]\n',
    "latin1.txt": "a caf\xe9 sign\n".encode("latin-1"),
    "split.jsonl": b'{"prompt": "a red circle", "split": "validation"}\n',
    "noprompt.jsonl": b'{"text": ""}\n',
    "badjson.jsonl": b'{"prompt": "a red circle"\n',
    "long.txt": b"x" * 1_000_000 + b"\n",
    "empty.txt": b"\n\n",
    "prompts.csv": b"a red circle\n",
    "afile": b"not a folder",
    "corrupt.db": b"this is not an SQLite database " * 40,
    "bad.json": b"{not json",
    "latin1.json": b'{"steps": "\xe9"}',
    "config.json": b'{"steps": 3}',
    "run/config.json": b"{}",
    "run/checkpoints/step_000001/readme.txt": b"no weights here",
}

TRAIN = [
    ("out-is-file", ["--out", "{tmp}/afile"], ["--out", "afile", "existing file"]),
    ("out-under-file", ["--out", "{tmp}/afile/run"], ["--out", "afile", "is a file"]),
    ("resume-missing", ["--out", "{tmp}/r", "--resume", "{tmp}/nowhere"], ["--resume", "nowhere", "no such folder"]),
    ("resume-nothing", ["--out", "{tmp}/r", "--resume"], ["--resume", "no checkpoint"]),
    ("resume-empty-folder", ["--out", "{tmp}/r", "--resume", "{tmp}/run/checkpoints"],
     ["--resume", "holds no checkpoint and no checkpoints/ folder"]),
    ("device-cuda", ["--out", "{tmp}/r", "--set", "model.device=cuda"], ["model.device", "cuda", "no CUDA"]),
    ("device-bogus", ["--out", "{tmp}/r", "--set", "model.device=gpu0"], ["model.device", "gpu0", "valid choices"]),
    ("seed-huge", ["--out", "{tmp}/r", "--set", f"seed={HUGE}"], ["seed", str(HUGE), "2**63 - 1"]),
    ("seed-negative", ["--out", "{tmp}/r", "--set", "seed=-1"], ["seed=-1", "must be an integer in"]),
    ("steps-huge", ["--out", "{tmp}/r", "--steps", str(HUGE)], ["steps", str(HUGE), "10000000"]),
    ("prompts-per-step", ["--out", "{tmp}/r", "--set", "sampling.prompts_per_step=100000"],
     ["sampling.prompts_per_step=100000", "[1, 4096]"]),
    ("images-per-prompt", ["--out", "{tmp}/r", "--set", "sampling.images_per_prompt=1000"],
     ["sampling.images_per_prompt=1000", "[2, 256]"]),
    ("batch-product", ["--out", "{tmp}/r", "--set", "sampling.prompts_per_step=4096", "--set",
                       "sampling.images_per_prompt=256"], ["prompts_per_step", "1048576 images", "16384"]),
    ("resolution-huge", ["--out", "{tmp}/r", "--set", "sampling.resolution=1048576"],
     ["sampling.resolution=1048576", "2048"]),
    ("resolution-odd", ["--out", "{tmp}/r", "--set", "sampling.resolution=17"], ["sampling.resolution=17", "multiple of 16"]),
    ("lora-rank-huge", ["--out", "{tmp}/r", "--set", "model.lora_rank=1000000"], ["model.lora_rank=1000000", "1024"]),
    ("lora-rank-float", ["--out", "{tmp}/r", "--set", "model.lora_rank=1e6"], ["model.lora_rank=1000000.0", "integer"]),
    ("micro-batch-huge", ["--out", "{tmp}/r", "--set", "nft.micro_batch_size=100000"],
     ["nft.micro_batch_size=100000", "4096"]),
    ("threads-huge", ["--out", "{tmp}/r", "--set", "num_threads=100000"], ["num_threads=100000", "1024"]),
    ("guidance-nan", ["--out", "{tmp}/r", "--set", "sampling.guidance_scale=NaN"], ["sampling.guidance_scale", "nan", ">= 1.0"]),
    ("unknown-key", ["--out", "{tmp}/r", "--set", "sampling.nope=1"], ["sampling.nope", "unknown key"]),
    ("set-no-equals", ["--out", "{tmp}/r", "--set", "steps"], ["--set", "steps", "key=value"]),
    ("preset-unknown", ["--out", "{tmp}/r", "--preset", "huge"], ["preset", "huge", "valid choices"]),
    ("config-missing", ["--out", "{tmp}/r", "--config", "{tmp}/none.json"], ["--config=", "none.json", "no such file"]),
    ("config-not-json", ["--out", "{tmp}/r", "--config", "{tmp}/bad.json"], ["--config=", "bad.json", "not valid JSON"]),
    ("config-is-folder", ["--out", "{tmp}/r", "--config", "{tmp}/run"], ["--config=", "is a folder", "config.json"]),
    ("set-into-a-value", ["--out", "{tmp}/r", "--set", "balance.ema_rho.x=0.5"],
     ["balance.ema_rho.x", "'balance.ema_rho' is a value, not a section"]),
    ("out-holds-a-run", ["--out", "{tmp}/run"], ["--out=", "already holds a run", "--resume"]),
    ("out-empty", ["--out", ""], ["--out=''", "name the run folder"]),
    ("processes-zero", ["--out", "{tmp}/r", "--num-processes", "0"], ["--num-processes=0", ">= 1"]),
    ("prompts-list-line", ["--out", "{tmp}/r", "--set", 'prompts.sources=["file:{tmp}/list.jsonl"]'],
     ["list.jsonl:1", "must be a JSON object", "not a list"]),
    ("prompts-not-utf8", ["--out", "{tmp}/r", "--set", 'prompts.sources=["file:{tmp}/latin1.txt"]'],
     ["latin1.txt", "not UTF-8", "0xe9"]),
    ("prompts-bad-split", ["--out", "{tmp}/r", "--set", 'prompts.sources=["file:{tmp}/split.jsonl"]'],
     ["split.jsonl:1", "split='validation'", "train, test"]),
    ("prompts-no-prompt", ["--out", "{tmp}/r", "--set", 'prompts.sources=["file:{tmp}/noprompt.jsonl"]'],
     ["noprompt.jsonl:1", "non-empty \"prompt\""]),
    ("prompts-bad-json", ["--out", "{tmp}/r", "--set", 'prompts.sources=["file:{tmp}/badjson.jsonl"]'],
     ["badjson.jsonl:1", "not valid JSON"]),
    ("prompts-megabyte", ["--out", "{tmp}/r", "--set", 'prompts.sources=["file:{tmp}/long.txt"]'],
     ["long.txt:1", "1000000 characters", "4096"]),
    ("prompts-empty", ["--out", "{tmp}/r", "--set", 'prompts.sources=["file:{tmp}/empty.txt"]'],
     ["empty.txt", "holds no prompts"]),
    ("prompts-suffix", ["--out", "{tmp}/r", "--set", 'prompts.sources=["file:{tmp}/prompts.csv"]'],
     ["prompts.csv", ".txt", ".jsonl"]),
    ("prompts-missing", ["--out", "{tmp}/r", "--set", 'prompts.sources=["file:{tmp}/none.txt"]'],
     ["none.txt", "does not exist"]),
    ("reward-no-prompts", ["--out", "{tmp}/r", "--set", 'rewards=["color_fidelity"]'],
     ["rewards[0].name='color_fidelity'", "applies to no prompt", "world-color"]),
    ("reward-size-unsized-prompts", ["--out", "{tmp}/r", "--set", 'prompts.sources=["world-single"]',
                                     "--set", 'rewards=["object_size", "single_object"]'],
     ["rewards[0].name='object_size'", "applies to no prompt", "world-size"]),
    ("reward-ocr-no-quotes", ["--out", "{tmp}/r", "--set", 'rewards=["ocr", "brightness"]'],
     ["rewards[0].name='ocr'", "applies to no prompt", "quoted"]),
    ("reward-unknown", ["--out", "{tmp}/r", "--set", 'rewards=["beauty"]'], ["rewards[0].name='beauty'", "valid choices"]),
    ("reward-server-down", ["--out", "{tmp}/r", "--set",
                            'rewards=[{"name": "remote", "kwargs": {"url": "http://127.0.0.1:9/score"}}]'],
     ["rewards[0].kwargs.url", "127.0.0.1:9", "does not answer"]),
]

SAMPLE = [
    ("resolution-zero", ["--resolution", "0"], ["--resolution=0", "[16, 2048]"]),
    ("resolution-odd", ["--resolution", "17"], ["--resolution=17", "multiple of 16"]),
    ("resolution-huge", ["--resolution", "1048576"], ["--resolution=1048576", "2048"]),
    ("steps-zero", ["--steps", "0"], ["--steps=0", "[1, 1000]"]),
    ("guidance-nan", ["--guidance", "nan"], ["--guidance=nan", "finite"]),
    ("guidance-low", ["--guidance", "0.5"], ["--guidance=0.5", "[1, 100]"]),
    ("seqlen-zero", ["--max-sequence-length", "0"], ["--max-sequence-length=0", "[1, 512]"]),
    ("seed-huge", ["--seed", str(HUGE)], ["--seed", str(HUGE), "9223372036854775807"]),
    ("out-suffix", ["--out", "{tmp}/x.xyz"], ["--out", "x.xyz", ".png"]),
    ("out-folder", ["--out", "{tmp}/dir.png"], ["--out", "dir.png", "is a folder"]),
    ("out-under-file", ["--out", "{tmp}/afile/x.png"], ["--out", "afile", "is a file"]),
    ("prompt-megabyte", ["--prompt", "y" * 100_000], ["--prompt", "100000 characters", "4096"]),
    ("prompt-empty", ["--prompt", "  "], ["--prompt", "must not be empty"]),
    ("lora-missing", ["--lora", "{tmp}/nowhere"], ["--lora", "nowhere", "not a folder"]),
    ("model-missing", ["--model", "{tmp}/nowhere"], ["nowhere", "not a built-in model"]),
]

EVALUATE = [
    ("threads-zero", ["--run", "{tmp}/run", "--threads", "0"], ["--threads=0", "[1, 1024]"]),
    ("checkpoint-no-weights", ["--run", "{tmp}/run", "--checkpoint", "{tmp}/run/checkpoints/step_000001"],
     ["--checkpoint", "step_000001", "pytorch_lora_weights.safetensors"]),
    ("run-not-a-run", ["--run", "{tmp}/nowhere"], ["--run", "nowhere", "no config.json"]),
    ("seeds-zero", ["--run", "{tmp}/run", "--seeds", "0"], ["--seeds=0", "[1, 256]"]),
    ("run-with-out", ["--run", "{tmp}/run", "--out", "{tmp}/e"], ["--out=", "only --study and --curve"]),
    ("study-out-file", ["--study", "{tmp}/run", "{tmp}/run", "--out", "{tmp}/afile"], ["--out", "afile", "existing file"]),
]

JOBS = [
    ("db-bad-url", ["--home", "{tmp}/h", "--db", "nonsense://x", "list"], ["--db='nonsense://x'", "cannot open"]),
    ("db-missing-folder", ["--home", "{tmp}/h", "--db", "sqlite:///{tmp}/no/dir/x.db", "list"],
     ["--db=", "no/dir/x.db", "unable to open database file"]),
    ("db-corrupt", ["--home", "{tmp}/h", "--db", "sqlite:///{tmp}/corrupt.db", "list"],
     ["--db=", "corrupt.db", "not a database"]),
    ("home-is-file", ["--home", "{tmp}/afile", "list"], ["--home", "afile", "is a file"]),
    ("list-limit", ["--home", "{tmp}/h", "list", "--limit", "-1"], ["--limit=-1", ">= 1"]),
    ("logs-lines", ["--home", "{tmp}/h", "logs", "1", "--lines", "-5"], ["--lines=-5", "[1, 100000]"]),
    ("logs-missing-run", ["--home", "{tmp}/h", "logs", "7"], ["run", "7"]),
    ("worker-poll", ["--home", "{tmp}/h", "worker", "--poll", "-1"], ["--poll=-1.0", "(0, 3600]"]),
    ("worker-slots", ["--home", "{tmp}/h", "worker", "--slots", "0"], ["--slots=0", "[1, 256]"]),
    ("worker-slurm-flag-local", ["--home", "{tmp}/h", "worker", "--time-limit", "0", "--once"],
     ["--time-limit", "only --executor slurm or submitit-local takes it"]),
    ("worker-slurm-mem", ["--home", "{tmp}/h", "worker", "--executor", "submitit-local", "--mem-gb", "-1", "--once"],
     ["mem_gb=-1", "integer >= 1"]),
    ("export-out-dir", ["--home", "{tmp}/h", "export", "1", "--format", "csv", "--out", "{tmp}"],
     ["--out", "is a folder", "metrics.csv"]),
    ("show-run-zero", ["--home", "{tmp}/h", "show", "0"], ["RUN=0", ">= 1"]),
    ("submit-long-name", ["--home", "{tmp}/h", "submit", "--name", "n" * 300], ["name=", "300 characters", "200"]),
    ("submit-bad-set", ["--home", "{tmp}/h", "submit", "--set", "sampling.resolution=1048576"],
     ["sampling.resolution=1048576", "2048"]),
    ("submit-reward-no-prompts", ["--home", "{tmp}/h", "submit", "--set", 'rewards=["spatial_relation"]'],
     ["rewards[0].name='spatial_relation'", "applies to no prompt"]),
    ("submit-processes", ["--home", "{tmp}/h", "submit", "--num-processes", "0"], ["num_processes=0", ">= 1"]),
    ("submit-config-missing", ["--home", "{tmp}/h", "submit", "--config", "{tmp}/none.json"], ["none.json"]),
    ("submit-config-folder", ["--home", "{tmp}/h", "submit", "--config", "{tmp}/run"], ["--config=", "is a folder"]),
]


def _fill(argv: list[str], tmp: Path) -> list[str]:
    return [a.replace("{tmp}", str(tmp)) for a in argv]


@pytest.fixture
def sandbox(tmp_path, monkeypatch):
    """A temp folder with the SETUP files as the working directory; MARBLE_HOME inside it."""
    for name, content in SETUP.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content)
    (tmp_path / "dir.png").mkdir()
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MARBLE_HOME", str(tmp_path / "h"))
    monkeypatch.delenv("MARBLE_DATABASE_URL", raising=False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    return tmp_path


def _snapshot(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


def _run_main(main, argv: list[str]) -> tuple[int, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as e:  # argparse's own refusals
            code = e.code
    return code, out.getvalue() + err.getvalue()


def _assert_refused(code, text: str, expected: list[str]) -> None:
    assert code == 2, f"exit code {code}, output: {text[-2000:]}"
    assert "Traceback" not in text, text[-3000:]
    lines = [ln for ln in text.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1, f"want one error line: {text[-2000:]}"
    for fragment in expected:
        assert fragment in lines[0], f"{fragment!r} not in {lines[0][:600]!r}"
    assert len(lines[0]) < 800, "the message must be one readable line, not the value in full"


def _cli(name: str):
    if name == "train":
        from core.train import main
    elif name == "sample":
        from core.sample import main
    elif name == "evaluate":
        from core.evaluate import main
    else:
        from jobs.cli import main
    return main


CASES = ([("train", *c) for c in TRAIN] + [("sample", *c) for c in SAMPLE] + [("evaluate", *c) for c in EVALUATE]
         + [("jobs", *c) for c in JOBS])


@pytest.mark.parametrize("cli,case,argv,expected", CASES, ids=[f"{c[0]}-{c[1]}" for c in CASES])
def test_cli_refuses_bad_input(sandbox, cli, case, argv, expected):
    argv = _fill(argv, sandbox)
    if cli == "train":
        argv = argv + ["--quiet"]
    if cli == "sample":
        argv = ["--prompt", "a red circle", "--out", str(sandbox / "x.png"), *argv]
    expected = _fill(expected, sandbox)
    before = _snapshot(sandbox)
    code, text = _run_main(_cli(cli), argv)
    _assert_refused(code, text, expected)
    created = _snapshot(sandbox) - before
    # nothing written but the data directory's database (jobs open it) — no run folder, no output
    assert all(p == "h" or p.startswith("h/marble.db") or p.startswith("h/worker") for p in created), created
    if cli == "jobs" and (sandbox / "h" / "marble.db").exists():
        from jobs.storage import Store

        with Store.open(sandbox / "h") as store:
            assert store.list_runs() == [], "a refused command queued a run"


@pytest.mark.parametrize("argv,expected", [
    (["-m", "core.train", "--out", "{tmp}/r", "--set", f"seed={HUGE}"], ["seed=", "2**63 - 1"]),
    (["-m", "core.sample", "--prompt", "x", "--out", "{tmp}/x.png", "--resolution", "17"], ["--resolution=17"]),
    (["-m", "jobs", "--home", "{tmp}/h", "worker", "--poll", "-1"], ["--poll=-1.0"]),
], ids=["train-seed", "sample-resolution", "jobs-worker-poll"])
def test_real_subprocess_exit_code_and_message(sandbox, argv, expected):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, *_fill(argv, sandbox)], capture_output=True, text=True, env=env,
                          timeout=120, cwd=sandbox)
    _assert_refused(proc.returncode, proc.stdout + proc.stderr, expected)
    assert not (sandbox / "r").exists() and not (sandbox / "x.png").exists()


# ---- configs (TrainConfig directly, as the web form and the worker build them) -------------------------

CONFIGS = [
    ({"sampling": {"prompts_per_step": 100000}}, "sampling.prompts_per_step"),
    ({"sampling": {"resolution": 1048576}}, "sampling.resolution"),
    ({"model": {"lora_rank": 1000000}}, "model.lora_rank"),
    ({"seed": HUGE}, "seed"),
    ({"steps": 0}, "steps"),
    ({"rewards": ["brightness"] * 40}, "rewards"),
    ({"model": {"name": ""}}, "model.name"),
    ({"prompts": {"split": "validation"}}, "prompts.split"),
    ({"sampling": {"rollout_batch_size": 10**6}}, "sampling.rollout_batch_size"),
    ({"model": {"name": "x" * 1_000_000, "lora_rank": 0}}, "model.lora_rank"),
]


@pytest.mark.parametrize("data,field", CONFIGS, ids=[c[1] + f"-{i}" for i, c in enumerate(CONFIGS)])
def test_config_refuses_naming_the_field(data, field):
    with pytest.raises(ConfigError) as info:
        TrainConfig.from_dict(data)
    assert info.value.field == field
    assert str(info.value).startswith(field + "=") and len(str(info.value)) < 600


# ---- the memory estimate ---------------------------------------------------------------------------

GiB = 1024**3


def test_presets_fit_their_devices_and_a_huge_rollout_does_not():
    from core.limits import host_memory_bytes

    for name in ("tiny", "mini-marble", "mini-weighted-sum"):  # here, on this machine's RAM
        check_fits(preset(name), host_memory_bytes(), "this machine's RAM")
    check_fits(preset("sd35m-paper"), 80 * GiB, "an 80 GB GPU", world_size=16)  # one of the paper's 16 GPUs
    check_fits(preset("sd35m-paper-1gpu"), 80 * GiB, "an 80 GB GPU")
    with pytest.raises(ConfigError) as info:  # all 1152 images of the paper's step on one 80 GB GPU at once
        check_fits(preset("sd35m-paper").with_overrides({"sampling.rollout_batch_size": 0}), 80 * GiB, "80 GB")
    assert info.value.field == "sampling.rollout_batch_size" and "80.0 GiB of 80 GB" in str(info.value)
    big = TrainConfig().with_overrides({"sampling.prompts_per_step": 4096, "sampling.images_per_prompt": 4,
                                        "sampling.resolution": 2048, "nft.micro_batch_size": 16,
                                        "sampling.rollout_batch_size": 16})
    with pytest.raises(ConfigError) as info:
        check_fits(big, 64 * GiB, "64 GiB of RAM")
    assert info.value.field == "sampling.prompts_per_step" and "rollout kept for the update" in str(info.value)


def test_estimate_scales_with_the_batch_and_splits_over_processes():
    cfg = preset("sd35m-paper")
    one, sixteen = estimate_memory(cfg, 1), estimate_memory(cfg, 16)
    assert one["rollout"] == 16 * sixteen["rollout"]  # 1152 vs 72 samples a process
    assert one["weights"] == sixteen["weights"]
    doubled = estimate_memory(cfg.with_overrides({"sampling.images_per_prompt": 48}), 16)
    assert doubled["rollout"] == 2 * sixteen["rollout"]


def test_cpu_run_too_big_for_this_host_is_refused_before_queueing(web_store, monkeypatch):
    from core import limits
    from jobs.runner import submit

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.setattr(limits, "host_memory_bytes", lambda: 1 * GiB)
    cfg = TrainConfig().with_overrides({"sampling.prompts_per_step": 512, "sampling.images_per_prompt": 16,
                                        "sampling.resolution": 512, "model.device": "cpu"})
    with pytest.raises(ConfigError, match=r"sampling\.\w+=\d+: the run would need ~[\d.]+ GiB, more than the 1.0 GiB"):
        submit(web_store, cfg)
    assert web_store.list_runs() == []


# ---- prompts: a megabyte prompt is never copied into rows ---------------------------------------------

def test_prompt_sampler_refuses_a_long_line_naming_file_and_line(tmp_path):
    from core.prompts import PromptSampler

    f = tmp_path / "p.txt"
    f.write_text("a red circle\n" + "z" * 5000 + "\n")
    with pytest.raises(ValueError, match=r"p\.txt:2: a prompt of 5000 characters .* 4096"):
        PromptSampler([f"file:{f}"])


# ---- web handlers ------------------------------------------------------------------------------------

def _form(preset_name="tiny"):
    from app.forms import config_form_values, form_fields

    cfg = preset(preset_name)
    fields = form_fields(cfg)
    *values, rewards, weights, stages, single, sources = config_form_values(cfg, fields)
    return fields, values, rewards, weights, stages, single, sources


def _with(fields, values, **changes):
    return [changes.get(f.path.replace(".", "__"), v) for f, v in zip(fields, values)]


WEB = [
    ("prompts-per-step", dict(sampling__prompts_per_step=100000), None, "sampling.prompts_per_step=100000"),
    ("resolution", dict(sampling__resolution=1048576), None, "sampling.resolution=1048576"),
    ("lora-rank", dict(model__lora_rank=1000000), None, "model.lora_rank=1000000"),
    ("seed", dict(seed=float(HUGE)), None, "seed="),
    ("empty-number", dict(steps=None), None, "steps=None: is empty"),
    ("reward-no-prompts", {}, ["count_accuracy"], "rewards[0].name='count_accuracy': applies to no prompt"),
    ("long-name", {}, "name:" + "n" * 300, "300 characters"),
]


@pytest.mark.parametrize("case,changes,extra,expected", WEB, ids=[w[0] for w in WEB])
def test_new_run_form_refuses_and_queues_nothing(web_store, case, changes, extra, expected):
    from app.pages.new_run import start

    fields, values, rewards, weights, stages, single, sources = _form()
    name = ""
    if isinstance(extra, list):
        rewards = extra
    elif isinstance(extra, str):
        name = extra[len("name:"):]
    error, status = start("tiny", name, rewards, weights, stages, single, sources, fields,
                          _with(fields, values, **changes))
    assert error.startswith("**Not started.**") and expected in error, error
    assert "Traceback" not in error and status == ""
    assert web_store.list_runs() == []


def test_study_refuses_a_reward_without_prompts_before_queueing_any(web_store):
    from app.pages.new_run import start_study

    fields, values, _, weights, stages, single, sources = _form()
    error, status = start_study("tiny", "", ["brightness", "spatial_relation"], weights, stages, single, sources,
                                ["marble", "equal"], 2, fields, values)
    assert "spatial_relation" in error and "applies to no prompt" in error and status == ""
    assert web_store.list_runs() == []


def test_exposed_form_offers_known_models_only_and_refuses_paths(web_store, monkeypatch, tmp_path):
    from app.forms import allowed_models, form_fields
    from app.pages.new_run import start

    monkeypatch.setenv("MARBLE_EXPOSED", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    (tmp_path / "hub" / "models--org--cached" / "snapshots" / "abc").mkdir(parents=True)
    assert allowed_models() == ["mini-world", "tiny", "org/cached"]
    fields = {f.path: f for f in form_fields(preset("tiny"))}
    assert fields["model.name"].kind == "choice" and fields["model.name"].choices == tuple(allowed_models())
    f, values, rewards, weights, stages, single, sources = _form()
    answers = set()
    for probe in ("/etc", "/nonexistent/path", "~/.ssh"):  # same answer whether the path exists or not
        error, _ = start("tiny", "", rewards, weights, stages, single, sources, f,
                         _with(f, values, model__name=probe))
        assert f"model.name={probe!r}" in error
        assert "only known models are offered: mini-world, tiny, org/cached" in error
        answers.add(error.replace(repr(probe), "PROBE"))
    assert len(answers) == 1, answers
    error, _ = start("tiny", "", rewards, weights, stages, single, [*sources, "file:/etc/passwd"], f, values)
    assert "prompts.sources='file:/etc/passwd'" in error and "registered prompt sources" in error
    assert web_store.list_runs() == []


def test_study_csv_stays_in_the_data_directory(web_store, monkeypatch, tmp_path):
    import tempfile

    from app.pages.study import study_csv_path

    path = Path(study_csv_path([3, 1, 2]))
    assert path.parent == web_store.home / "exports" and path.name == "study_1-2-3.csv"
    assert study_csv_path([1, 2, 3]) == str(path)  # re-rendering rewrites one file
    assert not str(path).startswith(tempfile.gettempdir() + os.sep + "marble_study_")
    long = Path(study_csv_path(list(range(1, 200))))
    assert long.parent == path.parent and len(long.name) < 40


# ---- the login --------------------------------------------------------------------------------------

def test_login_locks_a_user_out_after_repeated_failures():
    from app.auth import LockedOut, LoginGuard

    now = [1000.0]
    guard = LoginGuard("ada", "s3cret", max_failures=3, window=60, lockout=120, clock=lambda: now[0])
    assert guard("ada", "s3cret") is True
    assert guard("ada", "wrong") is False and guard("ada", "") is False
    now[0] += 61  # failures older than the window are forgotten
    assert guard("ada", "wrong") is False and guard("ada", "wrong") is False
    assert guard("ada", "wrong") is False  # the 3rd within 60 s: locked
    with pytest.raises(LockedOut) as info:
        guard("ada", "s3cret")  # even the right password, while locked
    assert info.value.status_code == 429 and "locked for 120 more seconds" in info.value.detail
    assert guard("bob", "s3cret") is False  # other names are counted apart
    now[0] += 121
    assert guard("ada", "s3cret") is True


def test_login_lockout_through_http(monkeypatch):
    """Gradio's /login route calls the guard: the 6th try answers 429 with the message."""
    import gradio as gr
    from fastapi.testclient import TestClient

    from app.auth import LoginGuard

    with gr.Blocks() as demo:
        gr.Markdown("hi")
    guard = LoginGuard("ada", "s3cret")
    app, _, _ = demo.launch(auth=guard, prevent_thread_lock=True, server_name="127.0.0.1", server_port=None,
                            quiet=True)
    try:
        client = TestClient(app)
        codes = [client.post("/login", data={"username": "ada", "password": "x"}).status_code for _ in range(5)]
        assert codes == [400] * 5
        locked = client.post("/login", data={"username": "ada", "password": "s3cret"})
        assert locked.status_code == 429 and "Too many failed logins" in locked.json()["detail"]
    finally:
        demo.close()


def test_share_without_login_is_refused(monkeypatch, capsys):
    import app.__main__ as entry

    monkeypatch.setenv("GRADIO_SHARE", "true")
    monkeypatch.delenv("MARBLE_USERNAME", raising=False)
    monkeypatch.delenv("MARBLE_PASSWORD", raising=False)
    monkeypatch.delenv("GRADIO_SERVER_NAME", raising=False)
    assert entry.main() == 2
    assert "GRADIO_SHARE=true" in capsys.readouterr().err
    monkeypatch.delenv("GRADIO_SHARE")
    monkeypatch.setenv("GRADIO_SERVER_PORT", "http")
    assert entry.main() == 2
    assert "GRADIO_SERVER_PORT='http'" in capsys.readouterr().err


def test_corpus_is_large_enough():
    n = len(CASES) + 3 + len(CONFIGS) + len(WEB) + 3
    assert n >= 60, n
    assert json.dumps([c[1] for c in CASES])  # ids are plain strings
