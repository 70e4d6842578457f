"""Causal attention for a flat batch of variable-length queries over a paged KV cache."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._common import AttentionConfig, dot_precision, next_pow2

_LOG2E = 1.4426950408889634


@triton.jit
def _find_request(query_start_loc_ptr, tile, num_reqs, BLOCK_Q: tl.constexpr):
    """The request owning program `tile`; request r owns tiles from query_start_loc[r] // BLOCK_Q + r."""
    lo = tl.full([], 0, tl.int32)
    hi = num_reqs
    while lo < hi:
        mid = (lo + hi) // 2
        first_tile = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first_tile <= tile:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _attend_tile(
    q,
    acc,
    m,
    denom,
    k_cache_ptr,
    v_cache_ptr,
    block_table,
    kv_offset,
    d_mask,
    q_pos,
    kv_end,
    start,
    scale_log2,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL_MASK: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """One online-softmax step over keys start : start + BLOCK_N (masked near the diagonal)."""
    pos = start + tl.arange(0, BLOCK_N)
    if CAUSAL_MASK:
        pos_mask = pos < kv_end
        block = tl.load(block_table + pos // BLOCK_SIZE, mask=pos_mask, other=0)
        kv_mask = pos_mask[:, None] & d_mask[None, :]
    else:
        block = tl.load(block_table + pos // BLOCK_SIZE)
        kv_mask = d_mask[None, :]
    slot = block.to(tl.int64) * BLOCK_SIZE + pos % BLOCK_SIZE
    kv_ptrs = slot[:, None] * (NUM_KV_HEADS * HEAD_DIM) + kv_offset[None, :]
    k = tl.load(k_cache_ptr + kv_ptrs, mask=kv_mask, other=0.0).to(q.dtype)
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2
    if CAUSAL_MASK:
        s = tl.where((pos[None, :] <= q_pos[:, None]) & pos_mask[None, :], s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, 1))
    alpha = tl.exp2(m - m_new)
    p = tl.exp2(s - m_new[:, None])
    denom = denom * alpha + tl.sum(p, 1)
    v = tl.load(v_cache_ptr + kv_ptrs, mask=kv_mask, other=0.0).to(q.dtype)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return acc, m_new, denom


# a mixed step passes query_start_loc and seq_lens from its first prompt on: 4-byte aligned
# only, which must not compile a second variant mid-run
@triton.jit(
    do_not_specialize=["num_reqs"],
    do_not_specialize_on_alignment=["query_start_loc_ptr", "seq_lens_ptr"],
)
def _prefill_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    block_tables_ptr,
    scale_log2,
    v_scale,
    num_reqs,
    q_stride_t,
    q_stride_h,
    out_stride_t,
    out_stride_h,
    block_table_stride,
    NUM_KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """Causal attention of BLOCK_Q consecutive queries of one request over its context, for the
    GROUP query heads that share one KV head: its BLOCK_M = BLOCK_Q * GROUP (or fewer) rows,
    token-major, share every key and value load."""
    kv_head = tl.program_id(0)
    # last tiles first: they see the most keys, so the long programs start early and the tail is short
    tile = tl.num_programs(1) - 1 - tl.program_id(1)
    req = _find_request(query_start_loc_ptr, tile, num_reqs, BLOCK_Q)
    if req < 0:  # a tile of the rows before query_start_loc[0] (a mixed step's decodes)
        return
    q_start = tl.load(query_start_loc_ptr + req)
    q_len = tl.load(query_start_loc_ptr + req + 1) - q_start
    m_tile = tile - (q_start // BLOCK_Q + req)
    if m_tile * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + req)
    first_q_pos = seq_len - q_len + m_tile * BLOCK_Q

    r = tl.arange(0, BLOCK_M)
    token = r // GROUP
    heads = kv_head * GROUP + r % GROUP
    rows = m_tile * BLOCK_Q + token
    row_mask = (token < BLOCK_Q) & (rows < q_len)
    q_pos = first_q_pos + token
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    tokens = (q_start + rows).to(tl.int64)
    io_mask = row_mask[:, None] & d_mask[None, :]
    q = tl.load(
        q_ptr + tokens[:, None] * q_stride_t + heads[:, None] * q_stride_h + d[None, :],
        mask=io_mask,
        other=0.0,
    )

    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    denom = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    block_table = block_tables_ptr + req.to(tl.int64) * block_table_stride
    kv_offset = kv_head * HEAD_DIM + d
    # keys before the tile's first query are visible to every row: no mask needed there
    kv_end = tl.minimum(seq_len, first_q_pos + BLOCK_Q)
    unmasked_end = (first_q_pos // BLOCK_N) * BLOCK_N
    for start in range(0, unmasked_end, BLOCK_N):
        acc, m, denom = _attend_tile(
            q, acc, m, denom, k_cache_ptr, v_cache_ptr, block_table, kv_offset, d_mask, q_pos, kv_end,
            start, scale_log2, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, BLOCK_N, False, PRECISION,
        )  # fmt: skip
    for start in range(unmasked_end, kv_end, BLOCK_N):
        acc, m, denom = _attend_tile(
            q, acc, m, denom, k_cache_ptr, v_cache_ptr, block_table, kv_offset, d_mask, q_pos, kv_end,
            start, scale_log2, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, BLOCK_N, True, PRECISION,
        )  # fmt: skip

    out = acc / denom[:, None] * v_scale  # an FP8 cache's values are v / v_scale
    tl.store(
        out_ptr + tokens[:, None] * out_stride_t + heads[:, None] * out_stride_h + d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=io_mask,
    )


def default_prefill_config(dtype: torch.dtype) -> AttentionConfig:
    if dtype == torch.float32:
        return AttentionConfig(block_m=32, block_n=32, num_warps=4, num_stages=2)
    return AttentionConfig(block_m=128, block_n=64, num_warps=4, num_stages=3)


def short_query_prefill_config(dtype: torch.dtype) -> AttentionConfig:
    """Tiles of 16 rows, for steps of mostly decode rows: a decode row then costs about what it
    does in the decode kernel (one token's GQA heads in a tile), not a whole 128-row tile's
    matmuls."""
    if dtype == torch.float32:
        return AttentionConfig(block_m=16, block_n=32, num_warps=4, num_stages=2)
    return AttentionConfig(block_m=16, block_n=64, num_warps=4, num_stages=3)


def paged_prefill_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    max_query_len: int,
    out: torch.Tensor | None = None,
    *,
    config: AttentionConfig | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """query [num_tokens, num_heads, head_dim]: request r owns rows query_start_loc[r]:[r + 1].

    Row i of request r sits at position seq_len[r] - query_len[r] + i and attends causally to
    every key up to its own position, all read from the paged kv_cache (a cached prefix included),
    so reshape_and_cache must have stored this step's keys first. Any query_len >= 1 works,
    decode rows included. Rows before query_start_loc[0] (which need not be 0: a mixed step
    leaves its decodes at the front to the decode kernel) and past query_start_loc[-1] are
    left unwritten. The cache holds keys / k_scale and values / v_scale (an FP8 cache's
    per-tensor scales).
    """
    num_tokens, num_heads, head_dim = query.shape
    _, _, block_size, num_kv_heads, _ = kv_cache.shape
    assert kv_cache.is_contiguous() and query.stride(-1) == 1
    assert num_heads % num_kv_heads == 0
    if out is None:
        out = torch.empty_like(query)
    num_reqs = seq_lens.shape[0]
    if num_tokens == 0 or num_reqs == 0 or max_query_len == 0:
        return out
    config = config or default_prefill_config(query.dtype)
    group = num_heads // num_kv_heads
    block_m = max(config.block_m, next_pow2(group))
    block_q = block_m // group
    # request r's tiles start at query_start_loc[r] // block_q + r, so this many cover every request
    num_tiles = num_tokens // block_q + num_reqs
    _prefill_kernel[(num_kv_heads, num_tiles)](
        query,
        kv_cache[0],
        kv_cache[1],
        out,
        query_start_loc,
        seq_lens,
        block_tables,
        scale * k_scale * _LOG2E,
        v_scale,
        num_reqs,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        block_tables.stride(0),
        NUM_KV_HEADS=num_kv_heads,
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_D=next_pow2(head_dim),
        BLOCK_SIZE=block_size,
        BLOCK_M=block_m,
        BLOCK_Q=block_q,
        BLOCK_N=config.block_n,
        PRECISION=dot_precision(query.dtype),
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    return out
