"""The CPU RMSNorm's fp32 path (torch.rms_norm) against the norm's float32 steps."""

from __future__ import annotations

import pytest
import torch

from asyncllm.layers.norm import rms_norm


def stepwise_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


@pytest.mark.parametrize("rows, hidden", [(0, 64), (1, 7), (17, 576), (3, 1000)])
def test_fp32_rms_norm_matches_its_steps(rows: int, hidden: int) -> None:
    gen = torch.Generator().manual_seed(rows + hidden)
    x = torch.randn(rows, hidden, generator=gen) * 3
    weight = torch.randn(hidden, generator=gen)
    out = rms_norm(x, weight, 1e-5)
    torch.testing.assert_close(out, stepwise_rms_norm(x, weight, 1e-5), rtol=1e-6, atol=1e-6)
