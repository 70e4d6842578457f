"""The linear methods: a layer's weight storage and GEMM, swapped by quantization while the
layers and the model code stay as they are (vLLM's LinearMethodBase). The quantized methods
(fp8, awq, gptq, compressed_tensors, cpu_int8) implement the same three steps: create the
parameters the checkpoint fills, repack them once loaded, run the GEMM.

The unquantized method keeps the fast paths of full-precision weights: batch-1 decode on CUDA
goes through kernels.gemv; fp32 weights on CPU are stored in panels for kernels/cpu_gemm.cpp
where the CPU has AVX-512 or AVX2 (on the Zen 4 the offline fp32 workload ran 1.21x faster than
with oneDNN: bench/results/throughput_fp32_cpu_smollm2_zen4_cpu_gemm_*.json), else in oneDNN's
own layout. bf16 weights (the CPU's bf16 mode) go to oneDNN where the CPU has bf16 dot
products, else to the same panels in bf16, which the kernel widens to fp32 as it loads them.

At batch 1 on an H200, cuBLAS reads a one-row GEMM's weights at a fraction of the copy
bandwidth (bench/results/decode_gemv_h200.json). On this project's CPUs oneDNN runs the model's
skinny fp32 GEMMs 1.5-4x faster than F.linear once the weight is stored in oneDNN's layout
(measured: 32 x 576 x 49152 in 5.1 ms instead of 21.0 ms); its dense-in/dense-out op spares the
to_mkldnn/to_dense copies of mkldnn_linear.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
import torch.nn.functional as F
from torch import nn

import kernels
from asyncllm.layers.quantization.parameter import weight_param
from kernels.cpu_gemm import cpu_gemm, cpu_gemm_fits, pack_cpu_gemm_weight

# rows oneDNN packs the weights for (a decode batch); other row counts run as fast here
_ROWS_HINT = 32


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
        """Registers this rank's parameters on layer, made by parameter.weight_param with the
        attributes the layer's weight_loader shards them by."""

    def process_weights_after_loading(self, layer: nn.Module) -> None:  # noqa: B027 (optional)
        """Once the checkpoint is in, the model moved to its device and dtype."""

    @abstractmethod
    def apply(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        """x @ weight.T (+ bias) on this rank's share of the weight."""

    def takes_fp8_rows(self, x: torch.Tensor) -> bool:
        """Whether apply would quantize x to FP8 per row with dynamic scales (as
        kernels.quantize_fp8 does, at least fp8.MIN_SCALE), so that the kernel that makes x may
        quantize it instead and hand the rows to apply_fp8 (the FP8 method's)."""
        return False


def single_cuda_row(x: torch.Tensor) -> bool:
    """Batch-1 decode on CUDA, the GEMV kernels' case: at 8 rows cuBLAS was as fast as a
    skinny kernel (bench/results/skinny_gemm_h200.json)."""
    return x.is_cuda and x.dim() == 2 and x.shape[0] == 1


class UnquantizedLinearMethod(LinearMethodBase):
    def __init__(self, cpu_weight_dtype: torch.dtype = torch.float32) -> None:
        """cpu_weight_dtype: what an fp32 weight on CPU is packed in; bfloat16 runs the GEMM on
        bf16 inputs (the activations rounded) with fp32 sums, its output back in fp32
        (cpu_bf16.py)."""
        self.cpu_weight_dtype = cpu_weight_dtype

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
        weight = weight_param(torch.empty(shape, dtype=params_dtype), output_dim=0, input_dim=1)
        layer.register_parameter("weight", weight)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        packed = self._pack_cpu_weight(layer.weight.detach())
        if packed is None:
            return
        # a tied lm_head gets its own packed copy: the embedding keeps the dense parameter
        del layer.weight
        layer.register_buffer("weight", packed[0])
        setattr(layer, packed[1], True)

    def _pack_cpu_weight(self, weight: torch.Tensor) -> tuple[torch.Tensor, str] | None:
        """A float32 CPU weight in cpu_weight_dtype in the layout of the GEMM that will run it,
        and that layout's flag: the CPU GEMM's panels, else oneDNN's; bf16 in oneDNN's where
        the CPU has bf16 dot products (there oneDNN's bf16 GEMM is the faster)."""
        if weight.device.type != "cpu" or weight.dtype != torch.float32:
            return None
        dtype = self.cpu_weight_dtype
        if cpu_gemm_fits(weight) and (dtype == torch.float32 or not native_bf16()):
            return pack_cpu_gemm_weight(weight.to(dtype)), "cpu_gemm_packed"
        if not torch.backends.mkldnn.is_available():
            return None
        if not onednn_bf16():  # AVX2 alone: a weight the panels do not take stays float32
            dtype = torch.float32
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.to(dtype), _ROWS_HINT)
        return packed, "onednn_packed"

    def apply(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        if getattr(layer, "cpu_gemm_packed", False):
            return cpu_gemm(x, layer.weight, bias)
        if getattr(layer, "onednn_packed", False):
            # packed weights come from float32 parameters: the model computes in float32
            keep = getattr(layer, "keeps_weight_dtype", False) and bias is None
            dtype = layer.weight.dtype if keep else torch.float32
            return packed_linear(x, layer.weight, bias, dtype)
        if single_cuda_row(x):
            return kernels.gemv(x, layer.weight, bias)
        return F.linear(x, layer.weight, bias)


def packed_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype
) -> torch.Tensor:
    """x @ weight^T (+ bias) in dtype: the model's float32, or the packed weight's own dtype
    for a consumer that reads it so (no bias then)."""
    # oneDNN keeps memory for every row count it has seen (RSS grew without bound under random
    # request lengths): pad the rows up to one of a few dozen sizes, at most 1/8 more
    rows = x.shape[0]
    padded = padded_rows(rows)
    x = x.to(weight.dtype)
    if padded != rows:
        x = F.pad(x, (0, 0, 0, padded - rows))
    if dtype == weight.dtype:
        # dense in, dense out: no to_mkldnn / to_dense conversions around the GEMM
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")[:rows]
    # bf16 weights under fp32 activations: the output and its bias in fp32
    out = torch.ops.mkldnn._linear_pointwise(x, weight, None, "none", [], "")[:rows].to(dtype)
    return out if bias is None else out.add_(bias)


def native_bf16() -> bool:
    """The CPU has bf16 dot products (AVX512_BF16 or AMX), which oneDNN's bf16 GEMM runs on."""
    return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()


def onednn_bf16() -> bool:
    """oneDNN packs and multiplies bf16 on this CPU (it refuses to on AVX2 alone)."""
    return torch.ops.mkldnn._is_mkldnn_bf16_supported()


def padded_rows(rows: int) -> int:
    """rows rounded up to a multiple of 2^(bit_length - 4): 8 sizes per power of two."""
    step = 1 << max(0, rows.bit_length() - 4)
    return -(-rows // step) * step
