"""bf16 weights on CPU, what `--dtype bfloat16` means there: every linear layer's weight (the
lm_head too) in bf16, the residual stream, norms, rotary, softmax and logits in fp32, and the KV
cache in bf16 (config.ModelConfig.compute_dtype). Which GEMM runs the weights:
- where the CPU has bf16 dot products (AVX512_BF16 or AMX), oneDNN's, in its layout: each
  GEMM's input rounded to bf16, fp32 sums, the output returned in fp32;
- elsewhere (AVX2 alone, or AVX-512 without them) kernels/cpu_gemm.cpp's, in its panels: the
  weights widened to fp32 as they are loaded, the input and the arithmetic fp32, so half the
  weight bytes of the fp32 default at its FLOP rate (on a Zen 3, 30 layers' weights streamed:
  1.7x fp32's GFLOP/s at 8 rows, 1.16x at 17, equal from 64;
  bench/results/cpu_gemm_chain_bf16_zen3_avx2.json).

Why not bf16 throughout, as on a GPU: on the default model, teacher forced over 299 positions
of real text (bench/quant_agreement_cpu.py), bf16 activations as well gave 97.99% top-1
agreement with fp32, where the issue asks 98%; this mode 97.99-98.66% by the attention's
last bits, and every disagreement left came from the bf16 lm_head (with an fp32 one, 100%),
as did the README's greedy capital-of-France reply, whose first tokens are 0.04 apart.

The lm_head: its bf16 GEMM (a fifth of the default model's) is kept, an fp32 one costing some
8% of a decode step; then each row's logits within REFINE_MARGIN of its largest (the only ones
greedy decoding can pick, and the likeliest a sample picks) are recomputed in float32 from the
fp32 weight (the tied embedding's, else the lm_head's own): one or two dot products a row, and
the top of the distribution is then as an fp32 lm_head computes it. On that text the bf16
logits were at most 0.21 from the fp32 ones.

With bf16 dot products oneDNN's path (casts included) ran the default model's projections
1.2-1.6x as fast as the packed fp32 weights at 17 rows and 1.8-1.9x at 256, one Zen 5 thread
(bench/results/cpu_linear_zen5_avx512_loaded.json). Without them and without the CPU GEMM
(no AVX2 and FMA) oneDNN emulates bf16 where it can, and the engine warns; where it cannot either,
the mode is refused at load with a message naming the fp32 default.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from asyncllm.layers.quantization.base import (
    LinearMethodBase,
    UnquantizedLinearMethod,
    native_bf16,
    onednn_bf16,
)
from asyncllm.layers.quantization.base_config import QuantizationConfig
from kernels.cpu_gemm import cpu_gemm_available
from kernels.cpu_layer_ops import cpu_layer_ops_available, refine_top_logits_cpu

logger = logging.getLogger(__name__)

# nats below a row's largest bf16 logit within which logits are recomputed in float32: about 5x
# the largest bf16-vs-fp32 difference measured on the default model
REFINE_MARGIN = 1.0


class CpuBf16Config(QuantizationConfig):
    name = "cpu_bf16"

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> CpuBf16Config:
        return cls()

    @classmethod
    def for_this_cpu(cls) -> CpuBf16Config:
        if native_bf16() or cpu_gemm_available():
            return cls()
        if not onednn_bf16():
            raise ValueError(
                "--dtype bfloat16 on CPU needs AVX2 and FMA (asyncllm's CPU GEMM) or oneDNN's "
                "bf16 GEMMs (AVX-512 BW, VL and DQ, or AVX-NE-CONVERT), and this CPU has "
                "neither: use the default float32"
            )
        logger.warning(
            "--dtype bfloat16 on this CPU: it has no bf16 dot products (AVX512_BF16 or AMX) and "
            "no AVX2 for asyncllm's CPU GEMM, so oneDNN emulates its bf16 GEMMs, several times "
            "slower than float32 (the default there)"
        )
        return cls()

    def linear_method(self, prefix: str) -> LinearMethodBase:
        return UnquantizedLinearMethod(torch.bfloat16)

    def get_quant_method(self, layer: nn.Module, prefix: str) -> LinearMethodBase:
        """Every linear layer, the lm_head too, whose top logits are then refined."""
        if prefix == "lm_head":
            return Bf16LMHeadMethod()
        return self.linear_method(prefix)


class Bf16LMHeadMethod(UnquantizedLinearMethod):
    """The lm_head's bf16 GEMM, then each row's logits within REFINE_MARGIN of its largest
    recomputed in float32 (the module's docstring says why)."""

    def __init__(self) -> None:
        super().__init__(torch.bfloat16)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        # the parameter itself: a tied one is the embedding's, whose rows the loader then maps
        # from the checkpoint's file (only the few rows read become resident)
        layer.float32_weight = layer.weight
        super().process_weights_after_loading(layer)

    def apply(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        logits = super().apply(layer, x, bias)
        return refine_top_logits(logits, x.float(), layer.float32_weight, REFINE_MARGIN)


def refine_top_logits(
    logits: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor, margin: float
) -> torch.Tensor:
    """In place: each row's logits within margin of its largest become hidden[r] . weight[v]."""
    if cpu_layer_ops_available():
        return refine_top_logits_cpu(logits, hidden.contiguous(), weight, margin)
    rows, columns = (logits >= logits.amax(-1, keepdim=True) - margin).nonzero(as_tuple=True)
    logits[rows, columns] = torch.linalg.vecdot(hidden[rows], weight[columns])
    return logits
