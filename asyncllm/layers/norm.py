"""RMSNorm, with the residual add fused in as the Triton kernel does it."""

from __future__ import annotations

import torch
from torch import nn

import kernels
from kernels.cpu_layer_ops import cpu_layer_ops_available, fused_add_rms_norm_cpu


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.dtype == weight.dtype == torch.float32:  # torch's one pass: a third faster on CPU
        return torch.rms_norm(x, weight.shape, weight, eps)
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (x32 * weight.float()).to(x.dtype)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (rms_norm(x + residual), x + residual)."""
    summed = x + residual
    return rms_norm(summed, weight, eps), summed


def _cpu_op_fits(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor) -> bool:
    return (
        x.device.type == "cpu"
        and x.dtype in (torch.float32, torch.bfloat16)
        and residual.dtype == weight.dtype == torch.float32
        and x.dim() == 2
        and x.is_contiguous()
        and residual.is_contiguous()
        and cpu_layer_ops_available()
    )


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """On CUDA the Triton kernels; the fused one works in place on x and residual, as does
        the C++ op on CPU (a float32 residual; x float32, or the bf16 mode's bf16 GEMM output,
        normed in float32 and rounded back into it)."""
        if residual is None:
            norm = kernels.rms_norm if x.is_cuda else rms_norm
            return norm(x, self.weight, self.eps)
        if x.is_cuda:
            fused = kernels.fused_add_rms_norm
        elif _cpu_op_fits(x, residual, self.weight):
            fused = fused_add_rms_norm_cpu
        else:
            fused = fused_add_rms_norm
        return fused(x, residual, self.weight, self.eps)

    def normalize_(self, x: torch.Tensor) -> None:
        """x (rows of unit stride, e.g. a slice of a projection's output) normalised in place."""
        if x.is_cuda:
            kernels.rms_norm(x, self.weight, self.eps, out=x)
        else:
            x.copy_(rms_norm(x, self.weight, self.eps))
