"""The fused MoE's gate/up projection at a token or two as grouped GEMVs: each (token, choice)
pair's gate and up rows of its expert read once along K by plain FMAs, SiLU-and-mul applied
as they are stored.

At one pair a tile the grouped GEMM (kernels.fused_moe) computes a 16-row MMA tile of which one
row is real, and its 64-column tiles make 96 programs at one token of Qwen3-30B-A3B (8 pairs x
768 / 64) for 132 SMs: 65% of the copy bandwidth (moe_kernels_qwen3-30b-a3b_*_h200.json), where
the down GEMM, at 256 programs, reaches 90%. Here a program owns block_n rows of gate and as
many of up for one pair (3,072 programs at that token at two rows each), all of K in flight
at once up to a 2,048-wide tile, as kernels.gemv does for dense weights.
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
