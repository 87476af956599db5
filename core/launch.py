"""Launching a run on several processes with torchrun, without importing torch (the job runner calls this).

A distributed run is W = num_processes × num_nodes copies of the same command; torchrun starts them and
sets RANK, WORLD_SIZE and LOCAL_RANK in each one's environment (``core.distributed`` reads them).

- one node: ``--standalone`` — torchrun picks a free local port, so several runs can share a host;
- several nodes: static rendezvous — run the same command on every node with its own ``node_rank``;
  ``master_addr:master_port`` is node 0, reachable from all nodes. The run folder must be on a file
  system every node sees (rank 0 writes it; every rank reads the checkpoint on resume).
"""

from __future__ import annotations

import os
import sys

TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK")


def torchrun_command(num_processes: int, num_nodes: int = 1, node_rank: int = 0, master_addr: str | None = None,
                     master_port: int = 29500, module_args: list[str] | tuple[str, ...] = ("core.train",),
                     python: str = sys.executable) -> list[str]:
    """The command line that runs ``python -m <module_args>`` as ``num_processes`` processes on this node.

    ``module_args`` is the module and its arguments, e.g. ``["core.train", "--preset", "tiny", "--out", "runs/a"]``.
    Raises ValueError naming the bad argument.
    """
    def _int(x) -> bool:
        return isinstance(x, int) and not isinstance(x, bool)

    if not (_int(num_processes) and num_processes >= 1):
        raise ValueError(f"num_processes={num_processes!r}: must be an integer >= 1 (processes per node, "
                         f"usually one per GPU)")
    if not (_int(num_nodes) and num_nodes >= 1):
        raise ValueError(f"num_nodes={num_nodes!r}: must be an integer >= 1")
    if not (_int(node_rank) and 0 <= node_rank < num_nodes):
        raise ValueError(f"node_rank={node_rank!r}: must be an integer in [0, {num_nodes - 1}] "
                         f"(this node's place among {num_nodes} nodes)")
    if not (_int(master_port) and 1 <= master_port <= 65535):
        raise ValueError(f"master_port={master_port!r}: must be a TCP port in [1, 65535]")
    if not module_args or not isinstance(module_args[0], str) or module_args[0].startswith("-"):
        raise ValueError(f"module_args={list(module_args)!r}: must start with a module name, e.g. core.train")
    launcher = [python, "-m", "torch.distributed.run", f"--nproc-per-node={num_processes}"]
    if num_nodes == 1:
        launcher += ["--standalone", "--nnodes=1"]
    else:
        if not master_addr:
            raise ValueError(f"master_addr={master_addr!r}: a run on {num_nodes} nodes needs the address of node 0, "
                             f"reachable from every node")
        launcher += [f"--nnodes={num_nodes}", f"--node-rank={node_rank}", f"--master-addr={master_addr}",
                     f"--master-port={master_port}"]
    return [*launcher, "-m", *module_args]


def launched_by_torchrun() -> bool:
    """True in a process that torchrun started (it sets RANK, WORLD_SIZE and LOCAL_RANK)."""
    return all(k in os.environ for k in TORCHRUN_ENV)


def launch_rank() -> int:
    """This process's global rank as torchrun set it (0 outside torchrun). Rank 0 alone writes files."""
    return int(os.environ.get("RANK", "0")) if launched_by_torchrun() else 0
