"""The 4-bit and FP8 GEMM kernels against their torch references.

On CPU under TRITON_INTERPRET=1 (set in conftest.py) on small awkward shapes: N and K off the
tiles, K not a multiple of the group, rows on both sides of the GEMV/GEMM switch; with a GPU
also in bf16 on a Llama-3.1-8B projection.
"""

from __future__ import annotations

import pytest
import torch

import kernels
from asyncllm.layers.quantization.fp8 import dequantize_blocks, quantize_per_token_group
from asyncllm.layers.quantization.int4 import dequantize_int4, pack_int4
from kernels.int4_gemm import GEMV_MAX_ROWS

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
# GEMV tiles inside one group (group 256 at 2 rows, 128 at 3) and across groups, K split
INT4_CASES = [
    (1, 64, 40, 16),
    (3, 200, 72, 40),
    (5, 96, 130, 32),
    (37, 136, 24, 8),
    (4, 1032, 8, 1032),
    (2, 600, 80, 256),
    (2, 4096, 64, 128),
    (3, 1024, 64, 128),
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
    """The FP8 layers' batch-1 path: one row of 16/32-bit x against e4m3 W, scaled after."""
    gen = torch.Generator().manual_seed(n)
    w = torch.randn(n, k, generator=gen).to(torch.float8_e4m3fn).to(DEVICE)
    x = (torch.randn(1, k, generator=gen) * k**-0.5).to(DEVICE)
    expected = x @ w.float().t()
    torch.testing.assert_close(kernels.gemv(x, w, None), expected, rtol=1e-4, atol=1e-4)
