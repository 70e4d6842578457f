"""Which experts each token goes to, and with what weight, as each model's router defines it."""

from __future__ import annotations

from dataclasses import dataclass

import torch

import kernels


@dataclass(frozen=True)
class RoutingConfig:
    top_k: int
    scoring: str = "softmax"  # or "sigmoid"
    renormalize: bool = True  # the top-k weights rescaled to sum to 1
    num_groups: int = 1  # grouped top-k (DeepSeek): experts in groups, the best topk_groups kept
    topk_groups: int = 1
    routed_scaling_factor: float = 1.0


def select_experts(
    router_logits: torch.Tensor, config: RoutingConfig, num_shared: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """(topk_weights float32 [T, k + s], topk_ids int32 [T, k + s]) from router_logits [T, E]:
    the routed choices, then the num_shared shared experts (E .. E + s - 1) at weight 1."""
    if router_logits.is_cuda and config.num_groups == 1:
        sigmoid = config.scoring == "sigmoid"
        scale = config.routed_scaling_factor
        return kernels.route_top_k(
            router_logits, config.top_k, sigmoid, config.renormalize, scale, num_shared
        )
    return torch_select_experts(router_logits, config, num_shared)


def torch_select_experts(
    router_logits: torch.Tensor, config: RoutingConfig, num_shared: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """select_experts in torch ops: the CPU path, grouped top-k, and the routing kernel's
    reference."""
    logits = router_logits.float()
    scores = logits.softmax(-1) if config.scoring == "softmax" else logits.sigmoid()
    if config.num_groups > 1:
        scores = _keep_best_groups(scores, config.num_groups, config.topk_groups)
    weights, ids = torch.topk(scores, config.top_k, dim=-1)
    if config.renormalize:
        weights = weights / weights.sum(-1, keepdim=True)
    if config.routed_scaling_factor != 1.0:
        weights = weights * config.routed_scaling_factor
    if num_shared:
        shared = torch.arange(num_shared, device=ids.device) + router_logits.shape[1]
        ids = torch.cat([ids, shared.expand(ids.shape[0], -1)], dim=1)
        weights = torch.cat([weights, weights.new_ones(weights.shape[0], num_shared)], dim=1)
    return weights, ids.to(torch.int32)


def _keep_best_groups(scores: torch.Tensor, num_groups: int, topk_groups: int) -> torch.Tensor:
    """Scores outside the topk_groups groups of highest best-expert score set to 0."""
    grouped = scores.view(scores.shape[0], num_groups, -1)
    best = torch.topk(grouped.amax(-1), topk_groups, dim=-1).indices
    keep = torch.zeros_like(grouped[..., 0], dtype=torch.bool).scatter_(1, best, True)
    return grouped.masked_fill(~keep[..., None], 0.0).view_as(scores)
