"""Everything between the qkv projection and attention in one launch: q/k RMSNorm, rotary, KV write.

On Hopper it launches with programmatic dependent launch (see kernels/gemv_kernels.py): it starts while
the projection finishes and waits for it before reading qkv."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._common import next_pow2, uses_pdl
from kernels.cache import scaled_for_cache


@triton.jit
def _norm_rope_heads(
    x_ptr,
    norm_weight_ptr,
    cos,
    sin,
    eps,
    NUM: tl.constexpr,
    BLOCK_HEADS: tl.constexpr,
    HAS_NORM: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    """NUM consecutive heads' two halves [BLOCK_HEADS, BLOCK_HALF], each head RMS-normalised
    (when HAS_NORM) then rotated, in fp32."""
    h = tl.arange(0, BLOCK_HEADS)[:, None]
    i = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (h < NUM) & (i < HALF)
    ptrs = x_ptr + h * (2 * HALF) + i
    x1 = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(ptrs + HALF, mask=mask, other=0.0).to(tl.float32)
    if HAS_NORM:
        squares = tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)
        rstd = tl.rsqrt(squares / (2 * HALF) + eps)[:, None]
        x1 *= rstd * tl.load(norm_weight_ptr + i, mask=i < HALF, other=0.0).to(tl.float32)
        x2 *= rstd * tl.load(norm_weight_ptr + HALF + i, mask=i < HALF, other=0.0).to(tl.float32)
    return x1 * cos - x2 * sin, x2 * cos + x1 * sin


@triton.jit
def _store_heads(
    dst, x1, x2, NUM: tl.constexpr, BLOCK_HEADS: tl.constexpr, HALF: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):  # fmt: skip
    """Heads [BLOCK_HEADS, 2 * HALF] (as two halves) at dst, one after another; rows past NUM
    are not stored."""
    h = tl.arange(0, BLOCK_HEADS)[:, None]
    i = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (h < NUM) & (i < HALF)
    ptrs = dst + h * (2 * HALF) + i
    tl.store(ptrs, x1.to(dst.dtype.element_ty), mask=mask)
    tl.store(ptrs + HALF, x2.to(dst.dtype.element_ty), mask=mask)


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
    k_scale,
    v_scale,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEADS: tl.constexpr,
    BLOCK_HEADS: tl.constexpr,
    HAS_NORM: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    FP8: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """Program (t, g): HEADS heads of token t, query heads g * HEADS on while
    g < NUM_HEADS / HEADS, else the key and value heads of the group's remainder."""
    if USE_PDL:  # launched early: qkv is the kernel before's output
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    token = tl.program_id(0).to(tl.int64)
    group = tl.program_id(1)
    head_dim = 2 * HALF
    i = tl.arange(0, BLOCK_HALF)[None, :]
    row = qkv_ptr + token * qkv_stride_t
    pos = tl.load(positions_ptr + token).to(tl.int64)
    angles = cos_sin_ptr + pos * cos_sin_stride + i
    cos = tl.load(angles, mask=i < HALF, other=0.0).to(tl.float32)
    sin = tl.load(angles + HALF, mask=i < HALF, other=0.0).to(tl.float32)
    if group < NUM_HEADS // HEADS:
        first = group * HEADS
        x1, x2 = _norm_rope_heads(
            row + first * head_dim, q_norm_weight_ptr, cos, sin, eps, HEADS, BLOCK_HEADS,
            HAS_NORM, HALF, BLOCK_HALF,
        )  # fmt: skip
        dst = query_ptr + (token * NUM_HEADS + first) * head_dim
        _store_heads(dst, x1, x2, HEADS, BLOCK_HEADS, HALF, BLOCK_HALF)
    else:
        slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
        if slot >= 0:
            first = group * HEADS - NUM_HEADS
            k_src = row + (NUM_HEADS + first) * head_dim
            x1, x2 = _norm_rope_heads(
                k_src, k_norm_weight_ptr, cos, sin, eps, HEADS, BLOCK_HEADS, HAS_NORM, HALF,
                BLOCK_HALF,
            )  # fmt: skip
            offset = (slot * NUM_KV_HEADS + first) * head_dim
            x1, x2 = scaled_for_cache(x1, k_scale, FP8), scaled_for_cache(x2, k_scale, FP8)
            _store_heads(k_cache_ptr + offset, x1, x2, HEADS, BLOCK_HEADS, HALF, BLOCK_HALF)
            h = tl.arange(0, BLOCK_HEADS)[:, None]
            mask = (h < HEADS) & (i < HALF)
            v_src = k_src + NUM_KV_HEADS * head_dim + h * head_dim + i
            v1 = tl.load(v_src, mask=mask, other=0.0)
            v2 = tl.load(v_src + HALF, mask=mask, other=0.0)
            v1, v2 = scaled_for_cache(v1, v_scale, FP8), scaled_for_cache(v2, v_scale, FP8)
            _store_heads(v_cache_ptr + offset, v1, v2, HEADS, BLOCK_HEADS, HALF, BLOCK_HALF)


def heads_per_program(num_tokens: int, num_kv_heads: int) -> int:
    """One head a program (1 warp) while the tokens are few, so that a batch-1 decode still
    spreads over num_heads + num_kv_heads programs; all of a token's KV heads (and as many
    query heads) a program from 64 tokens on, where one program per head was 6,144 tiny
    programs at batch 256. The threshold is a guess, not a measurement."""
    return 1 if num_tokens < 64 else num_kv_heads


def norm_rope_and_cache(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    q_norm_weight: torch.Tensor | None = None,
    k_norm_weight: torch.Tensor | None = None,
    eps: float = 0.0,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """The query [T, num_heads, head_dim] of the fused projection qkv [T, (Hq + 2 * Hkv) * D].

    Each q and k head is RMS-normalised over head_dim (when the norm weights [D] are given), then
    rotated (neox layout) by the angles of positions[t] in cos_sin_cache [max_position, D]
    (cos | sin, in the model's dtype or fp32); k and the raw v go to kv_cache [2, num_blocks, block_size, Hkv, D] (contiguous) at
    slot_mapping[t], skipped where it is -1; an FP8 (1-byte) cache stores e4m3(k / k_scale) and
    e4m3(v / v_scale), saturated. Norm and rotary share fp32, rounded once at the store.
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
    heads = heads_per_program(num_tokens, num_kv_heads)
    # without a norm the weight pointers are never read; any tensor fills the slots
    _norm_rope_and_cache_kernel[(num_tokens, (num_heads + num_kv_heads) // heads)](
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
        k_scale,
        v_scale,
        NUM_HEADS=num_heads,
        NUM_KV_HEADS=num_kv_heads,
        HEADS=heads,
        BLOCK_HEADS=next_pow2(heads),
        HAS_NORM=has_norm,
        HALF=half,
        BLOCK_HALF=next_pow2(half),
        FP8=kv_cache.element_size() == 1,
        USE_PDL=pdl,
        num_warps=1 if heads == 1 else 4,
        launch_pdl=pdl,
    )
    return query
