"""Single process or ``torchrun``: the rank/world/device of this process and the few collectives
the trainer needs (gloo on CPU, NCCL on CUDA)."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as torch_dist
from torch import Tensor

__all__ = ["DistContext", "init_distributed"]


@dataclass
class DistContext:
    rank: int = 0
    world: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")
    owns_group: bool = False  # we created the process group, so we tear it down

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world > 1

    def all_reduce_sum(self, t: Tensor) -> Tensor:
        if self.enabled:
            torch_dist.all_reduce(t, op=torch_dist.ReduceOp.SUM)
        return t

    def barrier(self) -> None:
        if self.enabled:
            torch_dist.barrier()

    def close(self) -> None:
        if self.owns_group and torch_dist.is_initialized():
            torch_dist.destroy_process_group()
            self.owns_group = False


def init_distributed(device: str = "auto") -> DistContext:
    """Read torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK); join the process group if there
    is more than one process.  ``device``: "auto" (CUDA when available), "cpu" or "cuda"."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    use_cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    if use_cuda and not torch.cuda.is_available():
        raise RuntimeError("device=cuda but torch sees no CUDA device")
    dev = torch.device("cuda", local) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(dev)
    owns = False
    if world > 1 and not torch_dist.is_initialized():
        torch_dist.init_process_group("nccl" if use_cuda else "gloo")
        owns = True
    return DistContext(rank, world, local, dev, owns)
