"""How a linear layer holds and applies its weights (vLLM's LinearMethodBase), and the plain
16/32-bit method. Quantized methods (fp8, awq, gptq, compressed_tensors) implement the same three
steps: create the parameters the checkpoint fills, repack them once loaded, run the GEMM."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
import torch.nn.functional as F
from torch import nn

from asyncllm.layers.quantization.parameter import weight_param


class LinearMethodBase(ABC):
    @abstractmethod
    def create_weights(
        self,
        layer: nn.Module,
        input_size_per_partition: int,
        output_partition_sizes: list[int],
        input_size: int,
        output_size: int,
        params_dtype: torch.dtype,
    ) -> None:
        """Register on layer the parameters the checkpoint fills (with their sharding attrs)."""

    def process_weights_after_loading(self, layer: nn.Module) -> None:  # noqa: B027
        """Repack the loaded parameters into the form apply runs on (nothing by default)."""

    @abstractmethod
    def apply(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        """x @ W^T (+ bias)."""


class UnquantizedLinearMethod(LinearMethodBase):
    def create_weights(
        self,
        layer: nn.Module,
        input_size_per_partition: int,
        output_partition_sizes: list[int],
        input_size: int,
        output_size: int,
        params_dtype: torch.dtype,
    ) -> None:
        shape = (sum(output_partition_sizes), input_size_per_partition)
        layer.register_parameter(
            "weight",
            weight_param(torch.empty(shape, dtype=params_dtype), output_dim=0, input_dim=1),
        )

    def apply(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        return F.linear(x, layer.weight, bias)
