"""GPTQ 4-bit weights (quantization_config.quant_method "gptq", AutoGPTQ / GPTQModel format):
qweight int32 [K / 8, N] packing 8 input rows per word (row 8i+j in bits 4j..4j+3), qzeros int32
[groups, N / 8] packing 8 columns per word the same way, scales [groups, N], g_idx [K] the group
of each input row (act-order, desc_act, permutes them). checkpoint_format "gptq" stores each
zero point minus one (the original GPTQ code's off-by-one), "gptq_v2" stores it as is.
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

_CHECKPOINT_PARAMS = ("qweight", "qzeros", "scales", "g_idx")


class GPTQConfig(QuantizationConfig):
    name = "gptq"

    def __init__(
        self,
        group_size: int,
        desc_act: bool,
        zeros_minus_one: bool,
        skipped: list[str] | None = None,
    ) -> None:
        super().__init__(skipped)
        self.group_size, self.desc_act, self.zeros_minus_one = group_size, desc_act, zeros_minus_one

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> GPTQConfig:
        choice(config, "bits", (4,))
        group_size = field(config, "group_size", int)
        if group_size != -1 and group_size <= 0:
            raise ValueError(
                f"quantization_config.group_size must be positive or -1, got {group_size}"
            )
        desc_act = field(config, "desc_act", bool, False)
        field(config, "sym", bool, True)  # either way the zero points come from qzeros
        checkpoint_format = choice(config, "checkpoint_format", ("gptq", "gptq_v2"), "gptq")
        skipped = field(config, "modules_to_not_convert", (list, type(None)), None)
        return cls(group_size, desc_act, checkpoint_format == "gptq", skipped)

    def linear_method(self, prefix: str) -> LinearMethodBase:
        return GPTQLinearMethod(self)


class GPTQLinearMethod(Int4LinearMethod):
    def __init__(self, config: GPTQConfig) -> None:
        self.config = config

    def create_weights(
        self,
        layer: nn.Module,
        input_size_per_partition: int,
        output_partition_sizes: list[int],
        input_size: int,
        output_size: int,
        params_dtype: torch.dtype,
    ) -> None:
        config, k, n = self.config, input_size_per_partition, sum(output_partition_sizes)
        if config.desc_act and k != input_size:
            raise ValueError(
                "gptq: desc_act (act-order) weights cannot split their input features over ranks"
            )
        group = input_size if config.group_size == -1 else config.group_size
        check_int4_shapes("gptq", k, output_partition_sizes, group)
        groups, group_dim = k // group, None if config.group_size == -1 else 0
        layer.gptq_group_size = group
        params = {
            "qweight": weight_param(
                torch.empty(k // PACK_FACTOR, n, dtype=torch.int32),
                output_dim=1,
                input_dim=0,
                packed_dim=0,
                packed_factor=PACK_FACTOR,
            ),
            "qzeros": weight_param(
                torch.empty(groups, n // PACK_FACTOR, dtype=torch.int32),
                output_dim=1,
                input_dim=group_dim,
                packed_dim=1,
                packed_factor=PACK_FACTOR,
            ),
            "scales": weight_param(
                torch.empty(groups, n, dtype=params_dtype), output_dim=1, input_dim=group_dim
            ),
            "g_idx": weight_param(torch.empty(k, dtype=torch.int32), output_dim=None, input_dim=0),
        }
        for name, param in params.items():
            layer.register_parameter(name, param)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        q = unpack_int4(layer.qweight.data, 0)
        zeros = unpack_int4(layer.qzeros.data, 1) + int(self.config.zeros_minus_one)
        # without act-order row k is in group k // group_size: a row-parallel rank's g_idx
        # slice counts the groups of the whole layer, its scales only its own
        g_idx = layer.g_idx.data if self.config.desc_act else None
        set_int4_weights(
            layer, _CHECKPOINT_PARAMS, q, layer.scales.data, zeros, layer.gptq_group_size, g_idx
        )
