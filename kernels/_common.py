"""Small helpers shared by the Triton kernel wrappers."""

from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass
from typing import TypeVar

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


@functools.lru_cache(maxsize=8)
def uses_pdl(device: torch.device) -> bool:
    """Whether kernels on device launch with programmatic dependent launch (Hopper and later):
    a kernel then starts while the one before it finishes, and waits for it (gdc_wait) only
    where it first reads that kernel's output. ASYNCLLM_PDL=0 turns it off (for A/B runs)."""
    if device.type != "cuda" or os.environ.get("ASYNCLLM_PDL", "1") == "0":
        return False
    return torch.cuda.get_device_capability(device)[0] >= 9


Config = TypeVar("Config")


@functools.lru_cache(maxsize=8)
def configs_by_shape(
    name: str, table: tuple[tuple[tuple[int, int], Config], ...], kind: type[Config]
) -> dict[tuple[int, int], Config]:
    """{(N, K): settings}: table's entries, and over them those of the JSON object
    {"NxK": {kind's fields}} in the environment variable `name` (a sweep's winners per
    shape, tried in the same run)."""
    configs = dict(table)
    for shape, fields in json.loads(os.environ.get(name) or "{}").items():
        n, k = map(int, shape.split("x"))
        configs[n, k] = kind(**fields)
    return configs


def next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()
