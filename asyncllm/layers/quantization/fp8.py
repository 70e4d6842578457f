"""FP8 W8A8 (e4m3): weights with per-tensor, per-channel or block (e.g. 128x128) scales,
activations quantized per token at run time (or with a static per-tensor scale).

The checkpoints of vLLM's "fp8" method (quantization_config.quant_method "fp8": Qwen3-FP8,
DeepSeek-V3 with weight_block_size) load here, compressed-tensors' float-quantized ones run the
same method, and `--quantization fp8` quantizes a 16-bit checkpoint's weights per channel at
load. On CUDA the per-channel GEMM is torch._scaled_mm with row-wise scales (or, up to the rows
kernels.fp8_rowwise_wins names, the Triton kernel of kernels.fp8_gemm) and the block GEMM a
Triton kernel; on CPU both run a dequantize-and-matmul reference.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

import kernels
from asyncllm.layers.quantization.base import LinearMethodBase
from asyncllm.layers.quantization.base_config import QuantizationConfig, choice, field
from asyncllm.layers.quantization.parameter import replace_param, weight_param

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max
# the smallest scale used, so an all-zero row quantizes to zeros instead of NaNs
MIN_SCALE = 1e-12


@dataclass(frozen=True)
class Fp8Scheme:
    weight_strategy: str  # tensor | channel | block
    block: tuple[int, int] | None = None  # (output, input) features per weight scale
    dynamic_activations: bool = True  # per token (per token and block of K for block weights)
    serialized: bool = True  # False: a 16-bit checkpoint quantized at load
    scale_name: str = "weight_scale"  # DeepSeek-style block checkpoints: weight_scale_inv


class Fp8Config(QuantizationConfig):
    name = "fp8"

    def __init__(self, scheme: Fp8Scheme, skipped: list[str] | None = None) -> None:
        super().__init__(skipped)
        self.scheme = scheme

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Fp8Config:
        serialized = field(config, "is_checkpoint_fp8_serialized", bool, True)
        activation = choice(config, "activation_scheme", ("dynamic", "static"), "dynamic")
        block = field(config, "weight_block_size", (list, type(None)), None)
        if block is not None and (
            len(block) != 2 or not all(isinstance(b, int) and b > 0 for b in block)
        ):
            raise ValueError(
                f"quantization_config.weight_block_size must be two positive ints, got {block!r}"
            )
        if block is not None and activation != "dynamic":
            raise ValueError(
                "quantization_config.activation_scheme must be 'dynamic' with weight_block_size"
            )
        if not serialized and activation != "dynamic":
            raise ValueError(
                "quantization_config.activation_scheme: quantizing at load needs 'dynamic'"
            )
        scheme = Fp8Scheme(
            weight_strategy="block" if block else "tensor" if serialized else "channel",
            block=tuple(block) if block else None,
            dynamic_activations=activation == "dynamic",
            serialized=serialized,
            scale_name="weight_scale_inv" if block else "weight_scale",
        )
        skipped = field(config, "ignored_layers", list, None) or field(
            config, "modules_to_not_convert", (list, type(None)), None
        )
        return cls(scheme, skipped)

    @classmethod
    def at_load(cls) -> Fp8Config:
        """`--quantization fp8` on a 16-bit checkpoint."""
        return cls.from_config({"is_checkpoint_fp8_serialized": False})

    def linear_method(self, prefix: str) -> LinearMethodBase:
        return Fp8LinearMethod(self.scheme)


class Fp8LinearMethod(LinearMethodBase):
    def __init__(self, scheme: Fp8Scheme) -> None:
        self.scheme = scheme

    def create_weights(
        self,
        layer: nn.Module,
        input_size_per_partition: int,
        output_partition_sizes: list[int],
        input_size: int,
        output_size: int,
        params_dtype: torch.dtype,
    ) -> None:
        scheme, out_features = self.scheme, sum(output_partition_sizes)
        layer.fp8_shard_sizes = list(output_partition_sizes)
        dtype = FP8 if scheme.serialized else params_dtype
        weight = torch.empty(out_features, input_size_per_partition, dtype=dtype)
        layer.register_parameter("weight", weight_param(weight, output_dim=0, input_dim=1))
        if not scheme.serialized:
            return
        layer.register_parameter(
            scheme.scale_name, self._weight_scale(output_partition_sizes, input_size_per_partition)
        )
        if not scheme.dynamic_activations:
            scales = torch.empty(len(output_partition_sizes), dtype=torch.float32)
            layer.register_parameter(
                "input_scale", weight_param(scales, None, None, shard_indexed=True)
            )

    def _weight_scale(self, sizes: list[int], in_features: int) -> nn.Parameter:
        scheme = self.scheme
        if scheme.weight_strategy == "tensor":
            return weight_param(
                torch.empty(len(sizes), dtype=torch.float32), None, None, shard_indexed=True
            )
        if scheme.weight_strategy == "channel":
            return weight_param(
                torch.empty(sum(sizes), 1, dtype=torch.float32), output_dim=0, input_dim=None
            )
        block_n, block_k = scheme.block
        if len(sizes) > 1 and any(s % block_n for s in sizes):
            raise ValueError(
                f"fp8: merged output sizes {sizes} are not multiples of the weight block {block_n}"
            )
        shape = (-(-sum(sizes) // block_n), -(-in_features // block_k))
        return weight_param(torch.empty(shape, dtype=torch.float32), output_dim=0, input_dim=1)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        scheme = self.scheme
        if not scheme.serialized:
            weight, scale = quantize_per_row(layer.weight.data)
            replace_param(layer, "weight", weight)
            layer.register_parameter(
                "weight_scale", nn.Parameter(scale.view(1, -1), requires_grad=False)
            )
            return
        if scheme.weight_strategy == "block":
            return
        scale = layer.weight_scale.data
        if scheme.weight_strategy == "tensor":  # one scale per merged shard, as a column's
            scale = scale.repeat_interleave(
                torch.tensor(layer.fp8_shard_sizes, device=scale.device)
            )
        replace_param(layer, "weight_scale", scale.reshape(1, -1).float())
        if not scheme.dynamic_activations:
            replace_param(layer, "input_scale", layer.input_scale.data.max().float().reshape(1, 1))

    def apply(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        if self._block_scaled:
            out = self._apply_block(layer, rows)
        else:
            out = self._apply_per_row(layer, rows)
        if bias is not None:
            out = out + bias
        return out.reshape(*x.shape[:-1], out.shape[-1])

    def takes_fp8_rows(self, x: torch.Tensor) -> bool:
        """On the GPU past one row, per-row scales of dynamic activations: the RMSNorm or the
        SiLU-and-mul before the layer quantizes its output (kernels.rms_norm_fp8,
        silu_and_mul_fp8) in its own launch, which writes FP8 rather than 16-bit rows for
        quantize_fp8 to read back."""
        dynamic = self.scheme.dynamic_activations
        return x.is_cuda and x.dim() == 2 and x.shape[0] > 1 and not self._block_scaled and dynamic

    @property
    def _block_scaled(self) -> bool:
        """Block-wise weight scales from the checkpoint: activations quantized per group of K."""
        return self.scheme.weight_strategy == "block" and self.scheme.serialized

    def apply_fp8(
        self,
        layer: nn.Module,
        xq: torch.Tensor,
        x_scale: torch.Tensor,
        dtype: torch.dtype,
        bias: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """apply for x already quantized per row (xq, x_scale [rows, 1]), its output in dtype."""
        out = self._scaled_gemm(layer, xq, x_scale, dtype)
        return out if bias is None else out + bias

    def _apply_per_row(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda and x.shape[0] == 1:  # batch-1 decode reads W once: FP8 W, 16-bit x
            return kernels.gemv(x, layer.weight, None, scale=layer.weight_scale)
        static_scale = None if self.scheme.dynamic_activations else layer.input_scale
        xq, x_scale = quantize_activations(x, static_scale=static_scale)
        return self._scaled_gemm(layer, xq, x_scale, x.dtype)

    def _scaled_gemm(
        self, layer: nn.Module, xq: torch.Tensor, x_scale: torch.Tensor, dtype: torch.dtype
    ) -> torch.Tensor:
        if xq.is_cuda and kernels.fp8_rowwise_wins(xq.shape[0], *layer.weight.shape):
            return kernels.fp8_rowwise_gemm(xq, x_scale, layer.weight, layer.weight_scale, dtype)
        if xq.is_cuda and _scaled_mm_fits(xq, layer.weight):
            return torch._scaled_mm(
                xq, layer.weight.t(), x_scale, layer.weight_scale, out_dtype=dtype
            )
        return scaled_matmul_reference(
            xq, x_scale, layer.weight, layer.weight_scale.view(-1, 1), dtype
        )

    def _apply_block(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        _, block_k = self.scheme.block
        xq, x_scale = quantize_activations(x, group_size=block_k)
        w_scale = getattr(layer, self.scheme.scale_name)
        if x.is_cuda:
            return kernels.fp8_block_gemm(
                xq, x_scale, layer.weight, w_scale, self.scheme.block, x.dtype
            )
        weight = dequantize_blocks(layer.weight, w_scale, self.scheme.block)
        return (dequantize_blocks(xq, x_scale, (1, block_k)) @ weight.t()).to(x.dtype)


def _scaled_mm_fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """cuBLAS' FP8 GEMM needs K and N in multiples of 16."""
    return x.shape[1] % 16 == 0 and weight.shape[0] % 16 == 0


def quantize_activations(
    x: torch.Tensor, group_size: int | None = None, static_scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 x, fp32 scales [rows, groups]): per row, per row and group of K, or with one
    static scale; on CUDA one fused launch (kernels.quantize_fp8), else the torch reference."""
    if x.is_cuda:
        return kernels.quantize_fp8(x, group_size, static_scale, MIN_SCALE)
    if static_scale is not None:
        scale = static_scale.reshape(1, 1).expand(x.shape[0], 1).contiguous()
        return quantize_with_scale(x, scale), scale
    if group_size is not None:
        return quantize_per_token_group(x, group_size)
    return quantize_per_row(x)


def quantize_per_row(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 x, fp32 scales [rows, 1]) with x ~ q * scale, each row's max mapped to FP8_MAX."""
    amax = x.abs().amax(dim=-1, keepdim=True).float()
    # a tensor divisor: CUDA divides by a Python number as a multiply by its reciprocal, which
    # rounds differently from the division kernels.quantize_fp8 does (and the CPU)
    scale = (amax / torch.full_like(amax, FP8_MAX)).clamp_(min=MIN_SCALE)
    return quantize_with_scale(x, scale), scale


def quantize_with_scale(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (x.float() / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8)


def quantize_per_token_group(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 x, fp32 scales [rows, ceil(K / group)]): one scale per row and group of K."""
    rows, k = x.shape
    padded = torch.nn.functional.pad(x.float(), (0, -k % group)).view(rows, -1, group)
    xq, scale = quantize_per_row(padded)
    return xq.view(rows, -1)[:, :k].contiguous(), scale.view(rows, -1)


def scaled_matmul_reference(
    xq: torch.Tensor,
    x_scale: torch.Tensor,
    wq: torch.Tensor,
    w_scale: torch.Tensor,
    dtype: torch.dtype,
) -> torch.Tensor:
    """(xq * x_scale) @ (wq * w_scale)^T in fp32: x_scale [M, 1], w_scale [N, 1]."""
    return ((xq.float() * x_scale) @ (wq.float() * w_scale).t()).to(dtype)


def dequantize_blocks(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """q * scale in fp32, where scale[i, j] covers q[i*bn:(i+1)*bn, j*bk:(j+1)*bk]."""
    block_n, block_k = block
    rows, cols = q.shape
    full = scale.repeat_interleave(block_n, dim=0)[:rows].repeat_interleave(block_k, dim=1)
    return q.float() * full[:, :cols]
