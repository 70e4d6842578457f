"""Paged decode attention for CPU tensors: a C++ kernel that reads the KV blocks in place, built
on first use (torch.utils.cpp_extension caches the build across processes)."""

from __future__ import annotations

import functools
import hashlib
import logging
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_decode_attention.cpp")
HEAD_DIM_MULTIPLE = 8  # the kernel reads head_dim in vectors of 8 floats


def build(name: str, source: Path) -> None:
    """Compile and load source's operators for this machine's vector extensions."""
    from torch.utils.cpp_extension import load  # imports setuptools: only when first needed

    load(
        name=name,
        sources=[str(source)],
        extra_cflags=["-O3", "-march=native", "-fopenmp"],
        extra_ldflags=["-fopenmp"],
        is_python_module=False,
    )


def build_name(source: Path) -> str:
    """Named after the source's hash: checkouts of different sources share torch's build cache
    without one loading (or rebuilding over) the other's library."""
    digest = hashlib.sha256(source.read_bytes()).hexdigest()[:12]
    return f"asyncllm_cpu_decode_attention_{digest}"


@functools.cache
def cpu_decode_attention_available() -> bool:
    """Build and load the kernel once; False, after one warning, when that fails."""
    try:
        build(build_name(SOURCE), SOURCE)
    except Exception as error:  # no compiler, no ninja, a failed build: the torch path remains
        logger.warning("CPU decode attention kernel unavailable (%s); using torch SDPA", error)
        return False
    return True


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
