"""out = x @ W for 4-bit weights (AWQ, GPTQ, compressed-tensors pack-quantized, all repacked to
one layout at load): W[k, n] = (q[k, n] - zeros[g, n]) * scales[g, n], g = k // group_size.
q packs 8 values of K per int32 (value k at bits 4 * (k % 8) of qweight[k // 8, n]).

Both kernels load each packed word once and widen its nibbles without an integer-to-float
conversion (which issues at a sixteenth of the FMA rate): OR-ing q into the mantissa of 2^23
gives the float 2^23 + q exactly, and one subtraction leaves q.

Batches of up to GEMV_MAX_ROWS rows (decode) sum x * q without tensor cores, each tile of W
widened once for all rows, so W is read once whatever the rows; a tile lies inside one group,
so its zero point and scale come in once, as s * (sum x * q - z * sum x). K is split in up to
four parts, their sums added atomically in fp32. Larger batches unpack a [BLOCK_K, BLOCK_N] tile of W to the activations' dtype for a
tensor-core dot.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._common import dot_precision, next_pow2

# rows at or below which the GEMV kernel runs
GEMV_MAX_ROWS = 4
# 2^23 as float bits: 2^23 + q for q < 2^23 has q as its mantissa
_MAGIC = tl.constexpr(0x4B000000)
_MAGIC_F = tl.constexpr(8388608.0)


@triton.jit
def _nibbles(packed, shift):
    """The 4-bit values at bits shift..shift+3 of packed, as fp32."""
    bits = ((packed >> shift) & 0xF) | _MAGIC
    return bits.to(tl.float32, bitcast=True) - _MAGIC_F


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
    shifts = tl.arange(0, 8) * 4
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
        packed = tl.load(qw_ptr + r.to(tl.int64)[:, None] * N + cols[None, :], mask=mask, other=0)
        # group_size is a multiple of 8: a packed word's 8 values share their group
        g = ((r * 8) // group_size).to(tl.int64)[:, None] * N + cols[None, :]
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
def _int4_gemv_kernel(
    x_ptr,
    qw_ptr,
    s_ptr,
    z_ptr,
    out_ptr,
    M,
    N,
    K,
    group_size,
    k_per_split,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
    SPLIT_K: tl.constexpr,
):
    """out (+)= x[:, split] @ W[split] for the M rows (SPLIT_K: out fp32 and zeroed, else
    out = x @ W in its dtype), BLOCK_R packed rows (8 * BLOCK_R of K, inside one group) a tile:
    each tile's nibbles widened once for every row, its sum taken at once."""
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    m = tl.arange(0, BLOCK_M)
    shifts = tl.arange(0, 8) * 4
    r_start = pid_k * (k_per_split // 8)
    r_end = tl.minimum(r_start + k_per_split // 8, tl.cdiv(K, 8))
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for r0 in range(r_start, r_end, BLOCK_R):
        r = r0 + tl.arange(0, BLOCK_R)
        packed = tl.load(
            qw_ptr + r.to(tl.int64)[:, None] * N + cols[None, :],
            mask=(r < r_end)[:, None] & col_mask[None, :],
            other=0,
        )
        q = _nibbles(packed[:, None, :], shifts[None, :, None])  # [BLOCK_R, 8, BLOCK_N]
        g = ((r0 * 8) // group_size).to(tl.int64) * N + cols
        scale = tl.load(s_ptr + g, mask=col_mask, other=0.0).to(tl.float32)
        zero = tl.load(z_ptr + g, mask=col_mask, other=0.0).to(tl.float32)
        k = r[:, None] * 8 + tl.arange(0, 8)[None, :]
        for i in tl.static_range(BLOCK_M):
            mask = (k < K) & (k * 0 + i < M)
            x = tl.load(x_ptr + i * K + k, mask=mask, other=0.0).to(tl.float32)
            dot = tl.sum(tl.sum(x[:, :, None] * q, axis=1), axis=0)
            row = scale * (dot - zero * tl.sum(tl.sum(x, axis=1), axis=0))
            acc += tl.where(m[:, None] == i, row[None, :], 0.0)
    out_ptrs = out_ptr + m[:, None] * N + cols[None, :]
    out_mask = (m < M)[:, None] & col_mask[None, :]
    if SPLIT_K:
        tl.atomic_add(out_ptrs, acc, mask=out_mask)
    else:
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=out_mask)


def int4_gemm(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group_size: int,
) -> torch.Tensor:
    """x [M, K] @ W [K, N]: qweight int32 [ceil(K / 8), N], scales and zeros [groups, N] (zeros
    as the zero point's value, in any float dtype), group_size a multiple of 8."""
    (m, k), n = x.shape, qweight.shape[1]
    if group_size % 8:
        raise ValueError(f"int4_gemm: group_size must be a multiple of 8, got {group_size}")
    x = x.contiguous()
    if m <= GEMV_MAX_ROWS:
        return _gemv(x, qweight, scales, zeros, group_size)
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
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=64,
        PRECISION=dot_precision(x.dtype),
        num_warps=4,
        num_stages=3,
    )
    return out


def _gemv(x, qweight, scales, zeros, group_size):
    (m, k), n = x.shape, qweight.shape[1]
    # 16 packed rows (128 of K) a tile, fewer where the group is smaller: a tile takes one
    # scale row; 64 columns, K in 4 parts and 2 warps were fastest on the H200 for all four
    # Llama-3.1-8B projections (bench/results/int4_gemv_sweep_h200.json)
    block_r = min(16, (group_size // 8) & -(group_size // 8))
    tile_k = 8 * block_r
    splits = min(4, triton.cdiv(k, tile_k))
    k_per_split = triton.cdiv(triton.cdiv(k, splits), tile_k) * tile_k
    splits = triton.cdiv(k, k_per_split)
    if splits > 1:
        out = torch.zeros(m, n, dtype=torch.float32, device=x.device)
    else:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    _int4_gemv_kernel[(triton.cdiv(n, 64), splits)](
        x,
        qweight,
        scales,
        zeros,
        out,
        m,
        n,
        k,
        group_size,
        k_per_split,
        BLOCK_M=next_pow2(m),
        BLOCK_N=64,
        BLOCK_R=block_r,
        SPLIT_K=splits > 1,
        num_warps=2,
        num_stages=3,
    )
    return out.to(x.dtype)
