"""compressed-tensors checkpoints (quantization_config.quant_method "compressed-tensors", as
LLM Compressor writes them): the "float-quantized" FP8 W8A8 format (tensor, channel or block
weight scales; dynamic per-token or static per-tensor activations), run by fp8's method, and
the "pack-quantized" 4-bit weight-only format: weight_packed int32 [N, K / 8] (value k of row n
at bits 4 * (k % 8), stored as the signed value + 8), weight_scale [N, groups], weight_shape,
and for asymmetric weights weight_zero_point int32 [N / 8, groups] packed the same way along N.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

from asyncllm.layers.quantization.base import LinearMethodBase
from asyncllm.layers.quantization.base_config import QuantizationConfig, choice, field
from asyncllm.layers.quantization.fp8 import Fp8LinearMethod, Fp8Scheme
from asyncllm.layers.quantization.int4 import (
    PACK_FACTOR,
    Int4LinearMethod,
    check_int4_shapes,
    set_int4_weights,
    unpack_int4,
)
from asyncllm.layers.quantization.parameter import weight_param

_FORMATS = ("float-quantized", "naive-quantized", "pack-quantized")


class CompressedTensorsConfig(QuantizationConfig):
    name = "compressed-tensors"

    def __init__(
        self, schemes: list[tuple[list[str], LinearMethodBase]], skipped: list[str]
    ) -> None:
        super().__init__()
        self.schemes, self.ignore = schemes, skipped

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> CompressedTensorsConfig:
        default_format = choice(config, "format", _FORMATS)
        groups = field(config, "config_groups", dict)
        schemes = []
        for name, group in groups.items():
            group_format = group.get("format") or default_format
            targets = field(group, "targets", list)
            schemes.append((targets, _linear_method(name, group, group_format)))
        return cls(schemes, field(config, "ignore", list, []))

    def is_skipped(self, prefix: str) -> bool:
        return any(_matches(pattern, prefix) for pattern in self.ignore)

    def linear_method(self, prefix: str) -> LinearMethodBase:
        for targets, method in self.schemes:
            if any(_matches(t, prefix) for t in targets):
                return method
        raise ValueError(
            f"quantization_config.config_groups: no group targets the linear layer {prefix!r}"
        )


def _matches(pattern: str, prefix: str) -> bool:
    """A target or ignore entry: "Linear" (every linear layer), "re:REGEX", or a module name.
    A fused layer (qkv_proj, gate_up_proj) matches what its parts (q_proj, ...) match."""
    if pattern == "Linear":
        return True
    names = [prefix] + [
        prefix.replace(fused, part)
        for fused, parts in _FUSED.items()
        if fused in prefix
        for part in parts
    ]
    if pattern.startswith("re:"):
        return any(re.match(pattern[3:], name) for name in names)
    return any(name == pattern or name.endswith("." + pattern) for name in names)


_FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def _linear_method(name: str, group: dict[str, Any], group_format: str) -> LinearMethodBase:
    where = f"config_groups.{name}"
    weights = _section(group, "weights", where)
    if group_format == "pack-quantized":
        return _int4_method(weights, group.get("input_activations"), where)
    if group_format in ("float-quantized", "naive-quantized") and weights.get("type") == "float":
        return Fp8LinearMethod(_fp8_scheme(weights, group.get("input_activations"), where))
    raise ValueError(
        f"quantization_config.{where}: format {group_format!r} with weights {weights} is not supported"
    )


def _section(group: dict[str, Any], key: str, where: str) -> dict[str, Any]:
    section = group.get(key)
    if not isinstance(section, dict):
        raise ValueError(f"quantization_config.{where}.{key} is missing")
    return section


def _fp8_scheme(
    weights: dict[str, Any], activations: dict[str, Any] | None, where: str
) -> Fp8Scheme:
    choice(weights, "num_bits", (8,))
    strategy = choice(weights, "strategy", ("tensor", "channel", "block"))
    block = None
    if strategy == "block":
        block = field(weights, "block_structure", list)
        if len(block) != 2:
            raise ValueError(
                f"quantization_config.{where}.weights.block_structure must have two sizes, got {block}"
            )
    if activations is None:
        raise ValueError(
            f"quantization_config.{where}.input_activations: FP8 weights without FP8 activations are not supported"
        )
    choice(activations, "num_bits", (8,))
    choice(activations, "type", ("float",))
    dynamic = field(activations, "dynamic", bool)
    allowed = ("token", "group") if dynamic else ("tensor",)
    choice(activations, "strategy", allowed)
    if block is not None and (not dynamic or activations.get("group_size") != block[1]):
        raise ValueError(
            f"quantization_config.{where}.input_activations must be dynamic, in groups of the "
            f"weight block's {block[1]} input features, with block weights"
        )
    return Fp8Scheme(
        weight_strategy=strategy, block=tuple(block) if block else None, dynamic_activations=dynamic
    )


def _int4_method(
    weights: dict[str, Any], activations: dict[str, Any] | None, where: str
) -> LinearMethodBase:
    choice(weights, "num_bits", (4,))
    choice(weights, "type", ("int",))
    strategy = choice(weights, "strategy", ("group", "channel"))
    if activations is not None:
        raise ValueError(
            f"quantization_config.{where}.input_activations: 4-bit weights run with 16-bit activations only"
        )
    group_size = field(weights, "group_size", int) if strategy == "group" else None
    return PackQuantizedLinearMethod(group_size, field(weights, "symmetric", bool, True))


class PackQuantizedLinearMethod(Int4LinearMethod):
    def __init__(self, group_size: int | None, symmetric: bool) -> None:
        self.group_size, self.symmetric = group_size, symmetric  # None: one group per row

    def create_weights(
        self,
        layer: nn.Module,
        input_size_per_partition: int,
        output_partition_sizes: list[int],
        input_size: int,
        output_size: int,
        params_dtype: torch.dtype,
    ) -> None:
        k, n = input_size_per_partition, sum(output_partition_sizes)
        group = self.group_size or k
        check_int4_shapes("compressed-tensors", k, output_partition_sizes, group)
        group_dim = 1 if self.group_size else None
        layer.ct_group_size = group
        params = {
            "weight_packed": weight_param(
                torch.empty(n, k // PACK_FACTOR, dtype=torch.int32),
                output_dim=0,
                input_dim=1,
                packed_dim=1,
                packed_factor=PACK_FACTOR,
            ),
            "weight_scale": weight_param(
                torch.empty(n, k // group, dtype=params_dtype), output_dim=0, input_dim=group_dim
            ),
            "weight_shape": weight_param(
                torch.empty(len(output_partition_sizes), 2, dtype=torch.int64),
                None,
                None,
                shard_indexed=True,
            ),
        }
        if not self.symmetric:
            params["weight_zero_point"] = weight_param(
                torch.empty(n // PACK_FACTOR, k // group, dtype=torch.int32),
                output_dim=0,
                input_dim=group_dim,
                packed_dim=0,
                packed_factor=PACK_FACTOR,
            )
        for name, param in params.items():
            layer.register_parameter(name, param)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        q = unpack_int4(layer.weight_packed.data, 1).t()
        scales = layer.weight_scale.data.t()
        if self.symmetric:
            zeros = torch.full_like(scales, 8)
        else:
            zeros = unpack_int4(layer.weight_zero_point.data, 0).t()
        names = tuple(
            n
            for n in ("weight_packed", "weight_scale", "weight_shape", "weight_zero_point")
            if hasattr(layer, n)
        )
        set_int4_weights(layer, names, q, scales.contiguous(), zeros, layer.ct_group_size)
