"""The 4-bit and FP8 GEMM kernels against their torch references.

On CPU under TRITON_INTERPRET=1 (set in conftest.py) on small awkward shapes: N and K off the
tiles, K not a multiple of the group, rows on both sides of the GEMV/GEMM switch; with a GPU
also in bf16 on a Llama-3.1-8B projection.
"""

from __future__ import annotations

import pytest
import torch

import kernels
from asyncllm.layers.quantization.fp8 import (
    MIN_SCALE,
    dequantize_blocks,
    quantize_per_row,
    quantize_per_token_group,
    quantize_with_scale,
)
from asyncllm.layers.quantization.int4 import dequantize_int4, pack_int4
from kernels.int4_kernels import GEMV_MAX_ROWS

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"


def int4_weights(k: int, n: int, group: int, dtype: torch.dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (k, n), generator=gen, dtype=torch.int32)
    groups = -(-k // group)
    scales = (torch.rand(groups, n, generator=gen) * 0.02 + 0.005).to(dtype)
    zeros = torch.randint(0, 16, (groups, n), generator=gen).to(dtype)
    return pack_int4(q, 0).to(DEVICE), scales.to(DEVICE), zeros.to(DEVICE)


# (M, K, N, group): GEMV rows (1-4) and GEMM rows (5, 37), K ending mid-group and mid-word;
# GEMV tiles inside one group (group 256 at 2 rows, 128 at 3) and across groups, K split, and
# K not split for N wide enough to fill the GPU alone
INT4_CASES = [
    (1, 64, 40, 16),
    (3, 200, 72, 40),
    (5, 96, 130, 32),
    (37, 136, 24, 8),
    (4, 1032, 8, 1032),
    (2, 600, 80, 256),
    (2, 4096, 64, 128),
    (3, 1024, 64, 128),
    (1, 520, 1040, 8),
]


@pytest.mark.parametrize(("m", "k", "n", "group"), INT4_CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_int4_gemm_matches_dequantized_weights(m, k, n, group, dtype) -> None:
    qweight, scales, zeros = int4_weights(k, n, group, dtype, seed=m + k + n)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(dtype).to(DEVICE)
    expected = x.float() @ dequantize_int4(qweight, scales, zeros, group, k)
    out = kernels.int4_gemm(x, qweight, scales, zeros, group)
    assert out.dtype == dtype and out.shape == (m, n)
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), expected, rtol=tolerance, atol=tolerance)


def test_both_int4_paths_are_covered() -> None:
    assert any(c[0] <= GEMV_MAX_ROWS for c in INT4_CASES)
    assert any(c[0] > GEMV_MAX_ROWS for c in INT4_CASES)


def test_int4_group_size_must_be_a_multiple_of_eight() -> None:
    qweight, scales, zeros = int4_weights(24, 8, 12, torch.float32, seed=0)
    with pytest.raises(ValueError, match="multiple of 8"):
        kernels.int4_gemm(torch.ones(1, 24, device=DEVICE), qweight, scales, zeros, 12)


# (M, N, K, block): partial blocks in N and K, rows below and above one tile
FP8_CASES = [
    (1, 48, 64, (16, 32)),
    (7, 40, 100, (16, 32)),
    (70, 130, 256, (128, 128)),
    (3, 200, 160, (64, 64)),
]


@pytest.mark.parametrize(("m", "n", "k", "block"), FP8_CASES)
def test_fp8_block_gemm_matches_dequantized_operands(m, n, k, block) -> None:
    gen = torch.Generator().manual_seed(m + n)
    wq = torch.randn(n, k, generator=gen).to(torch.float8_e4m3fn).to(DEVICE)
    w_scale = (torch.rand(-(-n // block[0]), -(-k // block[1]), generator=gen) * 0.01).to(DEVICE)
    x = torch.randn(m, k, generator=gen).to(DEVICE)
    xq, x_scale = quantize_per_token_group(x, block[1])
    expected = (
        dequantize_blocks(xq, x_scale, (1, block[1])) @ dequantize_blocks(wq, w_scale, block).t()
    )
    out = kernels.fp8_block_gemm(xq, x_scale, wq, w_scale, block, torch.float32)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(not CUDA, reason="needs a GPU")
@pytest.mark.parametrize("m", [1, 16, 256])
def test_int4_gemm_bf16_on_a_llama_8b_projection(m: int) -> None:
    k, n, group = 4096, 6144, 128
    qweight, scales, zeros = int4_weights(k, n, group, torch.bfloat16, seed=m)
    x = torch.randn(m, k, device=DEVICE, dtype=torch.bfloat16)
    expected = x.float() @ dequantize_int4(qweight, scales, zeros, group, k)
    out = kernels.int4_gemm(x, qweight, scales, zeros, group).float()
    assert (out - expected).abs().max() <= 2e-2 * expected.abs().max()


@pytest.mark.parametrize(("n", "k"), [(17, 96), (1000, 1000), (33, 5000)])
def test_gemv_reads_fp8_weights(n: int, k: int) -> None:
    """The FP8 layers' batch-1 path: one row of 16/32-bit x against e4m3 W (four rows of W a
    program, N off that), each column scaled in the kernel."""
    gen = torch.Generator().manual_seed(n)
    w = torch.randn(n, k, generator=gen).to(torch.float8_e4m3fn).to(DEVICE)
    x = (torch.randn(1, k, generator=gen) * k**-0.5).to(DEVICE)
    scale = (torch.rand(1, n, generator=gen) + 0.5).to(DEVICE)
    torch.testing.assert_close(kernels.gemv(x, w, None), x @ w.float().t(), rtol=1e-4, atol=1e-4)
    expected = (x @ w.float().t()) * scale
    out = kernels.gemv(x, w, None, scale=scale)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)


# (M, K, group): one group per row, a row longer than one 4096 tile, a partial last group
QUANT_CASES = [(3, 100, None), (2, 5000, None), (5, 300, 128), (1, 40, 16)]


@pytest.mark.parametrize(("m", "k", "group"), QUANT_CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantize_fp8_equals_the_torch_reference(m, k, group, dtype) -> None:
    """Bit for bit, an all-zero row (scale MIN_SCALE) included. On the GPU random values over
    six decades, into e4m3's subnormals; the interpreter's cast to e4m3 rounds wrongly (124.1 to
    64, 0.0038 to 0.00195), so on CPU the values are e4m3 values times 1/8 with each group's
    max at 448/8: the scale comes out 1/8 and x / scale needs no rounding."""
    gen = torch.Generator().manual_seed(m * k)
    if CUDA:
        magnitudes = (torch.rand(m, k, generator=gen) + 1) * torch.logspace(-3, 3, k)
        x = magnitudes * (torch.randint(0, 2, (m, k), generator=gen) * 2 - 1)
    else:
        x = torch.randn(m, k, generator=gen).to(torch.float8_e4m3fn).float() / 8
        x[:, :: group or k] = -448 / 8
    x = x.to(dtype)
    x[0] = 0.0
    x = x.to(DEVICE)
    q, scales = kernels.quantize_fp8(x, group, min_scale=MIN_SCALE)
    q_ref, scales_ref = quantize_per_row(x) if group is None else quantize_per_token_group(x, group)
    assert torch.equal(scales, scales_ref.view(m, -1))
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))


def test_quantize_fp8_with_a_static_scale() -> None:
    """e4m3 values times the scale (exact under the interpreter too, see above), and values
    past 448 times it, which clamp."""
    x = torch.randn(4, 70, generator=torch.Generator().manual_seed(0)) * 100
    x = x.to(torch.float8_e4m3fn).float() / 2
    x[:, ::9] = torch.tensor([500.0, -2000.0]).repeat(4, 4)
    x = x.to(DEVICE)
    static = torch.tensor([0.5], device=DEVICE)
    q, scales = kernels.quantize_fp8(x, static_scale=static)
    ref_scales = static.expand(4, 1)
    assert torch.equal(scales, ref_scales)
    assert torch.equal(q.view(torch.uint8), quantize_with_scale(x, ref_scales).view(torch.uint8))
