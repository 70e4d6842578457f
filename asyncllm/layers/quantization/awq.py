"""AWQ 4-bit weights (quantization_config.quant_method "awq", AutoAWQ's GEMM version): qweight
int32 [K, N / 8] and qzeros int32 [groups, N / 8] pack 8 output columns per word in AWQ's
interleaved order (nibble i holds column AWQ_ORDER[i] of each 8), scales [groups, N];
W[k, n] = (q - zero) * scale of group k // group_size.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from asyncllm.layers.quantization.base import LinearMethodBase
from asyncllm.layers.quantization.base_config import QuantizationConfig, choice, field
from asyncllm.layers.quantization.int4 import (
    PACK_FACTOR,
    Int4LinearMethod,
    check_int4_shapes,
    set_int4_weights,
    unpack_int4,
)
from asyncllm.layers.quantization.parameter import weight_param

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
_CHECKPOINT_PARAMS = ("qweight", "qzeros", "scales")


class AWQConfig(QuantizationConfig):
    name = "awq"

    def __init__(self, group_size: int, skipped: list[str] | None = None) -> None:
        super().__init__(skipped)
        self.group_size = group_size

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> AWQConfig:
        choice(config, "bits" if "bits" in config else "w_bit", (4,))
        group_size = field(config, "group_size" if "group_size" in config else "q_group_size", int)
        if group_size <= 0:
            raise ValueError(f"quantization_config.group_size must be positive, got {group_size}")
        choice(config, "zero_point", (True,), True)
        choice(config, "version", ("gemm", "GEMM"), "gemm")
        return cls(group_size, field(config, "modules_to_not_convert", (list, type(None)), None))

    def linear_method(self, prefix: str) -> LinearMethodBase:
        return AWQLinearMethod(self.group_size)


class AWQLinearMethod(Int4LinearMethod):
    def __init__(self, group_size: int) -> None:
        self.group_size = group_size

    def create_weights(
        self,
        layer: nn.Module,
        input_size_per_partition: int,
        output_partition_sizes: list[int],
        input_size: int,
        output_size: int,
        params_dtype: torch.dtype,
    ) -> None:
        k, n, group = input_size_per_partition, sum(output_partition_sizes), self.group_size
        check_int4_shapes("awq", k, output_partition_sizes, group)
        packed = n // PACK_FACTOR
        params = {
            "qweight": weight_param(
                torch.empty(k, packed, dtype=torch.int32),
                output_dim=1,
                input_dim=0,
                packed_dim=1,
                packed_factor=PACK_FACTOR,
            ),
            "qzeros": weight_param(
                torch.empty(k // group, packed, dtype=torch.int32),
                output_dim=1,
                input_dim=0,
                packed_dim=1,
                packed_factor=PACK_FACTOR,
            ),
            "scales": weight_param(
                torch.empty(k // group, n, dtype=params_dtype), output_dim=1, input_dim=0
            ),
        }
        for name, param in params.items():
            layer.register_parameter(name, param)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        q = unpack_int4(layer.qweight.data, 1, AWQ_ORDER)
        zeros = unpack_int4(layer.qzeros.data, 1, AWQ_ORDER)
        set_int4_weights(layer, _CHECKPOINT_PARAMS, q, layer.scales.data, zeros, self.group_size)
