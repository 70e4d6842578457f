"""Paged MLA decode: each query row's heads, absorbed into latent space, against one shared
latent per cached token (DeepSeek-V2's compressed KV cache), optionally split over the context.

Cache: [1, num_blocks, block_size, 1, kv_lora_rank + rope_dim]; a token's entry is its latent
(which is also its value) followed by its rope key. One program takes BLOCK_H heads of a row
and one split of its context, so each latent tile is read once for all those heads.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._common import dot_precision, next_pow2, num_sms, uses_pdl
from kernels.decode_attention import _decode_reduce_kernel

_LOG2E = 1.4426950408889634
MAX_SPLITS = 32
# a split reads at least this many tokens: fewer and its fp32 partial output (4 bytes x heads x
# rank) outweighs the bf16 latents it read (2 x (rank + rope) per token)
MIN_TOKENS_PER_SPLIT = 128


@triton.jit
def _write_latent_kernel(
    latent_ptr, cache_ptr, slot_mapping_ptr, latent_stride, WIDTH: tl.constexpr, BLOCK: tl.constexpr
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    cols = tl.arange(0, BLOCK)
    mask = cols < WIDTH
    latent = tl.load(latent_ptr + token * latent_stride + cols, mask=mask)
    tl.store(cache_ptr + slot * WIDTH + cols, latent.to(cache_ptr.dtype.element_ty), mask=mask)


def write_latent_cache(
    latent: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """latent [T, width] into kv_cache's slots; slots < 0 (padding) are skipped."""
    if latent.shape[0] == 0:
        return
    width = latent.shape[1]
    _write_latent_kernel[(latent.shape[0],)](
        latent, kv_cache, slot_mapping, latent.stride(0), WIDTH=width, BLOCK=next_pow2(width)
    )


@triton.jit
def _mla_decode_kernel(
    q_ptr,
    cache_ptr,
    block_tables_ptr,
    request_ptr,
    length_ptr,
    out_ptr,
    part_out_ptr,
    part_max_ptr,
    part_sum_ptr,
    scale_log2,
    q_stride_t,
    q_stride_h,
    block_table_stride,
    NUM_HEADS: tl.constexpr,
    RANK: tl.constexpr,
    ROPE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_L: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    SPLIT: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """BLOCK_H heads over one split: with SPLIT, the unnormalised output, running max (log2
    units) and sum, for the merge; else (one split) the output itself [T, H, RANK]."""
    row = tl.program_id(0).to(tl.int64)
    head_block = tl.program_id(1)
    split = tl.program_id(2)
    num_splits = tl.num_programs(2)
    request = tl.load(request_ptr + row).to(tl.int64)
    length = tl.load(length_ptr + row)
    heads = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
    head_mask = heads < NUM_HEADS
    lat = tl.arange(0, BLOCK_L)
    rope = tl.arange(0, BLOCK_R)
    q_rows = q_ptr + row * q_stride_t + heads[:, None] * q_stride_h
    q_lat = tl.load(
        q_rows + lat[None, :], mask=head_mask[:, None] & (lat < RANK)[None, :], other=0.0
    )
    q_pe = tl.load(
        q_rows + RANK + rope[None, :], mask=head_mask[:, None] & (rope < ROPE)[None, :], other=0.0
    )
    chunk = tl.cdiv(tl.cdiv(length, num_splits), TILE_N) * TILE_N
    start = split * chunk
    end = tl.minimum(start + chunk, length)
    m = tl.full((BLOCK_H,), float("-inf"), dtype=tl.float32)
    total = tl.zeros((BLOCK_H,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_H, BLOCK_L), dtype=tl.float32)
    for pos0 in range(start, end, TILE_N):
        pos = pos0 + tl.arange(0, TILE_N)
        pos_mask = pos < end
        block = tl.load(
            block_tables_ptr + request * block_table_stride + pos // BLOCK_SIZE,
            mask=pos_mask,
            other=0,
        )
        entry = cache_ptr + (block.to(tl.int64) * BLOCK_SIZE + pos % BLOCK_SIZE)[:, None] * (
            RANK + ROPE
        )
        c = tl.load(entry + lat[None, :], mask=pos_mask[:, None] & (lat < RANK)[None, :], other=0.0)
        pe = tl.load(
            entry + RANK + rope[None, :], mask=pos_mask[:, None] & (rope < ROPE)[None, :], other=0.0
        )
        scores = tl.dot(q_lat, tl.trans(c), input_precision=PRECISION)
        scores = tl.dot(q_pe, tl.trans(pe), scores, input_precision=PRECISION) * scale_log2
        scores = tl.where(pos_mask[None, :], scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, 1))
        p = tl.exp2(scores - m_new[:, None])
        alpha = tl.exp2(m - m_new)
        total = total * alpha + tl.sum(p, 1)
        acc = tl.dot(p.to(c.dtype), c, acc * alpha[:, None], input_precision=PRECISION)
        m = m_new
    out_mask = head_mask[:, None] & (lat < RANK)[None, :]
    if SPLIT:
        part = (row * NUM_HEADS + heads) * num_splits + split
        tl.store(part_max_ptr + part, m, mask=head_mask)
        tl.store(part_sum_ptr + part, total, mask=head_mask)
        tl.store(part_out_ptr + part[:, None] * RANK + lat[None, :], acc, mask=out_mask)
    else:
        acc = acc / tl.where(total > 0, total, 1.0)[:, None]
        out = out_ptr + (row * NUM_HEADS + heads)[:, None] * RANK + lat[None, :]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=out_mask)


def choose_mla_splits(
    num_rows: int, num_head_blocks: int, max_length: int, device: torch.device
) -> int:
    """Enough splits of each context to give every SM four programs (flash-decoding: a batch
    of one would otherwise run on one SM per head block), at most MAX_SPLITS, none shorter than
    MIN_TOKENS_PER_SPLIT of the block table's capacity; from shapes alone, so a CUDA graph
    keeps its choice."""
    programs = max(num_rows * num_head_blocks, 1)
    if programs >= num_sms(device):  # a wave already: splitting would only add the merge
        return 1
    by_occupancy = triton.cdiv(4 * num_sms(device), programs)
    by_length = triton.cdiv(max_length, MIN_TOKENS_PER_SPLIT)
    return max(1, min(MAX_SPLITS, by_occupancy, by_length))


def paged_mla_decode(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    request: torch.Tensor,
    length: torch.Tensor,
    scale: float,
    kv_lora_rank: int,
    num_splits: int | None = None,
) -> torch.Tensor:
    """query [T, H, rank + rope]; row t attends to the first length[t] cached tokens of request
    request[t]'s blocks -> [T, H, rank] (zeros where length is 0)."""
    num_rows, num_heads, width = query.shape
    rope = width - kv_lora_rank
    block_size = kv_cache.shape[2]
    block_h = max(16, min(next_pow2(num_heads), 64))
    head_blocks = triton.cdiv(num_heads, block_h)
    capacity = block_tables.shape[1] * block_size
    splits = num_splits or choose_mla_splits(num_rows, head_blocks, capacity, query.device)
    out = torch.empty(num_rows, num_heads, kv_lora_rank, dtype=query.dtype, device=query.device)
    if not num_rows:
        return out
    split = splits > 1
    if split:
        shape = (num_rows, num_heads, splits)
        part_out = torch.empty(*shape, kv_lora_rank, dtype=torch.float32, device=query.device)
        part_max = torch.empty(shape, dtype=torch.float32, device=query.device)
        part_sum = torch.empty(shape, dtype=torch.float32, device=query.device)
    else:
        part_out = part_max = part_sum = out
    fp32 = query.dtype == torch.float32
    _mla_decode_kernel[(num_rows, head_blocks, splits)](
        query,
        kv_cache,
        block_tables,
        request,
        length,
        out,
        part_out,
        part_max,
        part_sum,
        scale * _LOG2E,
        query.stride(0),
        query.stride(1),
        block_tables.stride(0),
        NUM_HEADS=num_heads,
        RANK=kv_lora_rank,
        ROPE=rope,
        BLOCK_H=block_h,
        BLOCK_L=next_pow2(kv_lora_rank),
        BLOCK_R=max(16, next_pow2(rope)),
        BLOCK_SIZE=block_size,
        TILE_N=16 if fp32 else 32,
        SPLIT=split,
        PRECISION=dot_precision(query.dtype),
        num_warps=4 if kv_lora_rank <= 256 else 8,
        # three 32-token latent tiles in flight: ~110 KB of shared memory at rank 512
        num_stages=3,
    )
    if not split:
        return out
    pdl = uses_pdl(query.device)
    # one launch merges the splits (the torch merge was a dozen kernels: most of the time at
    # small batch)
    _decode_reduce_kernel[(num_rows, num_heads)](
        part_out,
        part_max,
        part_sum,
        out,
        splits,
        num_heads,
        out.stride(0),
        out.stride(1),
        HEAD_DIM=kv_lora_rank,
        BLOCK_D=next_pow2(kv_lora_rank),
        BLOCK_S=next_pow2(splits),
        USE_PDL=pdl,
        num_warps=8,  # a [splits, rank 512] fp32 tile: 64 registers a thread at 32 splits
        launch_pdl=pdl,
    )
    return out
