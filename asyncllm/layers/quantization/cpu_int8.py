"""int8 W8A8 on CPU: `--quantization int8` quantizes a 16/32-bit checkpoint's weights at load,
symmetric per output channel, and fbgemm's dynamically quantized linear
(quantized::linear_dynamic) quantizes each call's activations and runs the int8 GEMM.

The name: vLLM's INT8 W8A8 has no flag of its own (llm-compressor's checkpoints load through
compressed-tensors) and SGLang calls its int8 method w8a8_int8; `int8` is the counterpart of
`--quantization fp8`, which is the same scheme in FP8 quantized at load, so a vLLM user finds it
beside that one.

Why fbgemm: on an AVX2 CPU without AVX-512 (no native bf16 dot products) oneDNN's bf16 GEMMs
ran 4-8x slower than fp32, while this op ran 2-4x faster than the oneDNN-packed fp32 weights at
8 and 32 rows on every projection of the default model (bench/cpu_linear.py, bench/NOTES.md): a
quarter of the weight bytes and vpmaddubsw's rate. Since the bf16 mode runs there on asyncllm's
CPU GEMM (bf16 weights widened to fp32), it is the faster mode on such a CPU too, at fp32's
accuracy (a Zen 3: 6.65x HF against this mode's 6.12x, 100% agreement against 79%;
bench/results/throughput_{bf16,int8}_cpu_smollm2_zen3_avx2*.json). torch 2.13's alternatives without the deprecated
quantized dtypes were slower here: aten._weight_int8pack_mm (int8 weights, fp32 activations)
10-60x, onednn.qlinear_pointwise with the activations quantized in torch 3-10x.

What fbgemm does with the activations: one asymmetric uint8 scale and zero point over all the
rows of a call, in 7 bits (reduce_range: vpmaddubsw's int16 pair sums saturate on 8-bit
activations, measured as errors 9x the rounding bound). A few tokens carry activations 50-100x
the others' (the first token's, in the default model): one scale for them all gave the default
model 42% top-1 agreement with fp32, a scale per row 79%. So each row is divided by its own
max before the call and its output multiplied back (exact: the op is linear and the bias is
added after), which gives every row a scale of its own for two elementwise passes.

Accuracy on the default model (tests/test_quant_model.py): 79% top-1 agreement with fp32 over
300 positions of real text, where the issue asks 98%: per-channel int8 weights alone give 96.7%,
8-bit activations per row alone 90-91%, 7-bit ones 87.7%; on a 135M model the activations'
rounding is what costs. An opt-in mode for speed, not a drop-in replacement.

The lm_head is quantized too (its 49,152 x 576 weight is a fifth of the default model's GEMM
work; int8 measured 3x faster at 8 rows; left in fp32 through modules_to_not_convert, the
agreement above is 82.7%), a lm_head tied to the embedding too: the embedding keeps its dense
weight. Under tensor parallelism each rank quantizes its own shard: the scales
are per output channel of the shard it holds.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn

from asyncllm.layers.quantization.base import LinearMethodBase, UnquantizedLinearMethod
from asyncllm.layers.quantization.base_config import QuantizationConfig, field

INT8_MAX = 127
# the smallest scale used, so an all-zero row quantizes to zeros instead of NaNs
MIN_SCALE = 1e-12


class Int8Config(QuantizationConfig):
    name = "int8"

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Int8Config:
        return cls(field(config, "modules_to_not_convert", (list, type(None)), None))

    @classmethod
    def at_load(cls) -> Int8Config:
        """`--quantization int8` on a 16/32-bit checkpoint."""
        return cls.from_config({})

    def linear_method(self, prefix: str) -> LinearMethodBase:
        return Int8LinearMethod()

    def get_quant_method(self, layer: nn.Module, prefix: str) -> LinearMethodBase:
        """Every linear layer, the lm_head too, but the skipped modules."""
        if self.is_skipped(prefix):
            return UnquantizedLinearMethod()
        return self.linear_method(prefix)


class Int8LinearMethod(LinearMethodBase):
    def create_weights(
        self,
        layer: nn.Module,
        input_size_per_partition: int,
        output_partition_sizes: list[int],
        input_size: int,
        output_size: int,
        params_dtype: torch.dtype,
    ) -> None:
        UnquantizedLinearMethod().create_weights(
            layer,
            input_size_per_partition,
            output_partition_sizes,
            input_size,
            output_size,
            params_dtype,
        )
        check_supported(layer.weight.device)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        weight, scale = quantize_per_channel(layer.weight.detach())
        # a tied lm_head's packed copy is its own: the embedding keeps the dense parameter
        del layer.weight
        layer.int8_packed = prepack(weight, scale)

    def apply(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1]).float()
        # fbgemm quantizes all rows with one scale: rows scaled to one max get one each
        row_max = rows.abs().amax(dim=1, keepdim=True).clamp_(min=MIN_SCALE)
        out = torch.ops.quantized.linear_dynamic(rows / row_max, layer.int8_packed, True)
        out *= row_max
        if bias is not None:
            out += bias
        return out.to(x.dtype).reshape(*x.shape[:-1], out.shape[-1])


def check_supported(device: torch.device) -> None:
    """ValueError unless fbgemm's kernels can run the layer: on CPU, with fbgemm built in."""
    if device.type != "cpu":
        raise ValueError(
            f"--quantization int8 runs fbgemm's CPU kernels, not on {device.type}: on a GPU use "
            "--quantization fp8 (the same W8A8 scheme in FP8)"
        )
    if "fbgemm" not in torch.backends.quantized.supported_engines:
        raise ValueError(
            "--quantization int8 needs fbgemm (an x86 CPU with AVX2); this torch has "
            f"{torch.backends.quantized.supported_engines}"
        )


def quantize_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 W, fp32 scales [out]) with W ~ q * scale per row, each row's max mapped to 127."""
    weight = weight.float()
    scale = (weight.abs().amax(dim=1) / INT8_MAX).clamp_(min=MIN_SCALE)
    q = torch.round(weight / scale[:, None]).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scale


def prepack(weight: torch.Tensor, scale: torch.Tensor) -> torch.ScriptObject:
    """fbgemm's packed weight of int8 W [out, in] with per-row scales."""
    zero_points = torch.zeros(weight.shape[0], dtype=torch.long)
    # the qint8 dtype linear_prepack takes is deprecated in torch 2.13 (pytorch#184982); the
    # op itself is not, and nothing without that dtype is as fast here (module docstring)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*quantized tensor creation functions")
        quantized = torch._make_per_channel_quantized_tensor(weight, scale.double(), zero_points, 0)
    return torch.ops.quantized.linear_prepack(quantized, None)
