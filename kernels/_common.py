"""Small helpers shared by the Triton kernel wrappers."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AttentionConfig:
    """Tile shape and launch settings of an attention kernel (block_m is unused by decode)."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs get exact products; tf32 would cost fp32 tests three decimal digits."""
    return "ieee" if dtype == torch.float32 else "tf32"


@functools.lru_cache(maxsize=8)
def num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 8
    return torch.cuda.get_device_properties(device).multi_processor_count


def next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()
