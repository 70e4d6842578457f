"""SiLU-gated linear unit: silu(gate) * up."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

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
