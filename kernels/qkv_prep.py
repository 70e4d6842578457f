"""Everything between the qkv projection and attention in one launch: q/k RMSNorm, rotary, KV write.

On Hopper it launches with programmatic dependent launch (see kernels/gemv.py): it starts while
the projection finishes and waits for it before reading qkv."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._common import next_pow2, uses_pdl


@triton.jit
def _norm_rope_head(
    x_ptr,
    norm_weight_ptr,
    cos,
    sin,
    eps,
    HAS_NORM: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    """One head's two halves, RMS-normalised (when HAS_NORM) then rotated, in fp32."""
    i = tl.arange(0, BLOCK_HALF)
    mask = i < HALF
    x1 = tl.load(x_ptr + i, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + HALF + i, mask=mask, other=0.0).to(tl.float32)
    if HAS_NORM:
        rstd = tl.rsqrt((tl.sum(x1 * x1, 0) + tl.sum(x2 * x2, 0)) / (2 * HALF) + eps)
        x1 *= rstd * tl.load(norm_weight_ptr + i, mask=mask, other=0.0).to(tl.float32)
        x2 *= rstd * tl.load(norm_weight_ptr + HALF + i, mask=mask, other=0.0).to(tl.float32)
    return x1 * cos - x2 * sin, x2 * cos + x1 * sin


@triton.jit
def _norm_rope_and_cache_kernel(
    qkv_ptr,
    positions_ptr,
    cos_sin_ptr,
    q_norm_weight_ptr,
    k_norm_weight_ptr,
    query_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    qkv_stride_t,
    cos_sin_stride,
    eps,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HAS_NORM: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """Program (t, h): query head h of token t, or for h >= NUM_HEADS its KV head h - NUM_HEADS."""
    if USE_PDL:  # launched early: qkv is the kernel before's output
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    head_dim = 2 * HALF
    i = tl.arange(0, BLOCK_HALF)
    mask = i < HALF
    row = qkv_ptr + token * qkv_stride_t
    pos = tl.load(positions_ptr + token).to(tl.int64)
    cos = tl.load(cos_sin_ptr + pos * cos_sin_stride + i, mask=mask, other=0.0).to(tl.float32)
    sin = tl.load(cos_sin_ptr + pos * cos_sin_stride + HALF + i, mask=mask, other=0.0)
    sin = sin.to(tl.float32)
    if head < NUM_HEADS:
        x1, x2 = _norm_rope_head(
            row + head * head_dim, q_norm_weight_ptr, cos, sin, eps, HAS_NORM, HALF, BLOCK_HALF
        )
        dst = query_ptr + (token * NUM_HEADS + head) * head_dim + i
        tl.store(dst, x1.to(query_ptr.dtype.element_ty), mask=mask)
        tl.store(dst + HALF, x2.to(query_ptr.dtype.element_ty), mask=mask)
    else:
        slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
        if slot >= 0:
            kv_head = head - NUM_HEADS
            k_src = row + (NUM_HEADS + kv_head) * head_dim
            x1, x2 = _norm_rope_head(
                k_src, k_norm_weight_ptr, cos, sin, eps, HAS_NORM, HALF, BLOCK_HALF
            )
            offset = (slot * NUM_KV_HEADS + kv_head) * head_dim + i
            tl.store(k_cache_ptr + offset, x1.to(k_cache_ptr.dtype.element_ty), mask=mask)
            tl.store(k_cache_ptr + offset + HALF, x2.to(k_cache_ptr.dtype.element_ty), mask=mask)
            v_src = k_src + NUM_KV_HEADS * head_dim
            v1 = tl.load(v_src + i, mask=mask)
            v2 = tl.load(v_src + HALF + i, mask=mask)
            tl.store(v_cache_ptr + offset, v1.to(v_cache_ptr.dtype.element_ty), mask=mask)
            tl.store(v_cache_ptr + offset + HALF, v2.to(v_cache_ptr.dtype.element_ty), mask=mask)


def norm_rope_and_cache(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    q_norm_weight: torch.Tensor | None = None,
    k_norm_weight: torch.Tensor | None = None,
    eps: float = 0.0,
) -> torch.Tensor:
    """The query [T, num_heads, head_dim] of the fused projection qkv [T, (Hq + 2 * Hkv) * D].

    Each q and k head is RMS-normalised over head_dim (when the norm weights [D] are given), then
    rotated (neox layout) by the angles of positions[t] in cos_sin_cache [max_position, D]
    (cos | sin, in the model's dtype or fp32); k and the raw v go to kv_cache [2, num_blocks, block_size, Hkv, D] (contiguous) at
    slot_mapping[t], skipped where it is -1. Norm and rotary share fp32, rounded once at the store.
    No host sync, no data-dependent allocation: CUDA-graph capturable.
    """
    num_tokens = qkv.shape[0]
    num_kv_heads, head_dim = kv_cache.shape[-2:]
    num_heads = qkv.shape[1] // head_dim - 2 * num_kv_heads
    assert qkv.shape[1] == (num_heads + 2 * num_kv_heads) * head_dim and qkv.stride(1) == 1
    assert kv_cache.is_contiguous() and cos_sin_cache.shape[-1] == head_dim
    assert cos_sin_cache.stride(-1) == 1
    assert (q_norm_weight is None) == (k_norm_weight is None)
    query = qkv.new_empty(num_tokens, num_heads, head_dim)
    if num_tokens == 0:
        return query
    has_norm = q_norm_weight is not None
    half = head_dim // 2
    pdl = uses_pdl(qkv.device)
    # without a norm the weight pointers are never read; any tensor fills the slots
    _norm_rope_and_cache_kernel[(num_tokens, num_heads + num_kv_heads)](
        qkv,
        positions,
        cos_sin_cache,
        q_norm_weight if has_norm else cos_sin_cache,
        k_norm_weight if has_norm else cos_sin_cache,
        query,
        kv_cache[0],
        kv_cache[1],
        slot_mapping,
        qkv.stride(0),
        cos_sin_cache.stride(0),
        eps,
        NUM_HEADS=num_heads,
        NUM_KV_HEADS=num_kv_heads,
        HAS_NORM=has_norm,
        HALF=half,
        BLOCK_HALF=next_pow2(half),
        USE_PDL=pdl,
        num_warps=1,
        launch_pdl=pdl,
    )
    return query
