"""Data-parallel training under torchrun: the process group and the few collectives MARBLE needs (spec §9).

Each of the W processes generates, scores and trains its share (B/W samples) of the step's global batch.
The communication of one step, in order:
- ``all_gather_rows`` of the rewards R, so the advantages' group means and std use the whole batch (§3);
- ``broadcast_flag`` of rank 0's stop flag before every unit, so every process stops at the same unit;
- on a harmonized unit (or step): ONE ``all_reduce_mean`` of the stacked per-reward gradients g_1..g_K,
  ∇KL and the K losses, each computed under DDP's ``no_sync()``; every process then solves the same QP
  on the same Gram matrix and writes the same combined gradient into ``.grad`` (§4);
- DDP's own bucketed all-reduce at the step's last ordinary backward: the amortized part (§5);
- one ``all_reduce_mean`` of two logging scalars (loss, KL).
Outside torchrun ``setup`` returns an inactive context and every helper is the identity.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from core.config import ConfigError, TrainConfig
from core.launch import launched_by_torchrun
from core.models import resolve_device


@dataclass
class DistContext:
    """Where this process stands in the run. ``active``: a process group exists (torchrun, even with W=1)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")
    active: bool = False
    owns_group: bool = False  # this context started the process group and destroys it in close()

    @property
    def is_main(self) -> bool:
        """Rank 0: the one process that emits events and writes samples and checkpoints."""
        return self.rank == 0

    @property
    def comm_device(self) -> torch.device:
        """NCCL communicates CUDA tensors; gloo CPU ones."""
        return self.device if self.active and dist.get_backend() == "nccl" else torch.device("cpu")

    # ---- collectives (the identity when inactive) --------------------------------------------------
    def all_gather_rows(self, x: torch.Tensor) -> torch.Tensor:
        """[n, ...] on every process -> [W·n, ...], rank 0's rows first (same n on every process)."""
        if not self.active:
            return x
        local = x.to(self.comm_device).contiguous()
        parts = [torch.empty_like(local) for _ in range(self.world_size)]
        dist.all_gather(parts, local)
        return torch.cat(parts).to(x.device)

    def all_reduce_mean(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The mean over processes of each tensor, with ONE all-reduce of them flattened and stacked."""
        if not self.active:
            return tensors
        flat = torch.cat([t.reshape(-1).to(self.comm_device, torch.float64) for t in tensors])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        flat /= self.world_size
        out, offset = [], 0
        for t in tensors:
            out.append(flat[offset:offset + t.numel()].view_as(t).to(t.device, t.dtype))
            offset += t.numel()
        return tuple(out)

    def broadcast_flag(self, value: bool) -> bool:
        """Rank 0's ``value`` on every process."""
        if not self.active:
            return value
        flag = torch.tensor([1 if value else 0], dtype=torch.int32, device=self.comm_device)
        dist.broadcast(flag, src=0)
        return bool(flag.item())

    def broadcast_object(self, obj):
        """Rank 0's (picklable) ``obj`` on every process."""
        if not self.active:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def all_gather_objects(self, obj) -> list:
        if not self.active:
            return [obj]
        out = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    def barrier(self) -> None:
        if self.active:
            dist.barrier()

    # ---- DDP ---------------------------------------------------------------------------------------
    def wrap(self, module: torch.nn.Module) -> torch.nn.Module:
        """DistributedDataParallel over the module's trainable parameters (the LoRA adapter).

        The frozen base weights and the buffers are constants loaded from the same files on every process:
        DDP is told to ignore them, so it neither broadcasts them (at start or per forward) nor builds
        buckets for them. Inactive: the module itself.
        """
        if not self.active:
            return module
        constants = [name for name, p in module.named_parameters() if not p.requires_grad]
        constants += [name for name, _ in module.named_buffers()]
        torch.nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(module, constants)
        device_ids = [self.device.index] if self.device.type == "cuda" else None
        return torch.nn.parallel.DistributedDataParallel(module, device_ids=device_ids)

    @staticmethod
    def sync_context(module: torch.nn.Module, sync: bool):
        """``module.no_sync()`` unless ``sync`` (DDP), else nothing: the forward AND backward of a unit run in it."""
        if sync or not isinstance(module, torch.nn.parallel.DistributedDataParallel):
            return contextlib.nullcontext()
        return module.no_sync()

    def close(self) -> None:
        """Destroy the process group if this context started it."""
        if self.owns_group and dist.is_initialized():
            dist.destroy_process_group()
        self.owns_group = False


def process_device(device: str, local_rank: int, world_size: int) -> torch.device:
    """The device of one process under torchrun: ``cuda:LOCAL_RANK`` for "auto" (with CUDA) and "cuda"."""
    if device.startswith("cuda:") and world_size > 1:
        raise ConfigError("model.device", device, f"pins all {world_size} processes to one GPU; under torchrun use "
                                                  f"'auto' or 'cuda' (each process takes cuda:LOCAL_RANK) or 'cpu'")
    if device == "cpu" or (device == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if device in ("auto", "cuda"):
        resolve_device("cuda")  # a clear error when CUDA is missing
        return torch.device("cuda", local_rank)
    return resolve_device(device)


def setup(device: str = "auto") -> DistContext:
    """Join the run's process group when torchrun launched this process, or use one the caller started.

    Backend: NCCL when the process's device is CUDA, gloo on CPU. Outside torchrun (and without a
    group): an inactive single-process context on ``resolve_device(device)``.
    """
    if not dist.is_available() or not (dist.is_initialized() or launched_by_torchrun()):
        return DistContext(device=resolve_device(device))
    owns = not dist.is_initialized()
    world_size = dist.get_world_size() if not owns else int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    dev = process_device(device, local_rank, world_size)
    if owns:
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        dist.init_process_group("nccl" if dev.type == "cuda" else "gloo",
                                device_id=dev if dev.type == "cuda" else None)
    return DistContext(rank=dist.get_rank(), world_size=dist.get_world_size(), local_rank=local_rank, device=dev,
                       active=True, owns_group=owns)


def check_batch_split(config: TrainConfig, world_size: int) -> int:
    """The micro-batch size each of ``world_size`` processes trains with (raises ConfigError when the global
    batch B does not split into W equal shares).

    A step's micro-batches are consecutive runs of one permutation of the B samples; each process takes
    B/W consecutive samples of it, in micro-batches of equal size. When the configured
    ``nft.micro_batch_size`` does not divide a process's share, the share is split into the largest equal
    micro-batches no bigger than the configured one (e.g. B = 48 on 4 processes with micro-batches of 24:
    each process trains its 12 samples as one micro-batch of 12), so every preset runs on W processes.
    """
    s, m = config.sampling, config.nft.micro_batch_size
    B = s.batch_size
    if B % world_size:
        raise ConfigError("sampling.prompts_per_step", s.prompts_per_step,
                          f"the global batch of {B} samples ({s.prompts_per_step} prompts × {s.images_per_prompt} "
                          f"images) must split evenly over {world_size} processes; choose prompts_per_step × "
                          f"images_per_prompt divisible by {world_size}")
    share = B // world_size
    return max(d for d in range(1, min(m, share) + 1) if share % d == 0)
