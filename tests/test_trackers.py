"""report_to: the job mirrors its scalars and samples to wandb / TensorBoard / trackio / MLflow (jobs.trackers).
Each tracker's offline output is read back with the tracker's own reader and must hold the store's numbers at
the same steps; a tracker that raises or hangs never stops nor blocks training."""

import glob
import json
import logging
import os
import struct
import threading
from pathlib import Path

import pytest

from core.config import ConfigError, TrainConfig, preset
from core.events import BalanceEvent, StepEvent
from jobs import schema as s
from jobs import trackers as trk
from jobs.runner import submit
from jobs.storage import Store
from tests.helpers import small_config

REWARDS = ["jpeg_compressibility", "colorfulness", "brightness"]


def test_report_to_is_validated_naming_field_value_and_choices():
    assert preset("tiny").report_to == []
    with pytest.raises(ConfigError) as e:
        preset("tiny").with_overrides({"report_to": ["wandb", "comet"]})
    assert str(e.value) == ("report_to=['wandb', 'comet']: must be a list of distinct trackers; valid choices: "
                            "wandb, tensorboard, trackio, mlflow")
    with pytest.raises(ConfigError, match="report_to='mlflow'"):
        preset("tiny").with_overrides({"report_to": "mlflow"})
    with pytest.raises(ConfigError, match="distinct"):
        preset("tiny").with_overrides({"report_to": ["mlflow", "mlflow"]})
    cfg = preset("tiny").with_overrides({"report_to": ["tensorboard", "mlflow"]})
    assert TrainConfig.from_json(cfg.to_json()).report_to == ["tensorboard", "mlflow"]


def test_new_run_form_offers_report_to_as_a_multiselect():
    from app.forms import build_config, form_fields

    field = next(f for f in form_fields(preset("tiny")) if f.path == "report_to")
    assert (field.kind, field.default, field.choices) == ("multi", [], ("wandb", "tensorboard", "trackio", "mlflow"))
    assert "requirements-trackers.txt" in field.help
    cfg = build_config("tiny", {"report_to": ["trackio"]}, REWARDS, "", "", None, ["tiny"])
    assert cfg.report_to == ["trackio"]


def _step(step):
    return StepEvent(step=step, rewards={r: step + i for i, r in enumerate(REWARDS)}, alpha={r: 1 / 3 for r in REWARDS},
                     seconds=0.1, loss=1.0, kl=float("nan"), grad_norm=0.5, phase="amortized")


def _balance(step, cos):
    return BalanceEvent(step=step, alpha_raw={r: 0.5 for r in REWARDS}, alpha_ema={r: 0.4 for r in REWARDS},
                        cosine={"names": REWARDS, "matrix": [[1, 0.2, -0.1], [0.2, 1, 0.3], [-0.1, 0.3, 1]]},
                        cos_to_update={r: cos for r in REWARDS}, grad_norms={r: 2.0 for r in REWARDS},
                        valid={r: True for r in REWARDS}, solver="x", phase="harmonized", update_norm=1.5)


class Gate:
    """A tracker whose writes wait until the gate opens: the mirror must not wait with it."""

    name = "gate"
    opened = threading.Event()

    def __init__(self):
        self.records = []

    def start(self, *a):
        pass

    def log(self, step, scalars, images):
        Gate.opened.wait(60)
        self.records.append((step, scalars))

    def finish(self):
        self.records.append("finished")


class Broken:
    name = "broken"
    calls = 0

    def start(self, *a):
        pass

    def log(self, *a):
        Broken.calls += 1
        raise OSError("disk full")

    def finish(self):
        raise AssertionError("a dropped tracker is not finished")


def test_mirror_never_waits_for_a_hung_tracker_and_drops_a_failing_one(tmp_path, caplog):
    mirror = trk.TrackerMirror(["gate", "broken"], tmp_path, "r", {}, trackers={"gate": Gate, "broken": Broken})
    with caplog.at_level(logging.ERROR, logger="jobs.trackers"):
        for step in (1, 2, 3):  # the gate is closed: these calls return only because they never wait
            mirror(_step(step))
        mirror(_balance(3, -0.2))
        Gate.opened.set()
        mirror.close()
    gate = mirror.trackers["gate"]
    assert [r[0] for r in gate.records[:-1]] == [1, 2, 3, 3] and gate.records[-1] == "finished"
    step1, bal = gate.records[0][1], gate.records[3][1]
    assert step1["reward/colorfulness"] == 2 and "kl" not in step1  # NaN (not applicable) is not sent
    assert bal["cos/jpeg_compressibility-vs-brightness"] == -0.1 and bal["alpha_raw/brightness"] == 0.5
    assert bal["conflict/rate"] == 1.0 and bal["conflict/min_cos_to_update"] == -0.2
    assert Broken.calls == 1 and "broken" not in mirror.trackers and "disk full" in mirror.failed["broken"]
    assert sum("tracker broken failed" in r.message for r in caplog.records) == 1


@pytest.mark.slow
def test_a_tracker_that_raises_never_fails_the_job(tmp_path, monkeypatch):
    class Raising(Broken):
        def start(self, *a):
            raise RuntimeError("login refused")

    seen = []

    class Recording(Gate):
        def log(self, step, scalars, images):
            seen.append((step, sorted(scalars), len(images)))

    monkeypatch.setattr(trk, "TRACKER_CLASSES", {"wandb": Raising, "mlflow": Recording})
    store = Store.open(tmp_path / "home")
    run_id = submit(store, small_config(steps=2, sample_every=2, report_to=["wandb", "mlflow"]), immediate=True)
    assert store.get_run(run_id).status == s.SUCCEEDED
    assert [x[0] for x in seen if "loss" in x[1]] == [1, 2]
    assert any(x[2] > 0 for x in seen)  # sample images
    log = store.log_tail(run_id, 200)
    assert log.count("tracker wandb failed to start (RuntimeError: login refused)") == 1 and "run 1 succeeded" in log
    store.close()


# ---- the real trackers, offline, read back with their own readers ------------------------------------------

INSTALLED = [n for n in ("wandb", "tensorboard", "trackio", "mlflow")
             if __import__("importlib").util.find_spec(n) is not None]


@pytest.fixture(scope="module")
def tracked_run(tmp_path_factory):
    """One tiny 2-step run mirrored to every installed tracker (offline stores under tmp)."""
    if not INSTALLED:
        pytest.skip("no tracker installed (pip install -r requirements-trackers.txt; `make test` does)")
    tmp = tmp_path_factory.mktemp("trackers")
    env = {"TRACKIO_DIR": str(tmp / "trackio"), "WANDB_MODE": "offline", "WANDB_SILENT": "true",
           "MLFLOW_TRACKING_URI": None, "WANDB_DIR": None}
    saved = {k: os.environ.get(k) for k in env}
    for k, v in env.items():
        os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
    try:
        import trackio.utils  # noqa: F401 - its store folder is fixed at import: TRACKIO_DIR must be set first

        if Path(trackio.utils.TRACKIO_DIR) != tmp / "trackio":
            pytest.skip("trackio was imported earlier in this process with another TRACKIO_DIR")
    except ImportError:
        pass
    store = Store.open(tmp / "home")
    try:
        run_id = submit(store, small_config(steps=2, sample_every=2, report_to=INSTALLED), name="tracked",
                        immediate=True)
        assert store.get_run(run_id).status == s.SUCCEEDED, store.log_tail(run_id, 50)
        expected = {k: dict(zip(*v)) for k, v in store.metrics(run_id).by_key().items()}
        for row in store.balance(run_id):
            for r, v in row["alpha_raw"].items():
                expected.setdefault(f"alpha_raw/{r}", {})[row["step"]] = v
        yield store, run_id, expected
    finally:
        store.close()
        for k, v in saved.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)


def _check(expected, got: dict[str, dict[int, float]]):
    for key in ("reward/colorfulness", "alpha/brightness", "loss", "grad_norm", "alpha_raw/jpeg_compressibility"):
        assert got[key] == pytest.approx(expected[key]), key
    assert sorted(got["reward/colorfulness"]) == [1, 2] and sorted(got["alpha_raw/jpeg_compressibility"]) == [1]
    assert "reward_grad_norm/colorfulness" in got and "conflict/rate" in got


def _need(name):
    if name not in INSTALLED:
        pytest.skip(f"{name} is not installed (pip install -r requirements-trackers.txt; `make test` does)")


@pytest.mark.slow
def test_tensorboard_event_files_hold_the_scalars(tracked_run):
    _need("tensorboard")
    from tensorboard.backend.event_processing import event_accumulator

    store, run_id, expected = tracked_run
    acc = event_accumulator.EventAccumulator(str(store.run_dir(run_id) / "trackers" / "tensorboard"),
                                             size_guidance={"scalars": 0, "images": 0})
    acc.Reload()
    got = {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}
    _check(expected, got)
    assert [e.step for e in acc.Images("samples/0")] == store.sample_steps(run_id) == [1, 2]


@pytest.mark.slow
def test_mlflow_file_store_holds_the_scalars(tracked_run):
    _need("mlflow")
    from mlflow.tracking import MlflowClient

    store, run_id, expected = tracked_run
    client = MlflowClient(tracking_uri=(store.run_dir(run_id) / "trackers" / "mlruns").resolve().as_uri())
    (run,) = client.search_runs([client.get_experiment_by_name("marble-studio").experiment_id])
    assert run.info.run_name == "tracked" and run.info.status == "FINISHED"
    got = {k: {m.step: m.value for m in client.get_metric_history(run.info.run_id, k)} for k in run.data.metrics}
    _check(expected, got)
    assert any(a.path.startswith("samples") for a in client.list_artifacts(run.info.run_id))


@pytest.mark.slow
def test_trackio_local_store_holds_the_scalars(tracked_run):
    _need("trackio")
    from trackio.sqlite_storage import SQLiteStorage

    _, _, expected = tracked_run
    got: dict[str, dict[int, float]] = {}
    for row in SQLiteStorage.get_logs("marble-studio", "tracked"):
        for k, v in row.items():
            if isinstance(v, (int, float)) and k not in ("step",):
                got.setdefault(k, {})[row["step"]] = v
    _check(expected, got)


def _wandb_history(path: str) -> list[dict]:
    """History rows of a wandb offline run file. wandb 0.31 ships no Python reader for .wandb files (its Go core
    reads them), so this walks the file's record framing (LevelDB log format: 32 KiB blocks, 7-byte headers,
    after the 7-byte ':W&B' file header) and parses each record with wandb's own protobuf ``Record``."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = Path(path).read_bytes()
    assert data[:4] == b":W&B"
    pos, block, rows, chunk = 7, 32768, [], b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:
            pos += block - pos % block
            continue
        length, kind = struct.unpack("<HB", data[pos + 4:pos + 7])
        if kind == 0:
            break
        chunk += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a full record, or the last piece of one
            record = pb.Record()
            record.ParseFromString(chunk)
            chunk = b""
            if record.WhichOneof("record_type") == "history":
                rows.append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item})
    return rows


@pytest.mark.slow
def test_wandb_offline_run_holds_the_scalars(tracked_run):
    _need("wandb")
    store, run_id, expected = tracked_run
    (path,) = glob.glob(str(store.run_dir(run_id) / "trackers" / "wandb" / "offline-run-*" / "run-*.wandb"))
    got: dict[str, dict[int, float]] = {}
    for row in _wandb_history(path):
        for k, v in row.items():
            if isinstance(v, (int, float)):
                got.setdefault(k, {})[row["_step"]] = v
    _check(expected, got)
    assert glob.glob(str(Path(path).parent / "files" / "media" / "images" / "samples_2_*.png"))
