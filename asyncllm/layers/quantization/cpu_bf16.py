"""bf16 weights on CPU, what `--dtype bfloat16` means there: every linear layer's weight (the
lm_head too) packed in oneDNN's layout in bf16, each GEMM run on its input rounded to bf16 with
fp32 sums and its output returned in fp32; the residual stream, norms, rotary, softmax and
logits stay fp32, and the KV cache is bf16 (config.ModelConfig.compute_dtype).

Why not bf16 throughout, as on a GPU: on the default model, teacher forced over 299 positions
of real text (bench/quant_agreement_cpu.py), bf16 activations as well gave 97.99% top-1
agreement with fp32, where the issue asks 98%; this mode 98.66%
(bench/results/quant_agreement_bf16_cpu.json).

Its logits carry the bf16 lm_head's rounding (as a GPU's bf16 logits do): near ties can flip,
such as the README's greedy capital-of-France reply, whose first tokens are 0.04 apart.

What it needs: native bf16 dot products (AVX512_BF16 or AMX). There this path (casts included)
ran the default model's projections 1.2-1.6x as fast as the packed fp32 weights at 17 rows and
1.8-1.9x at 256, one Zen 5 thread (bench/results/cpu_linear_zen5_avx512_loaded.json). Without
them oneDNN emulates them, and on an AVX2-only EPYC bf16 GEMMs were 4-8x slower than fp32: the
engine warns (bench/NOTES.md).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from asyncllm.layers.quantization.base import LinearMethodBase, UnquantizedLinearMethod
from asyncllm.layers.quantization.base_config import QuantizationConfig

logger = logging.getLogger(__name__)


class CpuBf16Config(QuantizationConfig):
    name = "cpu_bf16"

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> CpuBf16Config:
        return cls()

    @classmethod
    def for_this_cpu(cls) -> CpuBf16Config:
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
        """Every linear layer, the lm_head too: its GEMM is a fifth of the default model's."""
        return self.linear_method(prefix)


def native_bf16() -> bool:
    return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
