"""RMSNorm, alone or with the residual add fused in; and with the FP8 layers' dynamic per-row
activation quantization fused after it (rms_norm_fp8), when an FP8 GEMM reads the norm's output."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._common import next_pow2
from kernels.fp8_quant import FP8_MAX, group_scale, store_quantized


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    x_stride,
    residual_stride,
    out_stride,
    n_cols,
    eps,
    scale_ptr,
    fp8_max,
    min_scale,
    HAS_RESIDUAL: tl.constexpr,
    QUANTIZE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """out = rms_norm(x [+ residual]) * weight for one row; the sum is written back to residual.
    QUANTIZE: out is e4m3, the normed row rounded to x's dtype and then quantized as
    kernels.quantize_fp8 quantizes a row (its scale to scale_ptr[row])."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        residual_ptrs = residual_ptr + row * residual_stride + cols
        summed = x + tl.load(residual_ptrs, mask=mask, other=0.0).to(tl.float32)
        # the sum is rounded to the activation dtype before the norm, as the torch path does
        summed = summed.to(residual_ptr.dtype.element_ty)
        tl.store(residual_ptrs, summed, mask=mask)
        x = summed.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, 0) / n_cols + eps)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if QUANTIZE:
        normed = (x * rstd * weight).to(x_ptr.dtype.element_ty).to(tl.float32)
        scale = group_scale(normed, scale_ptr, row, 0, fp8_max, min_scale, False)
        store_quantized(out_ptr, row * out_stride, cols, n_cols, normed, scale, fp8_max)
    else:
        tl.store(
            out_ptr + row * out_stride + cols,
            (x * rstd * weight).to(out_ptr.dtype.element_ty),
            mask=mask,
        )


def _launch(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    out: torch.Tensor,
    eps: float,
    scales: torch.Tensor | None = None,
    min_scale: float = 0.0,
) -> None:
    n_cols = x.shape[-1]
    rows = x.reshape(-1, n_cols)
    out_rows = out.view(-1, n_cols)
    residual_rows = residual.view(-1, n_cols) if residual is not None else out_rows
    assert rows.stride(-1) == 1 and out_rows.stride(-1) == 1 and residual_rows.stride(-1) == 1
    if rows.shape[0] == 0:
        return
    block = next_pow2(n_cols)
    _rms_norm_kernel[(rows.shape[0],)](
        rows,
        residual_rows,
        weight,
        out_rows,
        rows.stride(0),
        residual_rows.stride(0),
        out_rows.stride(0),
        n_cols,
        eps,
        out_rows if scales is None else scales,  # read only when quantizing
        FP8_MAX,
        min_scale,
        HAS_RESIDUAL=residual is not None,
        QUANTIZE=scales is not None,
        BLOCK=block,
        num_warps=min(max(block // 512, 1), 16),
    )


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None
) -> torch.Tensor:
    """x [..., hidden] normalised in fp32 over the last dim, times weight, in x's dtype; into
    out when given (x itself too: each row is read whole before it is written)."""
    out = torch.empty_like(x) if out is None else out
    _launch(x, None, weight, out, eps)
    return out


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (rms_norm(x + residual), x + residual), computed IN PLACE: x holds the first, residual the second."""
    assert x.shape == residual.shape and x.is_contiguous() and residual.is_contiguous()
    _launch(x, residual, weight, x, eps)
    return x, residual


def rms_norm_fp8(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    min_scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(q [rows, hidden] e4m3, scales [rows, 1] fp32) of rms_norm(x [+ residual]) * weight in
    x's dtype, each row quantized as quantize_fp8(..., min_scale=min_scale) would quantize it
    (bit for bit in 16-bit dtypes; in float32 the sum of squares may differ in its last bit):
    the norm and an FP8 layer's activation quantization in one launch, without the normed rows
    written and read back. With residual, x + residual is written into it; x is left as it is."""
    assert residual is None or (residual.shape == x.shape and residual.is_contiguous())
    q = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)
    scales = torch.empty(*x.shape[:-1], 1, dtype=torch.float32, device=x.device)
    _launch(x, residual, weight, q, eps, scales, min_scale)
    return q, scales
