"""oneDNN-packed linear layers compute what nn.Linear computes."""

import pytest
import torch
from torch import nn

from asyncllm.layers.linear import (
    WARM_UP_MAX_ROWS,
    PackedLinear,
    pack_linear_layers,
    padded_rows,
    warm_up_packed_linears,
)

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


class Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 12) for _ in range(3))
        self.down = nn.Linear(12, 8, bias=False)
        self.lm_head = nn.Linear(8, 12)  # the shape of the layers, but fewer rows


def test_warm_up_runs_each_shape_once_at_every_padded_row_count(monkeypatch) -> None:
    model = Head()
    pack_linear_layers(model)
    calls: list[tuple[int, int, int]] = []
    original = PackedLinear.forward

    def recording(self: PackedLinear, x: torch.Tensor) -> torch.Tensor:
        calls.append((self.in_features, self.out_features, x.shape[0]))
        return original(self, x)

    monkeypatch.setattr(PackedLinear, "forward", recording)
    warm_up_packed_linears(model, max_rows=300, max_head_rows=40)

    def sizes(limit: int) -> list[int]:
        return sorted({padded_rows(rows) for rows in range(1, limit + 1)})

    expected = [(8, 12, n) for n in sizes(300)] + [(12, 8, n) for n in sizes(300)]
    expected += [(8, 12, n) for n in sizes(40)]  # the lm_head: its own, smaller limit
    assert sorted(calls) == sorted(expected)
    assert max(n for _, _, n in calls) == padded_rows(300) >= 300


def test_warm_up_stops_at_its_row_limit(monkeypatch) -> None:
    model = Head()
    pack_linear_layers(model)
    rows: list[int] = []
    monkeypatch.setattr(PackedLinear, "forward", lambda self, x: rows.append(x.shape[0]))
    warm_up_packed_linears(model, max_rows=3 * WARM_UP_MAX_ROWS, max_head_rows=8)
    assert max(rows) == WARM_UP_MAX_ROWS
