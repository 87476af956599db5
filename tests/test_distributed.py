"""Distributed training (spec §9): 2 gloo processes on CPU under a real torchrun, against a 1-process run.

The slow tests share ONE torchrun launch of tests/distributed_worker.py (2 ranks, one thread each), which
saves per rank the QP decisions, the combined gradients, the LoRA weights, a log of every all-reduce and the
files of a CLI run; the 1-process reference is computed here while the ranks run.
"""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from core.checkpoint import STATE_TENSORS_FILE, load_state, strip_prefix
from core.config import PRESETS, ConfigError, preset
from core.distributed import DistContext, check_batch_split, process_device
from core.launch import torchrun_command
from tests.helpers import small_config

ROOT = Path(__file__).resolve().parents[1]
WORKER_TIMEOUT_S = 480


# ---- launch helpers and validation (fast) ------------------------------------------------------------

def test_one_node_launch_uses_a_standalone_rendezvous_on_a_free_port():
    cmd = torchrun_command(8, module_args=["core.train", "--preset", "tiny", "--out", "runs/a"], python="py")
    assert cmd == ["py", "-m", "torch.distributed.run", "--nproc-per-node=8", "--standalone", "--nnodes=1",
                   "-m", "core.train", "--preset", "tiny", "--out", "runs/a"]


def test_multi_node_launch_names_this_node_and_node_zero():
    cmd = torchrun_command(8, num_nodes=2, node_rank=1, master_addr="10.0.0.5", master_port=29600,
                           module_args=["jobs.job", "7"], python="py")
    assert cmd == ["py", "-m", "torch.distributed.run", "--nproc-per-node=8", "--nnodes=2", "--node-rank=1",
                   "--master-addr=10.0.0.5", "--master-port=29600", "-m", "jobs.job", "7"]


@pytest.mark.parametrize("kwargs, message", [
    (dict(num_processes=0), "num_processes=0: must be an integer >= 1"),
    (dict(num_processes=2, num_nodes=2), "master_addr=None: a run on 2 nodes needs the address of node 0"),
    (dict(num_processes=2, num_nodes=2, node_rank=2, master_addr="h"), "node_rank=2: must be an integer in [0, 1]"),
])
def test_bad_launch_arguments_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        torchrun_command(**kwargs)


def test_the_global_batch_must_split_over_the_processes_and_the_micro_batch_adapts_to_each_share():
    cfg = small_config("marble")  # B = 2 x 4 = 8, micro-batches of 4
    assert check_batch_split(cfg, 1) == 4
    assert check_batch_split(cfg, 2) == 4
    with pytest.raises(ConfigError, match="global batch of 8 samples .* must split evenly over 3 processes"):
        check_batch_split(cfg, 3)
    assert check_batch_split(cfg, 4) == 2  # each process trains 2 samples: one micro-batch of 2
    assert check_batch_split(cfg, 8) == 1


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_splits_into_equal_micro_batches_on_one_and_two_processes(name):
    cfg = preset(name)
    B = cfg.sampling.batch_size
    assert B % cfg.nft.micro_batch_size == 0
    m2 = check_batch_split(cfg, 2)
    assert (B // 2) % m2 == 0 and m2 <= cfg.nft.micro_batch_size


def test_a_pinned_gpu_is_refused_under_torchrun_with_several_processes():
    with pytest.raises(ConfigError, match="model.device='cuda:1': pins all 2 processes to one GPU"):
        process_device("cuda:1", local_rank=0, world_size=2)
    assert process_device("cpu", local_rank=1, world_size=2) == torch.device("cpu")


def test_outside_torchrun_every_collective_is_the_identity():
    ctx = DistContext()
    g, kl = torch.randn(3, 5, dtype=torch.float64), torch.randn(5)
    assert not ctx.active and ctx.is_main
    assert all(a is b for a, b in zip(ctx.all_reduce_mean(g, kl), (g, kl)))
    assert ctx.all_gather_rows(g) is g and ctx.broadcast_flag(True) is True


def test_the_cli_relaunches_itself_under_torchrun_without_its_launch_flags(monkeypatch):
    from core import train as cli

    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(key, raising=False)
    seen = {}

    def fake_execv(path, argv):
        seen["argv"] = argv
        raise SystemExit(0)

    monkeypatch.setattr(os, "execv", fake_execv)
    with pytest.raises(SystemExit):
        cli.main(["--preset", "tiny", "--num-processes", "4", "--out", "runs/a", "--num-nodes=1", "--steps", "3"])
    argv = seen["argv"]
    assert argv[1:6] == ["-m", "torch.distributed.run", "--nproc-per-node=4", "--standalone", "--nnodes=1"]
    assert argv[6:] == ["-m", "core.train", "--preset", "tiny", "--out", "runs/a", "--steps", "3"]


# ---- 2 ranks under torchrun (slow) -------------------------------------------------------------------

class Worker:
    """One torchrun launch of tests/distributed_worker.py; ``results()`` waits for it (bounded)."""

    def __init__(self, out: Path):
        self.out = out
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
        cmd = torchrun_command(2, module_args=["tests.distributed_worker", str(out)])
        self.log = open(out / "torchrun.log", "w")
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True)  # its own process group: killed as one below
        self._results = None

    def results(self) -> tuple[dict, dict]:
        if self._results is None:
            try:
                code = self.proc.wait(timeout=WORKER_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.stop()
                pytest.fail(f"the torchrun worker ran past {WORKER_TIMEOUT_S} s")
            log = (self.out / "torchrun.log").read_text()
            assert code == 0, log[-4000:]
            self._results = tuple(torch.load(self.out / f"rank{r}.pt", weights_only=False) for r in (0, 1))
        return self._results

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.log.close()


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    w = Worker(tmp_path_factory.mktemp("distributed"))
    yield w
    w.stop()


def _flat_lora(state: dict) -> torch.Tensor:
    return torch.cat([state[n].reshape(-1) for n in sorted(state)])


@pytest.mark.slow
def test_two_ranks_equal_one_process_on_the_same_global_batch(worker, tmp_path):
    # harmonize_scope "step": every unit of the step is harmonized and the QP is solved once on the mean of all
    # units' per-reward gradients, so a 2-rank step is exactly a 1-rank step. (With "first_microbatch" each
    # rank harmonizes its own first unit: the QP then sees 2 micro-batches instead of 1, by design.)
    from core.trainer import Trainer
    from tests.distributed_worker import lora, record

    # The ranks take their per-reward gradients from per-sample gradients (the default, two backward passes);
    # the reference takes them from K backward passes: the same step either way.
    single = Trainer(small_config("marble", 1, **{"balance.harmonize_scope": "step", "balance.gradients": "per_reward"}),
                     tmp_path)
    assert single.gradient_path == "per_reward"
    seen = record(single)
    single.train_step(0)
    r0, r1 = (r["step_scope"] for r in worker.results())

    for key in ("alpha_raw", "alpha_ema", "grad_weights"):  # the same QP on both ranks, bit for bit
        assert np.array_equal(r0["decisions"][0][key], r1["decisions"][0][key])
        np.testing.assert_allclose(r0["decisions"][0][key], seen["decisions"][0][key], rtol=0, atol=1e-6)
    g0, g1, g = r0["grads"][0], r1["grads"][0], seen["grads"][0]
    assert torch.equal(g0, g1)  # the combined gradient, before clipping
    assert g.norm() > 1e-6 and float((g0 - g).norm() / g.norm()) < 1e-5
    w0, w1, w = _flat_lora(r0["lora"]), _flat_lora(r1["lora"]), _flat_lora(lora(single))
    assert torch.equal(w0, w1)
    # AdamW's first step moves each weight by ~lr·g/|g|: where g is near 0, the two paths' rounding (1e-7 of
    # the gradient) can show at 1e-7 of a weight; 1e-6 is still 1/300 of one step's move (lr 3e-4).
    torch.testing.assert_close(w0, w, rtol=0, atol=1e-6)
    assert r0["events"] == ["step", "balance"] and r1["events"] == []  # rank 0 alone reports


@pytest.mark.slow
def test_first_microbatch_marble_keeps_alpha_and_weights_identical_on_both_ranks(worker):
    r0, r1 = (r["first_microbatch"] for r in worker.results())
    assert len(r0["decisions"]) == 1  # step 0 harmonized, step 1 amortized with ᾱ
    for key in ("alpha_raw", "alpha_ema", "grad_weights"):
        assert np.array_equal(r0["decisions"][0][key], r1["decisions"][0][key])
    alpha = r0["decisions"][0]["alpha_raw"]
    assert np.all(alpha >= -1e-9) and alpha.sum() == pytest.approx(1.0)
    assert all(torch.equal(a, b) for a, b in zip(r0["grads"], r1["grads"], strict=True))
    assert torch.equal(_flat_lora(r0["lora"]), _flat_lora(r1["lora"]))
    assert torch.equal(_flat_lora(r0["old"]), _flat_lora(r1["old"]))


@pytest.mark.slow
def test_per_reward_gradients_never_trigger_ddp_sync_only_one_stacked_all_reduce(worker):
    for r in worker.results():
        fm = r["first_microbatch"]
        K, P, log = fm["num_rewards"], fm["num_trainable"], fm["all_reduces"]
        # each rank: 4 samples = 1 micro-batch x 3 timesteps = units 0-2 (step 0) and 3-5 (step 1)
        assert not [e for e in log if e["in_grads"]]  # nothing is reduced inside a per-reward gradient
        stacked = [e for e in log if not e["ddp"] and e["numel"] > 2]
        # exactly one stacked all-reduce: g_1..g_K, ∇KL and the K losses, in the harmonized unit
        assert stacked == [{"unit": 0, "numel": (K + 1) * P + K, "in_grads": False, "ddp": False}]
        ddp = [e for e in log if e["ddp"]]
        assert {e["unit"] for e in ddp} == {2, 5}  # DDP reduces only at each step's last (ordinary) backward
        assert all(sum(e["numel"] for e in ddp if e["unit"] == u) == P for u in (2, 5))  # every LoRA weight once
        assert [e["unit"] for e in log if not e["ddp"] and e["numel"] == 2] == [2, 5]  # loss/KL for the log
        assert len(log) == len(stacked) + len(ddp) + 2


@pytest.mark.slow
def test_only_rank_zero_writes_and_a_distributed_resume_repeats_the_uninterrupted_run(worker):
    r0, r1 = worker.results()
    assert r0["cli_exit"] == r1["cli_exit"] == 0 and r0["cli_resume_exit"] == r1["cli_resume_exit"] == 0
    run = worker.out / "cli"
    evs = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
    assert [e["step"] for e in evs if e["event"] == "step"] == [1, 2]  # written once: rank 1 wrote nothing
    assert evs[0]["event"] == "start" and evs[0]["world_size"] == 2
    for step in (1, 2):
        pngs = sorted((run / "samples" / f"step_{step:06d}").glob("*.png"))
        assert len(pngs) == 4  # rank 0's share of the 8 samples
        (samples,) = [e for e in evs if e["event"] == "samples" and e["step"] == step]
        assert sorted(Path(it["path"]).name for it in samples["items"]) == [p.name for p in pngs]
    assert not list(run.glob("checkpoints/.tmp*"))
    straight_t, straight = load_state(run / "checkpoints" / "step_000002")
    resumed_t, resumed = load_state(worker.out / "cli_resumed" / "checkpoints" / "step_000002")
    for which in ("policy/", "old/"):
        a, b = strip_prefix(which, resumed_t), strip_prefix(which, straight_t)
        torch.testing.assert_close(_flat_lora(a), _flat_lora(b), rtol=0, atol=1e-7)
    assert resumed["balancer"] == straight["balancer"]


@pytest.mark.slow
def test_a_stop_requested_on_rank_zero_stops_every_rank_after_the_same_step(worker):
    r0, r1 = worker.results()
    assert r0["stopped"] == r1["stopped"] == {"status": "stopped", "step": 1}
    assert (worker.out / "stopped" / "checkpoints" / "step_000001" / STATE_TENSORS_FILE).is_file()
