"""The experts in plain torch: the CPU path and the reference for kernels.fused_moe."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from asyncllm.layers.activation import silu_and_mul


def torch_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """Each expert over the (token, choice) pairs routed to it, weighted and summed over top-k.

    x [T, H]; w13 [E, 2 * I, H]; w2 [E, H, I]; topk_weights / topk_ids [T, k]."""
    out = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float32, device=x.device)
    flat_ids = topk_ids.flatten().long()
    order = torch.argsort(flat_ids, stable=True)
    counts = torch.bincount(flat_ids, minlength=w13.shape[0]).tolist()
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        pairs = order[start : start + count]
        start += count
        tokens = pairs // topk_ids.shape[1]
        hidden = F.linear(silu_and_mul(F.linear(x[tokens], w13[expert])), w2[expert])
        weight = topk_weights.flatten()[pairs].float()[:, None]
        out.index_add_(0, tokens, hidden.float() * weight)
    return out.to(x.dtype)
