"""RMSNorm, alone or with the residual add fused in."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._common import next_pow2


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
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """out = rms_norm(x [+ residual]) * weight for one row; the sum is written back to residual."""
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
        HAS_RESIDUAL=residual is not None,
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
