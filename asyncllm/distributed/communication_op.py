"""The collectives of tensor-parallel models, over the world group; with one rank each is the
identity and costs nothing."""

from __future__ import annotations

import torch
import torch.distributed as dist

from asyncllm.distributed.parallel_state import get_tensor_model_parallel_world_size


def tensor_model_parallel_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """The sum of x over the ranks, in place."""
    if get_tensor_model_parallel_world_size() == 1:
        return x
    dist.all_reduce(x)
    return x


def tensor_model_parallel_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """The ranks' x concatenated along dim, rank 0's first."""
    world_size = get_tensor_model_parallel_world_size()
    if world_size == 1:
        return x
    x = x.contiguous()
    if x.is_cuda:
        # one buffer, one NCCL call (gloo has no all_gather_into_tensor)
        stacked = torch.empty((world_size, *x.shape), dtype=x.dtype, device=x.device)
        dist.all_gather_into_tensor(stacked, x)
        parts = stacked.unbind(0)
    else:
        parts = [torch.empty_like(x) for _ in range(world_size)]
        dist.all_gather(parts, x)
    return torch.cat(parts, dim=dim)


def tensor_model_parallel_min(value: int) -> int:
    """The smallest of the ranks' values (on the host)."""
    if get_tensor_model_parallel_world_size() == 1:
        return value
    backend = dist.get_backend()
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else "cpu"
    tensor = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MIN)
    return int(tensor.item())
