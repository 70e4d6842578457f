"""out = x @ W for 4-bit weights (AWQ, GPTQ, compressed-tensors pack-quantized, all repacked to
one layout at load): W[k, n] = (q[k, n] - zeros[g, n]) * scales[g, n], g = k // group_size.
q packs 8 values of K per int32 (value k at bits 4 * (k % 8) of qweight[k // 8, n]).

Batches of a few rows (decode) read each packed word once, as 8 rows of W, and sum x * W without
tensor cores, K split over programs so that even narrow N fills the GPU; larger batches
unpack a [BLOCK_K, BLOCK_N] tile of W into registers for a tensor-core dot.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._common import dot_precision, num_sms

# rows at or below which the GEMV kernel runs
GEMV_MAX_ROWS = 4


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
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + ks
        k_mask = k < K
        x = tl.load(
            x_ptr + rows.to(tl.int64)[:, None] * K + k[None, :],
            mask=row_mask[:, None] & k_mask[None, :],
            other=0.0,
        )
        mask = k_mask[:, None] & col_mask[None, :]
        packed = tl.load(
            qw_ptr + (k // 8).to(tl.int64)[:, None] * N + cols[None, :], mask=mask, other=0
        )
        q = ((packed >> ((k % 8) * 4)[:, None]) & 0xF).to(tl.float32)
        g = (k // group_size).to(tl.int64)[:, None] * N + cols[None, :]
        scale = tl.load(s_ptr + g, mask=mask, other=0.0).to(tl.float32)
        zero = tl.load(z_ptr + g, mask=mask, other=0.0).to(tl.float32)
        w = ((q - zero) * scale).to(x_ptr.dtype.element_ty)
        acc += tl.dot(x, w, input_precision=PRECISION)
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
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    """out (fp32, zeroed) += x[:, split] @ W[split]; BLOCK_R packed rows (8 * BLOCK_R of K) at a time."""
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    packed_rows = tl.cdiv(K, 8)
    r_start = pid_k * (k_per_split // 8)
    r_end = tl.minimum(r_start + k_per_split // 8, packed_rows)
    for m in range(0, M):
        acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for r0 in range(r_start, r_end, BLOCK_R):
            r = r0 + tl.arange(0, BLOCK_R)
            r_mask = r < r_end
            mask = r_mask[:, None] & col_mask[None, :]
            packed = tl.load(
                qw_ptr + r.to(tl.int64)[:, None] * N + cols[None, :], mask=mask, other=0
            )
            # group_size is a multiple of 8: a packed word's 8 values share their group
            g = ((r * 8) // group_size).to(tl.int64)[:, None] * N + cols[None, :]
            scale = tl.load(s_ptr + g, mask=mask, other=0.0).to(tl.float32)
            zero = tl.load(z_ptr + g, mask=mask, other=0.0).to(tl.float32)
            for j in tl.static_range(8):
                k = r * 8 + j
                x = tl.load(x_ptr + m * K + k, mask=r_mask & (k < K), other=0.0).to(tl.float32)
                q = ((packed >> (4 * j)) & 0xF).to(tl.float32)
                acc += tl.sum(x[:, None] * ((q - zero) * scale), axis=0)
        tl.atomic_add(out_ptr + m * N + cols, acc, mask=col_mask)


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
    block_m = 16 if m <= 16 else 64
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, 64))
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
        BLOCK_N=64,
        BLOCK_K=32,
        PRECISION=dot_precision(x.dtype),
        num_warps=4,
    )
    return out


def _gemv(x, qweight, scales, zeros, group_size):
    (m, k), n = x.shape, qweight.shape[1]
    block_n = 64
    column_blocks = triton.cdiv(n, block_n)
    # enough programs for about four per SM, each over a whole number of packed rows
    splits = max(1, min(triton.cdiv(4 * num_sms(x.device), column_blocks), triton.cdiv(k, 512)))
    k_per_split = triton.cdiv(triton.cdiv(k, splits), 8) * 8
    splits = triton.cdiv(k, k_per_split)
    out = torch.zeros(m, n, dtype=torch.float32, device=x.device)
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
        BLOCK_N=block_n,
        BLOCK_R=16,
        num_warps=4,
    )
    return out.to(x.dtype)
