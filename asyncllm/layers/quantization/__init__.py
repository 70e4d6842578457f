"""Quantized linear layers: get_quantization_config() picks the method from a checkpoint's
quantization_config (its quant_method) or from --quantization."""

from __future__ import annotations

from typing import Any

from asyncllm.layers.quantization.awq import AWQConfig
from asyncllm.layers.quantization.base_config import QuantizationConfig
from asyncllm.layers.quantization.compressed_tensors import CompressedTensorsConfig
from asyncllm.layers.quantization.fp8 import Fp8Config
from asyncllm.layers.quantization.gptq import GPTQConfig

QUANTIZATION_METHODS: dict[str, type[QuantizationConfig]] = {
    c.name: c for c in (Fp8Config, AWQConfig, GPTQConfig, CompressedTensorsConfig)
}


def get_quantization_config(
    checkpoint_config: dict[str, Any] | None, quantization: str | None
) -> QuantizationConfig | None:
    """The checkpoint's quantization_config (config.json) when it has one, checked against
    --quantization; else --quantization fp8 quantizes a 16-bit checkpoint at load; else None."""
    if checkpoint_config is None:
        if quantization is None:
            return None
        if quantization != "fp8":
            raise ValueError(
                f"quantization {quantization!r} needs a checkpoint quantized that way; only 'fp8' quantizes at load"
            )
        return Fp8Config.at_load()
    if not isinstance(checkpoint_config, dict):
        raise ValueError("quantization_config must be a JSON object")
    method = checkpoint_config.get("quant_method")
    if method is None:
        raise ValueError("quantization_config.quant_method is missing")
    method = str(method).lower().replace("_", "-")
    if method not in QUANTIZATION_METHODS:
        raise ValueError(
            f"quantization_config.quant_method {method!r} is not supported; supported: {', '.join(QUANTIZATION_METHODS)}"
        )
    if quantization is not None and quantization != method:
        raise ValueError(
            f"quantization {quantization!r} disagrees with the checkpoint's quantization_config.quant_method {method!r}"
        )
    return QUANTIZATION_METHODS[method].from_config(checkpoint_config)


__all__ = ["QUANTIZATION_METHODS", "QuantizationConfig", "get_quantization_config"]
