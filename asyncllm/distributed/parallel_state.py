"""The tensor-parallel group: every worker of an engine is one rank of one torch.distributed
world (gloo on CPU, NCCL on CUDA), so the world is the tensor-parallel group and torch.distributed
holds the only state. A process that never joined a world is one rank of one."""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist

# a collective that waits this long means a peer is gone; the executor notices far sooner
_COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=10)


@dataclass(frozen=True)
class DistributedInit:
    """What one worker needs to join its engine's world."""

    world_size: int
    rank: int
    init_method: str  # tcp://host:port of rank 0's rendezvous
    backend: str  # gloo | nccl


def init_distributed(init: DistributedInit) -> None:
    dist.init_process_group(
        init.backend,
        init_method=init.init_method,
        world_size=init.world_size,
        rank=init.rank,
        timeout=_COLLECTIVE_TIMEOUT,
    )


def destroy_distributed() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def get_tensor_model_parallel_world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def get_tensor_model_parallel_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"
