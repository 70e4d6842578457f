"""Packed linear layers (the CPU GEMM's panels or oneDNN's layout) compute what F.linear
computes."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from asyncllm.layers.linear import (
    WARM_UP_MAX_ROWS,
    ReplicatedLinear,
    process_weights_after_loading,
    warm_up_packed_linears,
)
from asyncllm.layers.quantization import base
from asyncllm.layers.quantization.base import UnquantizedLinearMethod, padded_rows
from kernels.cpu_gemm import PANEL, cpu_gemm_available

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="needs oneDNN")


ONEDNN_BF16 = pytest.mark.skipif(
    not base.onednn_bf16(), reason="oneDNN has no bf16 GEMM on this CPU (AVX2 alone)"
)


def random_linear(input_size: int, output_size: int, bias: bool = True) -> ReplicatedLinear:
    linear = ReplicatedLinear(input_size, output_size, bias=bias)
    for param in linear.parameters():
        param.data.normal_(0.0, 0.1)
    return linear


@pytest.mark.parametrize("output_size", [150, 160])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 7, 17, 64, 333])
def test_packed_linear_matches_linear(output_size: int, bias: bool, rows: int) -> None:
    """Whole panels of outputs go to the CPU GEMM where it runs, the rest to oneDNN."""
    torch.manual_seed(0)
    linear = random_linear(96, output_size, bias)
    x = torch.randn(rows, 96)
    expected = F.linear(x, linear.weight, linear.bias)
    process_weights_after_loading(linear)
    panels = output_size % PANEL == 0 and cpu_gemm_available()
    assert getattr(linear, "cpu_gemm_packed" if panels else "onednn_packed", False)
    torch.testing.assert_close(linear(x), expected, rtol=1e-5, atol=1e-5)


def bf16_linear(bias: bool, output_size: int = 160) -> ReplicatedLinear:
    linear = random_linear(96, output_size, bias)
    linear.quant_method = UnquantizedLinearMethod(torch.bfloat16)
    return linear


@ONEDNN_BF16
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 17, 333])
def test_bf16_packed_linear_takes_and_gives_float32(
    bias: bool, rows: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--dtype bfloat16 on a CPU with bf16 dot products: oneDNN's GEMM, the input and weight
    rounded to bf16, fp32 sums, an output rounded to bf16 and returned in fp32 with the bias
    added there."""
    monkeypatch.setattr(base, "native_bf16", lambda: True)
    torch.manual_seed(0)
    linear = bf16_linear(bias)
    x = torch.randn(rows, 96)
    expected = F.linear(x.bfloat16().float(), linear.weight.bfloat16().float(), linear.bias)
    process_weights_after_loading(linear)
    assert linear.onednn_packed and linear.weight.dtype == torch.bfloat16
    out = linear(x)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, expected, rtol=8e-3, atol=8e-3)


@pytest.mark.skipif(not cpu_gemm_available(), reason="needs AVX-512, or AVX2 and FMA")
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 17, 333])
def test_bf16_weights_without_bf16_dot_products_go_to_the_cpu_gemm(
    bias: bool, rows: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--dtype bfloat16 on a CPU without bf16 dot products (AVX2 alone, or AVX-512 without
    AVX512_BF16): the CPU GEMM's bf16 panels, the input and the sums in fp32."""
    monkeypatch.setattr(base, "native_bf16", lambda: False)
    torch.manual_seed(0)
    linear = bf16_linear(bias)
    x = torch.randn(rows, 96)
    expected = F.linear(x, linear.weight.bfloat16().float(), linear.bias)
    process_weights_after_loading(linear)
    assert linear.cpu_gemm_packed and linear.weight.dtype == torch.bfloat16
    torch.testing.assert_close(linear(x), expected, rtol=1e-5, atol=1e-5)


def test_a_bf16_weight_that_is_not_whole_panels_stays_float32_without_onednn_bf16(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """AVX2 alone: 150 outputs are not whole panels and oneDNN has no bf16 GEMM there, so the
    weight keeps float32 in oneDNN's layout rather than fail in its first GEMM."""
    monkeypatch.setattr(base, "native_bf16", lambda: False)
    monkeypatch.setattr(base, "onednn_bf16", lambda: False)
    torch.manual_seed(0)
    linear = bf16_linear(bias=True, output_size=150)
    x = torch.randn(17, 96)
    expected = F.linear(x, linear.weight, linear.bias)
    process_weights_after_loading(linear)
    assert linear.onednn_packed and linear.weight.dtype == torch.float32
    torch.testing.assert_close(linear(x), expected, rtol=1e-5, atol=1e-5)


def test_packing_covers_nested_linears_and_keeps_the_rest() -> None:
    model = nn.Sequential(random_linear(8, 8), nn.Sequential(nn.ReLU(), random_linear(8, 4)))
    x = torch.randn(3, 8)
    expected = model(x)
    process_weights_after_loading(model)
    assert model[0].onednn_packed and model[1][1].onednn_packed
    torch.testing.assert_close(model(x), expected, rtol=1e-5, atol=1e-5)


def test_row_counts_are_padded_to_a_few_sizes_by_at_most_an_eighth() -> None:
    sizes = {padded_rows(rows) for rows in range(1, 8193)}
    assert len(sizes) <= 8 * 14
    for rows in range(1, 8193):
        assert rows <= padded_rows(rows) <= rows * 9 / 8


class Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(random_linear(8, 12) for _ in range(3))
        self.down = random_linear(12, 8, bias=False)
        self.lm_head = random_linear(8, 12)  # the shape of the layers, but fewer rows


def test_warm_up_runs_each_shape_once_at_every_padded_row_count(monkeypatch) -> None:
    model = Head()
    process_weights_after_loading(model)
    calls: list[tuple[int, int, int]] = []
    original = UnquantizedLinearMethod.apply

    def recording(self, layer, x: torch.Tensor, bias=None) -> torch.Tensor:
        calls.append((layer.input_size_per_partition, layer.output_size_per_partition, x.shape[0]))
        return original(self, layer, x, bias)

    monkeypatch.setattr(UnquantizedLinearMethod, "apply", recording)
    warm_up_packed_linears(model, max_rows=300, max_head_rows=40)

    def sizes(limit: int) -> list[int]:
        return sorted({padded_rows(rows) for rows in range(1, limit + 1)})

    expected = [(8, 12, n) for n in sizes(300)] + [(12, 8, n) for n in sizes(300)]
    expected += [(8, 12, n) for n in sizes(40)]  # the lm_head: its own, smaller limit
    assert sorted(calls) == sorted(expected)
    assert max(n for _, _, n in calls) == padded_rows(300) >= 300


def test_warm_up_stops_at_its_row_limit(monkeypatch) -> None:
    model = Head()
    process_weights_after_loading(model)
    rows: list[int] = []
    monkeypatch.setattr(
        UnquantizedLinearMethod, "apply", lambda self, layer, x, bias=None: rows.append(x.shape[0])
    )
    warm_up_packed_linears(model, max_rows=3 * WARM_UP_MAX_ROWS, max_head_rows=8)
    assert max(rows) == WARM_UP_MAX_ROWS
