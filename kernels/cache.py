"""Write new keys and values into the paged KV cache."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._common import next_pow2

_E4M3_MAX = tl.constexpr(448.0)


@triton.jit
def scaled_for_cache(x, scale, FP8: tl.constexpr):
    """x as an FP8 cache stores it: x / scale (rounded as torch divides), saturated at e4m3's
    range; as it is for a cache of the model's dtype."""
    # one return: triton 3.6 compiles the code after a constexpr branch's return too, and
    # refuses two returns of different types
    if FP8:
        x = tl.clamp(tl.math.div_rn(x.to(tl.float32), scale), -_E4M3_MAX, _E4M3_MAX)
    return x


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    key_stride_t,
    key_stride_h,
    value_stride_t,
    value_stride_h,
    k_scale,
    v_scale,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    FP8: tl.constexpr,
):
    """Copy token t's keys and values [num_kv_heads, head_dim] into cache slot slot_mapping[t]."""
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_D)[None, :]
    mask = (heads < NUM_KV_HEADS) & (dims < HEAD_DIM)
    key = tl.load(key_ptr + token * key_stride_t + heads * key_stride_h + dims, mask=mask)
    value = tl.load(value_ptr + token * value_stride_t + heads * value_stride_h + dims, mask=mask)
    dst = slot * (NUM_KV_HEADS * HEAD_DIM) + heads * HEAD_DIM + dims
    key = scaled_for_cache(key, k_scale, FP8)
    value = scaled_for_cache(value, v_scale, FP8)
    tl.store(k_cache_ptr + dst, key.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, value.to(v_cache_ptr.dtype.element_ty), mask=mask)


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Store key/value [num_tokens, num_kv_heads, head_dim] at their slots; slot -1 is skipped.
    An FP8 (1-byte) cache stores e4m3(key / k_scale) and e4m3(value / v_scale), saturated.

    kv_cache is [2, num_blocks, block_size, num_kv_heads, head_dim] and contiguous; key and value
    may be strided views (e.g. slices of a fused qkv projection) with a contiguous last dim.
    """
    num_tokens, num_kv_heads, head_dim = key.shape
    assert kv_cache.is_contiguous() and kv_cache.shape[-2:] == (num_kv_heads, head_dim)
    assert key.stride(-1) == 1 and value.stride(-1) == 1
    if num_tokens == 0:
        return
    _reshape_and_cache_kernel[(num_tokens,)](
        key,
        value,
        kv_cache[0],
        kv_cache[1],
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        k_scale,
        v_scale,
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_H=next_pow2(num_kv_heads),
        BLOCK_D=next_pow2(head_dim),
        FP8=kv_cache.element_size() == 1,
        num_warps=4,
    )
