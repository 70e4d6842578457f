"""Quantized layers split over two ranks compute what the whole layer computes: each rank's
weight_loader keeps its share of packed int4 words, group and block scales (the column-parallel
ranks' outputs side by side, the row-parallel ranks' partial sums added)."""

from __future__ import annotations

import pytest
import torch

from asyncllm.layers import linear
from asyncllm.layers.quantization import get_quantization_config
from asyncllm.layers.quantization.fp8 import FP8

K, N, RANKS = 128, 64, 2
CONFIGS = {
    "gptq": {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False},
    "awq": {"quant_method": "awq", "w_bit": 4, "q_group_size": 32, "zero_point": True},
    "fp8_block": {"quant_method": "fp8", "weight_block_size": [16, 32]},
    "fp8_static": {"quant_method": "fp8", "activation_scheme": "static"},
}


def build(kind: str, config: str, rank: int, size: int, monkeypatch) -> linear.LinearBase:
    monkeypatch.setattr(linear, "get_tensor_model_parallel_rank", lambda: rank)
    monkeypatch.setattr(linear, "get_tensor_model_parallel_world_size", lambda: size)
    quant_config = get_quantization_config(CONFIGS[config], None)
    if kind == "column":
        return linear.ColumnParallelLinear(K, N, True, False, quant_config, f"{kind}_proj")
    return linear.RowParallelLinear(K, N, True, True, False, quant_config, f"{kind}_proj")


def checkpoint(layer: linear.LinearBase) -> dict[str, torch.Tensor]:
    """Random tensors of the whole layer's parameters' shapes and dtypes."""
    gen = torch.Generator().manual_seed(0)
    tensors = {}
    for name, param in layer.named_parameters():
        if name == "g_idx":
            tensors[name] = (torch.arange(K) // 32).int()
        elif not param.is_floating_point():
            tensors[name] = torch.randint(-(2**31), 2**31 - 1, param.shape, generator=gen).int()
        elif "scale" in name:
            tensors[name] = torch.rand(param.shape, generator=gen) * 1e-2 + 1e-3
        else:
            tensors[name] = (torch.randn(param.shape, generator=gen) * 0.1).to(param.dtype)
    if "weight" in tensors and layer.weight.dtype == FP8:
        tensors["weight"] = torch.randn(layer.weight.shape, generator=gen).to(FP8)
    return tensors


def loaded(layer: linear.LinearBase, tensors: dict[str, torch.Tensor]) -> linear.LinearBase:
    for name, tensor in tensors.items():
        param = getattr(layer, name)
        param.weight_loader(param, tensor)
    assert layer.unloaded() == []
    layer.quant_method.process_weights_after_loading(layer)
    return layer


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("kind", ["column", "row"])
@torch.inference_mode()
def test_two_ranks_compute_the_whole_layer(kind: str, config: str, monkeypatch) -> None:
    whole = build(kind, config, 0, 1, monkeypatch)
    tensors = checkpoint(whole)
    loaded(whole, tensors)
    parts = [loaded(build(kind, config, r, RANKS, monkeypatch), tensors) for r in range(RANKS)]
    x = torch.randn(5, K, generator=torch.Generator().manual_seed(1))
    if kind == "column":
        out = torch.cat([part(x) for part in parts], dim=-1)
    else:
        out = sum(part(chunk) for part, chunk in zip(parts, x.chunk(RANKS, dim=-1)))
    expected = whole(x)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4 * expected.abs().max().item())


@pytest.mark.parametrize("kind", ["column", "row"])
@torch.inference_mode()
def test_int8_at_load_splits_like_any_linear(kind: str, monkeypatch) -> None:
    """--quantization int8 on two ranks: each rank quantizes its shard at load. Column-parallel
    ranks hold whole output channels (the same scales) and see the same rows: the whole layer's
    output. Row-parallel ranks scale their half of each channel and of each row on their own:
    a different rounding, as close to the float layer as the whole layer's."""
    quant_config = get_quantization_config(None, "int8")

    def make(rank: int, size: int) -> linear.LinearBase:
        monkeypatch.setattr(linear, "get_tensor_model_parallel_rank", lambda: rank)
        monkeypatch.setattr(linear, "get_tensor_model_parallel_world_size", lambda: size)
        if kind == "column":
            return linear.ColumnParallelLinear(K, N, True, False, quant_config, "column_proj")
        return linear.RowParallelLinear(K, N, True, True, False, quant_config, "row_proj")

    whole = make(0, 1)
    tensors = checkpoint(whole)
    loaded(whole, tensors)
    parts = [loaded(make(r, RANKS), tensors) for r in range(RANKS)]
    x = torch.randn(5, K, generator=torch.Generator().manual_seed(1))
    if kind == "column":
        out = torch.cat([part(x) for part in parts], dim=-1)
        torch.testing.assert_close(out, whole(x), rtol=1e-5, atol=1e-5)
        return
    out = sum(part(chunk) for part, chunk in zip(parts, x.chunk(RANKS, dim=-1)))
    exact = x @ tensors["weight"].t() + tensors["bias"]
    assert (out - exact).abs().max() <= 2 * (whole(x) - exact).abs().max()
