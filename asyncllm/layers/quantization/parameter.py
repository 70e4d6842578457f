"""Parameters that tell the layer's weight_loader how to shard them (the linear contract).

output_dim / input_dim: the tensor dim along the layer's output / input features, or None when
the tensor is not split that way. A tensor is laid out in proportion to the features it covers
(packed int4, group and block scales too): a shard's slice starts at its feature offset times
the tensor's size over the layer's feature count. packed_dim / packed_factor: the dim packing
packed_factor 4-bit values per int32. shard_indexed: dim 0 holds one value per merged shard
(per-tensor scales of fused q/k/v or gate/up)."""

from __future__ import annotations

import torch
from torch import nn


def weight_param(
    data: torch.Tensor,
    output_dim: int | None,
    input_dim: int | None,
    packed_dim: int | None = None,
    packed_factor: int = 1,
    shard_indexed: bool = False,
) -> nn.Parameter:
    param = nn.Parameter(data, requires_grad=False)
    param.output_dim = output_dim
    param.input_dim = input_dim
    param.packed_dim = packed_dim
    param.packed_factor = packed_factor
    param.shard_indexed = shard_indexed
    return param


def replace_param(layer: nn.Module, name: str, data: torch.Tensor) -> None:
    """Swap a loaded parameter for its repacked form (no sharding attrs: loading is over)."""
    delattr(layer, name)
    layer.register_parameter(name, nn.Parameter(data, requires_grad=False))
