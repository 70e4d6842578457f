"""The router's top-k in one kernel: each token's scores (softmax or sigmoid over the experts),
its k best experts, their weights renormalized and scaled; then, where a model has shared
experts, those (stacked after the routed ones) as further choices at weight 1, so that the fused
MoE runs them with the routed ones instead of an MLP of its own (four launches a layer fewer).

In torch that is a chain of six small ops (cast, softmax, topk, sum, divide, cast of the ids),
each a launch of a few microseconds: at batch 1 they cost more than the routing's bytes, 48
layers of them in a Qwen3-30B-A3B decode step.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._common import next_pow2, uses_pdl

# tokens x experts of one program's score tile
_TILE_ELEMENTS = 4096


@triton.jit(do_not_specialize=["num_tokens"])
def _top_k_routing_kernel(
    logits_ptr,
    weights_ptr,
    ids_ptr,
    num_tokens,
    num_experts,
    stride_t,
    scale,
    TOP_K: tl.constexpr,
    NUM_SHARED: tl.constexpr,
    SIGMOID: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """The k highest scores of each row, highest first (ties: the lower expert), picked by k
    rounds of max and knock-out; the weights and ids gathered in a BLOCK_T x BLOCK_K tile."""
    if USE_PDL:  # the logits are the kernel before's output
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    experts = tl.arange(0, BLOCK_E)
    valid = (experts < num_experts)[None, :]
    # rows past the end read the last row again (not stored): no row all -inf to normalize
    row_ptrs = logits_ptr + tl.minimum(rows, num_tokens - 1)[:, None] * stride_t
    logits = tl.load(row_ptrs + experts[None, :], mask=valid, other=-float("inf"))
    logits = logits.to(tl.float32)
    if SIGMOID:
        scores = tl.sigmoid(logits)
    else:
        exps = tl.exp(logits - tl.max(logits, 1)[:, None])
        scores = exps / tl.sum(exps, 1)[:, None]
    scores = tl.where(valid, scores, -1.0)  # below any score: never picked
    choices = tl.arange(0, BLOCK_K)
    weights = tl.zeros((BLOCK_T, BLOCK_K), dtype=tl.float32)
    ids = tl.zeros((BLOCK_T, BLOCK_K), dtype=tl.int32)
    for j in tl.static_range(TOP_K):
        best = tl.max(scores, 1)
        best_id = tl.min(tl.where(scores == best[:, None], experts[None, :], BLOCK_E), 1)
        best_id = tl.minimum(best_id, num_experts - 1)  # a NaN row matches none: still an expert
        weights = tl.where(choices[None, :] == j, best[:, None], weights)
        ids = tl.where(choices[None, :] == j, best_id[:, None], ids)
        scores = tl.where(experts[None, :] == best_id[:, None], -2.0, scores)
    if RENORMALIZE:
        weights = weights / tl.sum(weights, 1)[:, None]
    weights = weights * scale
    shared = (choices >= TOP_K)[None, :]
    weights = tl.where(shared, 1.0, weights)
    ids = tl.where(shared, num_experts + choices[None, :] - TOP_K, ids)
    out = rows[:, None] * (TOP_K + NUM_SHARED) + choices[None, :]
    mask = (rows < num_tokens)[:, None] & (choices < TOP_K + NUM_SHARED)[None, :]
    tl.store(weights_ptr + out, weights, mask=mask)
    tl.store(ids_ptr + out, ids, mask=mask)


def route_top_k(
    router_logits: torch.Tensor,
    top_k: int,
    sigmoid: bool = False,
    renormalize: bool = True,
    scale: float = 1.0,
    num_shared: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(topk_weights float32 [T, k + s], topk_ids int32 [T, k + s]) from router_logits [T, E]:
    the k best of softmax (or sigmoid) scores, renormalized to sum to 1 if asked, times scale;
    then the num_shared experts E .. E + s - 1 at weight 1."""
    num_tokens, num_experts = router_logits.shape
    device = router_logits.device
    width = top_k + num_shared
    weights = torch.empty(num_tokens, width, dtype=torch.float32, device=device)
    ids = torch.empty(num_tokens, width, dtype=torch.int32, device=device)
    if num_tokens == 0:
        return weights, ids
    block_e = max(16, next_pow2(num_experts))
    block_t = max(1, min(_TILE_ELEMENTS // block_e, next_pow2(num_tokens)))
    pdl = uses_pdl(device)
    _top_k_routing_kernel[(triton.cdiv(num_tokens, block_t),)](
        router_logits,
        weights,
        ids,
        num_tokens,
        num_experts,
        router_logits.stride(0),
        scale,
        TOP_K=top_k,
        NUM_SHARED=num_shared,
        SIGMOID=sigmoid,
        RENORMALIZE=renormalize,
        BLOCK_T=block_t,
        BLOCK_E=block_e,
        BLOCK_K=next_pow2(width),
        USE_PDL=pdl,
        num_warps=4,
        launch_pdl=pdl,
    )
    return weights, ids
