"""out = dequant(xq) @ dequant(wq)^T for block-scaled FP8 (DeepSeek-V3 / Qwen3-FP8 checkpoints):
xq [M, K] e4m3 with one scale per row and K block, wq [N, K] e4m3 with one scale per
(block_n x block_k) tile. Each K tile is one FP8 tensor-core dot, rescaled in fp32 by the row's
and the weight tile's scales before it is summed."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _fp8_block_gemm_kernel(
    x_ptr,
    xs_ptr,
    w_ptr,
    ws_ptr,
    out_ptr,
    M,
    N,
    K,
    num_k_scales,
    BLOCK_SCALE_N: tl.constexpr,
    BLOCK_SCALE_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PROMOTE_K: tl.constexpr,
):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask, col_mask = rows < M, cols < N
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = (k0 + ks) < K
        x = tl.load(
            x_ptr + rows.to(tl.int64)[:, None] * K + (k0 + ks)[None, :],
            mask=row_mask[:, None] & k_mask[None, :],
            other=0.0,
        )
        w = tl.load(
            w_ptr + cols.to(tl.int64)[None, :] * K + (k0 + ks)[:, None],
            mask=col_mask[None, :] & k_mask[:, None],
            other=0.0,
        )
        k_scale = k0 // BLOCK_SCALE_K
        x_scale = tl.load(xs_ptr + rows * num_k_scales + k_scale, mask=row_mask, other=0.0)
        w_scale = tl.load(
            ws_ptr + (cols // BLOCK_SCALE_N) * num_k_scales + k_scale, mask=col_mask, other=0.0
        )
        # by default Triton lets Hopper's FP8 MMA chain a whole tile in its narrow (about
        # 14-bit) running sum; promoting to fp32 every PROMOTE_K of K keeps the fp32 result
        dot = tl.dot(x, w, max_num_imprecise_acc=PROMOTE_K)
        acc += dot * x_scale[:, None] * w_scale[None, :]
    out = acc.to(out_ptr.dtype.element_ty)
    tl.store(
        out_ptr + rows[:, None] * N + cols[None, :], out, mask=row_mask[:, None] & col_mask[None, :]
    )


def fp8_block_gemm(
    xq: torch.Tensor,
    x_scale: torch.Tensor,
    wq: torch.Tensor,
    w_scale: torch.Tensor,
    block: tuple[int, int],
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """xq [M, K], x_scale [M, ceil(K / block_k)], wq [N, K], w_scale [ceil(N / block_n),
    ceil(K / block_k)]; block_k a power of two of at least 16."""
    xq, wq = xq.contiguous(), wq.contiguous()
    (m, k), n = xq.shape, wq.shape[0]
    block_n, block_k = block
    if block_k < 16 or block_k & (block_k - 1):
        raise ValueError(f"fp8_block_gemm: block_k must be a power of two >= 16, got {block_k}")
    out = torch.empty(m, n, dtype=out_dtype, device=xq.device)
    block_m = 16 if m <= 16 else 64
    tile_k = min(block_k, 128)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, 128))
    _fp8_block_gemm_kernel[grid](
        xq,
        x_scale.contiguous(),
        wq,
        w_scale.contiguous(),
        out,
        m,
        n,
        k,
        w_scale.shape[1],
        BLOCK_SCALE_N=block_n,
        BLOCK_SCALE_K=block_k,
        BLOCK_M=block_m,
        BLOCK_N=128,
        BLOCK_K=tile_k,
        PROMOTE_K=min(tile_k, 32),
        num_warps=4,
        num_stages=3,
    )
    return out
