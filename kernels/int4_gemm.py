"""out = x @ W for 4-bit weights (AWQ, GPTQ, compressed-tensors pack-quantized, all repacked to
one layout at load): W[k, n] = (q[k, n] - zeros[g, n]) * scales[g, n], g = k // group_size.
q packs 8 values of K per int32 (value k at bits 4 * (k % 8) of qweight[k // 8, n]).

Both kernels load each packed word once and widen its nibbles without an integer-to-float
conversion (which issues at a sixteenth of the FMA rate): OR-ing q into the mantissa of 2^23
gives the float 2^23 + q exactly, and one subtraction leaves q.

Batches of up to GEMV_MAX_ROWS rows (decode) sum x * q without tensor cores for all rows at
once, so W is read once whatever the rows; the zero point and scale come in once per packed
row and column, as s * (sum x * q - z * sum x), and the sum over K waits until the end. K is
split over programs (their sums added atomically in fp32) where N alone would not fill the
GPU. Larger batches unpack a [BLOCK_K, BLOCK_N] tile of W to the activations' dtype for a
tensor-core dot.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._common import dot_precision, next_pow2, num_sms

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
    GROUP_PER_TILE: tl.constexpr,
    SPLIT_K: tl.constexpr,
):
    """out += x[:, split] @ W[split] for all M rows (SPLIT_K: out fp32 and zeroed, else out =
    x @ W in its dtype); BLOCK_R packed rows (8 * BLOCK_R of K) at a time. GROUP_PER_TILE:
    every tile lies in one group (one scale row)."""
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    m = tl.arange(0, BLOCK_M)
    m_mask = m < M
    packed_rows = tl.cdiv(K, 8)
    r_start = pid_k * (k_per_split // 8)
    r_end = tl.minimum(r_start + k_per_split // 8, packed_rows)
    acc = tl.zeros((BLOCK_M, BLOCK_R, BLOCK_N), dtype=tl.float32)
    for r0 in range(r_start, r_end, BLOCK_R):
        r = r0 + tl.arange(0, BLOCK_R)
        r_mask = r < r_end
        packed = tl.load(
            qw_ptr + r.to(tl.int64)[:, None] * N + cols[None, :],
            mask=r_mask[:, None] & col_mask[None, :],
            other=0,
        )
        dot = tl.zeros((BLOCK_M, BLOCK_R, BLOCK_N), dtype=tl.float32)
        x_sum = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        for j in tl.static_range(8):
            k = r * 8 + j
            x = tl.load(
                x_ptr + m[:, None] * K + k[None, :],
                mask=m_mask[:, None] & (r_mask & (k < K))[None, :],
                other=0.0,
            ).to(tl.float32)
            dot += x[:, :, None] * _nibbles(packed, 4 * j)[None, :, :]
            x_sum += x
        if GROUP_PER_TILE:
            g = ((r0 * 8) // group_size).to(tl.int64) * N + cols
            scale = tl.load(s_ptr + g, mask=col_mask, other=0.0).to(tl.float32)[None, None, :]
            zero = tl.load(z_ptr + g, mask=col_mask, other=0.0).to(tl.float32)[None, None, :]
        else:
            g = ((r * 8) // group_size).to(tl.int64)[:, None] * N + cols[None, :]
            mask = r_mask[:, None] & col_mask[None, :]
            scale = tl.load(s_ptr + g, mask=mask, other=0.0).to(tl.float32)[None, :, :]
            zero = tl.load(z_ptr + g, mask=mask, other=0.0).to(tl.float32)[None, :, :]
        acc += scale * (dot - zero * x_sum[:, :, None])
    out_ptrs = out_ptr + m[:, None] * N + cols[None, :]
    out_mask = m_mask[:, None] & col_mask[None, :]
    if SPLIT_K:
        tl.atomic_add(out_ptrs, tl.sum(acc, axis=1), mask=out_mask)
    else:
        tl.store(out_ptrs, tl.sum(acc, axis=1).to(out_ptr.dtype.element_ty), mask=out_mask)


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
    block_m = next_pow2(m)
    block_n, block_r = 64, 32 if block_m <= 2 else 16
    tile_k = 8 * block_r
    column_blocks = triton.cdiv(n, block_n)
    # enough programs for about four per SM, each over a whole number of tiles; none split
    # where the columns alone make two per SM, so that one launch (no zeroing, no cast) does
    sms = num_sms(x.device)
    splits = max(1, min(triton.cdiv(4 * sms, column_blocks), triton.cdiv(k, 512)))
    if column_blocks >= 2 * sms:
        splits = 1
    k_per_split = triton.cdiv(triton.cdiv(k, splits), tile_k) * tile_k
    splits = triton.cdiv(k, k_per_split)
    if splits > 1:
        out = torch.zeros(m, n, dtype=torch.float32, device=x.device)
    else:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    _int4_gemv_kernel[(column_blocks, splits)](
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
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_R=block_r,
        GROUP_PER_TILE=group_size % tile_k == 0,
        SPLIT_K=splits > 1,
        num_warps=4,
    )
    return out.to(x.dtype)
