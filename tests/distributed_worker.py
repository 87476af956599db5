"""Run under torchrun by tests/test_distributed.py (not a test module): every rank trains the tiny model
through a few scenarios and saves what the tests compare to OUT/rank{R}.pt.

    python -m torch.distributed.run --standalone --nproc-per-node=2 -m tests.distributed_worker OUT
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from core import train as cli
from core.trainer import Trainer, train
from tests.helpers import small_config

# The tiny model on 2 ranks: B = 2 prompts x 4 images = 8, 4 samples per rank in one micro-batch, 3 timesteps.
SMALL_CLI = ["--preset", "tiny", "--quiet", "--set", "sampling.num_steps=4", "--set", "sampling.prompts_per_step=2",
             "--set", "sampling.images_per_prompt=4", "--set", "nft.micro_batch_size=4", "--set", "num_threads=1"]


def lora(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in trainer.policy.named_trainable.items()}


def record(trainer: Trainer) -> dict:
    """Wrap the trainer so that each step's QP decisions and combined gradient (before clipping) are kept."""
    seen = {"decisions": [], "grads": []}
    balance, clip_and_step = trainer.balancer.balance, trainer._clip_and_step

    def balance_recorded(gram, step):
        decision = balance(gram, step)
        seen["decisions"].append({"alpha_raw": decision.alpha_raw.copy(), "alpha_ema": decision.alpha_ema.copy(),
                                  "grad_weights": decision.grad_weights.copy()})
        return decision

    def clip_and_step_recorded(step):
        seen["grads"].append(torch.cat([p.grad.reshape(-1) for p in trainer.params]).clone())
        return clip_and_step(step)

    trainer.balancer.balance = balance_recorded
    trainer._clip_and_step = clip_and_step_recorded
    return seen


def count_all_reduces(trainer: Trainer) -> tuple[list[dict], callable]:
    """Log every dist.all_reduce with where it ran: inside a per-reward gradient (trainer._grads), inside DDP's
    bucket reduction (a comm hook that delegates to DDP's default all-reduce), and the unit it ran in."""
    log: list[dict] = []
    where = {"unit": -1, "in_grads": False, "ddp": False}
    real = dist.all_reduce

    def all_reduce(tensor, *args, **kwargs):
        log.append({"unit": where["unit"], "numel": tensor.numel(), "in_grads": where["in_grads"],
                    "ddp": where["ddp"]})
        return real(tensor, *args, **kwargs)

    def ddp_hook(state, bucket):
        where["ddp"] = True
        try:
            return default_hooks.allreduce_hook(None, bucket)  # calls dist.all_reduce: logged
        finally:
            where["ddp"] = False

    grads, forward = trainer._grads, trainer._forward

    def grads_logged(*args, **kwargs):
        where["in_grads"] = True
        try:
            return grads(*args, **kwargs)
        finally:
            where["in_grads"] = False

    def forward_counted(*args, **kwargs):
        where["unit"] += 1
        return forward(*args, **kwargs)

    dist.all_reduce = all_reduce
    trainer.policy.train_module.register_comm_hook(None, ddp_hook)
    trainer._grads, trainer._forward = grads_logged, forward_counted

    def restore():
        dist.all_reduce = real

    return log, restore


def main(out: Path) -> None:
    dist.init_process_group("gloo")  # the trainers below join this group and leave it open
    rank = dist.get_rank()
    results: dict = {"rank": rank, "world_size": dist.get_world_size()}

    # 1. One harmonized step with harmonize_scope "step": compared with a 1-process run by the test.
    events: list = []
    trainer = Trainer(small_config("marble", 1, **{"balance.harmonize_scope": "step"}), out / "unused", events.append)
    seen = record(trainer)
    trainer.train_step(0)
    results["step_scope"] = {**seen, "lora": lora(trainer), "events": [e.kind for e in events]}

    # 2. MARBLE with the authors' refresh scope: a full step (first unit harmonized) then an amortized one,
    #    with every all-reduce logged. No warm-up step: a warm-up step harmonizes every unit.
    trainer = Trainer(small_config("marble", 2, **{"balance.warmup_steps": 0}), out / "unused")
    seen = record(trainer)
    log, restore = count_all_reduces(trainer)
    for step in range(2):
        trainer.train_step(step)
    restore()
    results["first_microbatch"] = {**seen, "lora": lora(trainer), "old": dict(trainer.policy.old),
                                   "all_reduces": log, "num_trainable": trainer.policy.num_trainable,
                                   "num_rewards": len(trainer.reward_names)}

    # 3. The CLI on every rank: 2 steps with checkpoints and samples, then a resume from step 1.
    run = out / "cli"
    results["cli_exit"] = cli.main([*SMALL_CLI, "--out", str(run), "--steps", "2", "--set", "checkpoint_every=1",
                                    "--set", "sample_every=1"])
    results["cli_resume_exit"] = cli.main([*SMALL_CLI, "--out", str(out / "cli_resumed"), "--steps", "2",
                                           "--resume", str(run / "checkpoints" / "step_000001")])

    # 4. A stop requested on rank 0 only: both ranks stop after the same step.
    steps_done: list = []
    stop = (lambda: len(steps_done) >= 1) if rank == 0 else (lambda: False)
    result = train(small_config("marble", 5), out / "stopped",
                   on_event=lambda e: steps_done.append(e.step) if e.kind == "step" else None, should_stop=stop)
    results["stopped"] = {"status": result.status, "step": result.step}

    torch.save(results, out / f"rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    main(Path(sys.argv[1]))
