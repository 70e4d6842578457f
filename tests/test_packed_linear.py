"""oneDNN-packed linear layers compute what nn.Linear computes."""

import pytest
import torch
from torch import nn

from asyncllm.models.layers.linear import PackedLinear, pack_linear_layers, padded_rows

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="needs oneDNN")


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 7, 17, 64, 333])
def test_packed_linear_matches_linear(bias: bool, rows: int) -> None:
    torch.manual_seed(0)
    linear = nn.Linear(96, 160, bias=bias)
    x = torch.randn(rows, 96)
    torch.testing.assert_close(PackedLinear(linear)(x), linear(x), rtol=1e-5, atol=1e-5)


def test_packing_replaces_nested_linears_and_keeps_the_rest() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.Sequential(nn.ReLU(), nn.Linear(8, 4)))
    x = torch.randn(3, 8)
    expected = model(x)
    pack_linear_layers(model)
    assert isinstance(model[0], PackedLinear) and isinstance(model[1][1], PackedLinear)
    assert isinstance(model[1][0], nn.ReLU)
    torch.testing.assert_close(model(x), expected, rtol=1e-5, atol=1e-5)


def test_row_counts_are_padded_to_a_few_sizes_by_at_most_an_eighth() -> None:
    sizes = {padded_rows(rows) for rows in range(1, 8193)}
    assert len(sizes) <= 8 * 14
    for rows in range(1, 8193):
        assert rows <= padded_rows(rows) <= rows * 9 / 8
