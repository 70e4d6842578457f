"""Paged MLA decode: each query row's heads, absorbed into latent space, against one shared
latent per cached token (DeepSeek-V2's compressed KV cache), optionally split over the context.

Cache: [1, num_blocks, block_size, 1, kv_lora_rank + rope_dim]; a token's entry is its latent
(which is also its value) followed by its rope key. One program takes BLOCK_H heads of a row
and one split of its context, so each latent tile is read once for all those heads.

Scores are [heads, tokens]: with 16 heads M is 16, below the 64 of Hopper's wgmma, so Triton
uses mma.sync. [tokens, heads] (tokens as M, for wgmma) lost at every batch in the H200 sweep
(mla_sweep_h200.json, 2026-12-02: at 2 stages, as 3 do not fit in shared memory) and is gone.
With M = 16, a warp's share of the scores is 8 tokens over the whole rank: one chain of
dependent MMAs. The latent is read as two halves, making it two chains.

Splits write their output normalised, in the query's dtype, beside its log-sum-exp: half the
bytes of fp32 partials (at 16 heads and rank 512 a split's partial is 16 KB, the latents of 14
tokens, written once and read once by the merge). The merge is a second launch
(merge_mla_splits), or, with MLADecodeConfig.fold_merge, the last split of a row to finish
merges them: an atomic count per (row, head block) tells it that it is last, and it sets the
count back to zero, so counters zeroed once stay zeroed between calls.

MLADecodeConfig.head_groups > 1 gives a row's heads to that many programs, each reading the
row's latents: launched side by side, the second read mostly hits L2, and the row needs that
many times fewer context splits (so less to merge) to fill the GPU. MLADecodeConfig.
prefetch_tokens asks L2 for the cached tokens that far ahead of the tile in hand: reads in
flight beyond the two shared-memory stages that fit (a 64-token stage is 74 KB).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels._common import dot_precision, next_pow2, num_sms, uses_pdl

_LOG2E = 1.4426950408889634
# the merge holds a split per row of its tile: 128 splits of 32 tokens cover a 4,096-token
# context at batch one with a program per SM
MAX_SPLITS = 128
# elements of the merge's [splits, rank chunk] tile: 32 a thread at 4 warps
_MERGE_TILE = 4096


@dataclass(frozen=True)
class MLADecodeConfig:
    """Launch shape of the paged MLA decode kernel."""

    tile_n: int  # cached tokens a loop step reads
    num_warps: int
    num_stages: int
    programs_per_sm: int  # split each context until the launch has this many programs per SM
    head_groups: int = 1  # programs that share a row's heads, each reading its latents
    fold_merge: bool = False  # the last split of a row merges, in the same launch
    prefetch_tokens: int = 0  # cached tokens asked of L2 ahead of the tile in hand (CUDA only)


# steps of at most `rows` rows -> (tile_n, num_warps, num_stages, programs_per_sm, head_groups,
# fold_merge, prefetch_tokens), bf16/fp16 at DeepSeek's widths (rank 512 + rope 64); the last
# row holds for more rows.
# bench/mla_sweep.py prints this table from its H200 run (bench/results/mla_sweep_h200.json).
CONFIG_TABLE = (
    (1, 64, 8, 3, 1, 1, False, 256),
    (8, 32, 4, 3, 2, 1, False, 0),
    (32, 64, 8, 3, 1, 1, True, 0),
    (64, 64, 8, 3, 1, 1, True, 0),
    (128, 32, 4, 3, 2, 1, True, 0),
    (256, 32, 4, 3, 2, 1, False, 0),
)
# fp32 (tests, the reference checks): 16-token tiles keep three stages in shared memory
FP32_CONFIG = MLADecodeConfig(16, 8, 3, 1)


def mla_decode_config(num_rows: int, dtype: torch.dtype) -> MLADecodeConfig:
    """The table's config for a step of num_rows rows."""
    if dtype == torch.float32:
        return FP32_CONFIG
    entry = next((e for e in CONFIG_TABLE if num_rows <= e[0]), CONFIG_TABLE[-1])
    return MLADecodeConfig(*entry[1:])


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
def _split_chunk(length, num_splits, TILE_N: tl.constexpr):
    """Tokens per split of a row's context, whole tiles: splits past the context are empty."""
    return tl.cdiv(tl.cdiv(length, num_splits), TILE_N) * TILE_N


@triton.jit
def _tile_slots(table_ptr, pos0, end, BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr):
    """The cache rows of the TILE_N tokens from pos0 (row 0 past end)."""
    pos = pos0 + tl.arange(0, TILE_N)
    block = tl.load(table_ptr + pos // BLOCK_SIZE, mask=pos < end, other=0)
    return block.to(tl.int64) * BLOCK_SIZE + pos % BLOCK_SIZE


@triton.jit
def _prefetch_tile(
    cache_ptr,
    table_ptr,
    pos0,
    end,
    WIDTH: tl.constexpr,
    LINE: tl.constexpr,
    BLOCK_LINES: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
):
    """Asks L2 for the cache rows of the TILE_N tokens from pos0 (none past end), a 128-byte
    line (LINE entries) at a time: reads in flight beyond what the shared-memory stages hold."""
    if pos0 < end:
        slots = _tile_slots(table_ptr, pos0, end, BLOCK_SIZE, TILE_N)
        lines = tl.minimum(tl.arange(0, BLOCK_LINES), tl.cdiv(WIDTH, LINE) - 1)
        line_ptrs = cache_ptr + slots[:, None] * WIDTH + lines[None, :] * LINE
        tl.inline_asm_elementwise(
            "prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;",
            "=r,l",
            [line_ptrs],
            dtype=tl.int32,
            is_pure=False,
            pack=1,
        )


@triton.jit
def _latent_rows(
    rows,
    row_mask,
    RANK: tl.constexpr,
    ROPE: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    """Entries of rank + rope values from the pointers rows: the latent's halves [rows, HALF]
    x 2 and the rope part [rows, BLOCK_R] (cache rows, or the query's heads)."""
    half = tl.arange(0, HALF)
    rope = tl.arange(0, BLOCK_R)
    rows = rows[:, None]
    lo = tl.load(rows + half[None, :], mask=row_mask[:, None] & (half < RANK)[None, :], other=0.0)
    hi_mask = row_mask[:, None] & (HALF + half < RANK)[None, :]
    hi = tl.load(rows + HALF + half[None, :], mask=hi_mask, other=0.0)
    pe_mask = row_mask[:, None] & (rope < ROPE)[None, :]
    pe = tl.load(rows + RANK + rope[None, :], mask=pe_mask, other=0.0)
    return lo, hi, pe


@triton.jit
def _scores(q_lo, q_hi, q_pe, c_lo, c_hi, pe, PRECISION: tl.constexpr):
    """[heads, tokens]: the latent halves as two independent chains of MMAs (one chain over the
    whole rank is 36 dependent MMAs a warp at rank 512), the rope keys after the second; the fma
    joins them where an add would fold one product into the other's accumulator."""
    lo = tl.dot(q_lo, tl.trans(c_lo), input_precision=PRECISION)
    hi = tl.dot(q_hi, tl.trans(c_hi), input_precision=PRECISION)
    return tl.fma(lo, 1.0, tl.dot(q_pe, tl.trans(pe), hi, input_precision=PRECISION))


@triton.jit
def _merge_weight(lse, top):
    """2^(lse - top): zero for an empty split (lse -inf), also when every split is empty."""
    return tl.exp2(lse - tl.where(top == float("-inf"), 0.0, top))


@triton.jit
def _merge_if_last(
    counter_ptr,
    part_out_ptr,
    part_lse_ptr,
    out_ptr,
    head_rows,
    head_mask,
    lat,
    out_mask,
    live,
    num_splits,
    RANK: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_L: tl.constexpr,
):
    """Counts this split in; the last of the row's live splits to arrive merges their partials
    (head_rows: row * NUM_HEADS + heads) into the output and sets the count back to zero."""
    tl.debug_barrier()  # every thread's partial stored before the release below
    if tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu") == live - 1:
        top = tl.full((BLOCK_H,), float("-inf"), dtype=tl.float32)
        total = tl.zeros((BLOCK_H,), dtype=tl.float32)
        acc = tl.zeros((BLOCK_H, BLOCK_L), dtype=tl.float32)
        for s in tl.range(0, live, num_stages=3):
            parts = head_rows * num_splits + s
            # other SMs wrote these: the acquire above emptied this SM's L1 (CCTL.IVALL)
            lse = tl.load(
                part_lse_ptr + parts, mask=head_mask, other=float("-inf"), cache_modifier=".cg"
            )
            part = tl.load(
                part_out_ptr + parts[:, None] * RANK + lat[None, :],
                mask=out_mask,
                other=0.0,
                cache_modifier=".cg",
            )
            new_top = tl.maximum(top, lse)
            alpha = _merge_weight(top, new_top)
            weight = _merge_weight(lse, new_top)
            acc = acc * alpha[:, None] + part.to(tl.float32) * weight[:, None]
            total = total * alpha + weight
            top = new_top
        out = acc / tl.where(total > 0, total, 1.0)[:, None]
        out_rows = out_ptr + head_rows[:, None] * RANK + lat[None, :]
        tl.store(out_rows, out.to(out_ptr.dtype.element_ty), mask=out_mask)
        tl.store(counter_ptr, 0)


@triton.jit
def _mla_decode_kernel(
    q_ptr,
    cache_ptr,
    block_tables_ptr,
    request_ptr,
    length_ptr,
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    counter_ptr,
    scale_log2,
    q_stride_t,
    q_stride_h,
    block_table_stride,
    NUM_HEADS: tl.constexpr,
    HEADS_PER_BLOCK: tl.constexpr,
    RANK: tl.constexpr,
    ROPE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_L: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    SPLIT: tl.constexpr,
    FOLD: tl.constexpr,
    PREFETCH: tl.constexpr,
    LINE: tl.constexpr,
    BLOCK_LINES: tl.constexpr,
    PRECISION: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """HEADS_PER_BLOCK heads (in a BLOCK_H tile) of a row over one split of its context: with
    SPLIT, the split's normalised output and its log-sum-exp (log2 units) for the merge (FOLD:
    the last split merges them), nothing for an empty split past the first; else (one split)
    the output itself [T, H, RANK]. Programs run over (row, head block), then splits."""
    if USE_PDL:  # launched early: the query and the cache are the kernels before's output
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    program = tl.program_id(0)
    head_blocks = tl.cdiv(NUM_HEADS, HEADS_PER_BLOCK)
    row = (program // head_blocks).to(tl.int64)
    head_block = program % head_blocks
    split = tl.program_id(1)
    num_splits = tl.num_programs(1)
    length = tl.load(length_ptr + row)
    request = tl.load(request_ptr + row).to(tl.int64)
    chunk = _split_chunk(length, num_splits, TILE_N)
    start = split * chunk
    if SPLIT:  # noqa: SIM102 (a compile-time branch around a run-time one)
        # the merge skips empty splits, from the same lengths; the first always runs, so a row
        # with no context has a program to merge its zeros. The request (never negative) is in
        # the test so that its load goes out beside the length's, not a round trip after it.
        if (start >= length) & (split > 0) & (request >= 0):
            return
    end = tl.minimum(start + chunk, length)
    table_ptr = block_tables_ptr + request * block_table_stride
    h = tl.arange(0, BLOCK_H)
    heads = head_block * HEADS_PER_BLOCK + h
    head_mask = (h < HEADS_PER_BLOCK) & (heads < NUM_HEADS)
    HALF: tl.constexpr = BLOCK_L // 2
    lat = tl.arange(0, BLOCK_L)
    q_rows = q_ptr + row * q_stride_t + heads * q_stride_h
    q_lo, q_hi, q_pe = _latent_rows(q_rows, head_mask, RANK, ROPE, HALF, BLOCK_R)
    m = tl.full((BLOCK_H,), float("-inf"), dtype=tl.float32)
    # row sums kept per thread, summed across warps once at the end, not once a step
    sums = tl.zeros((BLOCK_H, TILE_N), dtype=tl.float32)
    acc_lo = tl.zeros((BLOCK_H, HALF), dtype=tl.float32)
    acc_hi = tl.zeros((BLOCK_H, HALF), dtype=tl.float32)
    for ahead in tl.static_range(0, PREFETCH, TILE_N):
        _prefetch_tile(
            cache_ptr,
            table_ptr,
            start + ahead,
            end,
            RANK + ROPE,
            LINE,
            BLOCK_LINES,
            BLOCK_SIZE,
            TILE_N,
        )
    slots = _tile_slots(table_ptr, start, end, BLOCK_SIZE, TILE_N)
    for pos0 in range(start, end, TILE_N):
        if PREFETCH > 0:
            _prefetch_tile(
                cache_ptr,
                table_ptr,
                pos0 + PREFETCH,
                end,
                RANK + ROPE,
                LINE,
                BLOCK_LINES,
                BLOCK_SIZE,
                TILE_N,
            )
        pos_mask = pos0 + tl.arange(0, TILE_N) < end
        cache_rows = cache_ptr + slots * (RANK + ROPE)
        c_lo, c_hi, pe = _latent_rows(cache_rows, pos_mask, RANK, ROPE, HALF, BLOCK_R)
        # the next tile's rows a step ahead: the latents' loads then wait on no load of their
        # own step, so the pipeliner issues them num_stages - 1 steps ahead, not one
        slots = _tile_slots(table_ptr, pos0 + TILE_N, end, BLOCK_SIZE, TILE_N)
        scores = _scores(q_lo, q_hi, q_pe, c_lo, c_hi, pe, PRECISION)
        scores = tl.where(pos_mask[None, :], scores * scale_log2, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, 1))  # finite: a step has a position in range
        p = tl.exp2(scores - m_new[:, None])
        alpha = tl.exp2(m - m_new)[:, None]
        sums = sums * alpha + p
        p = p.to(c_lo.dtype)
        acc_lo = tl.dot(p, c_lo, acc_lo * alpha, input_precision=PRECISION)
        acc_hi = tl.dot(p, c_hi, acc_hi * alpha, input_precision=PRECISION)
        m = m_new
    total = tl.sum(sums, 1)
    acc = tl.reshape(tl.permute(tl.join(acc_lo, acc_hi), (0, 2, 1)), (BLOCK_H, BLOCK_L))
    out = acc / tl.where(total > 0, total, 1.0)[:, None]
    out_mask = head_mask[:, None] & (lat < RANK)[None, :]
    head_rows = row * NUM_HEADS + heads
    if SPLIT:
        part = head_rows * num_splits + split
        tl.store(part_lse_ptr + part, m + tl.log2(total), mask=head_mask)
        part_out = part_out_ptr + part[:, None] * RANK + lat[None, :]
        tl.store(part_out, out.to(part_out_ptr.dtype.element_ty), mask=out_mask)
        if FOLD:
            live = tl.maximum(tl.cdiv(length, tl.maximum(chunk, 1)), 1)
            _merge_if_last(
                counter_ptr + program,
                part_out_ptr,
                part_lse_ptr,
                out_ptr,
                head_rows,
                head_mask,
                lat,
                out_mask,
                live,
                num_splits,
                RANK,
                BLOCK_H,
                BLOCK_L,
            )
    else:
        out_rows = out_ptr + head_rows[:, None] * RANK + lat[None, :]
        tl.store(out_rows, out.to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _merge_splits_kernel(
    part_out_ptr,
    part_lse_ptr,
    length_ptr,
    out_ptr,
    num_splits,
    NUM_HEADS: tl.constexpr,
    RANK: tl.constexpr,
    TILE_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """One head's BLOCK_D output columns: its splits' normalised outputs weighed by 2^lse."""
    if USE_PDL:  # launched early: the partial results are the kernel before's output
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    d = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
    s = tl.arange(0, BLOCK_S)
    parts = (row * NUM_HEADS + head) * num_splits + s
    # read before the length, beside it: empty splits' entries were never written, and the
    # selects below drop them (a zero weight times their garbage could be NaN)
    lse = tl.load(part_lse_ptr + parts, mask=s < num_splits, other=float("-inf"))
    part_mask = (s < num_splits)[:, None] & (d < RANK)[None, :]
    part = tl.load(part_out_ptr + parts[:, None] * RANK + d[None, :], mask=part_mask, other=0.0)
    length = tl.load(length_ptr + row)
    live = (s < num_splits) & (s * _split_chunk(length, num_splits, TILE_N) < length)
    lse = tl.where(live, lse, float("-inf"))
    part = tl.where(live[:, None], part, 0.0)
    weight = _merge_weight(lse, tl.max(lse, 0))
    total = tl.sum(weight, 0)
    out = tl.sum(part.to(tl.float32) * weight[:, None], 0) / tl.where(total > 0, total, 1.0)
    tl.store(
        out_ptr + (row * NUM_HEADS + head) * RANK + d,
        out.to(out_ptr.dtype.element_ty),
        mask=d < RANK,
    )


@dataclass(frozen=True)
class HeadBlocks:
    """How a row's heads are shared out: `count` programs of `heads` heads, in BLOCK_H tiles."""

    heads: int
    count: int
    tile: int


def head_blocks(num_heads: int, head_groups: int) -> HeadBlocks:
    """At most 64 heads a program (the tile's rows), at least 16 rows in its tile (mma's M)."""
    heads = min(triton.cdiv(num_heads, head_groups), 64)
    return HeadBlocks(heads, triton.cdiv(num_heads, heads), max(16, next_pow2(heads)))


def choose_mla_splits(
    num_rows: int,
    num_head_blocks: int,
    capacity: int,
    config: MLADecodeConfig,
    device: torch.device,
) -> int:
    """Splits of each context that bring the launch to config.programs_per_sm programs per SM
    without passing it (a partial last wave would take as long as a full one), at most
    MAX_SPLITS and none shorter than a tile of the block table's capacity; from shapes alone,
    so a CUDA graph keeps its choice."""
    programs = max(num_rows * num_head_blocks, 1)
    by_occupancy = config.programs_per_sm * num_sms(device) // programs
    by_length = triton.cdiv(capacity, config.tile_n)
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
    config: MLADecodeConfig | None = None,
    counters: torch.Tensor | None = None,
) -> torch.Tensor:
    """query [T, H, rank + rope]; row t attends to the first length[t] cached tokens of request
    request[t]'s blocks -> [T, H, rank] (zeros where length is 0). config: the table's
    (mla_decode_config) unless given; num_splits: chosen from it unless given. counters: for a
    folded merge, int32 zeros, T x head blocks or more, left zero (None: zeroed here)."""
    num_rows, num_heads, width = query.shape
    config = config or mla_decode_config(num_rows, query.dtype)
    blocks = head_blocks(num_heads, config.head_groups)
    capacity = block_tables.shape[1] * kv_cache.shape[2]
    splits = num_splits or choose_mla_splits(num_rows, blocks.count, capacity, config, query.device)
    out = torch.empty(num_rows, num_heads, kv_lora_rank, dtype=query.dtype, device=query.device)
    if not num_rows:
        return out
    fold = config.fold_merge and splits > 1
    part_out, part_lse = _split_buffers(out, splits)
    if fold and counters is None:
        counters = torch.zeros(num_rows * blocks.count, dtype=torch.int32, device=query.device)
    pdl = uses_pdl(query.device)
    _mla_decode_kernel[(num_rows * blocks.count, splits)](
        query,
        kv_cache,
        block_tables,
        request,
        length,
        out,
        part_out,
        part_lse,
        counters if fold else out,
        scale * _LOG2E,
        query.stride(0),
        query.stride(1),
        block_tables.stride(0),
        NUM_HEADS=num_heads,
        HEADS_PER_BLOCK=blocks.heads,
        RANK=kv_lora_rank,
        ROPE=width - kv_lora_rank,
        BLOCK_H=blocks.tile,
        BLOCK_L=max(32, next_pow2(kv_lora_rank)),  # halves of 16 or more: MMA's K
        BLOCK_R=max(16, next_pow2(width - kv_lora_rank)),
        BLOCK_SIZE=kv_cache.shape[2],
        TILE_N=config.tile_n,
        SPLIT=splits > 1,
        FOLD=fold,
        PREFETCH=config.prefetch_tokens if query.is_cuda else 0,  # PTX: not in the interpreter
        LINE=128 // kv_cache.element_size(),
        BLOCK_LINES=next_pow2(triton.cdiv(width * kv_cache.element_size(), 128)),
        PRECISION=dot_precision(query.dtype),
        USE_PDL=pdl,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        launch_pdl=pdl,
    )
    if splits > 1 and not fold:
        merge_mla_splits(part_out, part_lse, length, out, config.tile_n)
    return out


def _split_buffers(out: torch.Tensor, splits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A split launch's normalised partials [T, H, splits, rank] in out's dtype and their
    log-sum-exps [T, H, splits]; with one split out stands in for both (they go unused)."""
    if splits == 1:
        return out, out
    num_rows, num_heads, rank = out.shape
    part_lse = torch.empty(num_rows, num_heads, splits, dtype=torch.float32, device=out.device)
    return out.new_empty(num_rows, num_heads, splits, rank), part_lse


def merge_mla_splits(
    part_out: torch.Tensor,
    part_lse: torch.Tensor,
    length: torch.Tensor,
    out: torch.Tensor,
    tile_n: int,
) -> None:
    """The split partials [T, H, splits, rank] and log-sum-exps [T, H, splits] into out
    [T, H, rank], in one launch of a program per (row, head, rank chunk): at batch one the
    chunks give the merge more than the 16 heads' programs."""
    num_rows, num_heads, splits, rank = part_out.shape
    block_s = next_pow2(splits)
    block_d = min(next_pow2(rank), max(16, _MERGE_TILE // block_s))
    pdl = uses_pdl(out.device)
    _merge_splits_kernel[(num_rows, num_heads, triton.cdiv(rank, block_d))](
        part_out,
        part_lse,
        length,
        out,
        splits,
        NUM_HEADS=num_heads,
        RANK=rank,
        TILE_N=tile_n,
        BLOCK_D=block_d,
        BLOCK_S=block_s,
        USE_PDL=pdl,
        num_warps=4,
        launch_pdl=pdl,
    )
