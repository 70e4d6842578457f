"""Rotary position embedding, applied in place to q and k: pairs (i, i + D/2) (neox /
rotate_half) or, interleaved (GPT-J, DeepSeek), (2i, 2i + 1)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._common import next_pow2


@triton.jit
def rotate_heads(
    x_ptr,
    stride_h,
    cos,
    sin,
    NUM_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    """Rotate the pairs of every head of one token by the same angles."""
    heads = tl.arange(0, BLOCK_H)[:, None]
    i = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (heads < NUM_HEADS) & (i < HALF)
    if INTERLEAVED:
        ptrs, partner = x_ptr + heads * stride_h + 2 * i, 1
    else:
        ptrs, partner = x_ptr + heads * stride_h + i, HALF
    x1 = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(ptrs + partner, mask=mask, other=0.0).to(tl.float32)
    tl.store(ptrs, (x1 * cos - x2 * sin).to(x_ptr.dtype.element_ty), mask=mask)
    tl.store(ptrs + partner, (x2 * cos + x1 * sin).to(x_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(
    positions_ptr,
    q_ptr,
    k_ptr,
    cos_sin_ptr,
    q_stride_t,
    q_stride_h,
    k_stride_t,
    k_stride_h,
    cos_sin_stride,
    NUM_Q_HEADS: tl.constexpr,
    NUM_K_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    BLOCK_Q_HEADS: tl.constexpr,
    BLOCK_K_HEADS: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    """Rotate token t's query and key heads by the angles of positions[t]."""
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + token).to(tl.int64)
    i = tl.arange(0, BLOCK_HALF)[None, :]
    cos = tl.load(cos_sin_ptr + pos * cos_sin_stride + i, mask=i < HALF, other=0.0).to(tl.float32)
    sin = tl.load(cos_sin_ptr + pos * cos_sin_stride + HALF + i, mask=i < HALF, other=0.0).to(
        tl.float32
    )
    rotate_heads(
        q_ptr + token * q_stride_t,
        q_stride_h,
        cos,
        sin,
        NUM_Q_HEADS,
        HALF,
        INTERLEAVED,
        BLOCK_Q_HEADS,
        BLOCK_HALF,
    )
    rotate_heads(
        k_ptr + token * k_stride_t,
        k_stride_h,
        cos,
        sin,
        NUM_K_HEADS,
        HALF,
        INTERLEAVED,
        BLOCK_K_HEADS,
        BLOCK_HALF,
    )


def rotary_embedding(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    interleaved: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q [T, Hq, D] and k [T, Hk, D] (or [T, H * D]) IN PLACE and return them.

    cos_sin_cache is [max_position, D]: cos of each frequency in the first half, sin in the
    second. q and k may be strided views (slices of a fused qkv output) with a contiguous last dim.
    """
    head_dim = cos_sin_cache.shape[-1]
    num_tokens = positions.shape[0]
    q3 = q.view(num_tokens, -1, head_dim)
    k3 = k.view(num_tokens, -1, head_dim)
    assert q3.stride(-1) == 1 and k3.stride(-1) == 1 and cos_sin_cache.stride(-1) == 1
    if num_tokens == 0:
        return q, k
    half = head_dim // 2
    _rotary_kernel[(num_tokens,)](
        positions,
        q3,
        k3,
        cos_sin_cache,
        q3.stride(0),
        q3.stride(1),
        k3.stride(0),
        k3.stride(1),
        cos_sin_cache.stride(0),
        NUM_Q_HEADS=q3.shape[1],
        NUM_K_HEADS=k3.shape[1],
        HALF=half,
        INTERLEAVED=interleaved,
        BLOCK_Q_HEADS=next_pow2(q3.shape[1]),
        BLOCK_K_HEADS=next_pow2(k3.shape[1]),
        BLOCK_HALF=next_pow2(half),
        num_warps=4,
    )
    return q, k
