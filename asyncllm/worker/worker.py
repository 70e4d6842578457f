"""What makes a process (or Ray actor) one tensor-parallel rank before its model runner is
built: its device, its place in the engine's torch.distributed world, its random state."""

from __future__ import annotations

import dataclasses
import os

import torch

from asyncllm.config import EngineConfig
from asyncllm.distributed.parallel_state import DistributedInit, init_distributed


def init_worker(config: EngineConfig, init: DistributedInit, local_rank: int) -> EngineConfig:
    """Joins the world; the config this rank's model runner is built from (its own GPU)."""
    device = config.model.device
    if device.type == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        # NVLink multicast (NVLS) stays off unless the operator turns it on
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    else:
        # the ranks share this machine's cores
        torch.set_num_threads(max(1, torch.get_num_threads() // init.world_size))
    init_distributed(init)
    # every rank samples the same ids from the same gathered logits, so the unseeded requests'
    # fresh seeds must come from the same generator state on each
    torch.manual_seed(config.model.seed)
    model = dataclasses.replace(config.model, device=device)
    return dataclasses.replace(config, model=model)
