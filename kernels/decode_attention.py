"""Paged attention for decode: one query token per request, GQA-aware, optionally split-K.

With programmatic dependent launch (Hopper), each kernel starts while the one before it
finishes and waits for it before reading its output: the attention kernel after the q/k
preparation, the split-K reduce after the attention kernel; the kernel after them (the output
projection's GEMV) may start loading its weights meanwhile."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels._common import AttentionConfig, dot_precision, next_pow2, num_sms, uses_pdl

MIN_TOKENS_PER_SPLIT = 256
MAX_SPLITS = 64
# long sequences split into pieces of at least this many keys, until there are BALANCE_WAVES
# programs an SM (issue 28's long-context workload; `bench/NOTES.md`)
LONG_SPLIT_TOKENS = 4096
BALANCE_WAVES = 8
LONG_TILE_MIN_SEQS = 64
_LOG2E = 1.4426950408889634
_TL_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}
# a query scaled by a power of two to at most 2^14 stays inside fp16's range (65,504)
_FP16_QUERY_EXPONENT = tl.constexpr(13.0)


@dataclass(frozen=True)
class Fp8CacheRead:
    """How the decode kernel widens an FP8 cache's keys and values for its two dots.

    fp16_dots: a 16-bit query's dots run in fp16 (the query scaled by a power of two into
    fp16's range, keeping all its bits), since e4m3 -> fp16 is one Hopper cvt per two values;
    e4m3 -> bf16 goes through fp16 and costs one more cvt per value. value_pairs: the value tile, whose
    dot runs along its strided dim (tokens), is read as 16-bit words of two neighbouring
    values: 16-bit tiles transpose in ldmatrix, 8-bit ones went through one shared-memory load
    a byte; the even and the odd values then feed two dots of half the head dim each.
    prmt_pairs: on a GPU, with fp16 dots of an e4m3 cache, the pairs split into their even and
    odd bytes by one prmt each (inline PTX) where Triton's shifts and masks took four
    instructions; the interpreter (CPU tensors) always takes Triton's split."""

    fp16_dots: bool = True
    value_pairs: bool = True
    prmt_pairs: bool = True


@triton.jit
def _widen_pairs(pairs, FP8: tl.constexpr, DOT_DTYPE: tl.constexpr, PRMT: tl.constexpr):
    """16-bit words of two FP8 values (the even index in the low byte) -> (evens, odds)."""
    if PRMT:  # two words a register: bytes 0 and 2 are the evens, 1 and 3 the odds
        even, odd = tl.inline_asm_elementwise(
            """{
            .reg .b32 e, o;
            .reg .b16 e_lo, e_hi, o_lo, o_hi;
            prmt.b32 e, $2, 0, 0x0020;
            prmt.b32 o, $2, 0, 0x0031;
            mov.b32 {e_lo, e_hi}, e;
            mov.b32 {o_lo, o_hi}, o;
            cvt.rn.f16x2.e4m3x2 $0, e_lo;
            cvt.rn.f16x2.e4m3x2 $1, o_lo;
            }""",
            "=r,=r,r",
            [pairs],
            dtype=(tl.float16, tl.float16),
            is_pure=True,
            pack=2,
        )
    else:
        even = (pairs & 0xFF).to(tl.uint8).to(FP8, bitcast=True).to(DOT_DTYPE)
        odd = (pairs >> 8).to(tl.uint8).to(FP8, bitcast=True).to(DOT_DTYPE)
    return even, odd


@triton.jit(do_not_specialize=["num_seqs", "min_tiles_per_split"])
def _decode_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    out_ptr,
    part_out_ptr,
    part_max_ptr,
    part_sum_ptr,
    scale_log2,
    v_scale,
    num_seqs,
    min_tiles_per_split,
    q_stride_s,
    q_stride_h,
    out_stride_s,
    out_stride_h,
    block_table_stride,
    NUM_KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    SPLIT: tl.constexpr,
    PRECISION: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    VALUE_PAIRS: tl.constexpr,
    PRMT_PAIRS: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """Attention of the GROUP query heads sharing one KV head, over one split of a sequence's keys."""
    if USE_PDL:  # launched early: the query and the new key are the kernel before's output
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    num_splits = tl.num_programs(2)
    # query rows past the last sequence (a padded batch) see no keys and come out as zeros
    seq_len = tl.load(seq_lens_ptr + seq, mask=seq < num_seqs, other=0)

    # any split count covers any seq_len, so a captured graph stays right as sequences grow;
    # the splits past a short sequence's last piece of min_tiles_per_split stay empty
    num_tiles = tl.cdiv(seq_len, TILE_N)
    tiles_per_split = tl.maximum(tl.cdiv(num_tiles, num_splits), min_tiles_per_split)
    tile_lo = split * tiles_per_split
    tile_hi = tl.minimum(tile_lo + tiles_per_split, num_tiles)

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    n = tl.arange(0, TILE_N)
    heads = kv_head * GROUP + g
    g_mask = g < GROUP
    d_mask = d < HEAD_DIM
    q = tl.load(
        q_ptr + seq * q_stride_s + heads[:, None] * q_stride_h + d[None, :],
        mask=g_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    if q.dtype != DOT_DTYPE:  # a bf16 query into fp16, by a power of two the scores undo
        q_max = tl.max(tl.max(tl.abs(q.to(tl.float32)), 1), 0)
        shift = tl.where(q_max > 0.0, tl.floor(tl.log2(q_max)) - _FP16_QUERY_EXPONENT, 0.0)
        q = (q.to(tl.float32) * tl.exp2(-shift)).to(DOT_DTYPE)
        scale_log2 = scale_log2 * tl.exp2(shift)

    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    denom = tl.zeros([BLOCK_G], tl.float32)
    if VALUE_PAIRS:
        acc_even = tl.zeros([BLOCK_G, BLOCK_D // 2], tl.float32)
        acc_odd = tl.zeros([BLOCK_G, BLOCK_D // 2], tl.float32)
        d_pair = tl.arange(0, BLOCK_D // 2)
        pair_mask = d_pair < HEAD_DIM // 2
        pair_offset = kv_head * (HEAD_DIM // 2) + d_pair
        pairs_ptr = v_cache_ptr.to(tl.pointer_type(tl.uint16), bitcast=True)
    else:
        acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    block_table = block_tables_ptr + seq.to(tl.int64) * block_table_stride
    kv_offset = kv_head * HEAD_DIM + d
    for tile in range(tile_lo, tile_hi):
        pos = tile * TILE_N + n
        pos_mask = pos < seq_len
        block = tl.load(block_table + pos // BLOCK_SIZE, mask=pos_mask, other=0)
        slot = block.to(tl.int64) * BLOCK_SIZE + pos % BLOCK_SIZE
        kv_ptrs = slot[:, None] * (NUM_KV_HEADS * HEAD_DIM) + kv_offset[None, :]
        kv_mask = pos_mask[:, None] & d_mask[None, :]
        k = tl.load(k_cache_ptr + kv_ptrs, mask=kv_mask, other=0.0).to(DOT_DTYPE)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2
        s = tl.where(pos_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        denom = denom * alpha + tl.sum(p, 1)
        if VALUE_PAIRS:
            pairs = tl.load(
                pairs_ptr + slot[:, None] * (NUM_KV_HEADS * HEAD_DIM // 2) + pair_offset[None, :],
                mask=pos_mask[:, None] & pair_mask[None, :],
                other=0,
            )
            v_even, v_odd = _widen_pairs(pairs, v_cache_ptr.dtype.element_ty, DOT_DTYPE, PRMT_PAIRS)
            p = p.to(DOT_DTYPE)
            acc_even = acc_even * alpha[:, None] + tl.dot(p, v_even, input_precision=PRECISION)
            acc_odd = acc_odd * alpha[:, None] + tl.dot(p, v_odd, input_precision=PRECISION)
        else:
            v = tl.load(v_cache_ptr + kv_ptrs, mask=kv_mask, other=0.0).to(DOT_DTYPE)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m = m_new
    if VALUE_PAIRS:  # interleaved back: column 2j is acc_even's j, column 2j + 1 acc_odd's
        acc = tl.reshape(tl.join(acc_even, acc_odd), [BLOCK_G, BLOCK_D])
    acc *= v_scale  # an FP8 cache's values are v / v_scale

    if SPLIT:
        row = (seq * NUM_KV_HEADS * GROUP + heads) * num_splits + split
        tl.store(part_max_ptr + row, m, mask=g_mask)
        tl.store(part_sum_ptr + row, denom, mask=g_mask)
        tl.store(
            part_out_ptr + row[:, None] * HEAD_DIM + d[None, :],
            acc,
            mask=g_mask[:, None] & d_mask[None, :],
        )
    else:
        out = acc / tl.where(denom == 0.0, 1.0, denom)[:, None]
        tl.store(
            out_ptr + seq * out_stride_s + heads[:, None] * out_stride_h + d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=g_mask[:, None] & d_mask[None, :],
        )


@triton.jit
def _decode_reduce_kernel(
    part_out_ptr,
    part_max_ptr,
    part_sum_ptr,
    out_ptr,
    num_splits,
    num_heads,
    out_stride_s,
    out_stride_h,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """Merge one head's per-split (max, sum, unnormalised output) into the final output row."""
    if USE_PDL:  # launched early: the partial results are the kernel before's output
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    seq = tl.program_id(0)
    head = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    s_mask = s < num_splits
    rows = (seq * num_heads + head) * num_splits + s
    m = tl.load(part_max_ptr + rows, mask=s_mask, other=float("-inf"))
    denom = tl.load(part_sum_ptr + rows, mask=s_mask, other=0.0)
    m_max = tl.max(m, 0)
    weight = tl.exp2(m - tl.where(m_max == float("-inf"), 0.0, m_max))
    total = tl.sum(weight * denom, 0)
    acc = tl.load(
        part_out_ptr + rows[:, None] * HEAD_DIM + d[None, :],
        mask=s_mask[:, None] & (d[None, :] < HEAD_DIM),
        other=0.0,
    )
    out = tl.sum(acc * weight[:, None], 0) / tl.where(total == 0.0, 1.0, total)
    tl.store(
        out_ptr + seq * out_stride_s + head * out_stride_h + d,
        out.to(out_ptr.dtype.element_ty),
        mask=d < HEAD_DIM,
    )


@dataclass(frozen=True)
class DecodeSplit:
    """Each sequence's keys in num_splits pieces, none shorter than min_tokens: the splits past
    a short sequence's last piece stay empty."""

    num_splits: int
    min_tokens: int = 0


def choose_decode_split(
    num_seqs: int, num_kv_heads: int, max_seq_len: int, sms: int
) -> DecodeSplit:
    """Split the keys when (sequence, KV head) programs alone would leave SMs idle: when there
    are fewer programs than SMs, or, with sequences of several LONG_SPLIT_TOKENS, fewer than
    BALANCE_WAVES programs an SM. A program reads its sequence to the end: 32 sequences of 8k
    to 32k tokens are 256 programs, about two an SM, and the SMs with short ones then idle
    behind the longest. Those pieces are of at least LONG_SPLIT_TOKENS, so that a decode graph
    captured for a long max_model_len leaves shorter sequences whole."""
    programs = num_seqs * num_kv_heads
    if max_seq_len <= MIN_TOKENS_PER_SPLIT:
        return DecodeSplit(1)
    if programs < sms:
        by_occupancy = math.ceil(2 * sms / programs)
        by_length = math.ceil(max_seq_len / MIN_TOKENS_PER_SPLIT)
        return DecodeSplit(max(1, min(by_occupancy, by_length, MAX_SPLITS)))
    by_balance = math.ceil(BALANCE_WAVES * sms / programs)
    by_length = max_seq_len // LONG_SPLIT_TOKENS
    num_splits = min(by_balance, by_length, MAX_SPLITS)
    return DecodeSplit(num_splits, LONG_SPLIT_TOKENS) if num_splits > 1 else DecodeSplit(1)


def default_decode_config(
    dtype: torch.dtype, num_seqs: int, cache_dtype: torch.dtype | None = None
) -> AttentionConfig:
    """Big batches read in 128-key tiles: 91 -> 94% of copy bandwidth at 256 sequences of
    100-2,048 tokens on the H200, 82 -> 86% at 128 (`kernels_decode_mixed_sweep_h200.json`).
    An FP8 cache read by 16-bit queries: 128-key tiles, two stages where the batch fills the
    device (90% of copy bandwidth at 256 x 1,024 tokens, 94% at 64 x 4,096), three where the
    context is split (68% at 8 x 8,192; `fp8_kv_attention_sweep_h200.json`)."""
    one_byte = cache_dtype is not None and cache_dtype.itemsize == 1
    if one_byte and dtype.itemsize == 2:
        stages = 2 if num_seqs >= LONG_TILE_MIN_SEQS else 3
        return AttentionConfig(block_m=0, block_n=128, num_warps=4, num_stages=stages)
    widen = 2 if one_byte else 1
    if dtype == torch.float32:
        return AttentionConfig(block_m=0, block_n=32 * widen, num_warps=4, num_stages=2)
    block_n = (128 if num_seqs >= LONG_TILE_MIN_SEQS else 64) * widen
    return AttentionConfig(block_m=0, block_n=block_n, num_warps=4, num_stages=3)


def _widened_cache(
    query: torch.Tensor, cache_dtype: torch.dtype, block_d: int, read: Fp8CacheRead
) -> tuple[torch.dtype, bool, bool]:
    """(the dots' dtype, whether values load in pairs, whether prmt splits them)."""
    if cache_dtype.itemsize != 1:
        return query.dtype, False, False
    fp16 = read.fp16_dots and query.dtype.itemsize == 2
    dot_dtype = torch.float16 if fp16 else query.dtype
    # each half-width dot needs 16 columns on the GPU
    pairs = read.value_pairs and query.shape[-1] % 2 == 0 and block_d >= 32
    prmt = pairs and read.prmt_pairs and fp16 and cache_dtype == torch.float8_e4m3fn
    return dot_dtype, pairs, prmt and query.device.type == "cuda"


def paged_decode_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    *,
    max_seq_len: int | None = None,
    num_splits: int | None = None,
    config: AttentionConfig | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    fp8_read: Fp8CacheRead = Fp8CacheRead(),
) -> torch.Tensor:
    """query [num_seqs, num_heads, head_dim], one token per sequence at position seq_len - 1.

    Reads keys/values from kv_cache [2, num_blocks, block_size, num_kv_heads, head_dim] through
    block_tables [num_seqs, max_blocks] (int32) and seq_lens [num_seqs] (int32). Query rows past
    len(seq_lens) are padding and come out as zeros. num_splits (None: chosen from the host int
    max_seq_len, default the block table's capacity) only affects speed, never the result, and
    nothing here syncs with the device, so the call can be captured in a CUDA graph. The cache
    holds keys / k_scale and values / v_scale (an FP8 cache's per-tensor scales); fp8_read
    says how an FP8 cache is widened (speed only).
    """
    num_rows, num_heads, head_dim = query.shape
    _, _, block_size, num_kv_heads, _ = kv_cache.shape
    assert kv_cache.is_contiguous() and query.stride(-1) == 1
    assert num_heads % num_kv_heads == 0
    if out is None:
        out = torch.empty_like(query)
    if num_rows == 0:
        return out
    group = num_heads // num_kv_heads
    if max_seq_len is None:
        max_seq_len = block_tables.shape[1] * block_size
    if num_splits is None:
        chosen = choose_decode_split(num_rows, num_kv_heads, max_seq_len, num_sms(query.device))
    else:
        chosen = DecodeSplit(num_splits)
    num_splits = chosen.num_splits
    config = config or default_decode_config(query.dtype, num_rows, kv_cache.dtype)
    split = num_splits > 1
    if split:
        part_out = torch.empty(
            num_rows, num_heads, num_splits, head_dim, dtype=torch.float32, device=query.device
        )
        part_max = torch.empty(
            num_rows, num_heads, num_splits, dtype=torch.float32, device=query.device
        )
        part_sum = torch.empty_like(part_max)
    else:
        part_out = part_max = part_sum = out
    block_d = next_pow2(head_dim)
    dot_dtype, value_pairs, prmt_pairs = _widened_cache(query, kv_cache.dtype, block_d, fp8_read)
    pdl = uses_pdl(query.device)
    _decode_kernel[(num_rows, num_kv_heads, num_splits)](
        query,
        kv_cache[0],
        kv_cache[1],
        block_tables,
        seq_lens,
        out,
        part_out,
        part_max,
        part_sum,
        scale * k_scale * _LOG2E,
        v_scale,
        seq_lens.shape[0],
        -(-chosen.min_tokens // config.block_n),
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        block_tables.stride(0),
        NUM_KV_HEADS=num_kv_heads,
        GROUP=group,
        BLOCK_G=max(16, next_pow2(group)),
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        BLOCK_SIZE=block_size,
        TILE_N=config.block_n,
        SPLIT=split,
        PRECISION=dot_precision(query.dtype),
        DOT_DTYPE=_TL_DTYPES[dot_dtype],
        VALUE_PAIRS=value_pairs,
        PRMT_PAIRS=prmt_pairs,
        USE_PDL=pdl,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        launch_pdl=pdl,
    )
    if split:
        _decode_reduce_kernel[(num_rows, num_heads)](
            part_out,
            part_max,
            part_sum,
            out,
            num_splits,
            num_heads,
            out.stride(0),
            out.stride(1),
            HEAD_DIM=head_dim,
            BLOCK_D=block_d,
            BLOCK_S=next_pow2(num_splits),
            USE_PDL=pdl,
            num_warps=4,
            launch_pdl=pdl,
        )
    return out
