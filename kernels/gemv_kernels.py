"""y = f(x) @ W^T (+ bias) for one row x: batch-1 decode's GEMMs, bound by reading W once.

f is the elementwise op the decoder layer runs before the GEMM, fused in so that each projection
is one launch: nothing, RMSNorm (with the residual add), or SiLU-and-mul (asyncllm's layers fuse
only short rows, see FUSED_MAX_ROW in asyncllm/layers/linear.py). x is a single row of a
few KB, so every program recomputes f on the slice of it that it needs, from L2, next to its
slice of W. Each program owns two rows of W and reads them whole along K: even 1024-row weights
give every SM a few programs, so K is never split. With GemvConfig.programs_per_sm (K in one
tile, no f) a few programs a SM take the row blocks in turn instead, reading x once and
loading the next block's W while they sum one (e4m3 weights' sweep, bench/fp8_gemm_sweep.py).

On Hopper the kernels launch with programmatic dependent launch: a GEMV starts while the kernel
before it finishes, loads its first tile of W (which no kernel writes), and only then waits
for the kernel before it to read x.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels._common import configs_by_shape, next_pow2, num_sms, uses_pdl

# what runs on x before the GEMM (constexpr, so the kernel may read them)
NO_PROLOGUE = tl.constexpr(0)
RMS_NORM = tl.constexpr(1)
SILU_AND_MUL = tl.constexpr(2)
THREE_PROGRAMS_A_SM = 3 * 132  # on the H200


@dataclass(frozen=True)
class GemvConfig:
    """block_n rows of W a program, read along K in tiles of block_k. programs_per_sm > 0 (one
    K tile, no prologue): that many programs a SM each take row blocks in turn, x read once
    and the next block's W loading while one is summed, instead of one program a block."""

    block_n: int
    block_k: int
    num_warps: int = 4
    programs_per_sm: int = 0


# 16- and 32-bit weights' settings per (N, K), as the model runs that shape, where a sweep found
# the rules more than 5% slower (bench/decode_gemv.py): Qwen3-30B-A3B's o_proj 6.34 -> 5.09 us
# (decode_gemv_qwen3-30b-a3b_h200.json); Qwen3-0.6B's lm_head 94.2 -> 69.7 us
# (decode_gemv_qwen3-0.6b_prologue_h200.json). ASYNCLLM_GEMV, the JSON {"NxK": {GemvConfig's
# fields}}, adds to and overrides the table (a sweep's winners, tried in the same run)
GEMV_BY_SHAPE: dict[tuple[int, int], GemvConfig] = {
    (2048, 4096): GemvConfig(block_n=2, block_k=2048, num_warps=8),
    (151936, 1024): GemvConfig(block_n=8, block_k=512, num_warps=4),
}
GEMV_BY_SHAPE_ENV = "ASYNCLLM_GEMV"
# e4m3 weights' settings per (N, K) where a sweep found better than choose_gemv_config's
# (bench/fp8_gemm_sweep.py); ASYNCLLM_FP8_GEMV, the JSON {"NxK": {GemvConfig's fields}} the
# sweep writes, adds to and overrides the table
FP8_GEMV_BY_SHAPE: dict[tuple[int, int], GemvConfig] = {}
FP8_GEMV_BY_SHAPE_ENV = "ASYNCLLM_FP8_GEMV"


@triton.jit
def _summed_row(x_ptr, residual_ptr, cols, mask, HAS_RESIDUAL: tl.constexpr):
    """x (+ residual) in fp32, rounded to x's dtype as the unfused residual add stores it."""
    x = tl.load(x_ptr + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + residual.to(tl.float32)).to(x_ptr.dtype.element_ty)
    return x.to(tl.float32)


@triton.jit
def _w_tile(w_ptr, rows, row_mask, cols, K):
    mask = row_mask[:, None] & (cols < K)[None, :]
    return tl.load(w_ptr + rows.to(tl.int64)[:, None] * K + cols[None, :], mask=mask, other=0.0)


@triton.jit
def _x_tile(
    x_ptr,
    residual_ptr,
    norm_weight_ptr,
    cols,
    K,
    rstd,
    PROLOGUE: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
):
    """f(x) on cols, in fp32 after rounding to x's dtype as the unfused op stores it."""
    mask = cols < K
    dtype = x_ptr.dtype.element_ty
    if PROLOGUE == RMS_NORM:
        x = _summed_row(x_ptr, residual_ptr, cols, mask, HAS_RESIDUAL)
        weight = tl.load(norm_weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        x = (x * rstd * weight).to(dtype).to(tl.float32)
    elif PROLOGUE == SILU_AND_MUL:  # x holds [gate | up], 2K values
        gate = tl.load(x_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(x_ptr + K + cols, mask=mask, other=0.0).to(tl.float32)
        x = (gate * tl.sigmoid(gate) * up).to(dtype).to(tl.float32)
    else:
        x = tl.load(x_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    return x


@triton.jit
def _gemv_kernel(
    x_ptr,
    residual_ptr,
    residual_out_ptr,
    norm_weight_ptr,
    w_ptr,
    bias_ptr,
    scale_ptr,
    out_ptr,
    N,
    K,
    eps,
    PROLOGUE: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_PDL: tl.constexpr,
    PERSISTENT: tl.constexpr,
):
    """out[n] = sum_k f(x)[k] * w[n, k] (* scale[n]) (+ bias[n]); f's input dtype rounding as
    unfused. PERSISTENT: K in one tile and no prologue, the programs taking the row blocks in
    turn (_gemv_blocks)."""
    if PERSISTENT:
        _gemv_blocks(x_ptr, w_ptr, bias_ptr, scale_ptr, out_ptr, N, K, HAS_BIAS, HAS_SCALE,
                     BLOCK_N, BLOCK_K, USE_PDL)  # fmt: skip
    else:
        _gemv_block(x_ptr, residual_ptr, residual_out_ptr, norm_weight_ptr, w_ptr, bias_ptr,
                    scale_ptr, out_ptr, N, K, eps, PROLOGUE, HAS_RESIDUAL, HAS_BIAS, HAS_SCALE,
                    BLOCK_N, BLOCK_K, USE_PDL)  # fmt: skip


@triton.jit
def _store_rows(acc, rows, row_mask, bias_ptr, scale_ptr, out_ptr, HAS_BIAS, HAS_SCALE):
    if HAS_SCALE:
        acc *= tl.load(scale_ptr + rows, mask=row_mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rows, mask=row_mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + rows, acc.to(out_ptr.dtype.element_ty), mask=row_mask)


@triton.jit
def _gemv_blocks(
    x_ptr, w_ptr, bias_ptr, scale_ptr, out_ptr, N, K, HAS_BIAS, HAS_SCALE,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    """Row blocks pid, pid + programs, ... of out = x @ W^T, K <= BLOCK_K: x is read once, and
    each block's W tile loads while the one before it is summed."""
    pid, programs = tl.program_id(0), tl.num_programs(0)
    k = tl.arange(0, BLOCK_K)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    w = _w_tile(w_ptr, rows, rows < N, k, K)  # no kernel writes W: its first tile needs no wait
    if USE_PDL:  # the next kernel may start loading its weights; x is the kernel before's output
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    x = tl.load(x_ptr + k, mask=k < K, other=0.0).to(tl.float32)
    for block in range(pid, tl.cdiv(N, BLOCK_N), programs):
        rows = block * BLOCK_N + tl.arange(0, BLOCK_N)
        ahead = rows + programs * BLOCK_N
        following = _w_tile(w_ptr, ahead, ahead < N, k, K)
        acc = tl.sum(w.to(tl.float32) * x[None, :], axis=1)
        _store_rows(acc, rows, rows < N, bias_ptr, scale_ptr, out_ptr, HAS_BIAS, HAS_SCALE)
        w = following


@triton.jit
def _gemv_block(
    x_ptr, residual_ptr, residual_out_ptr, norm_weight_ptr, w_ptr, bias_ptr, scale_ptr, out_ptr,
    N, K, eps, PROLOGUE: tl.constexpr, HAS_RESIDUAL: tl.constexpr, HAS_BIAS: tl.constexpr,
    HAS_SCALE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    """Row block pid of out, K in tiles of BLOCK_K."""
    pid = tl.program_id(0)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < N
    k = tl.arange(0, BLOCK_K)
    w = _w_tile(w_ptr, rows, row_mask, k, K)  # no kernel writes W: its first tile needs no wait
    if USE_PDL:  # the next kernel may start loading its weights; x is the kernel before's output
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    rstd = 1.0
    if PROLOGUE == RMS_NORM:  # the row's scale first; program 0 stores x + residual
        squares = tl.zeros([BLOCK_K], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            mask = k0 + k < K
            x = _summed_row(x_ptr, residual_ptr, k0 + k, mask, HAS_RESIDUAL)
            if HAS_RESIDUAL:  # noqa: SIM102 (a constexpr and a runtime test stay apart)
                if pid == 0:
                    tl.store(residual_out_ptr + k0 + k, x.to(x_ptr.dtype.element_ty), mask=mask)
            squares += x * x
        rstd = tl.rsqrt(tl.sum(squares, 0) / K + eps)
    x = _x_tile(x_ptr, residual_ptr, norm_weight_ptr, k, K, rstd, PROLOGUE, HAS_RESIDUAL)
    acc = tl.sum(w.to(tl.float32) * x[None, :], axis=1)
    for k0 in range(BLOCK_K, K, BLOCK_K):
        cols = k0 + k
        w = _w_tile(w_ptr, rows, row_mask, cols, K)
        x = _x_tile(x_ptr, residual_ptr, norm_weight_ptr, cols, K, rstd, PROLOGUE, HAS_RESIDUAL)
        acc += tl.sum(w.to(tl.float32) * x[None, :], axis=1)
    _store_rows(acc, rows, row_mask, bias_ptr, scale_ptr, out_ptr, HAS_BIAS, HAS_SCALE)


def choose_gemv_config(n: int, k: int, block_n: int = 2) -> GemvConfig:
    """Two rows of W per program, read along K in tiles of up to 4096 values, 8 warps from 2048:
    in a sweep of 1-16 rows and 256-8192 values per row, within 1% of the fastest on every
    Qwen3-0.6B GEMM and within 4% on Llama-3.1-8B's (bench/results/decode_gemv_h200.json,
    decode_gemv_llama8b_h200.json)."""
    block_k = min(next_pow2(k), 4096)
    return GemvConfig(block_n=block_n, block_k=block_k, num_warps=8 if block_k >= 2048 else 4)


def choose_norm_gemv_config(n: int, k: int) -> GemvConfig:
    """rms_norm_gemv's: every program first passes over x for the norm's sum of squares, so
    more rows a program share that pass: 8 rows where that still gives every H200 SM three
    programs, in K tiles of up to 1,024 values on 4 warps. Within 2% of the fastest of the
    sweep on the four norm-first GEMVs of Qwen3-0.6B and Qwen3-30B-A3B, where the plain
    GEMV's rule took 1.29-1.39x as long (decode_gemv_*_prologue_h200.json)."""
    block_n = 8 if triton.cdiv(n, 8) >= THREE_PROGRAMS_A_SM else 2
    return GemvConfig(block_n=block_n, block_k=min(next_pow2(k), 1024), num_warps=4)


def gemv_config(n: int, k: int, fp8: bool = False, norm_first: bool = False) -> GemvConfig:
    """The settings a GEMV of W [N, K] runs with (norm_first: as rms_norm_gemv): its shape's in
    the tables, else the rule."""
    if fp8:
        return fp8_gemv_config(n, k)
    table = configs_by_shape(GEMV_BY_SHAPE_ENV, tuple(GEMV_BY_SHAPE.items()), GemvConfig)
    rule = choose_norm_gemv_config if norm_first else choose_gemv_config
    return table.get((n, k)) or rule(n, k)


def fp8_gemv_config(n: int, k: int) -> GemvConfig:
    """FP8_GEMV_BY_SHAPE's, else four e4m3 rows a program (half as long in bytes, they give a
    program bf16's two rows' bytes) in K tiles of up to 2,048 values on 4 warps: the fastest
    on each of Llama-3.1-8B's four projections (fp8_gemm_sweep_h200.json: 60.4 us over the
    four against 68.0 with bf16's 4,096 values on 8 warps, 1.79x the bf16 GEMV)."""
    table = configs_by_shape(FP8_GEMV_BY_SHAPE_ENV, tuple(FP8_GEMV_BY_SHAPE.items()), GemvConfig)
    return table.get((n, k)) or GemvConfig(block_n=4, block_k=min(next_pow2(k), 2048))


def _launch(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    k: int,
    prologue: int,
    config: GemvConfig | None,
    residual: torch.Tensor | None = None,
    residual_out: torch.Tensor | None = None,
    norm_weight: torch.Tensor | None = None,
    eps: float = 0.0,
    scale: torch.Tensor | None = None,
) -> torch.Tensor:
    n = weight.shape[0]
    assert x.is_contiguous() and weight.is_contiguous() and weight.shape[1] == k
    fp8 = weight.dtype == torch.float8_e4m3fn
    assert weight.dtype == x.dtype or fp8
    assert scale is None or (scale.is_contiguous() and scale.numel() == n)
    out = torch.empty(1, n, dtype=x.dtype, device=x.device)
    config = config or gemv_config(n, k, fp8, prologue == RMS_NORM)
    pdl = uses_pdl(x.device)
    blocks = triton.cdiv(n, config.block_n)
    persistent = config.programs_per_sm > 0 and prologue == NO_PROLOGUE and k <= config.block_k
    if persistent:
        blocks = min(blocks, config.programs_per_sm * num_sms(x.device))
    _gemv_kernel[(blocks,)](
        x,
        residual if residual is not None else x,
        residual_out if residual_out is not None else x,
        norm_weight if norm_weight is not None else x,
        weight,
        bias if bias is not None else weight,
        scale if scale is not None else weight,
        out,
        n,
        k,
        eps,
        PROLOGUE=prologue,
        HAS_RESIDUAL=residual is not None,
        HAS_BIAS=bias is not None,
        HAS_SCALE=scale is not None,
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        USE_PDL=pdl,
        PERSISTENT=persistent,
        num_warps=config.num_warps,
        launch_pdl=pdl,
    )
    return out


def gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    config: GemvConfig | None = None,
    scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [1, K] @ weight [N, K]^T * scale [N] + bias [N] -> [1, N] in x's dtype, accumulated
    in fp32; weight in x's dtype or e4m3 (scale: its per-column fp32 scales).

    Like every function here it allocates only by shape and never syncs with the device, so
    it can be captured in a CUDA graph."""
    assert x.shape[0] == 1
    return _launch(x, weight, bias, x.shape[1], NO_PROLOGUE, config, scale=scale)


def rms_norm_gemv(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    config: GemvConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual) @ weight^T + bias, x + residual) for one row; without a residual
    the second is x itself. Neither input is written."""
    assert x.shape[0] == 1 and (residual is None or residual.shape == x.shape)
    residual_out = torch.empty_like(x) if residual is not None else x
    out = _launch(
        x, weight, bias, x.shape[1], RMS_NORM, config, residual, residual_out, norm_weight, eps
    )
    return out, residual_out


def silu_and_mul_gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    config: GemvConfig | None = None,
) -> torch.Tensor:
    """(silu(x[:, :I]) * x[:, I:]) @ weight [N, I]^T + bias for one row x [1, 2 * I]."""
    assert x.shape[0] == 1 and x.shape[1] % 2 == 0
    return _launch(x, weight, bias, x.shape[1] // 2, SILU_AND_MUL, config)
