"""out = x @ W for 4-bit weights (AWQ, GPTQ, compressed-tensors pack-quantized, all repacked to
one layout at load): W[k, n] = (q[k, n] - zeros[g, n]) * scales[g, n], g = k // group_size.
q packs 8 values of K per int32, interleaved: value 2j at bits 4j and value 2j + 1 at bits
16 + 4j of qweight[k // 8, n] (j = k % 8 // 2), so that one shift and one mask put a pair of
consecutive values in the two 16-bit halves of a word. zeros hold whole numbers (every
format's zero points are).

Batches of up to GEMV_MAX_ROWS rows (decode) should be bound by reading W: an H200 streams
8.4e12 4-bit weights a second (4.2 TB/s) and issues 3.3e13 thread instructions (integer logic
at half that), about 4 issue slots a weight. Widening in fp32 (shift, mask, subtract and FMA
per weight) took about 6: ALU-bound. The packed path takes 19 instructions a word of 8
(3 shifts, 4 lop3, 4 packed subtractions, 4 packed FMAs, 2 widenings, 2 fp32 ops; ptxas's
sm_90 loop has 25). In bf16 or fp16 on the GPU (inline PTX): OR-ing a pair of nibbles into
the mantissas of two halves of 128 (bf16) or 1024 (fp16) gives 128 + q exactly, one packed
subtraction of 128 + z leaves q - z, and packed FMAs take the 8 values of a word against 8 of
x; the word's two half sums are added in fp32. Elsewhere (fp32, or the CPU interpreter) the
same sums run in fp32 with the nibbles widened through the mantissa of 2^23. A tile is SLICES
slices of BLOCK_R packed rows, each slice inside one group, its scale applied once per word;
the rows' sums are kept apart until the end, so nothing crosses threads in the loop. K is
split in up to `splits` parts, their sums added atomically in fp32 (a zero-fill and a cast
launch around the kernel); unsplit, the kernel writes the output in its dtype, one launch.
W is read once whatever the rows: each word is unpacked once for all of them.

Larger batches unpack a [BLOCK_K, BLOCK_N] tile of W to the activations' dtype for a
tensor-core dot.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels._common import configs_by_shape, dot_precision, next_pow2, uses_pdl

# rows at or below which the GEMV kernel runs
GEMV_MAX_ROWS = 4
# 2^23 as float bits: 2^23 + q for q < 2^23 has q as its mantissa
_MAGIC = tl.constexpr(0x4B000000)
_MAGIC_F = tl.constexpr(8388608.0)
# the half (packed) path's dtypes: 128 and 1024 have a unit last place in bf16 and fp16
NO_HALF = tl.constexpr(0)
BF16 = tl.constexpr(1)
FP16 = tl.constexpr(2)

# a word's nibbles at bits 0..3 and 16..19 (after a shift of 4j: values 2j and 2j + 1), and the
# bits of a pair of 128s (bf16) and 1024s (fp16) that they are OR-ed into
PAIR_MASK = 0x000F000F
HALF_MAGIC_BITS = {torch.bfloat16: 0x43004300, torch.float16: 0x64006400}
# (128 + q) pairs of a word's 4 shifts: bits 4j..4j+3 and 16+4j..16+4j+3 into both mantissas,
# then the packed 128 + z subtracted; outputs the pairs (q - z) of values 2j, 2j + 1
_UNPACK = """{{
.reg .b32 t<4>;
lop3.b32 t0, $4, {mask}, {magic}, 0xEA;
shr.u32 t1, $4, 4;
lop3.b32 t1, t1, {mask}, {magic}, 0xEA;
shr.u32 t2, $4, 8;
lop3.b32 t2, t2, {mask}, {magic}, 0xEA;
shr.u32 t3, $4, 12;
lop3.b32 t3, t3, {mask}, {magic}, 0xEA;
sub.rn.{ty} $0, t0, $5;
sub.rn.{ty} $1, t1, $5;
sub.rn.{ty} $2, t2, $5;
sub.rn.{ty} $3, t3, $5;
}}"""
# the 8 products of 4 (q - z) pairs and 4 x pairs summed packed, the two halves added in fp32
_DOT = """{{
.reg .b32 a;
mul.rn.{ty} a, $1, $5;
fma.rn.{ty} a, $2, $6, a;
fma.rn.{ty} a, $3, $7, a;
fma.rn.{ty} a, $4, $8, a;
{widen}
add.f32 $0, lo, hi;
}}"""
_WIDEN_BF16 = """.reg .b32 lo, hi;
shl.b32 lo, a, 16;
and.b32 hi, a, 0xFFFF0000;"""
_WIDEN_FP16 = """.reg .b16 l, h;
.reg .f32 lo, hi;
mov.b32 {l, h}, a;
cvt.f32.f16 lo, l;
cvt.f32.f16 hi, h;"""
_UNPACK_BF16 = tl.constexpr(
    _UNPACK.format(mask=hex(PAIR_MASK), magic=hex(HALF_MAGIC_BITS[torch.bfloat16]), ty="bf16x2")
)
_UNPACK_FP16 = tl.constexpr(
    _UNPACK.format(mask=hex(PAIR_MASK), magic=hex(HALF_MAGIC_BITS[torch.float16]), ty="f16x2")
)
_DOT_BF16 = tl.constexpr(_DOT.format(ty="bf16x2", widen=_WIDEN_BF16))
_DOT_FP16 = tl.constexpr(_DOT.format(ty="f16x2", widen=_WIDEN_FP16))


@dataclass(frozen=True)
class Int4GemvConfig:
    """Launch settings of the GEMV kernel: block_n columns and `slices` slices of block_r packed
    rows (8 * block_r of K each, cut to the group) a tile, K in up to `splits` parts."""

    block_n: int = 64
    block_r: int = 16
    slices: int = 1
    splits: int = 4
    num_warps: int = 4
    num_stages: int = 1


# What int4_gemm runs at one row: per (N, K) the settings a sweep found fastest
# (bench/int4_gemv_sweep.py), GEMV_CONFIG for other shapes; ASYNCLLM_INT4_GEMV, the JSON
# {"NxK": {Int4GemvConfig's fields}} the sweep writes, adds to and overrides the table. The
# H200's sweep (int4_gemv_sweep_a7a3157_h200.json): 16 columns, 8 slices of a group, K
# unsplit, 8 warps, 1.60x the bf16 GEMV over Llama-3.1-8B's four projections. At 2-4 rows
# GEMV_ROWS_CONFIG: the one-row winners keep 16 words of W a thread in up to 212 registers,
# and a second to fourth row's accumulators spill them (ptxas for sm_90).
GEMV_CONFIG = Int4GemvConfig(block_n=16, block_r=16, slices=8, splits=1, num_warps=8)
GEMV_BY_SHAPE: dict[tuple[int, int], Int4GemvConfig] = {
    (28672, 4096): Int4GemvConfig(block_n=16, block_r=16, slices=4, splits=1, num_warps=4),
}
GEMV_ROWS_CONFIG = Int4GemvConfig()
GEMV_BY_SHAPE_ENV = "ASYNCLLM_INT4_GEMV"


def gemv_config_for(m: int, n: int, k: int) -> Int4GemvConfig:
    """The GEMV's settings for x [m, k] @ W [k, n], m <= GEMV_MAX_ROWS."""
    if m > 1:
        return GEMV_ROWS_CONFIG
    table = configs_by_shape(GEMV_BY_SHAPE_ENV, tuple(GEMV_BY_SHAPE.items()), Int4GemvConfig)
    return table.get((n, k), GEMV_CONFIG)


@triton.jit
def _nibbles(packed, shift):
    """The 4-bit values at bits shift..shift+3 of packed, as fp32."""
    bits = ((packed >> shift) & 0xF) | _MAGIC
    return bits.to(tl.float32, bitcast=True) - _MAGIC_F


@triton.jit
def _value_shifts():
    """The bit position of each of a word's 8 values (the interleaved order)."""
    v = tl.arange(0, 8)
    return (v % 2) * 16 + (v // 2) * 4


@triton.jit
def _int4_gemm_kernel(
    x_ptr,
    qw_ptr,
    s_ptr,
    z_ptr,
    out_ptr,
    M,
    N,
    K,
    group_size,
    stride_wr,
    stride_wn,
    stride_sg,
    stride_sn,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask, col_mask = rows < M, cols < N
    ks = tl.arange(0, BLOCK_K)
    words = tl.arange(0, BLOCK_K // 8)
    shifts = _value_shifts()
    packed_rows = tl.cdiv(K, 8)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + ks
        x = tl.load(
            x_ptr + rows.to(tl.int64)[:, None] * K + k[None, :],
            mask=row_mask[:, None] & (k < K)[None, :],
            other=0.0,
        )
        r = k0 // 8 + words
        mask = (r < packed_rows)[:, None] & col_mask[None, :]
        words_at = r.to(tl.int64)[:, None] * stride_wr + cols[None, :] * stride_wn
        packed = tl.load(qw_ptr + words_at, mask=mask, other=0)
        # group_size is a multiple of 8: a packed word's 8 values share their group
        g = ((r * 8) // group_size).to(tl.int64)[:, None] * stride_sg + cols[None, :] * stride_sn
        scale = tl.load(s_ptr + g, mask=mask, other=0.0).to(tl.float32)
        zero = tl.load(z_ptr + g, mask=mask, other=0.0).to(tl.float32)
        q = _nibbles(packed[:, None, :], shifts[None, :, None])  # [BLOCK_K // 8, 8, BLOCK_N]
        w = ((q - zero[:, None, :]) * scale[:, None, :]).to(x_ptr.dtype.element_ty)
        acc = tl.dot(x, tl.reshape(w, (BLOCK_K, BLOCK_N)), acc, input_precision=PRECISION)
    tl.store(
        out_ptr + rows[:, None] * N + cols[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=row_mask[:, None] & col_mask[None, :],
    )


@triton.jit
def _half_pairs(packed, zero, HALF: tl.constexpr):
    """The 4 words of packed (q - z) half pairs of each word of packed, values (2j, 2j + 1) in
    word j; zero the zero point in fp32."""
    if HALF == BF16:
        half = (zero + 128.0).to(tl.bfloat16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
        return tl.inline_asm_elementwise(
            _UNPACK_BF16, "=r,=r,=r,=r,r,r", [packed, half | (half << 16)],
            dtype=(tl.int32, tl.int32, tl.int32, tl.int32), is_pure=True, pack=1,
        )  # fmt: skip
    else:
        half = (zero + 1024.0).to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
        return tl.inline_asm_elementwise(
            _UNPACK_FP16, "=r,=r,=r,=r,r,r", [packed, half | (half << 16)],
            dtype=(tl.int32, tl.int32, tl.int32, tl.int32), is_pure=True, pack=1,
        )  # fmt: skip


@triton.jit
def _half_dot(d0, d1, d2, d3, x0, x1, x2, x3, HALF: tl.constexpr):
    """sum of the 8 products of the (q - z) pairs d and the x pairs, in fp32 (broadcast)."""
    if HALF == BF16:
        return tl.inline_asm_elementwise(
            _DOT_BF16, "=r,r,r,r,r,r,r,r,r", [d0, d1, d2, d3, x0, x1, x2, x3],
            dtype=tl.float32, is_pure=True, pack=1,
        )  # fmt: skip
    else:
        return tl.inline_asm_elementwise(
            _DOT_FP16, "=r,r,r,r,r,r,r,r,r", [d0, d1, d2, d3, x0, x1, x2, x3],
            dtype=tl.float32, is_pure=True, pack=1,
        )  # fmt: skip


@triton.jit
def _row_dot(x_ptr, row, M, K, packed, d0, d1, d2, d3, zero, r, r_mask, HALF, EVEN):
    """[SLICES, BLOCK_R, BLOCK_N]: row `row` of x's sum over each word of packed (packed rows r,
    [SLICES, BLOCK_R, 1]) of x times q - zero: from the words' (q - z) pairs d when HALF (x_ptr
    is x as int32 pairs), else in fp32 from packed (d unused). EVEN: every word valid, only the
    row may be past M."""
    mask = r * 0 + row < M
    if not EVEN:
        mask = mask & r_mask
    k = r * 8
    if HALF != NO_HALF:
        pairs = x_ptr + row * (K // 2) + r * 4
        x0 = tl.load(pairs, mask=mask if EVEN else mask & (k < K), other=0)
        x1 = tl.load(pairs + 1, mask=mask if EVEN else mask & (k + 2 < K), other=0)
        x2 = tl.load(pairs + 2, mask=mask if EVEN else mask & (k + 4 < K), other=0)
        x3 = tl.load(pairs + 3, mask=mask if EVEN else mask & (k + 6 < K), other=0)
        return _half_dot(d0, d1, d2, d3, x0, x1, x2, x3, HALF)
    else:
        dot = tl.zeros(packed.shape, dtype=tl.float32)
        for j in tl.static_range(8):
            q = _nibbles(packed, (j % 2) * 16 + (j // 2) * 4) - zero
            x = tl.load(x_ptr + row * K + k + j, mask=mask & (k + j < K), other=0.0)
            dot += x.to(tl.float32) * q
        return dot


@triton.jit
def _w_tile(w_ptr, offsets, r, r_end, col_mask, EVEN):
    """The packed rows r ([SLICES, BLOCK_R, 1]) of W's columns; w_ptr at the tile's first row,
    offsets [slice, row, col] from it."""
    mask = r < r_end
    if not EVEN:
        mask = mask & col_mask
    return tl.load(w_ptr + offsets, mask=mask, other=0)


@triton.jit
def _store_row(out_ptr, row, M, N, cols, acc, SPLIT_K):
    """Row `row` of out from its accumulator [SLICES, BLOCK_R, BLOCK_N]."""
    total = tl.sum(tl.sum(acc, axis=0), axis=0)
    mask = (cols < N) & (cols * 0 + row < M)
    if SPLIT_K:
        tl.atomic_add(out_ptr + row * N + cols, total, mask=mask)
    else:
        tl.store(out_ptr + row * N + cols, total.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _int4_gemv_kernel(
    x_ptr,
    qw_ptr,
    s_ptr,
    z_ptr,
    out_ptr,
    M,
    N,
    K,
    k_per_split,
    stride_wr,
    stride_wn,
    stride_sg,
    stride_sn,
    GROUP_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
    SLICES: tl.constexpr,
    SPLIT_K: tl.constexpr,
    EVEN: tl.constexpr,
    HALF: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """out (+)= x[:, split] @ W[split] for the M rows (SPLIT_K: out fp32 and zeroed, else
    out = x @ W in its dtype), SLICES slices of BLOCK_R packed rows (8 * BLOCK_R of K, each
    inside one group) a tile. BLOCK_M is 1, 2 or 4, each row its own accumulator (4 named: no
    tensor of them crosses the loop without a layout change). EVEN: N a multiple of BLOCK_N, K
    of k_per_split."""
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    out_cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = out_cols[None, None, :]
    col_mask = cols < N
    # [slice, row, 1]: packed row slice * BLOCK_R + row of a tile, and each slice's first row
    firsts = (tl.arange(0, SLICES) * BLOCK_R)[:, None, None]
    rs = firsts + tl.arange(0, BLOCK_R)[None, :, None]
    offsets = rs * stride_wr + cols * stride_wn
    tile_rows = SLICES * BLOCK_R
    r_start = pid_k * (k_per_split // 8)
    r_end = tl.minimum(r_start + k_per_split // 8, tl.cdiv(K, 8))
    acc0 = tl.zeros((SLICES, BLOCK_R, BLOCK_N), dtype=tl.float32)
    acc1, acc2, acc3 = acc0, acc0, acc0
    # no kernel writes W: its first tile needs no wait
    packed = _w_tile(qw_ptr + r_start * stride_wr, offsets, r_start + rs, r_end, col_mask, EVEN)
    if USE_PDL:  # the next kernel may start loading its weights; x is the kernel before's output
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    for r0 in range(r_start, r_end, tile_rows):
        r = r0 + rs
        r_next = r0 + tile_rows
        following = _w_tile(
            qw_ptr + r_next * stride_wr, offsets, r_next + rs, r_end, col_mask, EVEN
        )
        # [slice, 1, col]: a slice's group's scales and zero points (masked past K: its words
        # are zeros, x too, but a zero point's (q - z) pairs are not)
        groups = (r0 + firsts) // (GROUP_SIZE // 8) * stride_sg + cols * stride_sn
        group_mask = col_mask & (r0 + firsts < r_end)
        scale = tl.load(s_ptr + groups, mask=group_mask, other=0.0).to(tl.float32)
        zero = tl.load(z_ptr + groups, mask=group_mask, other=0.0).to(tl.float32)
        if HALF != NO_HALF:
            d0, d1, d2, d3 = _half_pairs(packed, zero, HALF)
        else:
            d0, d1, d2, d3 = packed, packed, packed, packed
        r_mask = r < r_end
        acc0 += (
            _row_dot(x_ptr, 0, M, K, packed, d0, d1, d2, d3, zero, r, r_mask, HALF, EVEN) * scale
        )
        if BLOCK_M > 1:
            acc1 += (
                _row_dot(x_ptr, 1, M, K, packed, d0, d1, d2, d3, zero, r, r_mask, HALF, EVEN)
                * scale
            )
        if BLOCK_M > 2:
            acc2 += (
                _row_dot(x_ptr, 2, M, K, packed, d0, d1, d2, d3, zero, r, r_mask, HALF, EVEN)
                * scale
            )
            acc3 += (
                _row_dot(x_ptr, 3, M, K, packed, d0, d1, d2, d3, zero, r, r_mask, HALF, EVEN)
                * scale
            )
        packed = following
    _store_row(out_ptr, 0, M, N, out_cols, acc0, SPLIT_K)
    if BLOCK_M > 1:
        _store_row(out_ptr, 1, M, N, out_cols, acc1, SPLIT_K)
    if BLOCK_M > 2:
        _store_row(out_ptr, 2, M, N, out_cols, acc2, SPLIT_K)
        _store_row(out_ptr, 3, M, N, out_cols, acc3, SPLIT_K)


def int4_gemm(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group_size: int,
    gemv_config: Int4GemvConfig | None = None,
) -> torch.Tensor:
    """x [M, K] @ W [K, N]: qweight int32 [ceil(K / 8), N], scales and zeros [groups, N] (zeros
    as the zero point's whole value, in any float dtype), group_size a multiple of 8. Any
    strides: each column's words one after another (N-major, int4_n_major) or each packed
    row's columns (row-major); zeros strided as scales."""
    (m, k), n = x.shape, qweight.shape[1]
    if group_size % 8:
        raise ValueError(f"int4_gemm: group_size must be a multiple of 8, got {group_size}")
    assert zeros.stride() == scales.stride()
    x = x.contiguous()
    if m <= GEMV_MAX_ROWS:
        config = gemv_config or gemv_config_for(m, n, k)
        return _gemv(x, qweight, scales, zeros, group_size, config)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    # 64 x 128 tiles from 64 rows: 256 rows of a 4096-wide projection still make 128 programs
    block_m = min(max(next_pow2(m), 16), 64)
    block_n = 128 if m > 32 else 64
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _int4_gemm_kernel[grid](
        x,
        qweight,
        scales,
        zeros,
        out,
        m,
        n,
        k,
        group_size,
        *qweight.stride(),
        *scales.stride(),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=64,
        PRECISION=dot_precision(x.dtype),
        num_warps=4,
        num_stages=3,
    )
    return out


def int4_n_major(t: torch.Tensor) -> torch.Tensor:
    """t [rows, N] stored column by column (the same values, strides (1, rows)): the GEMV then
    reads each column's packed words, a group's scales, in one run of addresses."""
    return t.t().contiguous().t()


def half_kind(x: torch.Tensor) -> int:
    """The GEMV's packed path for x (BF16, FP16), NO_HALF where it runs in fp32: x in fp32,
    on the CPU (the interpreter runs no PTX), or not in whole pairs (x is read as int32)."""
    if not x.is_cuda or x.shape[-1] % 2 or x.storage_offset() % 2:
        return NO_HALF.value
    if x.dtype == torch.bfloat16:
        return BF16.value
    return FP16.value if x.dtype == torch.float16 else NO_HALF.value


def _gemv(x, qweight, scales, zeros, group_size, config):
    (m, k), n = x.shape, qweight.shape[1]
    # a tile takes one scale row: its packed rows a power of two dividing the group's
    block_r = min(config.block_r, (group_size // 8) & -(group_size // 8))
    tile_k = 8 * block_r * config.slices
    splits = min(config.splits, triton.cdiv(k, tile_k))
    k_per_split = triton.cdiv(triton.cdiv(k, splits), tile_k) * tile_k
    splits = triton.cdiv(k, k_per_split)
    if splits > 1:
        out = torch.zeros(m, n, dtype=torch.float32, device=x.device)
    else:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    half = half_kind(x)
    pdl = uses_pdl(x.device)
    _int4_gemv_kernel[(triton.cdiv(n, config.block_n), splits)](
        x.view(torch.int32) if half else x,
        qweight,
        scales,
        zeros,
        out,
        m,
        n,
        k,
        k_per_split,
        *qweight.stride(),
        *scales.stride(),
        GROUP_SIZE=group_size,
        BLOCK_M=next_pow2(m),
        BLOCK_N=config.block_n,
        BLOCK_R=block_r,
        SLICES=config.slices,
        SPLIT_K=splits > 1,
        EVEN=n % config.block_n == 0 and k % k_per_split == 0,
        HALF=half,
        USE_PDL=pdl,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        launch_pdl=pdl,
    )
    return out.to(x.dtype)
