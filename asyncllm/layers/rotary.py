"""Rotary position embedding (neox / HF `rotate_half` layout, or interleaved pairs), with llama3
and YaRN frequency scaling."""

from __future__ import annotations

import math

import torch
from torch import nn

import kernels
from kernels.cpu_layer_ops import cpu_layer_ops_available, rotary_embedding_cpu


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


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_attention_factor(scaling: dict) -> float:
    """The scale YaRN puts on cos and sin (DeepSeek's mscale over mscale_all_dim)."""
    if scaling.get("attention_factor") is not None:
        return scaling["attention_factor"]
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return yarn_mscale(scaling["factor"], mscale) / yarn_mscale(
            scaling["factor"], mscale_all_dim
        )
    return yarn_mscale(scaling["factor"])


def yarn_inv_freq(inv_freq: torch.Tensor, theta: float, scaling: dict) -> torch.Tensor:
    """Interpolate (divide by factor) the frequencies that rotate fewer than beta_slow times over
    the original context, keep those past beta_fast, ramp linearly between (YaRN)."""
    dim = 2 * inv_freq.numel()
    old_context = scaling["original_max_position_embeddings"]

    def correction_dim(rotations: float) -> float:
        return dim * math.log(old_context / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low = correction_dim(scaling.get("beta_fast") or 32)
    high = correction_dim(scaling.get("beta_slow") or 1)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    high = high + 0.001 if low == high else high
    ramp = ((torch.arange(dim // 2, dtype=inv_freq.dtype) - low) / (high - low)).clamp(0, 1)
    return inv_freq / scaling["factor"] * ramp + inv_freq * (1 - ramp)


def build_cos_sin_cache(
    head_dim: int, max_position: int, theta: float, scaling: dict | None
) -> torch.Tensor:
    """[max_position, head_dim]: cos of each frequency in the first half, sin in the second."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    magnitude = 1.0
    if rope_type == "llama3":
        inv_freq = llama3_inv_freq(inv_freq, scaling)
    elif rope_type == "yarn":
        inv_freq, magnitude = (
            yarn_inv_freq(inv_freq, theta, scaling),
            yarn_attention_factor(scaling),
        )
    elif rope_type != "default":
        raise ValueError(f"rope_scaling type {rope_type!r} is not supported")
    angles = torch.outer(torch.arange(max_position, dtype=torch.float64), inv_freq)
    return (torch.cat([angles.cos(), angles.sin()], dim=-1) * magnitude).float()


def apply_rotary(
    x: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor, interleaved: bool = False
) -> torch.Tensor:
    """x [T, H, D] rotated by the angles of positions [T]; the pairs rotated are (i, i + D/2),
    or with interleaved (GPT-J, DeepSeek) (2i, 2i + 1)."""
    cos, sin = cos_sin_cache[positions].unsqueeze(1).chunk(2, dim=-1)
    if interleaved:
        x1, x2 = x.float()[..., 0::2], x.float()[..., 1::2]
        rotated = torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).flatten(-2)
        return rotated.to(x.dtype)
    x1, x2 = x.float().chunk(2, dim=-1)
    rotated = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    return rotated.to(x.dtype)


class RotaryEmbedding(nn.Module):
    def __init__(
        self,
        head_dim: int,
        max_position: int,
        theta: float,
        scaling: dict | None,
        interleaved: bool = False,
    ) -> None:
        super().__init__()
        cache = build_cos_sin_cache(head_dim, max_position, theta, scaling)
        self.register_buffer("cos_sin_cache", cache, persistent=False)
        self.interleaved = interleaved

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """On CUDA the Triton kernel rotates q and k in place (one launch for both), on CPU a
        C++ op (float32 heads, half-split pairs)."""
        if q.is_cuda:
            return kernels.rotary_embedding(positions, q, k, self.cos_sin_cache, self.interleaved)
        if self._cpu_op_fits(q, k):
            return rotary_embedding_cpu(positions, q, k, self.cos_sin_cache)
        cache, interleaved = self.cos_sin_cache, self.interleaved
        return (
            apply_rotary(q, positions, cache, interleaved),
            apply_rotary(k, positions, cache, interleaved),
        )

    def rotate_(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> None:
        """q and k (views of the projections' outputs) rotated in place on every device."""
        rotated_q, rotated_k = self(positions, q, k)
        q.copy_(rotated_q)  # on CUDA the same tensors: copy_ returns at once
        k.copy_(rotated_k)

    def _cpu_op_fits(self, q: torch.Tensor, k: torch.Tensor) -> bool:
        return (
            not self.interleaved
            and q.device.type == "cpu"
            and q.dtype == k.dtype == self.cos_sin_cache.dtype == torch.float32
            and q.dim() == k.dim() == 3
            and cpu_layer_ops_available()
        )
