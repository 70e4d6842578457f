"""The fused MoE's two projections at a token or two as grouped GEMVs: each (token, choice)
pair's gate and up rows of its expert read once along K by plain FMAs, SiLU-and-mul applied
as they are stored (up_gemv); and down, each program summing its token's k choices of a few
output rows with their routing weights (summed_down_gemv: no [T, k, H] rows, no sum launch).

At one pair a tile the grouped GEMM (kernels.fused_moe) computes a 16-row MMA tile of which one
row is real, and its 64-column tiles make 96 programs at one token of Qwen3-30B-A3B (8 pairs x
768 / 64) for 132 SMs: 65% of the copy bandwidth (moe_kernels_qwen3-30b-a3b_*_h200.json), where
the down GEMM, at 256 programs, reaches 90%. Here a program owns block_n rows of gate and as
many of up for one pair (3,072 programs at that token at two rows each), all of K in flight
at once up to a 2,048-wide tile, as kernels.gemv does for dense weights. The down GEMV's
program owns block_n output rows of one token and reads them from each of its k experts in
one tile (k x block_n x block_k): 1,024 programs at a Qwen3 token at two rows each, where a
down GEMM summing its k choices itself made 32 MMA programs and lost to GEMM + sum by 1.5-3x
(moe_tune_h200.json's "+sum" alignments).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels._common import next_pow2, uses_pdl


@dataclass(frozen=True)
class MoeGemvConfig:
    block_n: int  # rows of gate (and as many of up) a program
    block_k: int  # K read a step
    num_warps: int


def default_moe_gemv_config(hidden: int) -> MoeGemvConfig:
    """Two rows of gate and two of up a program, K in tiles of up to 2,048, 4 warps: the
    fastest of five settings at one and two tokens of Qwen3-30B-A3B (11.9 and 25.0 us against
    the GEMM's 18.6 and 35.4) and of Mixtral-8x7B, within 2% of the fastest on
    DeepSeek-V2-Lite (moe_kernels_*_up_gemv_h200.json)."""
    return MoeGemvConfig(block_n=2, block_k=min(next_pow2(hidden), 2048), num_warps=4)


@triton.jit
def _row_sums(w_rows, x, cols, row_mask, K):
    """Each row of the tile w_rows[:, cols] times x, summed in fp32."""
    mask = row_mask[:, None] & (cols < K)[None, :]
    w = tl.load(w_rows[:, None] + cols[None, :], mask=mask, other=0.0)
    return tl.sum(w.to(tl.float32) * x[None, :], axis=1)


@triton.jit
def _up_gemv_kernel(
    x_ptr,
    w_ptr,
    expert_ids_ptr,
    out_ptr,
    N,
    K,
    stride_xm,
    stride_we,
    TOP_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """out[pair, n] = silu(x[pair // TOP_K] . w[e, n]) * (x[pair // TOP_K] . w[e, N + n]) for
    BLOCK_N values of n, e the pair's expert."""
    if USE_PDL:  # the pairs' experts and x are the kernels before's output
        tl.extra.cuda.gdc_wait()
    pair = tl.program_id(0).to(tl.int64)
    rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < N
    expert = tl.load(expert_ids_ptr + pair).to(tl.int64)
    gate_rows = w_ptr + expert * stride_we + rows.to(tl.int64) * K
    up_rows = gate_rows + N * K
    x_row = x_ptr + (pair // TOP_K) * stride_xm
    k = tl.arange(0, BLOCK_K)
    gate = tl.zeros([BLOCK_N], dtype=tl.float32)
    up = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + k
        x = tl.load(x_row + cols, mask=cols < K, other=0.0).to(tl.float32)
        gate += _row_sums(gate_rows, x, cols, row_mask, K)
        up += _row_sums(up_rows, x, cols, row_mask, K)
    if USE_PDL:
        # only now: the down GEMM's programs, launched early, would wait on SMs that this
        # kernel's later waves need (the whole MoE at one token of Qwen3-30B-A3B took 28.6 us
        # with the trigger at the start, 27.2 with it here)
        tl.extra.cuda.gdc_launch_dependents()
    out = gate * tl.sigmoid(gate) * up
    tl.store(out_ptr + pair * N + rows, out.to(out_ptr.dtype.element_ty), mask=row_mask)


@triton.jit
def _summed_down_gemv_kernel(
    a_ptr,
    w_ptr,
    expert_ids_ptr,
    topk_weights_ptr,
    out_ptr,
    N,
    K,
    stride_we,
    stride_om,
    TOP_K: tl.constexpr,
    CHOICES: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """out[t, n] = sum_j topk_weights[t, j] * (a[t * TOP_K + j] . w[e_j, n]) for BLOCK_N values
    of n; the k choices are the first axis of each tile (CHOICES: TOP_K to a power of two)."""
    if USE_PDL:  # a, the pairs' experts and weights are the kernels before's output
        tl.extra.cuda.gdc_wait()
    token = tl.program_id(0).to(tl.int64)
    choice = tl.arange(0, CHOICES)
    chosen = choice < TOP_K
    pairs = token * TOP_K + choice
    expert = tl.load(expert_ids_ptr + pairs, mask=chosen, other=0).to(tl.int64)
    routed = tl.load(topk_weights_ptr + pairs, mask=chosen, other=0.0).to(tl.float32)
    rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    w_rows = w_ptr + expert[:, None] * stride_we + rows.to(tl.int64)[None, :] * K
    w_mask = chosen[:, None] & (rows < N)[None, :]
    a_rows = a_ptr + pairs * K
    k = tl.arange(0, BLOCK_K)
    acc = tl.zeros([CHOICES, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + k
        a_mask = chosen[:, None] & (cols < K)[None, :]
        a = tl.load(a_rows[:, None] + cols[None, :], mask=a_mask, other=0.0).to(tl.float32)
        mask = w_mask[:, :, None] & (cols < K)[None, None, :]
        w = tl.load(w_rows[:, :, None] + cols[None, None, :], mask=mask, other=0.0)
        acc += tl.sum(w.to(tl.float32) * a[:, None, :], axis=2)
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
    out = tl.sum(acc * routed[:, None], axis=0)
    tl.store(out_ptr + token * stride_om + rows, out.to(out_ptr.dtype.element_ty), mask=rows < N)


def up_gemv(
    x: torch.Tensor,
    w13: torch.Tensor,
    expert_ids: torch.Tensor,
    out: torch.Tensor,
    config: MoeGemvConfig | None = None,
) -> None:
    """out [T * k, I] = silu(gate) * up of each pair (token t's choice j in row t * k + j): x
    [T, H], w13 [E, 2 * I, H] (gate rows, then up rows), expert_ids [T * k] (flat topk ids)."""
    num_pairs, inner = out.shape
    hidden = x.shape[1]
    assert x.stride(1) == 1 and w13.stride(1) == hidden and w13.stride(2) == 1
    assert out.is_contiguous() and w13.shape[1] == 2 * inner
    config = config or default_moe_gemv_config(hidden)
    pdl = uses_pdl(x.device)
    _up_gemv_kernel[(num_pairs, triton.cdiv(inner, config.block_n))](
        x,
        w13,
        expert_ids,
        out,
        inner,
        hidden,
        x.stride(0),
        w13.stride(0),
        TOP_K=num_pairs // x.shape[0],
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        USE_PDL=pdl,
        num_warps=config.num_warps,
        launch_pdl=pdl,
    )


def summed_down_gemv(
    a: torch.Tensor,
    w2: torch.Tensor,
    out: torch.Tensor,
    expert_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    config: MoeGemvConfig | None = None,
) -> None:
    """out [T, H] = sum over each token's k choices of its routing weight times w2[e] @ a[pair]:
    a [T * k, I] (pair t * k + j), w2 [E, H, I], expert_ids and topk_weights flat [T * k]."""
    num_tokens, hidden = out.shape
    inner = a.shape[1]
    top_k = expert_ids.numel() // num_tokens
    assert a.is_contiguous() and w2.stride(1) == inner and w2.stride(2) == 1
    assert out.stride(1) == 1 and w2.shape[1] == hidden
    config = config or default_moe_gemv_config(inner)
    pdl = uses_pdl(a.device)
    _summed_down_gemv_kernel[(num_tokens, triton.cdiv(hidden, config.block_n))](
        a,
        w2,
        expert_ids,
        topk_weights,
        out,
        hidden,
        inner,
        w2.stride(0),
        out.stride(0),
        TOP_K=top_k,
        CHOICES=next_pow2(top_k),
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        USE_PDL=pdl,
        num_warps=config.num_warps,
        launch_pdl=pdl,
    )
