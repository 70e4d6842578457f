"""Paged decode attention for CPU tensors: a C++ kernel that reads the KV blocks in place, built
on first use (kernels/cpu_extension.py)."""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from kernels.cpu_extension import load_extension

SOURCE = Path(__file__).with_name("cpu_decode_attention.cpp")
HEAD_DIM_MULTIPLE = 8  # the kernel reads head_dim in vectors of 8 floats


@functools.cache
def cpu_decode_attention_available() -> bool:
    """Build and load the kernel once; False, after one warning, when that fails."""
    return load_extension(SOURCE, "torch SDPA")


def paged_decode_attention_cpu(
    query: torch.Tensor,  # [num_rows >= num_reqs, num_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # int32 [num_reqs, max_blocks]
    seq_lens: torch.Tensor,  # int32 [num_reqs], including the current token
    scale: float,
    out: torch.Tensor,  # like query; rows past num_reqs are left alone
) -> torch.Tensor:
    """Row r of query attends to the first seq_lens[r] positions of request r's blocks."""
    torch.ops.asyncllm_cpu.paged_decode_attention(
        query, kv_cache, block_tables, seq_lens, scale, out
    )
    return out
