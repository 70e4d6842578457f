"""Fused mixture-of-experts: one grouped GEMM over all experts for gate/up (SiLU-and-mul fused)
and one for down (routing weights applied), over the (token, choice) pairs grouped by expert;
then each token's choices summed (top_k_sum).

The pairs are grouped by expert and each expert's run cut into row tiles (align_by_expert):
full tiles of block_m, the rest padded to block_m or, with tail_m, to tiles of tail_m rows
launched apart; so every row tile of the grouped GEMM belongs to one expert and reads its
weights once; the padding rows hold a sentinel index past the last pair and are masked.
Between the two GEMMs the activations stay in those sorted rows (gate/up writes each pair's at
its row), so down reads a tile's rows as one block, through Hopper's TMA unit where the rows
are 16-byte aligned (Rows).
At a token or two each row tile takes one pair instead, with no alignment launches at all,
and gate/up and down may run as grouped GEMVs instead (MoeTiles.up_gemv and down_gemv,
kernels/moe_gemv.py), down then summing each token's k choices itself.
The two GEMMs take tiles of their own (MoeTiles), tuned per shape and batch size on the
device (bench/moe_tune.py) into fused_moe_configs/.
Everything stays on the device with fixed-size outputs: no host sync, so CUDA graphs capture it.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from kernels._common import dot_precision, next_pow2, num_sms, uses_pdl
from kernels.moe_gemv import summed_down_gemv, up_gemv

CONFIG_DIR = Path(__file__).with_name("fused_moe_configs")
# (token, choice) pairs one program of the alignment counts or places
_PAIRS_PER_PROGRAM = 1024
# int32 counters a 128-byte line
_COUNT_STRIDE = 32
# choices x columns of one program of the top-k sum: 64 values a thread at 4 warps
_SUM_TILE_ELEMENTS = 8192
# shared memory kept back from the GEMM's pipeline for its epilogue's layout conversion
_EPILOGUE_SHARED_BYTES = 24 * 1024


@dataclass(frozen=True)
class MoeTileConfig:
    block_m: int
    block_n: int
    block_k: int
    group_m: int
    num_warps: int
    num_stages: int
    weight_tma: bool = False  # weight tiles through Hopper's TMA unit (a host descriptor)
    # down over the sorted rows, both operands through TMA: a program per SM walking the tiles
    persistent: bool = False


@dataclass(frozen=True)
class MoeTiles:
    """The tiles of the two grouped GEMMs: gate/up holds two accumulators and reads the hidden
    size, down one accumulator over the inner size, so they fit different tiles. They share
    the alignment: each expert's run in full tiles of block_m, its rest padded to block_m, or
    with tail_m to tiles of tail_m rows (fewer padded rows where runs are a tile or two long)."""

    up: MoeTileConfig
    down: MoeTileConfig
    tail_m: int = 0
    # at one pair a tile: gate/up as grouped GEMVs (kernels.moe_gemv), not 16-row MMA tiles
    up_gemv: bool = False
    # at one pair a tile: down as grouped GEMVs, each program summing its token's k choices
    down_gemv: bool = False

    def __post_init__(self) -> None:
        block_m = self.up.block_m
        if self.down.block_m != block_m:
            raise ValueError(f"block_m differs: up {block_m}, down {self.down.block_m}")
        if self.tail_m and (self.tail_m >= block_m or block_m % self.tail_m):
            raise ValueError(f"tail_m {self.tail_m} does not divide block_m {block_m}")

    @classmethod
    def same(cls, config: MoeTileConfig) -> MoeTiles:
        return cls(config, config)


@dataclass(frozen=True)
class RowTiles:
    """Row tiles of one height over the sorted pairs: each one's first row and its expert."""

    height: int
    rows: torch.Tensor  # int32 [capacity]
    experts: torch.Tensor  # int32 [capacity]
    count: torch.Tensor  # int32 [1]: tiles in use (programs past it return)


@dataclass(frozen=True)
class Rows:
    """Which of a grouped GEMM's operands are indexed by sorted row rather than by pair: the
    activations between the two GEMMs, so that down reads each tile's rows as one block."""

    sorted_a: bool = False
    sorted_out: bool = False


@dataclass(frozen=True)
class ExpertAlignment:
    """The (token, choice) pairs grouped by expert, each group padded to whole row tiles."""

    sorted_pair_ids: torch.Tensor  # int32 [max_padded]: pair index, num_pairs for padding
    num_pairs: int  # the (token, choice) pairs: T * k
    tiles: tuple[RowTiles, ...]  # the full tiles, then (tail_m) the tails' tiles
    # each row tile holds the one pair of its index (tiles[0].experts: the flat topk ids; the
    # rest unused), so nothing is sorted: at a token or two the alignment's launches cost
    # more than the GEMMs
    one_pair_tiles: bool = False


def pairs_as_tiles(topk_ids: torch.Tensor) -> ExpertAlignment:
    """The alignment with one pair per row tile, launch-free; it reads each pair's expert
    separately, so it is for pairs that rarely share an expert (see uses_one_pair_tiles)."""
    flat = topk_ids.flatten()
    tiles = (RowTiles(16, flat, flat, flat),)
    return ExpertAlignment(flat, flat.numel(), tiles, one_pair_tiles=True)


def sorted_rows(num_pairs: int, num_experts: int, pad_m: int) -> int:
    """The rows the pairs may take grouped by expert, each expert's run padded to pad_m."""
    return triton.cdiv(num_pairs + num_experts * (pad_m - 1), pad_m) * pad_m


def uses_one_pair_tiles(num_tokens: int, top_k: int, num_experts: int) -> bool:
    """One token's top-k experts are distinct; a few more tokens over many experts mostly so
    (4 tokens of Qwen3's top-8 of 128: about 10% read twice, from L2 while concurrent)."""
    return num_tokens * top_k <= max(num_experts // 4, top_k)


def align_by_expert(
    topk_ids: torch.Tensor, block_m: int, num_experts: int, tail_m: int = 0
) -> ExpertAlignment:
    """topk_ids [T, k] -> the pairs t * k + j grouped by expert (in no set order within a
    group: each pair's row is its own, so the order changes no output), each expert's run in
    full tiles of block_m, its rest padded to block_m (one list of tiles), or with tail_m to
    tail_m rows (a second list). Three launches after a zeroed count per expert (count,
    prefix, place, the first and last an atomic per pair) instead of a sort and a chain of
    small torch ops, which cost more than the GEMMs themselves at a few hundred tokens."""
    flat = topk_ids.flatten()
    num_pairs = flat.numel()
    pad_m = tail_m or block_m
    max_padded = sorted_rows(num_pairs, num_experts, pad_m)
    if tail_m:
        capacities = [
            num_pairs // block_m,
            min(max_padded // tail_m, num_experts * block_m // tail_m),
        ]
    else:
        capacities = [max_padded // block_m, 0]
    block_e = max(16, next_pow2(num_experts))
    device = flat.device
    # each expert's count, then (the prefix kernel) its next free row; one cache line each, so
    # that the atomics on them spread over L2's slices (in 4 lines they took 46 us at 8,192
    # tokens of Qwen3-30B-A3B on the H200)
    counts = torch.zeros(block_e, _COUNT_STRIDE, dtype=torch.int32, device=device)
    sorted_ids = torch.empty(max_padded, dtype=torch.int32, device=device)
    # each list 16-byte aligned, whatever its capacity: Triton specializes pointers on it
    stride = triton.cdiv(max(capacities), 4) * 4
    tile_rows = torch.empty(2, stride, dtype=torch.int32, device=device)
    tile_experts = torch.empty(2, stride, dtype=torch.int32, device=device)
    tile_counts = torch.empty(2, 4, dtype=torch.int32, device=device)
    pdl = uses_pdl(device)
    launch = {"USE_PDL": pdl, "launch_pdl": pdl}
    pair_args = (flat, counts, sorted_ids, num_pairs, max_padded)
    pair_launch = {
        "BLOCK_P": _PAIRS_PER_PROGRAM,
        "BLOCK_E": block_e,
        "COUNT_STRIDE": _COUNT_STRIDE,
        "num_warps": 4,
        **launch,
    }
    grid = (triton.cdiv(max_padded, _PAIRS_PER_PROGRAM),)  # max_padded >= num_pairs
    _expert_pairs_kernel[grid](*pair_args, PLACE=False, **pair_launch)
    _expert_prefix_kernel[(1,)](
        counts,
        tile_rows,
        tile_experts,
        tile_counts,
        *capacities,
        stride,
        tile_counts.stride(0),
        NUM_EXPERTS=num_experts,
        BLOCK_E=block_e,
        COUNT_STRIDE=_COUNT_STRIDE,
        BLOCK_M=block_m,
        TAIL_M=pad_m,
        BLOCK_T=64,
        num_warps=4,
        **launch,
    )
    _expert_pairs_kernel[(triton.cdiv(num_pairs, _PAIRS_PER_PROGRAM),)](
        *pair_args, PLACE=True, **pair_launch
    )
    heights = [block_m, tail_m]
    tiles = tuple(
        RowTiles(heights[i], tile_rows[i, :size], tile_experts[i, :size], tile_counts[i, :1])
        for i, size in enumerate(capacities)
        if size
    )
    return ExpertAlignment(sorted_ids, num_pairs, tiles)


@triton.jit(do_not_specialize=["num_pairs", "max_padded"])
def _expert_pairs_kernel(
    ids_ptr,
    counts_ptr,
    sorted_ids_ptr,
    num_pairs,
    max_padded,
    BLOCK_P: tl.constexpr,
    BLOCK_E: tl.constexpr,
    COUNT_STRIDE: tl.constexpr,
    PLACE: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """BLOCK_P pairs: without PLACE, counted per expert (an atomic add per expert present),
    and the same span of the sorted list set to the padding sentinel; with PLACE (the counts
    now each expert's next free row), each pair written to a row taken from its expert's."""
    if USE_PDL:  # every read here is the kernel before's output
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    pairs = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)
    is_pair = pairs < num_pairs
    expert = tl.load(ids_ptr + pairs, mask=is_pair, other=0).to(tl.int32)
    if PLACE:
        row = tl.atomic_add(counts_ptr + expert * COUNT_STRIDE, 1, mask=is_pair, sem="relaxed")
        tl.store(sorted_ids_ptr + row, pairs, mask=is_pair)
    else:
        tl.store(sorted_ids_ptr + pairs, num_pairs, mask=pairs < max_padded)
        # the pairs past the end in a bin of their own, never added
        bins = tl.arange(0, 2 * BLOCK_E)
        hist = tl.histogram(tl.where(is_pair, expert, BLOCK_E), 2 * BLOCK_E)
        counted = (bins < BLOCK_E) & (hist > 0)
        tl.atomic_add(counts_ptr + bins * COUNT_STRIDE, hist, mask=counted, sem="relaxed")


# sizes that vary with the batch: one compiled variant for all of them (Triton would specialize
# each on divisibility by 16, compiling again inside a timed run at a new batch size)
@triton.jit(do_not_specialize=["full_capacity", "tail_capacity", "stride_list"])
def _expert_prefix_kernel(
    counts_ptr,
    tile_rows_ptr,
    tile_experts_ptr,
    tile_counts_ptr,
    full_capacity,
    tail_capacity,
    stride_list,
    stride_counts,
    NUM_EXPERTS: tl.constexpr,
    BLOCK_E: tl.constexpr,
    COUNT_STRIDE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    TAIL_M: tl.constexpr,
    BLOCK_T: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """Each expert's padded run, the two lists of row tiles (full BLOCK_M tiles, then the
    TAIL_M tiles of each run's rest; with TAIL_M == BLOCK_M every tile is in the first), and
    the counts turned in place into each run's first row."""
    if USE_PDL:  # the counts are the kernel before's output
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    experts = tl.arange(0, BLOCK_E)
    counts = tl.load(counts_ptr + experts * COUNT_STRIDE)
    # one height: the rest of a run padded to a whole tile; two: the rest goes to the tails
    full = (counts + BLOCK_M - 1) // BLOCK_M if TAIL_M == BLOCK_M else counts // BLOCK_M
    tails = (tl.maximum(counts - full * BLOCK_M, 0) + TAIL_M - 1) // TAIL_M
    padded = full * BLOCK_M + tails * TAIL_M
    base = tl.cumsum(padded, 0) - padded
    _write_row_tiles(
        tile_rows_ptr,
        tile_experts_ptr,
        full_capacity,
        full,
        base,
        experts,
        BLOCK_M,
        NUM_EXPERTS,
        BLOCK_T,
    )
    _write_row_tiles(
        tile_rows_ptr + stride_list,
        tile_experts_ptr + stride_list,
        tail_capacity,
        tails,
        base + full * BLOCK_M,
        experts,
        TAIL_M,
        NUM_EXPERTS,
        BLOCK_T,
    )
    tl.store(tile_counts_ptr, tl.sum(full, 0))
    tl.store(tile_counts_ptr + stride_counts, tl.sum(tails, 0))
    tl.store(counts_ptr + experts * COUNT_STRIDE, base)


@triton.jit
def _write_row_tiles(
    rows_ptr,
    experts_ptr,
    capacity,
    tiles_per_expert,
    first_row,
    experts,
    HEIGHT: tl.constexpr,
    NUM_EXPERTS: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    """Tile j of the list: expert e's when j falls in e's share of the list (the tiles ordered
    by expert); its first row, e's first_row plus HEIGHT for each earlier tile of e's."""
    ends = tl.cumsum(tiles_per_expert, 0)
    row_of_first = first_row - (ends - tiles_per_expert) * HEIGHT
    for t0 in range(0, capacity, BLOCK_T):
        tile = t0 + tl.arange(0, BLOCK_T)
        expert = tl.sum((ends[None, :] <= tile[:, None]).to(tl.int32), 1)
        mine = expert[:, None] == experts[None, :]
        row = tl.sum(tl.where(mine, row_of_first[None, :], 0), 1) + tile * HEIGHT
        mask = tile < capacity
        tl.store(experts_ptr + tile, tl.minimum(expert, NUM_EXPERTS - 1), mask=mask)
        tl.store(rows_ptr + tile, row, mask=mask)


@triton.jit(do_not_specialize=["num_pairs", "group_m"])
def _grouped_gemm_kernel(
    a_ptr,
    w_ptr,
    out_ptr,
    sorted_pair_ids_ptr,
    tile_rows_ptr,
    tile_experts_ptr,
    num_tiles_ptr,
    topk_weights_ptr,
    num_pairs,
    rows_per_a,
    group_m,
    N,
    K,
    w_rows,
    stride_am,
    stride_we,
    stride_wn,
    stride_wk,
    stride_om,
    ONE_PAIR_TILES: tl.constexpr,
    A_SORTED: tl.constexpr,
    A_TMA: tl.constexpr,
    OUT_SORTED: tl.constexpr,
    SILU_AND_MUL: tl.constexpr,
    MUL_ROUTED_WEIGHT: tl.constexpr,
    EVEN_K: tl.constexpr,
    WEIGHT_TMA: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """out[pair, n] = a[pair // rows_per_a] . w[expert(pair), n] for one BLOCK_M x BLOCK_N tile;
    with SILU_AND_MUL, silu(gate) * up where the up row is n + N of the same expert.

    The weights' loads are unpredicated where K is a multiple of BLOCK_K (the columns past N
    wrap around, discarded by the masked store); a's are predicated on the row only, so padding
    rows read nothing (see _load_rows). With
    WEIGHT_TMA, w_ptr is a descriptor of the weights viewed [E * w_rows, K] (Hopper's TMA unit
    copies each tile, zero past K; rows past N belong to the next rows, discarded too).
    With A_SORTED, a's rows are the sorted rows themselves (the activations between the two
    GEMMs, which OUT_SORTED writes so), read whole, with A_TMA through a descriptor of a: its
    padding rows are read too, their outputs discarded by the masked store."""
    if USE_PDL:  # every read below but the weights' is the kernel before's output
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    pid = tl.program_id(0)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_pid_m = tl.num_programs(0) // num_pid_n
    # grouped ordering: group_m row tiles share each weight tile while it is in L2
    group = pid // (group_m * num_pid_n)
    first_m = group * group_m
    group_size = min(num_pid_m - first_m, group_m)
    pid_m = first_m + (pid % (group_m * num_pid_n)) % group_size
    pid_n = (pid % (group_m * num_pid_n)) // group_size
    if ONE_PAIR_TILES:
        pair = pid_m + tl.zeros((BLOCK_M,), dtype=tl.int64)
        row_mask = tl.arange(0, BLOCK_M) == 0
    else:
        if pid_m >= tl.load(num_tiles_ptr):
            return
        tile_row = tl.load(tile_rows_ptr + pid_m)
        offs_m = tile_row + tl.arange(0, BLOCK_M)
        pair = tl.load(sorted_pair_ids_ptr + offs_m).to(tl.int64)
        row_mask = pair < num_pairs
        pair = tl.where(row_mask, pair, 0)
    expert = tl.load(tile_experts_ptr + pid_m).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    a_index = offs_m.to(tl.int64) if A_SORTED else pair // rows_per_a
    if not A_TMA:
        a_rows = a_ptr + a_index[:, None] * stride_am
    if WEIGHT_TMA:
        w_row = (expert * w_rows + pid_n * BLOCK_N).to(tl.int32)
    else:
        w_cols = w_ptr + expert * stride_we + (offs_n % N)[None, :] * stride_wn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if SILU_AND_MUL:
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + offs_k
        if A_TMA:
            a = a_ptr.load([tile_row, k0])
        else:
            a = _load_rows(a_rows + k[None, :], row_mask[:, None], (k < K)[None, :], EVEN_K)
        if WEIGHT_TMA:
            w = w_ptr.load([w_row, k0]).T
        else:
            w = _load_k_tile(w_cols + k[:, None] * stride_wk, (k < K)[:, None], EVEN_K)
        acc = tl.dot(a, w, acc, input_precision=PRECISION)
        if SILU_AND_MUL:
            if WEIGHT_TMA:
                w_up = w_ptr.load([w_row + N, k0]).T
            else:
                w_up = w_cols + N * stride_wn + k[:, None] * stride_wk
                w_up = _load_k_tile(w_up, (k < K)[:, None], EVEN_K)
            acc_up = tl.dot(a, w_up, acc_up, input_precision=PRECISION)
    if SILU_AND_MUL:
        acc = acc * tl.sigmoid(acc) * acc_up
    if MUL_ROUTED_WEIGHT:
        routed = tl.load(topk_weights_ptr + pair, mask=row_mask, other=0.0).to(tl.float32)
        acc = acc * routed[:, None]
    if OUT_SORTED:
        out = out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    else:
        out = out_ptr + pair[:, None] * stride_om + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & (offs_n < N)[None, :])


@triton.jit(do_not_specialize=["num_pairs"])
def _persistent_down_kernel(
    a_desc,
    w_desc,
    out_ptr,
    sorted_pair_ids_ptr,
    tile_rows_ptr,
    tile_experts_ptr,
    num_tiles_ptr,
    topk_weights_ptr,
    num_pairs,
    N,
    K,
    w_rows,
    stride_om,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """down as _grouped_gemm_kernel with A_SORTED, A_TMA and WEIGHT_TMA, each program walking
    tiles num_programs apart: the loops flattened, so that the compiler's pipeline loads a
    tile's first K steps during the epilogue of the one before (K, the inner size, is a few
    steps: 12 of 64 for Qwen3-30B-A3B)."""
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_tiles = tl.load(num_tiles_ptr) * num_pid_n
    for tile in tl.range(tl.program_id(0), num_tiles, tl.num_programs(0), flatten=True):
        pid_m, pid_n = tile // num_pid_n, tile % num_pid_n
        tile_row, pair, row_mask = _tile_pairs(
            tile_rows_ptr, sorted_pair_ids_ptr, pid_m, num_pairs, BLOCK_M
        )
        expert = tl.load(tile_experts_ptr + pid_m)
        w_row = (expert * w_rows + pid_n * BLOCK_N).to(tl.int32)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            w = w_desc.load([w_row, k0]).T
            acc = tl.dot(a_desc.load([tile_row, k0]), w, acc, input_precision=PRECISION)
        acc = _times_routed_weights(acc, topk_weights_ptr, pair, row_mask)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        _store_rows(out_ptr, acc, pair, row_mask, offs_n, N, stride_om)


# The persistent kernel's pieces. _grouped_gemm_kernel keeps the same lines inline: built on
# these helpers, its gate/up compiled 7% slower on the H200 (bench/NOTES.md, session 41)
@triton.jit
def _tile_pairs(tile_rows_ptr, sorted_pair_ids_ptr, pid_m, num_pairs, BLOCK_M: tl.constexpr):
    """Row tile pid_m's first sorted row, its rows' pairs (0 on padding) and which hold one."""
    tile_row = tl.load(tile_rows_ptr + pid_m)
    pair = tl.load(sorted_pair_ids_ptr + tile_row + tl.arange(0, BLOCK_M)).to(tl.int64)
    row_mask = pair < num_pairs
    return tile_row, tl.where(row_mask, pair, 0), row_mask


@triton.jit
def _times_routed_weights(acc, topk_weights_ptr, pair, row_mask):
    routed = tl.load(topk_weights_ptr + pair, mask=row_mask, other=0.0).to(tl.float32)
    return acc * routed[:, None]


@triton.jit
def _store_rows(out_ptr, acc, rows, row_mask, offs_n, N, stride_om):
    out = out_ptr + rows[:, None] * stride_om + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & (offs_n < N)[None, :])


@triton.jit
def _load_k_tile(ptrs, k_mask, EVEN_K: tl.constexpr):
    return tl.load(ptrs) if EVEN_K else tl.load(ptrs, mask=k_mask, other=0.0)


@triton.jit
def _load_rows(ptrs, row_mask, k_mask, EVEN_K: tl.constexpr):
    """An activation tile, its padding rows zeros and unread. At decode sizes most of a 16-row
    tile is padding (at one pair a tile, 15 rows); read unpredicated, each fetched row 0 again
    (L1/L2 hits, but as many requests as the real rows' 16 times over at one token)."""
    mask = row_mask if EVEN_K else row_mask & k_mask
    return tl.load(ptrs, mask=mask, other=0.0)


def grouped_gemm(
    a: torch.Tensor,
    w: torch.Tensor,
    out: torch.Tensor,
    alignment: ExpertAlignment,
    topk_weights: torch.Tensor | None,
    rows_per_a: int,
    n: int,
    config: MoeTileConfig,
    rows: Rows = Rows(),
) -> None:
    """One of fused_experts' two GEMMs: out [pairs, n] from a's rows (pair // rows_per_a) and
    w [E, n or 2n, K]; w of 2n rows: silu(gate) * up; with topk_weights, times each pair's.
    rows says where a's and out's rows are the sorted rows instead (sorted_rows: how many).
    One launch for each list of row tiles."""
    for tiles in alignment.tiles:
        if alignment.one_pair_tiles or tiles.height == config.block_m:
            launch = config
        else:  # tails: of 16-64 rows, one warpgroup's MMA
            launch = dataclasses.replace(
                config, block_m=tiles.height, num_warps=min(config.num_warps, 4)
            )
        _launch_gemm(a, w, out, alignment, tiles, topk_weights, rows_per_a, n, launch, rows)


def _launch_gemm(
    a: torch.Tensor,
    w: torch.Tensor,
    out: torch.Tensor,
    alignment: ExpertAlignment,
    tiles: RowTiles,
    topk_weights: torch.Tensor | None,
    rows_per_a: int,
    n: int,
    config: MoeTileConfig,
    rows: Rows,
) -> None:
    a_tma = rows.sorted_a and tma_fits(a)
    if config.persistent and a_tma and config.weight_tma and topk_weights is not None:
        _launch_persistent_down(a, w, out, alignment, tiles, topk_weights, n, config)
        return
    silu_and_mul = w.shape[1] == 2 * n
    k = w.shape[2]
    block_m = 16 if alignment.one_pair_tiles else config.block_m
    grid = (tiles.experts.numel() * triton.cdiv(n, config.block_n),)
    pdl = uses_pdl(a.device)
    if config.weight_tma:
        w_arg = TensorDescriptor.from_tensor(w.view(-1, k), [config.block_n, config.block_k])
    else:
        w_arg = w
    a_arg = TensorDescriptor.from_tensor(a, [block_m, config.block_k]) if a_tma else a
    _grouped_gemm_kernel[grid](
        a_arg,
        w_arg,
        out,
        alignment.sorted_pair_ids,
        tiles.rows,
        tiles.experts,
        tiles.count,
        topk_weights if topk_weights is not None else out,
        alignment.num_pairs,
        rows_per_a,
        config.group_m,
        n,
        k,
        w.shape[1],
        a.stride(0),
        w.stride(0),
        w.stride(1),
        w.stride(2),
        out.stride(0),
        ONE_PAIR_TILES=alignment.one_pair_tiles,
        A_SORTED=rows.sorted_a,
        A_TMA=a_tma,
        OUT_SORTED=rows.sorted_out,
        SILU_AND_MUL=silu_and_mul,
        MUL_ROUTED_WEIGHT=topk_weights is not None,
        EVEN_K=k % config.block_k == 0,
        WEIGHT_TMA=config.weight_tma,
        BLOCK_M=block_m,
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        PRECISION=dot_precision(a.dtype),
        USE_PDL=pdl,
        num_warps=config.num_warps,
        num_stages=_stages_that_fit(config, a.element_size(), silu_and_mul, a.device),
        launch_pdl=pdl,
    )


def _launch_persistent_down(
    a: torch.Tensor,
    w: torch.Tensor,
    out: torch.Tensor,
    alignment: ExpertAlignment,
    tiles: RowTiles,
    topk_weights: torch.Tensor,
    n: int,
    config: MoeTileConfig,
) -> None:
    k = w.shape[2]
    programs = min(tiles.experts.numel() * triton.cdiv(n, config.block_n), num_sms(a.device))
    pdl = uses_pdl(a.device)
    _persistent_down_kernel[(programs,)](
        TensorDescriptor.from_tensor(a, [config.block_m, config.block_k]),
        TensorDescriptor.from_tensor(w.view(-1, k), [config.block_n, config.block_k]),
        out,
        alignment.sorted_pair_ids,
        tiles.rows,
        tiles.experts,
        tiles.count,
        topk_weights,
        alignment.num_pairs,
        n,
        k,
        w.shape[1],
        out.stride(0),
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        PRECISION=dot_precision(a.dtype),
        USE_PDL=pdl,
        num_warps=config.num_warps,
        num_stages=_stages_that_fit(config, a.element_size(), False, a.device),
        launch_pdl=pdl,
    )


def tma_fits(t: torch.Tensor) -> bool:
    """Whether Hopper's TMA unit can copy tiles of t's rows: its rows contiguous and, with its
    start, 16-byte aligned."""
    aligned = t.data_ptr() % 16 == 0 and t.stride(0) * t.element_size() % 16 == 0
    return t.dim() == 2 and t.stride(1) == 1 and aligned


def _stages_that_fit(
    config: MoeTileConfig, element_size: int, silu_and_mul: bool, device: torch.device
) -> int:
    """config.num_stages, fewer where the tiles' pipeline would overflow shared memory (fp32
    inputs take twice bf16's bytes; a table tuned in bf16 can ask for 4 stages of 128 x 64)."""
    if device.type != "cuda":
        return config.num_stages
    weight_tiles = 2 if silu_and_mul else 1
    stage = (config.block_m + weight_tiles * config.block_n) * config.block_k * element_size
    room = _shared_memory(device.index or 0) - _EPILOGUE_SHARED_BYTES
    return max(1, min(config.num_stages, room // stage))


@functools.lru_cache(maxsize=8)
def _shared_memory(device_index: int) -> int:
    return triton.runtime.driver.active.utils.get_device_properties(device_index)["max_shared_mem"]


def fused_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    tiles: MoeTiles | None = None,
) -> torch.Tensor:
    """sum_j topk_weights[t, j] * w2[e] @ (silu(w1[e] @ x[t]) * (w3[e] @ x[t])), e = topk_ids[t, j].

    x [T, H]; w13 [E, 2 * I, H] (gate rows, then up rows); w2 [E, H, I]; topk_* [T, k]."""
    num_tokens, top_k = topk_ids.shape
    num_experts, two_i, hidden = w13.shape
    inner = two_i // 2
    tiles = tiles or tile_config(num_experts, inner, hidden, num_tokens, x.device, top_k)
    if num_tokens == 0:
        return torch.empty(0, hidden, dtype=x.dtype, device=x.device)
    alignment = align_for(topk_ids, tiles.up.block_m, num_experts, tiles.tail_m)
    # grouped, the activations are kept in the sorted rows, so down reads a tile as one block
    grouped = not alignment.one_pair_tiles
    rows = alignment.sorted_pair_ids.numel() if grouped else alignment.num_pairs
    activated = torch.empty(rows, inner, dtype=x.dtype, device=x.device)
    if alignment.one_pair_tiles and tiles.up_gemv:
        up_gemv(x, w13, topk_ids.flatten(), activated)
    else:
        grouped_gemm(
            x, w13, activated, alignment, None, top_k, inner, tiles.up, Rows(sorted_out=grouped)
        )
    weights = topk_weights.flatten()  # a view: the kernel reads it in fp32
    if alignment.one_pair_tiles and tiles.down_gemv:
        out = torch.empty(num_tokens, hidden, dtype=x.dtype, device=x.device)
        summed_down_gemv(activated, w2, out, topk_ids.flatten(), weights)
        return out
    out = torch.empty(num_tokens, top_k, hidden, dtype=x.dtype, device=x.device)
    down_rows = Rows(sorted_a=grouped)
    grouped_gemm(
        activated, w2, out.view(-1, hidden), alignment, weights, 1, hidden, tiles.down, down_rows
    )
    return top_k_sum(out)


def top_k_sum(rows: torch.Tensor) -> torch.Tensor:
    """rows [T, k, H] -> [T, H], summed in fp32: one read of the rows at about the copy
    bandwidth (torch's sum over the middle dimension took 99 us at 8,192 tokens of Qwen3-30B-A3B
    on the H200, 0.73 of it)."""
    num_tokens, top_k, hidden = rows.shape
    out = torch.empty(num_tokens, hidden, dtype=rows.dtype, device=rows.device)
    block_k = next_pow2(top_k)
    block_h = min(next_pow2(hidden), max(16, _SUM_TILE_ELEMENTS // block_k))
    pdl = uses_pdl(rows.device)
    _top_k_sum_kernel[(num_tokens, triton.cdiv(hidden, block_h))](
        rows,
        out,
        hidden,
        TOP_K=top_k,
        BLOCK_K=block_k,
        BLOCK_H=block_h,
        USE_PDL=pdl,
        num_warps=4,
        launch_pdl=pdl,
    )
    return out


@triton.jit(do_not_specialize=["hidden"])
def _top_k_sum_kernel(
    rows_ptr,
    out_ptr,
    hidden,
    TOP_K: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_H: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """BLOCK_H columns of one token's TOP_K rows, summed."""
    if USE_PDL:  # the rows are the kernel before's output
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    choices = tl.arange(0, BLOCK_K)
    mask = (choices < TOP_K)[:, None] & (cols < hidden)[None, :]
    ptrs = rows_ptr + (token * TOP_K + choices)[:, None] * hidden + cols[None, :]
    total = tl.sum(tl.load(ptrs, mask=mask, other=0.0).to(tl.float32), 0)
    tl.store(
        out_ptr + token * hidden + cols, total.to(out_ptr.dtype.element_ty), mask=cols < hidden
    )


def align_for(
    topk_ids: torch.Tensor, block_m: int, num_experts: int, tail_m: int = 0
) -> ExpertAlignment:
    """The pairs as the grouped GEMMs read them: one a row tile at a token or two, else grouped
    by expert in tiles of block_m (and tail_m: see align_by_expert)."""
    num_tokens, top_k = topk_ids.shape
    if uses_one_pair_tiles(num_tokens, top_k, num_experts):
        return pairs_as_tiles(topk_ids)
    return align_by_expert(topk_ids, block_m, num_experts, tail_m)


def tile_config(
    num_experts: int,
    inner: int,
    hidden: int,
    num_tokens: int,
    device: torch.device,
    top_k: int = 1,
) -> MoeTiles:
    """The committed tiles for this shape on this device at the batch size measured nearest
    in ratio (the sweep's sizes are powers of two and more), else a default by batch size."""
    table = _config_table(num_experts, inner, hidden, _device_name(device))
    if table:
        nearest = min(table, key=lambda m: abs(math.log(m / max(num_tokens, 1))))
        return table[nearest]
    return MoeTiles.same(default_tile_config(num_tokens, num_tokens * top_k / num_experts))


def default_tile_config(num_tokens: int, rows_per_expert: float | None = None) -> MoeTileConfig:
    """Decode: 16- then 32-row tiles (>= 70% of the copy bandwidth from 2 tokens on Mixtral's
    shape on the H200). Prefill: row tiles about the size of each expert's run (rows_per_expert,
    default num_tokens), so padding stays under about a third; from 64 rows the Hopper-sized
    tiles of the published configs (64-128 x 128 per accumulator, gate and up being two, K 64,
    4 stages where the shared memory allows)."""
    rows = num_tokens if rows_per_expert is None else rows_per_expert
    if num_tokens <= 32:
        return MoeTileConfig(16, 64, 64, 1, 4, 3)
    if num_tokens <= 128:
        return MoeTileConfig(32, 64, 64, 8, 4, 3)
    if rows < 48:
        return MoeTileConfig(32, 128, 64, 8, 4, 4)
    if rows < 192:
        return MoeTileConfig(64, 128, 64, 8, 4, 4)
    return MoeTileConfig(128, 128, 64, 16, 8, 3)


def config_file_name(num_experts: int, inner: int, hidden: int, device_name: str) -> str:
    return f"E={num_experts},N={inner},K={hidden},device={device_name}.json"


@functools.lru_cache(maxsize=8)
def _device_name(device: torch.device) -> str:
    if device.type != "cuda":
        return "cpu"
    return torch.cuda.get_device_name(device).replace(" ", "_")


@functools.lru_cache(maxsize=32)
def _config_table(
    num_experts: int, inner: int, hidden: int, device_name: str
) -> dict[int, MoeTiles]:
    path = CONFIG_DIR / config_file_name(num_experts, inner, hidden, device_name)
    if not path.exists():
        return {}
    return {int(m): tiles_from_json(entry) for m, entry in json.loads(path.read_text()).items()}


def tiles_from_json(entry: dict) -> MoeTiles:
    """A table entry: {"up": {...}, "down": {...}, "tail_m": n}, or one config for both
    (older tables)."""
    if "up" in entry:
        up, down = MoeTileConfig(**entry["up"]), MoeTileConfig(**entry["down"])
        extras = {name: entry[name] for name in ("tail_m", "up_gemv", "down_gemv") if name in entry}
        return MoeTiles(up, down, **extras)
    return MoeTiles.same(MoeTileConfig(**entry))


def tiles_to_json(tiles: MoeTiles) -> dict:
    up, down = dataclasses.asdict(tiles.up), dataclasses.asdict(tiles.down)
    return {
        "up": up,
        "down": down,
        "tail_m": tiles.tail_m,
        "up_gemv": tiles.up_gemv,
        "down_gemv": tiles.down_gemv,
    }
