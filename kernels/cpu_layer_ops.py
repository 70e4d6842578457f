"""A decoder layer's per-token ops on CPU (kernels/cpu_layer_ops.cpp): in place in float32 the
residual add with the RMSNorm (x in bfloat16 too), the rotary embedding of q and k, and the KV
cache write; and the bf16 mode's SiLU-and-mul, bfloat16 in and out, and its lm_head's top
logits recomputed in float32."""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from kernels.cpu_extension import load_extension

SOURCE = Path(__file__).with_name("cpu_layer_ops.cpp")


@functools.cache
def cpu_layer_ops_available() -> bool:
    """Build and load the ops once; False, after one warning, when that fails."""
    return load_extension(SOURCE, "torch's ops")


def fused_add_rms_norm_cpu(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual), IN PLACE: x holds the first, residual the second.
    residual and weight float32; x float32, or bfloat16 (computed in float32, rounded into x)."""
    torch.ops.asyncllm_cpu_layer.fused_add_rms_norm(x, residual, weight, eps)
    return x, residual


def rotary_embedding_cpu(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, Hq, D] and k [T, Hk, D] (strided views of qkv) rotated IN PLACE, the pairs
    (i, i + D / 2)."""
    torch.ops.asyncllm_cpu_layer.rotary_embedding(positions, q, k, cos_sin_cache)
    return q, k


def write_kv_cache_cpu(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """float32 key and value [T, Hk, D] (strided views of qkv) into their slots of a float32 or
    bf16 cache; slots < 0 are padding and skipped."""
    torch.ops.asyncllm_cpu_layer.write_kv_cache(key, value, kv_cache, slot_mapping)


def silu_and_mul_bf16_cpu(x: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of x = [gate | up] bfloat16 [T, 2 * I] -> bfloat16 [T, I], in float32
    inside and rounded once."""
    return torch.ops.asyncllm_cpu_layer.silu_and_mul_bf16(x)


def refine_top_logits_cpu(
    logits: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor, margin: float
) -> torch.Tensor:
    """IN PLACE: each row's logits within margin of its largest become the float32 dot products
    hidden[r] . weight[v]. All float32: logits [R, V], hidden [R, H], weight [V, H]."""
    torch.ops.asyncllm_cpu_layer.refine_top_logits(logits, hidden, weight, margin)
    return logits
