"""out = dequant(xq) @ dequant(wq)^T for block-scaled FP8 (DeepSeek-V3 / Qwen3-FP8 checkpoints):
xq [M, K] e4m3 with one scale per row and K block, wq [N, K] e4m3 with one scale per
(block_n x block_k) tile. Each K tile is one FP8 tensor-core dot, rescaled in fp32 by the row's
and the weight tile's scales before it is summed.

Per-channel FP8 (one scale per row of x and per output column) is the case of one K block and
one output column a block: fp8_rowwise_gemm, an alternative to torch._scaled_mm at mid row counts,
where cuBLAS' tiles of a 4096-wide output leave SMs idle (bench/fp8_gemm_sweep.py times both).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels._common import configs_by_shape, next_pow2


@dataclass(frozen=True)
class Fp8GemmConfig:
    """Tiles and launch settings of the FP8 GEMM; max_rows: the rows up to which the
    per-channel FP8 layer runs fp8_rowwise_gemm instead of torch._scaled_mm (ROWWISE_BY_SHAPE's
    entries)."""

    block_m: int = 64
    block_n: int = 128
    block_k: int = 128
    num_warps: int = 4
    num_stages: int = 3
    max_rows: int = 0


# The row-wise path's settings per (N, K), where a sweep found it faster than torch._scaled_mm
# (bench/fp8_gemm_sweep.py); ASYNCLLM_FP8_GEMM, the JSON {"NxK": {Fp8GemmConfig's fields}} the
# sweep writes, adds to and overrides the table. Other shapes stay on _scaled_mm.
ROWWISE_BY_SHAPE: dict[tuple[int, int], Fp8GemmConfig] = {}
ROWWISE_BY_SHAPE_ENV = "ASYNCLLM_FP8_GEMM"


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
    ROWWISE: tl.constexpr,
):
    """ROWWISE: one scale per row of x and per column of w (one K block), applied once at the
    end instead of to every K tile's dot."""
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
        # by default Triton lets Hopper's FP8 MMA chain a whole tile in its narrow (about
        # 14-bit) running sum; it is promoted to fp32 every PROMOTE_K of K (0: none imprecise)
        if ROWWISE:
            acc = tl.dot(x, w, acc, max_num_imprecise_acc=PROMOTE_K)
        else:
            k_scale = k0 // BLOCK_SCALE_K
            x_scale = tl.load(xs_ptr + rows * num_k_scales + k_scale, mask=row_mask, other=0.0)
            w_scale = tl.load(
                ws_ptr + (cols // BLOCK_SCALE_N) * num_k_scales + k_scale,
                mask=col_mask,
                other=0.0,
            )
            dot = tl.dot(x, w, max_num_imprecise_acc=PROMOTE_K)
            acc += dot * x_scale[:, None] * w_scale[None, :]
    if ROWWISE:
        x_scale = tl.load(xs_ptr + rows, mask=row_mask, other=0.0)
        acc *= x_scale[:, None] * tl.load(ws_ptr + cols, mask=col_mask, other=0.0)[None, :]
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
    m = xq.shape[0]
    block_k = block[1]
    if block_k < 16 or block_k & (block_k - 1):
        raise ValueError(f"fp8_block_gemm: block_k must be a power of two >= 16, got {block_k}")
    config = Fp8GemmConfig(block_m=16 if m <= 16 else 64, block_k=min(block_k, 128))
    return _launch(xq, x_scale, wq, w_scale, block, out_dtype, config, promote_k=32)


def fp8_rowwise_gemm(
    xq: torch.Tensor,
    x_scale: torch.Tensor,
    wq: torch.Tensor,
    w_scale: torch.Tensor,
    out_dtype: torch.dtype,
    config: Fp8GemmConfig | None = None,
) -> torch.Tensor:
    """xq [M, K] @ wq [N, K]^T * x_scale [M, 1] * w_scale [N] (any shape of N values), summed
    in fp32 throughout, as torch._scaled_mm does by default. Hopper's FP8 MMA keeps a narrower
    running sum between promotions: promoted once a 128-wide K tile (DeepSeek-V3's recipe), 54%
    of a 130 x 72 x 1,000 product's outputs were off by more than 1e-4 on the H200, none with
    no imprecise accumulation (bench/results/fp8_rowwise_probe_h200.json)."""
    config = config or rowwise_config(wq.shape[0], wq.shape[1]) or Fp8GemmConfig()
    xq, wq = xq.contiguous(), wq.contiguous()
    x_scale, w_scale = x_scale.reshape(-1).float(), w_scale.reshape(-1).float()
    block = (1, max(next_pow2(xq.shape[1]), config.block_k))
    return _launch(xq, x_scale, wq, w_scale, block, out_dtype, config, promote_k=0, rowwise=True)


def rowwise_config(n: int, k: int) -> Fp8GemmConfig | None:
    table = tuple(ROWWISE_BY_SHAPE.items())
    return configs_by_shape(ROWWISE_BY_SHAPE_ENV, table, Fp8GemmConfig).get((n, k))


def fp8_rowwise_wins(rows: int, n: int, k: int) -> bool:
    """Whether the per-channel FP8 layer takes fp8_rowwise_gemm for x [rows, k] @ W [n, k]^T."""
    config = rowwise_config(n, k)
    return config is not None and rows <= config.max_rows


def _launch(
    xq, x_scale, wq, w_scale, block, out_dtype, config: Fp8GemmConfig, promote_k, rowwise=False
) -> torch.Tensor:
    (m, k), n = xq.shape, wq.shape[0]
    out = torch.empty(m, n, dtype=out_dtype, device=xq.device)
    grid = (triton.cdiv(m, config.block_m), triton.cdiv(n, config.block_n))
    _fp8_block_gemm_kernel[grid](
        xq,
        x_scale.contiguous(),
        wq,
        w_scale.contiguous(),
        out,
        m,
        n,
        k,
        1 if rowwise else w_scale.shape[1],
        BLOCK_SCALE_N=block[0],
        BLOCK_SCALE_K=block[1],
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        PROMOTE_K=promote_k,
        ROWWISE=rowwise,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    return out
