"""Paged decode and prompt attention for CPU tensors: C++ kernels that read the KV blocks in place,
built on first use (kernels/cpu_extension.py)."""

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


def paged_prefill_attention_cpu(
    query: torch.Tensor,  # float32 [num_rows, num_heads, head_dim]
    kv_cache: torch.Tensor,  # float32 or bf16 [2, num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # int32 [num_reqs, max_blocks]
    seq_lens: torch.Tensor,  # int32 [num_reqs], including the query rows
    query_starts: torch.Tensor,  # int32 [num_reqs]: each request's first query row
    query_lens: torch.Tensor,  # int32 [num_reqs]: its query rows, the last of its positions
    scale: float,
    out: torch.Tensor,  # like query; rows of no request are left alone
) -> torch.Tensor:
    """Query row query_starts[r] + i attends causally to positions 0 .. seq_lens[r] -
    query_lens[r] + i of request r's blocks."""
    torch.ops.asyncllm_cpu.paged_prefill_attention(
        query, kv_cache, block_tables, seq_lens, query_starts, query_lens, scale, out
    )
    return out
