"""y = x @ W^T (+ bias) for a few rows of x: the decode-sized GEMMs, bound by reading W once.

Each program owns block_n rows of W and streams them along K (contiguous, so the loads are wide
and coalesced) against all rows of x, padded to the 16 that tl.dot needs. When W has too few
row tiles to keep every SM busy, K is split across programs too: each split writes an fp32
partial and a second small kernel sums them, adds the bias and casts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels._common import dot_precision, num_sms

BLOCK_M = 16  # tl.dot's smallest tile: rows of x past M are masked to zero
TILE_BYTES = 512  # bytes of one W row per K step: 256 bf16 / fp16 values, 128 fp32
_REDUCE_BLOCK = 1024


@dataclass(frozen=True)
class SkinnyGemmConfig:
    """Tile shape and launch settings; split_k programs each cover k_per_split of K."""

    block_n: int
    block_k: int
    split_k: int
    k_per_split: int
    num_warps: int = 4
    num_stages: int = 4


@triton.jit
def _skinny_gemm_kernel(
    x_ptr,
    w_ptr,
    bias_ptr,
    out_ptr,
    M,
    N,
    K,
    x_stride,
    k_per_split,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """out[split, m, n] = sum over this split's K range of x[m, k] * w[n, k] (+ bias[n])."""
    split = tl.program_id(1)
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    m = tl.arange(0, BLOCK_M)
    k = tl.arange(0, BLOCK_K)
    row_mask = rows < N
    m_mask = m < M
    w_ptrs = w_ptr + rows.to(tl.int64)[:, None] * K + k[None, :]
    x_ptrs = x_ptr + m[:, None] * x_stride + k[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    k_lo = split * k_per_split
    # k_per_split is a multiple of BLOCK_K, so only the chunk past K needs a mask
    for k0 in range(k_lo, tl.minimum(k_lo + k_per_split, K), BLOCK_K):
        k_mask = k0 + k < K
        w = tl.load(w_ptrs + k0, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        x = tl.load(x_ptrs + k0, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        acc = tl.dot(x, tl.trans(w), acc, input_precision=PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rows, mask=row_mask, other=0.0).to(tl.float32)[None, :]
    out_ptrs = out_ptr + split * M * N + m[:, None] * N + rows[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & row_mask[None, :])


@triton.jit
def _split_k_reduce_kernel(
    part_ptr, bias_ptr, out_ptr, num_splits, M, N, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr
):
    """out[m, n] = sum over splits of part[split, m, n] (+ bias[n]), cast to out's dtype."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < M * N
    acc = tl.zeros([BLOCK], tl.float32)
    for split in range(num_splits):
        acc += tl.load(part_ptr + split * M * N + offs, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs % N, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def choose_skinny_config(n: int, k: int, element_size: int, sms: int) -> SkinnyGemmConfig:
    """The widest row tile (64, 32, 16) that still gives two tiles per SM, as wider tiles reload
    x less often. A stage holds (block_n + 16) x TILE_BYTES: 64-row tiles keep 3 of them (120 KB),
    narrower ones 4 (64 KB with 16 rows)."""
    block_n = next(b for b in (64, 32, 16) if triton.cdiv(n, b) >= 2 * sms or b == 16)
    num_stages = 3 if block_n == 64 else 4
    return split_k_config(n, k, block_n, TILE_BYTES // element_size, num_stages, sms)


def split_k_config(
    n: int, k: int, block_n: int, block_k: int, num_stages: int, sms: int
) -> SkinnyGemmConfig:
    """Split K when the row tiles alone would leave SMs idle, into as many parts as reach two
    programs per SM, none shorter than one block_k step."""
    tiles = triton.cdiv(n, block_n)
    k_steps = triton.cdiv(k, block_k)
    split_k = min(triton.cdiv(2 * sms, tiles), k_steps) if tiles < sms else 1
    steps_per_split = triton.cdiv(k_steps, split_k)
    return SkinnyGemmConfig(
        block_n=block_n,
        block_k=block_k,
        split_k=triton.cdiv(k_steps, steps_per_split),  # no split left without work
        k_per_split=steps_per_split * block_k,
        num_stages=num_stages,
    )


def skinny_gemm(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    config: SkinnyGemmConfig | None = None,
) -> torch.Tensor:
    """x [M, K] (M <= 16, rows contiguous) @ weight [N, K]^T + bias [N] -> [M, N] in x's dtype.

    Accumulates in fp32. Allocates only by shape and never syncs with the device, so the call
    can be captured in a CUDA graph.
    """
    (m, k), n = x.shape, weight.shape[0]
    assert m <= BLOCK_M and weight.shape[1] == k and x.stride(-1) == 1
    assert weight.is_contiguous() and weight.dtype == x.dtype
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    config = config or choose_skinny_config(n, k, x.element_size(), num_sms(x.device))
    assert config.k_per_split % config.block_k == 0 and config.split_k * config.k_per_split >= k
    split = config.split_k > 1
    part = torch.empty(config.split_k, m, n, dtype=torch.float32, device=x.device) if split else out
    _skinny_gemm_kernel[(triton.cdiv(n, config.block_n), config.split_k)](
        x,
        weight,
        bias if bias is not None else weight,
        part,
        m,
        n,
        k,
        x.stride(0),
        config.k_per_split,
        BLOCK_M=BLOCK_M,
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        HAS_BIAS=bias is not None and not split,
        PRECISION=dot_precision(x.dtype),
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    if split:
        _split_k_reduce_kernel[(triton.cdiv(m * n, _REDUCE_BLOCK),)](
            part,
            bias if bias is not None else part,
            out,
            config.split_k,
            m,
            n,
            HAS_BIAS=bias is not None,
            BLOCK=_REDUCE_BLOCK,
            num_warps=4,
        )
    return out
