"""Fused mixture-of-experts: one grouped GEMM over all experts for gate/up (SiLU-and-mul fused)
and one for down (routing weights applied), over the (token, choice) pairs sorted by expert.

The pairs are sorted by expert and each expert's run padded to a multiple of BLOCK_M
(align_by_expert), so every row tile of the grouped GEMM belongs to one expert and reads its
weights once; the padding rows hold a sentinel index past the last pair and are masked.
Everything stays on the device with fixed-size outputs: no host sync, so CUDA graphs capture it.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path

import torch
import triton
import triton.language as tl

from kernels._common import dot_precision

CONFIG_DIR = Path(__file__).with_name("fused_moe_configs")


@dataclass(frozen=True)
class MoeTileConfig:
    block_m: int
    block_n: int
    block_k: int
    group_m: int
    num_warps: int
    num_stages: int


@dataclass(frozen=True)
class ExpertAlignment:
    """The (token, choice) pairs grouped by expert, each group padded to a multiple of block_m."""

    sorted_pair_ids: torch.Tensor  # int32 [max_padded]: pair index, num_pairs for padding
    block_experts: torch.Tensor  # int32 [max_padded // block_m]: each row tile's expert
    num_padded: torch.Tensor  # int32 [1]: rows in use (the rest are skipped)


def align_by_expert(topk_ids: torch.Tensor, block_m: int, num_experts: int) -> ExpertAlignment:
    """topk_ids [T, k] -> the pairs t * k + j sorted by expert, padded per expert to block_m."""
    flat = topk_ids.flatten().long()
    num_pairs = flat.numel()
    max_padded = num_pairs + num_experts * (block_m - 1)
    max_padded = triton.cdiv(max_padded, block_m) * block_m
    # scatter_add, not bincount: bincount reads the largest id back to the host (no capture)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = padded.cumsum(0)
    padded_start = padded_end - padded
    count_start = counts.cumsum(0) - counts
    order = torch.argsort(flat, stable=True)
    rank = torch.arange(num_pairs, device=flat.device) - count_start[flat[order]]
    position = padded_start[flat[order]] + rank
    sorted_ids = torch.full((max_padded,), num_pairs, dtype=torch.int32, device=flat.device)
    sorted_ids.scatter_(0, position, order.to(torch.int32))
    tile_starts = torch.arange(0, max_padded, block_m, device=flat.device)
    block_experts = torch.searchsorted(padded_end, tile_starts, right=True)
    return ExpertAlignment(
        sorted_ids,
        block_experts.clamp_(max=num_experts - 1).to(torch.int32),
        padded_end[-1:].to(torch.int32),
    )


@triton.jit
def _grouped_gemm_kernel(
    a_ptr,
    w_ptr,
    out_ptr,
    sorted_pair_ids_ptr,
    block_experts_ptr,
    num_padded_ptr,
    topk_weights_ptr,
    num_pairs,
    N,
    K,
    stride_am,
    stride_we,
    stride_wn,
    stride_wk,
    stride_om,
    ROWS_PER_A: tl.constexpr,
    SILU_AND_MUL: tl.constexpr,
    MUL_ROUTED_WEIGHT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """out[pair, n] = a[pair // ROWS_PER_A] . w[expert(pair), n] for one BLOCK_M x BLOCK_N tile;
    with SILU_AND_MUL, silu(gate) * up where the up row is n + N of the same expert."""
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(tl.num_programs(0), tl.cdiv(N, BLOCK_N))
    num_pid_n = tl.cdiv(N, BLOCK_N)
    # grouped ordering: GROUP_M row tiles share each weight tile while it is in L2
    group = pid // (GROUP_M * num_pid_n)
    first_m = group * GROUP_M
    group_size = min(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * num_pid_n)) % group_size
    pid_n = (pid % (GROUP_M * num_pid_n)) // group_size
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_pair_ids_ptr + offs_m).to(tl.int64)
    row_mask = pair < num_pairs
    expert = tl.load(block_experts_ptr + pid_m).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_rows = a_ptr + (pair // ROWS_PER_A)[:, None] * stride_am
    w_cols = w_ptr + expert * stride_we + offs_n[None, :] * stride_wn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if SILU_AND_MUL:
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + offs_k
        k_mask = k < K
        a = tl.load(a_rows + k[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        w_mask = k_mask[:, None] & n_mask[None, :]
        w = tl.load(w_cols + k[:, None] * stride_wk, mask=w_mask, other=0.0)
        acc = tl.dot(a, w, acc, input_precision=PRECISION)
        if SILU_AND_MUL:
            w_up = tl.load(w_cols + N * stride_wn + k[:, None] * stride_wk, mask=w_mask, other=0.0)
            acc_up = tl.dot(a, w_up, acc_up, input_precision=PRECISION)
    if SILU_AND_MUL:
        acc = acc * tl.sigmoid(acc) * acc_up
    if MUL_ROUTED_WEIGHT:
        acc = acc * tl.load(topk_weights_ptr + pair, mask=row_mask, other=0.0)[:, None]
    out = out_ptr + pair[:, None] * stride_om + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & n_mask[None, :])


def _grouped_gemm(
    a: torch.Tensor,
    w: torch.Tensor,
    out: torch.Tensor,
    alignment: ExpertAlignment,
    topk_weights: torch.Tensor | None,
    rows_per_a: int,
    n: int,
    config: MoeTileConfig,
) -> None:
    num_pairs = out.shape[0]
    grid = (alignment.block_experts.numel() * triton.cdiv(n, config.block_n),)
    _grouped_gemm_kernel[grid](
        a,
        w,
        out,
        alignment.sorted_pair_ids,
        alignment.block_experts,
        alignment.num_padded,
        topk_weights if topk_weights is not None else out,
        num_pairs,
        n,
        w.shape[2],
        a.stride(0),
        w.stride(0),
        w.stride(1),
        w.stride(2),
        out.stride(0),
        ROWS_PER_A=rows_per_a,
        SILU_AND_MUL=w.shape[1] == 2 * n,
        MUL_ROUTED_WEIGHT=topk_weights is not None,
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        GROUP_M=config.group_m,
        PRECISION=dot_precision(a.dtype),
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )


def fused_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    config: MoeTileConfig | None = None,
) -> torch.Tensor:
    """sum_j topk_weights[t, j] * w2[e] @ (silu(w1[e] @ x[t]) * (w3[e] @ x[t])), e = topk_ids[t, j].

    x [T, H]; w13 [E, 2 * I, H] (gate rows, then up rows); w2 [E, H, I]; topk_* [T, k]."""
    num_tokens, top_k = topk_ids.shape
    num_experts, two_i, hidden = w13.shape
    inner = two_i // 2
    config = config or tile_config(num_experts, inner, hidden, num_tokens, x.device)
    out = torch.empty(num_tokens, top_k, hidden, dtype=x.dtype, device=x.device)
    if num_tokens == 0:
        return out.sum(1)
    alignment = align_by_expert(topk_ids, config.block_m, num_experts)
    activated = torch.empty(num_tokens * top_k, inner, dtype=x.dtype, device=x.device)
    _grouped_gemm(x, w13, activated, alignment, None, top_k, inner, config)
    weights = topk_weights.to(torch.float32).flatten().contiguous()
    _grouped_gemm(activated, w2, out.view(-1, hidden), alignment, weights, 1, hidden, config)
    return out.sum(1)


def tile_config(
    num_experts: int, inner: int, hidden: int, num_tokens: int, device: torch.device
) -> MoeTileConfig:
    """The committed config for this shape on this device at the nearest batch size measured,
    else a default by batch size."""
    table = _config_table(num_experts, inner, hidden, _device_name(device))
    if table:
        nearest = min(table, key=lambda m: abs(m - num_tokens))
        return table[nearest]
    return default_tile_config(num_tokens)


def default_tile_config(num_tokens: int) -> MoeTileConfig:
    if num_tokens <= 32:
        return MoeTileConfig(16, 64, 64, 1, 4, 3)
    if num_tokens <= 512:
        return MoeTileConfig(32, 64, 64, 8, 4, 3)
    return MoeTileConfig(64, 128, 64, 8, 8, 3)


def config_file_name(num_experts: int, inner: int, hidden: int, device_name: str) -> str:
    return f"E={num_experts},N={inner},K={hidden},device={device_name}.json"


def _device_name(device: torch.device) -> str:
    if device.type != "cuda":
        return "cpu"
    return torch.cuda.get_device_name(device).replace(" ", "_")


@functools.lru_cache(maxsize=32)
def _config_table(
    num_experts: int, inner: int, hidden: int, device_name: str
) -> dict[int, MoeTileConfig]:
    path = CONFIG_DIR / config_file_name(num_experts, inner, hidden, device_name)
    if not path.exists():
        return {}
    return {int(m): MoeTileConfig(**c) for m, c in json.loads(path.read_text()).items()}
