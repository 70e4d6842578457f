"""Rotary position embedding (neox / HF `rotate_half` layout), with llama3 frequency scaling."""

from __future__ import annotations

import math

import torch
from torch import nn

import kernels


def llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Stretch low frequencies by `factor`, keep high ones, blend in between (Llama 3.1)."""
    factor = scaling["factor"]
    low_freq_factor = scaling.get("low_freq_factor", 1.0)
    high_freq_factor = scaling.get("high_freq_factor", 4.0)
    old_context = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    scaled = torch.where(wavelen > old_context / low_freq_factor, inv_freq / factor, blended)
    return torch.where(wavelen < old_context / high_freq_factor, inv_freq, scaled)


def build_cos_sin_cache(
    head_dim: int, max_position: int, theta: float, scaling: dict | None
) -> torch.Tensor:
    """[max_position, head_dim]: cos of each frequency in the first half, sin in the second."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if rope_type == "llama3":
        inv_freq = llama3_inv_freq(inv_freq, scaling)
    elif rope_type != "default":
        raise ValueError(f"rope_scaling type {rope_type!r} is not supported")
    angles = torch.outer(torch.arange(max_position, dtype=torch.float64), inv_freq)
    return torch.cat([angles.cos(), angles.sin()], dim=-1).float()


def apply_rotary(
    x: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor
) -> torch.Tensor:
    """x [T, H, D] rotated by the angles of positions [T]."""
    cos, sin = cos_sin_cache[positions].unsqueeze(1).chunk(2, dim=-1)
    x1, x2 = x.float().chunk(2, dim=-1)
    rotated = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    return rotated.to(x.dtype)


class RotaryEmbedding(nn.Module):
    def __init__(
        self, head_dim: int, max_position: int, theta: float, scaling: dict | None
    ) -> None:
        super().__init__()
        cache = build_cos_sin_cache(head_dim, max_position, theta, scaling)
        self.register_buffer("cos_sin_cache", cache, persistent=False)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """On CUDA the Triton kernel rotates q and k in place."""
        if q.is_cuda:
            return kernels.rotary_embedding(positions, q, k, self.cos_sin_cache)
        cache = self.cos_sin_cache
        return apply_rotary(q, positions, cache), apply_rotary(k, positions, cache)
