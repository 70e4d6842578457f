"""bf16 weights on CPU, what `--dtype bfloat16` means there: every linear layer's weight (the
lm_head too) packed in oneDNN's layout in bf16, each GEMM run on its input rounded to bf16 with
fp32 sums and its output returned in fp32; the residual stream, norms, rotary, softmax and
logits stay fp32, and the KV cache is bf16 (config.ModelConfig.compute_dtype).

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

What it needs: native bf16 dot products (AVX512_BF16 or AMX). There this path (casts included)
ran the default model's projections 1.2-1.6x as fast as the packed fp32 weights at 17 rows and
1.8-1.9x at 256, one Zen 5 thread (bench/results/cpu_linear_zen5_avx512_loaded.json). Without
them, on AVX-512, oneDNN emulates them and the engine warns; on a CPU with AVX2 alone oneDNN
has no bf16 GEMM at all, and the mode is refused at load with a message naming the fp32 default.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from asyncllm.layers.quantization.base import LinearMethodBase, UnquantizedLinearMethod
from asyncllm.layers.quantization.base_config import QuantizationConfig
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
        if not onednn_bf16():
            raise ValueError(
                "--dtype bfloat16 on CPU runs oneDNN's bf16 GEMMs, which need AVX-512 (BW, VL "
                "and DQ) or AVX-NE-CONVERT, and this CPU has neither: use the default float32 "
                "(or --quantization int8)"
            )
        if not native_bf16():
            logger.warning(
                "--dtype bfloat16 on this CPU: it has no native bf16 dot products (AVX512_BF16 "
                "or AMX), so its bf16 GEMMs are emulated, several times slower than float32 "
                "(the default there)"
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


def native_bf16() -> bool:
    return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()


def onednn_bf16() -> bool:
    """oneDNN packs and multiplies bf16 on this CPU (it refuses to on AVX2 alone)."""
    return torch.ops.mkldnn._is_mkldnn_bf16_supported()
