"""SiLU-gated linear unit: silu(gate) * up; and with the FP8 layers' dynamic per-row activation
quantization fused after it (silu_and_mul_fp8), when an FP8 GEMM reads its output."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._common import next_pow2
from kernels.fp8_quant import FP8_MAX, group_scale, one_read_warps, store_quantized

_BLOCK = 1024


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, x_stride, out_stride, n_cols, BLOCK: tl.constexpr):
    """out[t, j] = silu(x[t, j]) * x[t, n_cols + j], computed in fp32."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    gate = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * x_stride + n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    out = gate * tl.sigmoid(gate) * up
    tl.store(out_ptr + row * out_stride + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [..., 2 * I] -> silu(x[..., :I]) * x[..., I:], in x's dtype."""
    n_cols = x.shape[-1] // 2
    rows = x.reshape(-1, 2 * n_cols)
    assert rows.stride(-1) == 1
    out = torch.empty(*x.shape[:-1], n_cols, dtype=x.dtype, device=x.device)
    if rows.shape[0] == 0:
        return out
    out_rows = out.view(-1, n_cols)
    _silu_and_mul_kernel[(rows.shape[0], triton.cdiv(n_cols, _BLOCK))](
        rows, out_rows, rows.stride(0), out_rows.stride(0), n_cols, BLOCK=_BLOCK, num_warps=4
    )
    return out


@triton.jit
def _silu_and_mul_fp8_kernel(
    x_ptr, q_ptr, scale_ptr, x_stride, n_cols, fp8_max, min_scale, BLOCK: tl.constexpr
):
    """q[t] = silu(gate) * up of row t rounded to x's dtype, quantized as quantize_fp8 does."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    gate = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * x_stride + n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    out = (gate * tl.sigmoid(gate) * up).to(x_ptr.dtype.element_ty).to(tl.float32)
    scale = group_scale(out, scale_ptr, row, 0, fp8_max, min_scale, False)
    store_quantized(q_ptr, row * n_cols, cols, n_cols, out, scale, fp8_max)


def silu_and_mul_fp8(x: torch.Tensor, min_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x [rows, 2 * I] -> (q [rows, I] e4m3, scales [rows, 1] fp32) of silu_and_mul(x), each row
    quantized as quantize_fp8(..., min_scale=min_scale) would quantize it: one launch, without
    the activations written and read back. A program holds a whole row (Llama's 14,336 too)."""
    n_cols = x.shape[-1] // 2
    assert x.dim() == 2 and x.stride(-1) == 1
    q = torch.empty(x.shape[0], n_cols, dtype=torch.float8_e4m3fn, device=x.device)
    scales = torch.empty(x.shape[0], 1, dtype=torch.float32, device=x.device)
    if x.shape[0]:
        block = next_pow2(n_cols)
        _silu_and_mul_fp8_kernel[(x.shape[0],)](
            x,
            q,
            scales,
            x.stride(0),
            n_cols,
            FP8_MAX,
            min_scale,
            BLOCK=block,
            num_warps=one_read_warps(block),
        )
    return q, scales
