"""The AVX-512 or AVX2 fp32 GEMM (kernels/cpu_gemm.cpp) computes what F.linear computes, and with
SiLU-and-mul on its sums what torch computes after it; with bf16 weights (the bf16 mode where
the CPU has no bf16 dot products) what F.linear computes on those weights widened to fp32."""

import pytest
import torch
import torch.nn.functional as F

from kernels.cpu_gemm import (
    cpu_gemm,
    cpu_gemm_available,
    cpu_gemm_silu_and_mul,
    pack_cpu_gemm_weight,
)

pytestmark = pytest.mark.skipif(not cpu_gemm_available(), reason="needs AVX-512, or AVX2 and FMA")


WEIGHT_DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])


@WEIGHT_DTYPES
@pytest.mark.parametrize("rows", [1, 5, 6, 7, 13, 14, 15, 29, 32, 200, 333])
@pytest.mark.parametrize("bias", [False, True])
def test_every_row_block_size_matches_linear(rows: int, bias: bool, dtype: torch.dtype) -> None:
    """Rows split into blocks of up to 14 (AVX-512) or 6 (AVX2), and into chunks past 170 rows
    of K = 576."""
    torch.manual_seed(0)
    weight, x = torch.randn(96, 576).to(dtype), torch.randn(rows, 576)
    b = torch.randn(96) if bias else None
    out = cpu_gemm(x, pack_cpu_gemm_weight(weight), b)
    torch.testing.assert_close(out, F.linear(x, weight.float(), b), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("rows", [1, 17, 32])
def test_bf16_panels_stream_like_float32_ones(rows: int) -> None:
    """Many panels of a long K, bf16 (a panel's row is one cache line, not two): every panel's
    prefetch share lands on its own lines, the sums as the widened weights give them."""
    torch.manual_seed(0)
    weight, x = torch.randn(18 * 32, 1536).bfloat16(), torch.randn(rows, 1536)
    out = cpu_gemm(x, pack_cpu_gemm_weight(weight), None)
    expected = F.linear(x.double(), weight.double()).float()
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_panels_split_over_threads(threads: int) -> None:
    torch.manual_seed(0)
    weight, x = torch.randn(7 * 32, 40), torch.randn(5, 40)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = cpu_gemm(x, pack_cpu_gemm_weight(weight), None)
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(out, F.linear(x, weight), rtol=1e-5, atol=1e-5)


def test_strided_rows_are_read_in_place() -> None:
    """x a view of wider rows (the attention output's or the MLP's halves)."""
    torch.manual_seed(0)
    weight, wide = torch.randn(64, 48), torch.randn(9, 100)
    x = wide[:, 10:58]
    out = cpu_gemm(x, pack_cpu_gemm_weight(weight), None)
    torch.testing.assert_close(out, F.linear(x, weight), rtol=1e-5, atol=1e-5)


def test_no_rows_give_an_empty_output() -> None:
    out = cpu_gemm(torch.empty(0, 16), pack_cpu_gemm_weight(torch.randn(32, 16)), None)
    assert out.shape == (0, 32)


@WEIGHT_DTYPES
@pytest.mark.parametrize("rows", [1, 14, 29, 333])
def test_silu_and_mul_on_the_sums_matches_torch(rows: int, dtype: torch.dtype) -> None:
    """[gate | up] of 3 panels each: silu(gate) * up within a few ulps of torch's."""
    torch.manual_seed(0)
    weight, x = (torch.randn(6 * 32, 576) * 0.1).to(dtype), torch.randn(rows, 576)
    x[0, :] = 0.0  # silu(0) = 0
    gate, up = F.linear(x, weight.float()).chunk(2, dim=-1)
    out = cpu_gemm_silu_and_mul(x, pack_cpu_gemm_weight(weight))
    torch.testing.assert_close(out, F.silu(gate) * up, rtol=1e-5, atol=1e-5)


def test_silu_saturates_as_torch_does() -> None:
    """Gate sums far past exp's range: silu(-200) = -0, silu(200) = 200."""
    weight = torch.zeros(64, 1)
    weight[:32] = 200.0  # gate
    weight[32:] = 1.0  # up
    x = torch.tensor([[-1.0], [1.0]])
    out = cpu_gemm_silu_and_mul(x, pack_cpu_gemm_weight(weight))
    torch.testing.assert_close(out, torch.tensor([[0.0] * 32, [200.0] * 32]))
