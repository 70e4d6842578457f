"""FusedMoE: the experts of one layer, their weights stacked [E, ...] for the grouped GEMM.

A model's shared experts (DeepSeek's: an MLP every token goes through, of n_shared times an
expert's inner size) are stacked after the routed ones as that many more experts, each a slice
of the MLP's inner dimension, and every token is routed to them at weight 1: an MLP is the sum
of its inner slices' MLPs, so the fused MoE computes it with the routed experts, in the same
launches (at batch 1: four launches a layer fewer: the MLP's two GEMMs, its activation, the add).

Under tensor parallelism each rank holds a slice of every expert's inner dimension (the columns
of gate/up, the rows' inputs of down); its output is then a partial sum, all-reduced across ranks
as a row-parallel linear layer's.
"""

from __future__ import annotations

import torch
from torch import nn

import kernels
from asyncllm.distributed.communication_op import tensor_model_parallel_all_reduce
from asyncllm.distributed.parallel_state import (
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
)
from asyncllm.layers.fused_moe.routing import RoutingConfig, select_experts
from asyncllm.layers.fused_moe.torch_experts import torch_experts

# checkpoint names of an expert's three projections -> (stacked parameter, shard)
EXPERT_SHARDS = {
    "w1": ("w13_weight", 0),
    "gate_proj": ("w13_weight", 0),
    "w3": ("w13_weight", 1),
    "up_proj": ("w13_weight", 1),
    "w2": ("w2_weight", None),
    "down_proj": ("w2_weight", None),
}


class FusedMoE(nn.Module):
    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        routing: RoutingConfig,
        tp_rank: int | None = None,
        tp_size: int | None = None,
        num_shared: int = 0,
    ) -> None:
        """num_experts routed ones, then num_shared shared ones; tp_rank and tp_size default to
        this process's tensor-parallel rank and world."""
        super().__init__()
        tp_rank = get_tensor_model_parallel_rank() if tp_rank is None else tp_rank
        tp_size = get_tensor_model_parallel_world_size() if tp_size is None else tp_size
        if intermediate_size % tp_size:
            raise ValueError(f"moe intermediate size {intermediate_size} splits over {tp_size}")
        self.num_experts = num_experts
        self.num_shared = num_shared
        self.routing = routing
        self.tp_rank = tp_rank
        self.inner = intermediate_size // tp_size
        stacked = num_experts + num_shared
        self.w13_weight = nn.Parameter(torch.empty(stacked, 2 * self.inner, hidden_size))
        self.w2_weight = nn.Parameter(torch.empty(stacked, hidden_size, self.inner))

    def forward(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        topk_weights, topk_ids = select_experts(router_logits, self.routing, self.num_shared)
        weights = (self.w13_weight, self.w2_weight, topk_weights, topk_ids)
        if not x.is_cuda:
            return tensor_model_parallel_all_reduce(torch_experts(x, *weights))
        # the routed experts' tiles (the table tuned for them): shared ones add a few row tiles
        tiles = kernels.tile_config(
            self.num_experts, self.inner, x.shape[1], x.shape[0], x.device, self.routing.top_k
        )
        return tensor_model_parallel_all_reduce(kernels.fused_experts(x, *weights, tiles))

    def weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, expert: int, shard: int | None
    ) -> None:
        """Copy this rank's slice of one expert's gate (shard 0), up (1) or down (None) weight."""
        rank_slice = slice(self.tp_rank * self.inner, (self.tp_rank + 1) * self.inner)
        if shard is None:
            param.data[expert].copy_(loaded[:, rank_slice])
            return
        param.data[expert, shard * self.inner : (shard + 1) * self.inner].copy_(loaded[rank_slice])

    def load_shared(self, name: str, loaded: torch.Tensor) -> None:
        """The shared experts' MLP (gate_proj, up_proj [s * I, H], down_proj [H, s * I]) as the
        experts after the routed ones, an inner slice of I each."""
        target, shard = EXPERT_SHARDS[name]
        along = 1 if shard is None else 0
        for index, part in enumerate(loaded.chunk(self.num_shared, dim=along)):
            self.weight_loader(getattr(self, target), part, self.num_experts + index, shard)

    def load_stacked(self, name: str, loaded: torch.Tensor) -> None:
        """HF transformers' own stacked layout: gate_up_proj [E, 2 * I, H], down_proj [E, H, I]."""
        if name == "down_proj":
            for expert in range(self.num_experts):
                self.weight_loader(self.w2_weight, loaded[expert], expert, None)
            return
        gate, up = loaded.chunk(2, dim=1)
        for expert in range(self.num_experts):
            self.weight_loader(self.w13_weight, gate[expert], expert, 0)
            self.weight_loader(self.w13_weight, up[expert], expert, 1)
