"""The fp32 linear layers' GEMM on CPU with AVX-512 or AVX2 (kernels/cpu_gemm.cpp): weights
packed in panels of 32 output columns, the next panel prefetched while one is computed; and the
MLP's gate/up GEMM with SiLU-and-mul on its sums. The weights are float32 or bfloat16, which the
kernel widens to float32 as it loads them."""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from kernels.cpu_extension import load_extension

SOURCE = Path(__file__).with_name("cpu_gemm.cpp")
PANEL = 32


@functools.cache
def cpu_gemm_available() -> bool:
    """Built and loaded once, and compiled with AVX-512, or AVX2 and FMA (without them oneDNN's
    GEMM stays)."""
    return load_extension(SOURCE, "oneDNN's GEMM") and torch.ops.asyncllm_cpu_gemm.supported()


def cpu_gemm_fits(weight: torch.Tensor) -> bool:
    """A CPU weight [N, K] whose N is whole panels, on a machine with the kernel."""
    return weight.shape[0] % PANEL == 0 and cpu_gemm_available()


def pack_cpu_gemm_weight(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] -> [N / 32, K, 32] in the weight's dtype (float32 or bfloat16): a panel's 32
    columns of each k side by side."""
    n, k = weight.shape
    return weight.reshape(n // PANEL, PANEL, k).transpose(1, 2).contiguous()


def cpu_gemm(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] @ W^T (+ bias) in float32 (x and bias float32) for W packed by
    pack_cpu_gemm_weight."""
    return torch.ops.asyncllm_cpu_gemm.linear(x, packed, bias)


def cpu_gemm_silu_and_mul(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """silu(x @ gate^T) * (x @ up^T) [M, N / 2] for W = [gate | up] packed by
    pack_cpu_gemm_weight, each half whole panels: the [M, N] product is never written."""
    return torch.ops.asyncllm_cpu_gemm.linear_silu_mul(x, packed)
